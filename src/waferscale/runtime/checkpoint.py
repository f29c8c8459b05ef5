"""Checkpoints: one format, written by `wsc run` and `cstorch.save` alike, read by everything.

A checkpoint is one safetensors file: its tensors, and the nested state they sit in (dicts, lists, numbers,
strings) as JSON in the file's metadata, under the format `waferscale-checkpoint/2`. What a run saves is the
state Model Zoo's scripts save, so a cstorch script's checkpoint and `wsc run`'s are the same kind of object:

    {"model": state dict (tied weights stored once), "optimizer": optimizer.state_dict(), "global_step": N,
     "model_config": the architecture, "rng": {"torch": RNG state}, "data": the loader's position, ...}

`wsc run` writes `model_dir/checkpoint_{step}.safetensors`; a cstorch script names its own path. Each file is
written to a temporary name and renamed, so it is complete or absent; a truncated or foreign file is refused
with a clear error, and loading never unpickles anything. `state["model_config"]` (which `wsc run` writes and a
cstorch script may) lets every command rebuild the model from the file alone.

Older checkpoints load too: the first `wsc run` format (`checkpoint_{step}.json` manifest + `.safetensors`
weights + `.optim.safetensors`), the first `cstorch.save` files (`waferscale.pytorch/1`), and Model Zoo `.mdl`
files (`runtime/mdl.py`; their weights under our names by `models/modelzoo.py`, their optimizer state
renumbered by `models/modelzoo_optim.py`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from waferscale.errors import CheckpointError
from waferscale.models.config import ModelConfig
from waferscale.runtime.mdl import is_mdl, load_mdl
from waferscale.util.files import atomic_path

FORMAT = "waferscale-checkpoint/2"
FORMAT_V1_RUN = "waferscale-checkpoint-v1"  # the first `wsc run` format's manifest
FORMAT_V1_CSTORCH = "waferscale.pytorch/1"  # the first `cstorch.save` files: this layout, another name
ONE_FILE = (FORMAT, FORMAT_V1_CSTORCH)
_NAME = re.compile(r"^checkpoint_(\d+)\.(safetensors|json|mdl)$")


def tensor_identity(t: torch.Tensor) -> tuple | None:
    """What makes two tensors the same stored values (tied weights, or two detached views of one parameter): the
    same storage, offset, shape, strides and dtype. None for an empty tensor (nothing to share)."""
    if not t.numel():
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def unique_state_dict(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state dict (or the given one) with tied tensors kept once (first name wins)."""
    first: dict[Any, tuple[str, torch.Tensor]] = {}
    for name, t in (model if isinstance(model, Mapping) else model.state_dict(keep_vars=True)).items():
        key = tensor_identity(t)
        first.setdefault(key if key is not None else ("empty", name), (name, t.detach()))
    return dict(first.values())


# ---- the file: nested state, its tensors stored once each ----------------------------------------------------
def _flatten(obj: Any, tensors: dict[str, torch.Tensor], seen: dict[Any, tuple[str, torch.Tensor]],
             where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        # the same tensor twice (tied weights) is stored once: told on the tensor itself, where it lives (a copy's
        # address means nothing once freed), and each one held until the file is written
        view = tensor_identity(obj)
        if view is not None and (view, obj.device) in seen:
            return {"__tensor__": seen[view, obj.device][0]}
        key = str(len(tensors))
        tensors[key] = obj.detach().cpu().contiguous().clone()  # (safetensors stores whole, unshared tensors)
        if view is not None:
            seen[view, obj.device] = (key, obj)
        return {"__tensor__": key}
    if isinstance(obj, Mapping):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise CheckpointError(f"{where}: dictionary keys must be strings or integers")
        return {"__dict__": [[k, _flatten(v, tensors, seen, where)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__" if isinstance(obj, list) else "__tuple__": [_flatten(v, tensors, seen, where)
                                                                        for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj)}
    raise CheckpointError(f"{where}: cannot store a {type(obj).__name__}; use tensors, numbers, strings, lists "
                          "and dicts")


def _unflatten(obj: Any, tensors: Mapping[str, torch.Tensor] | None) -> Any:
    """The nested state; tensors None: the structure alone, each tensor as None."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return None if tensors is None else tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: _unflatten(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            return [_unflatten(v, tensors) for v in obj["__list__"]]
        if "__tuple__" in obj:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        if "__dtype__" in obj:
            return getattr(torch, obj["__dtype__"].removeprefix("torch."))
    return obj


def save_state(state: Any, path: str | os.PathLike, where: str = "checkpoint") -> Path:
    """Write `state` (nested dicts, lists, tensors, numbers, strings) as one checkpoint file, atomically."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    structure = _flatten(state, tensors, {}, where)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "structure": json.dumps(structure)})
    return path


def _file_meta(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a complete checkpoint ({str(e).splitlines()[0][:120]}); it was "
                              f"partially written or is another format") from None


def load_state(path: str | os.PathLike, map_location: Any = None, only: tuple[str, ...] | None = None) -> Any:
    """The state in checkpoint `path`, whichever format wrote it (the module's docstring): a file of ours, a first
    `wsc run` checkpoint (its manifest, tensor files or a model_dir: as the state it would be now), or a `.mdl`.
    only: the tensors of these top-level entries alone are read, the others' are None: ("model",) without the
    optimizer's; () the structure alone (a file of ours: its header only)."""
    p = resolve_checkpoint_path(path)
    if p.suffix == ".json":
        return _load_v1(p, map_location, only)
    if is_mdl(p):
        return load_mdl(p, map_location)  # (whole: its structure is small beside its tensors)
    meta = _file_meta(p)
    if meta.get("format") not in ONE_FILE:
        raise CheckpointError(f"{p} is not a waferscale checkpoint (a safetensors file without its state's "
                              "structure): pass a checkpoint written by `wsc run` or `cstorch.save`")
    structure = json.loads(meta["structure"])
    if only is not None and "__dict__" not in structure:
        only = None  # (not a dict of entries: all of it)
    if only == ():
        return _unflatten(structure, None)
    try:
        with safe_open(str(p), framework="pt", device=str(map_location) if map_location else "cpu") as f:
            read = _Reader(f)
            if only is None:
                return _unflatten(structure, read)
            return {k: _unflatten(v, read if k in only else None) for k, v in structure["__dict__"]}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{p} is not a complete checkpoint ({str(e).splitlines()[0][:120]}); it was "
                              f"partially written: use an earlier checkpoint") from None


class _Reader:
    """The tensors of an open safetensors file by key, each read once (a tied tensor is one tensor)."""

    def __init__(self, f: Any) -> None:
        self.f, self.read = f, {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.read:
            self.read[key] = self.f.get_tensor(key)
        return self.read[key]


# ---- the first `wsc run` format, read as the state it would be now --------------------------------------------
def _load_v1(manifest_path: Path, map_location: Any = None, only: tuple[str, ...] | None = None) -> dict[str, Any]:
    manifest = _read_v1_manifest(manifest_path)
    device = str(map_location) if map_location else "cpu"
    stem = manifest_path.with_suffix("")
    model: dict[str, Any] = {}
    extra: dict[str, torch.Tensor] = {}
    if only != ():
        for name, size in manifest["files"].items():
            f = manifest_path.with_name(name)
            if not f.exists() or f.stat().st_size != size:
                raise CheckpointError(f"checkpoint {manifest_path.name} is partial: {name} is missing or has the "
                                      f"wrong size; use an earlier checkpoint")
        model = load_file(str(stem.with_suffix(".safetensors")), device=device)
        optim = manifest_path.with_name(stem.name + ".optim.safetensors")
        if optim.exists() and (only is None or {"optimizer", "rng"} & set(only)):
            extra = load_file(str(optim), device=device)
    state = {k: v for k, v in manifest.items() if k not in ("format", "step", "files", "optimizer")}
    state.update(model=model, global_step=int(manifest["step"]))
    if "rng.torch" in extra:
        state["rng"] = {"torch": extra["rng.torch"]}
    if "optimizer" in manifest:
        opt: dict[int, dict[str, Any]] = {}
        for name, t in extra.items():
            if name.startswith("state."):
                _, idx, key = name.split(".", 2)
                opt.setdefault(int(idx), {})[key] = t
        for idx, sc in manifest["optimizer"].get("scalars", {}).items():
            opt.setdefault(int(idx), {}).update(sc)
        state["optimizer"] = {"state": opt, "param_groups": manifest["optimizer"]["param_groups"],
                              **manifest["optimizer"].get("extra", {})}
    return state


def _read_v1_manifest(manifest_path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_V1_RUN:
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{manifest_path} is not a waferscale checkpoint (format {fmt!r})")
    return manifest


# ---- a checkpoint as a run resumes it ---------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """A loaded checkpoint: its model weights, step and the rest of its state."""

    step: int
    path: Path
    model: dict[str, torch.Tensor]
    state: dict[str, Any]  # everything else: model_config, optimizer, rng, data, sparsity, note, ...
    # a Model Zoo checkpoint's per-parameter optimizer state under our indices (its param groups are ours)
    optimizer_per_param: dict[int, dict[str, Any]] | None = None

    @property
    def model_config(self) -> dict[str, Any] | None:
        """The architecture it was written for; None for a cstorch script's checkpoint that did not save one."""
        return self.state.get("model_config")

    def optimizer_state(self) -> dict[str, Any] | None:
        """The optimizer state dict; for a Model Zoo checkpoint only its "state" (the caller's optimizer gives the
        param groups: hyper-parameters come from the params file)."""
        if self.optimizer_per_param is not None:
            return {"state": self.optimizer_per_param}
        return self.state.get("optimizer")

    @property
    def rng_state(self) -> torch.Tensor | None:
        rng = self.state.get("rng")
        return rng.get("torch") if isinstance(rng, dict) else None


def load_cerebras_checkpoint(path: str | Path, cfg: ModelConfig, optimizer_index: Mapping[str, int] | None = None,
                             lr_scales: Mapping[str, float] | None = None) -> Checkpoint:
    """A Model Zoo .mdl as a Checkpoint of `cfg`'s model: weights under our names, the step it reached and, given
    `optimizer_index` (parameter name -> its index in our optimizer's state dict) and the params file's
    `adjust_learning_rate` scales (which shape Model Zoo's param groups), its optimizer state."""
    from waferscale.models.modelzoo import model_state, state_dict_from_zoo
    from waferscale.models.modelzoo_optim import optimizer_state_from_zoo

    path = Path(path)
    state = load_mdl(path)
    weights = state_dict_from_zoo(model_state(state, str(path)), cfg, where=str(path))
    step = _int(state.get("global_step", 0))
    notes = []
    per_param = None
    if state.get("optimizer") is not None:
        if optimizer_index is None:
            notes.append("its optimizer state is not carried over (a fresh optimizer starts)")
        else:
            shapes = {n: tuple(weights[n].shape) for n in optimizer_index if n in weights}
            per_param = optimizer_state_from_zoo(state["optimizer"], cfg, optimizer_index, shapes, lr_scales or {},
                                                 str(path))
    # our schedules are functions of the step (runtime/optim.py): the scheduler's own position is only checked
    scheduler = state.get("lr_scheduler") or next(iter(state.get("schedulers") or []), None)
    if isinstance(scheduler, dict) and "last_epoch" in scheduler and _int(scheduler["last_epoch"]) != step:
        notes.append(f"its learning-rate scheduler was at step {_int(scheduler['last_epoch'])}, global_step {step}; "
                     f"the schedule here follows global_step")
    rest = {"model_config": cfg.to_dict(), "data": {"step": step}, "note": "; ".join(notes) or None}
    return Checkpoint(step=step, path=path, model=weights, state=rest, optimizer_per_param=per_param)


def name_optimizer_state(state: dict[str, Any], index: Mapping[str, int]) -> dict[str, Any]:
    """`state` (an optimizer.state_dict()) with each param group's parameter names (`param_names`, as torch writes
    for an optimizer given named parameters), `index` naming each parameter's index: so that a run grouped
    otherwise can take it (`regroup_optimizer_state`)."""
    name_of = {i: n for n, i in index.items()}
    if sorted(i for g in state["param_groups"] for i in g["params"]) != sorted(name_of):
        raise CheckpointError(f"the optimizer holds {sum(len(g['params']) for g in state['param_groups'])} "
                              f"parameters, the model {len(name_of)}: they cannot be named")
    return {**state, "param_groups": [{**g, "param_names": [name_of[i] for i in g["params"]]}
                                      for g in state["param_groups"]]}


def regroup_optimizer_state(state: dict[str, Any], ours: dict[str, Any], index: Mapping[str, int],
                            where: str) -> dict[str, Any]:
    """A named optimizer state (`name_optimizer_state`) in our grouping `ours` (this run's state_dict(), `index`
    naming its parameters): each parameter's state moved to our index by name, the hyper-parameters ours. A state
    already grouped as ours, or without names, is returned as it is."""
    groups = state.get("param_groups", [])
    if not groups or not all("param_names" in g for g in groups):
        return state  # (nothing to regroup by)
    sizes = [len(g["params"]) for g in groups]
    if sizes == [len(g["params"]) for g in ours["param_groups"]] and \
            [n for g in groups for n in g["param_names"]] == [n for _, n in sorted((i, n) for n, i in index.items())]:
        return state  # (grouped as ours already)
    theirs = {n: i for g in groups for n, i in zip(g["param_names"], g["params"])}
    if set(theirs) != set(index):
        missing, extra = sorted(set(index) - set(theirs)), sorted(set(theirs) - set(index))
        raise CheckpointError(f"{where}: its optimizer state is for other parameters (missing {missing[:3]}, "
                              f"unexpected {extra[:3]})")
    per_param = {index[n]: state["state"][i] for n, i in theirs.items() if i in state["state"]}
    return {**{k: v for k, v in state.items() if k not in ("state", "param_groups")}, "state": per_param,
            "param_groups": ours["param_groups"]}


def _int(v: Any) -> int:
    return int(v.item() if torch.is_tensor(v) else v)


def save_checkpoint(model_dir: Path, step: int, model: torch.nn.Module | Mapping[str, torch.Tensor],
                    model_config: dict[str, Any], *,
                    optimizer_state: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write `model_dir/checkpoint_{step}.safetensors` (the module's docstring), atomically; returns its path. A
    first-format checkpoint of the same step (its weights file has this name) is replaced whole."""
    weights = model.state_dict() if isinstance(model, torch.nn.Module) else dict(model)  # (tied: stored once)
    state: dict[str, Any] = {"model": weights, "global_step": step, "model_config": model_config,
                             "rng": {"torch": torch.get_rng_state()}, **(extra or {})}
    if optimizer_state is not None:
        state["optimizer"] = optimizer_state
    path = save_state(state, Path(model_dir) / f"checkpoint_{step}.safetensors")
    for old in (path.with_suffix(".json"), path.with_name(f"checkpoint_{step}.optim.safetensors")):
        old.unlink(missing_ok=True)
    return path


def latest_checkpoint(model_dir: Path) -> Path | None:
    """The newest checkpoint in `model_dir` (checkpoint_{step}.safetensors, a first-format checkpoint_{step}.json
    or a Model Zoo checkpoint_{step}.mdl), or None."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return None
    found = []
    for p in model_dir.iterdir():
        if (m := _NAME.match(p.name)) is None:
            continue
        if m.group(2) == "safetensors" and _first_format_weights(p):
            continue  # (its manifest stands for it; without one it is a partial first-format checkpoint)
        found.append((int(m.group(1)), m.group(2) != "json", p))  # (one step in both formats: the newer one)
    return max(found)[2] if found else None


def resolve_checkpoint_path(path: str | Path) -> Path:
    """The checkpoint file `path` names: itself, its stem (`checkpoint_5`), or a model_dir's latest; a first-format
    checkpoint by its manifest, whichever of its files names it."""
    p = Path(path)
    if p.is_dir():
        latest = latest_checkpoint(p)
        if latest is None:
            raise CheckpointError(f"no checkpoint in {p} (no checkpoint_*.safetensors, .json or .mdl); train first "
                                  "or pass a checkpoint file")
        return latest
    v1_parts = (".optim.safetensors", ".safetensors")
    if p.is_file() and not (p.name.endswith(v1_parts[0]) or (p.suffix == v1_parts[1] and _first_format_weights(p))):
        return p
    stem = next((p.name[: -len(s)] for s in v1_parts if p.name.endswith(s)), p.name)
    for name in (stem + ".json", stem + ".safetensors", stem + ".mdl"):
        q = p.with_name(name)
        if q.is_file() and (q.suffix != ".safetensors" or is_checkpoint_file(q)):
            return q
    if p.is_file():
        raise CheckpointError(f"{p} is part of a first-format checkpoint whose manifest ({stem}.json) is missing: it "
                              "is partial; use an earlier checkpoint")
    raise CheckpointError(f"no checkpoint at {p}")


def _first_format_weights(p: Path) -> bool:
    """Whether `p` is the weights file of a first-format checkpoint: a manifest beside it, or a complete
    safetensors file without this format's metadata. (An unreadable one is not: loading it says what is wrong.)"""
    if p.with_suffix(".json").is_file():
        return True
    try:
        return _file_meta(p).get("format") not in ONE_FILE
    except CheckpointError:
        return False


def is_checkpoint_file(p: Path) -> bool:
    """Whether `p` is a checkpoint file of ours in one file (this format, or a first `cstorch.save` file)."""
    try:
        return p.is_file() and _file_meta(p).get("format") in ONE_FILE
    except CheckpointError:
        return False


def load_checkpoint(path: str | Path, with_optimizer: bool = True, model_config: ModelConfig | None = None,
                    optimizer_index: Mapping[str, int] | None = None, lr_scales: Mapping[str, float] | None = None
                    ) -> Checkpoint:
    """Any checkpoint (the module's docstring) as a run resumes it. A Model Zoo .mdl needs the model's config (its
    parameter names are mapped for it) and gives its optimizer state given our optimizer's indices
    (`load_cerebras_checkpoint`)."""
    p = resolve_checkpoint_path(path)
    if p.suffix != ".json" and is_mdl(p):
        if model_config is None:
            raise CheckpointError(f"{p} is a Cerebras checkpoint: its parameter names are mapped for a model, so "
                                  f"give the params file of the model it holds")
        return load_cerebras_checkpoint(p, model_config, optimizer_index if with_optimizer else None, lr_scales)
    state = load_state(p, only=None if with_optimizer else ("model",))  # (weights only: the optimizer's unread)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{p} holds no model weights (a checkpoint is a dict with a \"model\" state dict, as "
                              "cstorch.save({\"model\": model.state_dict(), ...}) writes)")
    rest = {k: v for k, v in state.items() if k not in ("model", "global_step")}
    if not with_optimizer:
        rest.pop("optimizer", None)
        rest.pop("rng", None)
    return Checkpoint(step=_int(state.get("global_step", 0)), path=p, model=state["model"], state=rest)


def with_tied_names(weights: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`weights` (each tensor once, as MemoryX holds them) under every name `model`'s state dict has: a tied
    parameter also under its other names (the same tensor), as `model.state_dict()` gives it, so that a script's
    strict `load_state_dict` takes the checkpoint. `model` may be on the meta device."""
    out = dict(weights)
    first: dict[int, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        held = first.setdefault(id(t), name)
        if held != name and held in out:
            out[name] = out[held]
    return out


def load_model_weights(model: torch.nn.Module | Mapping[str, torch.Tensor], weights: dict[str, torch.Tensor],
                       where: str) -> None:
    """Copy weights into `model`, refusing another architecture with the first mismatch named. Sparsity masks
    (`<name>_mask`) are optional both ways: a dense model ignores a sparse run's (dense fine-tuning after
    sparse pre-training), a sparse model without them in the checkpoint keeps the masks it has."""
    expected = unique_state_dict(model)
    kept = {tensor_identity(v) for k, v in weights.items() if k in expected}  # a tied copy under another name: once
    weights = {k: v for k, v in weights.items()
               if k in expected or not (k.endswith("_mask") or tensor_identity(v) in kept)}
    expected = {k: v for k, v in expected.items() if k in weights or not k.endswith("_mask")}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where} is for another architecture: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    for name, t in expected.items():
        if tuple(weights[name].shape) != tuple(t.shape):
            raise CheckpointError(f"{where} is for another architecture: {name} has shape "
                                  f"{tuple(weights[name].shape)}, the model expects {tuple(t.shape)}")
    with torch.no_grad():
        for name, t in expected.items():
            t.copy_(weights[name])
