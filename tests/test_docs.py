"""The docs hold together: every relative link in the README and docs/ reaches a file (and a heading, for an
#anchor), and every `WSC_` environment variable the package reads or sets is in docs/environment.md's table."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "RESULTS.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_relative_links_reach_a_file_and_a_heading() -> None:
    bad = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_every_environment_variable_is_in_the_table() -> None:
    table = (ROOT / "docs" / "environment.md").read_text(encoding="utf-8")
    used = set()
    for f in (ROOT / "src").rglob("*.py"):
        used |= set(re.findall(r"\bWSC_[A-Z0-9_]+", f.read_text(encoding="utf-8")))
    used.discard("WSC_PORTABLE")  # a C compile-time switch (kernels.py passes -DWSC_PORTABLE), not a variable
    missing = sorted(v for v in used if f"`{v}`" not in table)
    assert not missing, f"not in docs/environment.md: {missing}"


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """`make docs`: mkdocs builds the site (the README its home page) with no broken link or anchor."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs.py"), str(tmp_path / "site")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "environment" / "index.html").is_file()
