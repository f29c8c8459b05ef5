"""`make docs`: the documentation site, built by mkdocs from `mkdocs.yml` (its navigation and link checks) into
build/site, or into the directory given. The README is its home page (its links into docs/ made relative to
it), the pages of docs/ the rest. Strict: a broken link or anchor, or a page missing from the navigation,
fails the build (exit code 1, mkdocs' message)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def build(site: Path) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "docs"
        shutil.copytree(ROOT / "docs", src)
        (src / "index.md").write_text((ROOT / "README.md").read_text(encoding="utf-8").replace("](docs/", "]("),
                                      encoding="utf-8")
        cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
        cfg.update(docs_dir=str(src), site_dir=str(site.resolve()))
        (Path(tmp) / "mkdocs.yml").write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
        return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",  # (no -q: it hides warnings)
                               str(Path(tmp) / "mkdocs.yml")], capture_output=True, text=True)


def main() -> int:
    site = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "site"
    r = build(site)
    if r.returncode != 0:
        sys.stderr.write(r.stdout + r.stderr)
        return 1
    print(f"docs: built {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
