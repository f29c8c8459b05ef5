"""The cache directory: `$WSC_CACHE_DIR`, else `~/.cache/waferscale`.

What lives there (each user makes its own subdirectory): `tokens/` (tokenized corpora, `data/tokens.py`) and
`kernels/` (compiled serving kernels). Everything in it can be deleted; it is rebuilt on demand.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """The root of waferscale's caches (not created here). An empty `$WSC_CACHE_DIR` counts as unset."""
    return Path(os.environ.get("WSC_CACHE_DIR") or Path.home() / ".cache" / "waferscale")
