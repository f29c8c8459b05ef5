"""The appliance's dashboard page (/) end to end: a real `wsc appliance start` process with its SQLite store, real
jobs submitted through waferscale.appliance.Client, and the page driven in Debian's headless Chromium (see
test_playground.py: the `playwright` package only as a driver). Skips with the reason when either is missing.

Three jobs on a pool of 2 systems: alice's short `wsc run` (metrics for the loss curve, the run's summary for the
log tail), alice's script that holds a system, and bob's 2-system run that waits for them. The screenshot, taken
with the admin's token, is saved as dashboard.png in the test's tmp dir.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from appliance_helpers import ApplianceProc
from test_playground import CHROMIUM, FLAGS

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install -y chromium)")]

ROOT = Path(__file__).resolve().parents[1]


def pixel_stddev(page, png: bytes) -> float:
    """The standard deviation of the screenshot's gray levels, measured by the browser (a canvas): near 0 for a
    blank page."""
    return page.evaluate("""async (src) => {
        const img = new Image(); img.src = src; await img.decode();
        const c = document.createElement("canvas"); c.width = img.width; c.height = img.height;
        const ctx = c.getContext("2d"); ctx.drawImage(img, 0, 0);
        const d = ctx.getImageData(0, 0, c.width, c.height).data;
        let n = 0, s = 0, s2 = 0;
        for (let i = 0; i < d.length; i += 4) { const g = (d[i] + d[i + 1] + d[i + 2]) / 3; n++; s += g; s2 += g * g; }
        return Math.sqrt(s2 / n - (s / n) ** 2);
    }""", "data:image/png;base64," + base64.b64encode(png).decode())


def test_dashboard_shows_pool_queue_log_and_loss(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                                                                  "(pip install playwright; no browser download)")
    service = ApplianceProc(tmp_path, users={"alice": [], "bob": []})
    base = service.address
    admin, alice, bob = (service.client(u) for u in ("admin", "alice", "bob"))
    try:
        tokens = {name: f.read_text().strip() for name, f in service.tokens.items()}
        run = alice.submit_run(ROOT / "configs" / "gpt2_tiny_shakespeare.yaml", num_csx=1, priority="p1",
                               labels={"team": "lm"}, max_steps=6)
        holder_py = tmp_path / "hold.py"
        holder_py.write_text("import time\ntime.sleep(600)\n")
        holder = alice.submit_script(holder_py, num_csx=1, labels={"role": "holder"})
        wide = bob.submit_run(ROOT / "configs" / "gpt2_tiny_shakespeare.yaml", num_csx=2, priority="p3",
                              labels={"exp": "wide"}, max_steps=6)
        assert alice.status(run["id"])["state"] == "RUNNING" and alice.status(holder["id"])["state"] == "RUNNING"
        assert bob.status(wide["id"])["state"] == "QUEUED"

        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 860})
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("dialog", lambda d: errors.append(f"a dialog: {d.message}"))  # errors belong in the page
                page.goto(base + "/", wait_until="networkidle")
                assert page.title() == "waferscale appliance"
                assert "No token" in page.locator("#error").inner_text()

                def use_token(token: str) -> None:
                    page.fill("#token", token)
                    page.click("#token-form button[type=submit]")

                # a wrong token: the service's refusal, in the page
                use_token("not-a-token")
                page.wait_for_selector("#error:text('token refused')")
                assert "unknown token" in page.locator("#error").inner_text()
                assert page.locator("#systems .system").count() == 0

                # alice: the pool (both systems, by which job), her running job selected, its loss curve growing
                use_token(tokens["alice"])
                page.wait_for_selector("#whoami:text('alice')")
                assert page.locator("#error").is_hidden()
                page.wait_for_selector(f"#systems .system.used:has-text('{holder['id']}')")
                tiles = page.locator("#systems .system")
                assert tiles.count() == 2 and page.locator("#systems .system.used").count() == 2
                used = {tiles.nth(s).locator(".what").inner_text() for s in range(2)}
                assert used == {run["id"], holder["id"]}
                assert page.locator(f"#jobs tr[data-job={wide['id']}]").count() == 0  # bob's: not hers to see
                assert "1 of other users" in page.locator("#queue-summary").inner_text()
                page.click(f"#jobs tr[data-job={run['id']}]")
                page.wait_for_selector(f"#d-id:text('{run['id']}')")
                assert "team=lm" in page.locator("#d-facts").inner_text()
                page.wait_for_function("+document.querySelector('#loss').dataset.points >= 2", timeout=120_000)

                # the run ends: its summary in the log tail, all its steps on the curve
                page.wait_for_selector("#d-state:text('SUCCEEDED')", timeout=180_000)
                page.wait_for_selector("#log:has-text('final loss')")
                page.wait_for_function("+document.querySelector('#loss').dataset.points == 6")
                points = page.locator("#loss polyline").get_attribute("points").split()
                assert len(points) == 6
                assert "step 6" in page.locator("#loss-last").inner_text()
                assert page.locator("#cancel").is_hidden()  # nothing to cancel any more

                # bob: his job waits, and says why
                use_token(tokens["bob"])
                row = page.locator(f"#queue li[data-job={wide['id']}]")
                row.locator(".reason:text('waiting for 2 systems, 1 free')").wait_for()
                assert "exp=wide" in row.inner_text() and "p3" in row.inner_text()
                assert page.locator(f"#systems .system.used:has-text('{holder['id']}') .who").inner_text() == \
                    "another user's job"

                # the admin: everything, for the screenshot (the finished run selected, the queue, the pool)
                use_token(tokens["admin"])
                page.check("#show-all")
                page.click(f"#jobs tr[data-job={run['id']}]")
                page.wait_for_selector(f"#d-id:text('{run['id']}')")
                page.wait_for_function("+document.querySelector('#loss').dataset.points == 6")
                page.wait_for_selector(f"#queue li[data-job={wide['id']}]")
                shot = tmp_path / "dashboard.png"
                png = page.screenshot(path=str(shot), full_page=True)
                assert pixel_stddev(page, png) > 10, "the screenshot is blank"

                # bob cancels his waiting job from the page (two clicks: the first only arms the button)
                use_token(tokens["bob"])
                page.click(f"#queue li[data-job={wide['id']}]")
                page.wait_for_selector(f"#d-id:text('{wide['id']}')")
                page.click("#cancel")
                assert page.locator("#cancel").inner_text() == "Click again to cancel"
                assert bob.status(wide["id"])["state"] == "QUEUED"
                page.click("#cancel")
                page.wait_for_selector("#d-state:text('CANCELLED')", timeout=30_000)
                assert "cancelled while queued" in page.locator("#d-reason").inner_text()
                assert page.locator("#queue li.empty").is_visible()
                assert not errors, errors
            finally:
                browser.close()
    finally:
        service.stop()
