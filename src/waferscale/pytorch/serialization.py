"""`cstorch.save(state, path)` / `cstorch.load(path)`: nested state (dicts, lists, tensors, numbers, strings) as
one checkpoint file, the format `wsc run` writes too (`runtime/checkpoint.py`), so a script's checkpoint resumes
a `wsc run` and the other way round. `save(..., format="mdl")` writes Cerebras' own HDF5 checkpoint format instead
(`runtime/mdl.py`), and `load` reads every format, telling them apart by the file's first bytes.

Written to a temporary file and renamed, so a checkpoint is either complete or absent; a truncated or
foreign file is refused with a clear error, and loading unpickles nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from waferscale.errors import CheckpointError
from waferscale.pytorch import distributed as _dist
from waferscale.runtime.checkpoint import load_state, save_state
from waferscale.runtime.mdl import save_mdl

__all__ = ["save", "load"]


def save(state: Any, path: str | os.PathLike, format: str | None = None) -> None:
    """`format`: "safetensors" (this package's file) or "mdl" (a Cerebras checkpoint, for a Cerebras system); by
    default the name decides: a `.mdl` path gets Cerebras' format (what an unchanged Cerebras script saves there
    goes back to a Cerebras system), any other the safetensors file."""
    if format is None:
        format = "mdl" if Path(path).suffix == ".mdl" else "safetensors"
    if format not in ("safetensors", "mdl"):
        raise CheckpointError(f"cstorch.save: format {format!r} is not supported; use 'safetensors' or 'mdl'")
    if not _dist.is_master():  # one writer: rank 0 holds the weights
        return
    if format == "mdl":
        save_mdl(state, path)
        return
    save_state(state, path, where="cstorch.save")


def load(path: str | os.PathLike, map_location: Any = None) -> Any:
    """The state `save` wrote, or any other checkpoint: a `wsc run` one (a file, or a model_dir: its latest) or a
    Cerebras `.mdl`."""
    if not Path(path).exists():
        raise CheckpointError(f"no checkpoint at {path}")
    return load_state(path, map_location)
