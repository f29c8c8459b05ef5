"""The playground page end to end in a real headless Chromium (Debian's `chromium` + the `playwright` Python
package used only as a driver: no browser download). Skips with the reason when either is missing.

Setup: `apt-get install -y chromium` and `pip install playwright` (never `playwright install`).
The screenshot lands in $WSC_TEST_ARTIFACTS (default: artifacts/tests/, git-ignored) as playground.png.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from serve_helpers import run_server, tiny_model_dir

CHROMIUM = next((p for p in (os.environ.get("WSC_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), "/usr/bin/chromium") if p and Path(p).is_file()),
                None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]

pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install -y chromium)")]


def artifacts_dir() -> Path:
    d = Path(os.environ.get("WSC_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts" / "tests"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                                                                  "(pip install playwright; no browser download)")
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_api.sync_playwright() as pw:
        # a fresh profile directory (playwright passes it as --user-data-dir)
        ctx = pw.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                    args=FLAGS, viewport={"width": 1280, "height": 800})
        try:
            yield ctx
        finally:
            ctx.close()


@pytest.mark.slow
def test_playground_streams_with_badge_and_projection(browser, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pg")
    with run_server(tiny_model_dir(tmp_path_factory.getbasetemp()), tmp, "--target", "wse3") as srv:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(srv.base + "/", wait_until="networkidle")
        assert page.title() == "waferscale playground"
        # model picker filled from /v1/models; projection card from /v1/models/{id}
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        assert page.locator("#model").input_value() == "tiny-chat"
        page.wait_for_selector("#projection-card:not(.hidden)")
        assert "projection" in page.locator("#projection-card").inner_text().lower()

        page.fill("#seed", "7")
        page.fill("#max-tokens", "24")
        page.fill("#prompt", "Tell me about wafers.")
        page.click("#send")
        page.wait_for_selector(".msg.assistant .badge.count", timeout=60_000)
        answer = page.locator(".msg.assistant .body").inner_text()
        speed = page.locator(".msg.assistant .badge.speed").inner_text()
        proj = page.locator(".msg.assistant .badge.proj").inner_text()
        assert answer.strip(), "no streamed text"
        assert speed.endswith("tokens/s") and float(speed.split()[0].replace(",", "")) > 0, speed
        assert proj.startswith("projection on 1 x wse3") and "tokens/s" in proj, proj
        assert page.locator(".msg.assistant .badge.count").inner_text() == "24 tokens"

        # View code: Python (openai client) and curl reflect the current settings
        page.click("#view-code")
        code = page.locator("#code").inner_text()
        assert "from openai import OpenAI" in code and f'base_url="{srv.base}/v1"' in code
        assert "seed=7" in code and "max_completion_tokens=24" in code and "stream=True" in code
        page.click(".tab[data-tab=curl]")
        curl = page.locator("#code").inner_text()
        assert curl.startswith(f"curl -N {srv.base}/v1/chat/completions") and '"seed": 7' in curl
        page.click("#close-code")

        # a second, non-streamed JSON-mode answer
        page.uncheck("#stream")
        page.check("#json-mode")
        page.fill("#max-tokens", "12")
        page.fill("#prompt", "Answer in JSON.")
        page.click("#send")
        page.wait_for_function("document.querySelectorAll('.msg.assistant .badge.count').length == 2",
                               timeout=60_000)
        shot = artifacts_dir() / "playground.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        assert not errors, errors
