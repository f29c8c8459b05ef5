"""`cstorch.save(state, path)` / `cstorch.load(path)`: nested state (dicts, lists, tensors, numbers, strings)
in one safetensors file; the structure rides in the file's metadata. `save(..., format="mdl")` writes Cerebras'
own HDF5 checkpoint format instead (`runtime/mdl.py`), and `load` reads either, telling them apart by the file's
first bytes.

Written to a temporary file and renamed, so a checkpoint is either complete or absent; a truncated or
foreign file is refused with a clear error, and loading unpickles nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from waferscale.errors import CheckpointError
from waferscale.pytorch import distributed as _dist
from waferscale.runtime.checkpoint import tensor_identity
from waferscale.runtime.mdl import is_mdl, load_mdl, save_mdl
from waferscale.util.files import atomic_path

__all__ = ["save", "load"]

_FORMAT = "waferscale.pytorch/1"


def _flatten(obj: Any, tensors: dict[str, torch.Tensor], seen: dict[Any, str]) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        view = tensor_identity(t)
        if view in seen:  # the same tensor twice (tied weights): stored once
            return {"__tensor__": seen[view]}
        key = str(len(tensors))
        tensors[key] = t.clone()  # (safetensors stores whole, unshared tensors)
        if view is not None:
            seen[view] = key
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise CheckpointError("cstorch.save: dictionary keys must be strings or integers")
        return {"__dict__": [[k, _flatten(v, tensors, seen)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__" if isinstance(obj, list) else "__tuple__": [_flatten(v, tensors, seen) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj)}
    raise CheckpointError(f"cstorch.save: cannot store a {type(obj).__name__}; use tensors, numbers, strings, "
                          f"lists and dicts")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: _unflatten(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            return [_unflatten(v, tensors) for v in obj["__list__"]]
        if "__tuple__" in obj:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        if "__dtype__" in obj:
            return getattr(torch, obj["__dtype__"].removeprefix("torch."))
    return obj


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
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    structure = _flatten(state, tensors, {})
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": _FORMAT, "structure": json.dumps(structure)})


def load(path: str | os.PathLike, map_location: Any = None) -> Any:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    if is_mdl(path):
        return load_mdl(path, map_location)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path), device=str(map_location) if map_location else "cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a complete checkpoint ({str(e).splitlines()[0][:120]}); it was "
                              f"partially written or is another format") from None
    if meta.get("format") != _FORMAT:
        raise CheckpointError(f"{path} was not written by cstorch.save")
    return _unflatten(json.loads(meta["structure"]), tensors)
