"""Checkpoints: `model_dir/checkpoint_{step}.*`, tensors in safetensors, everything else in JSON.

    checkpoint_{step}.safetensors        model weights (tied weights stored once)
    checkpoint_{step}.optim.safetensors  optimizer state tensors, keyed "state.{param_index}.{name}", + RNG state
    checkpoint_{step}.json               the manifest: step, model config, optimizer hyper-parameters, data loader
                                          position, user state, and the size of each tensor file

The manifest is written last, by rename: a checkpoint without a manifest, or whose files do not match the
sizes it lists, is partial and refused. Loading never unpickles anything.

A Cerebras Model Zoo checkpoint (`.mdl`, `runtime/mdl.py`) loads too: its model's weights under our names
(`models/modelzoo.py`), its global_step and, given our optimizer's parameter indices, its optimizer state
renumbered from Model Zoo's param groups to ours (`models/modelzoo_optim.py`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from waferscale.errors import CheckpointError
from waferscale.models.config import ModelConfig
from waferscale.runtime.mdl import is_mdl, load_mdl
from waferscale.util.files import atomic_path, atomic_write_bytes

FORMAT = "waferscale-checkpoint-v1"
_NAME = re.compile(r"^checkpoint_(\d+)\.json$")


def _atomic_save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))


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


def optimizer_to_tensors(opt_state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split `optimizer.state_dict()` into tensors (for safetensors) and JSON-able hyper-parameters."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in opt_state["state"].items():
        for key, val in st.items():
            if torch.is_tensor(val):
                tensors[f"state.{idx}.{key}"] = val
            else:
                scalars.setdefault(str(idx), {})[key] = val
    extra = {k: v for k, v in opt_state.items() if k not in ("state", "param_groups")}  # e.g. grad_scaler
    return tensors, {"param_groups": opt_state["param_groups"], "scalars": scalars, "extra": extra}


def optimizer_from_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        if not name.startswith("state."):
            continue
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = t
    for idx, sc in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(sc)
    return {"state": state, "param_groups": meta["param_groups"], **meta.get("extra", {})}


@dataclass
class Checkpoint:
    """A loaded checkpoint: tensors plus the manifest."""

    step: int
    path: Path  # the manifest
    model: dict[str, torch.Tensor]
    manifest: dict[str, Any]
    optim_tensors: dict[str, torch.Tensor] | None
    # a Model Zoo checkpoint's per-parameter optimizer state under our indices (its param groups are ours)
    optimizer_per_param: dict[int, dict[str, Any]] | None = None

    @property
    def model_config(self) -> dict[str, Any]:
        return self.manifest["model_config"]

    def optimizer_state(self) -> dict[str, Any] | None:
        """The optimizer state dict; for a Model Zoo checkpoint only its "state" (the caller's optimizer gives the
        param groups: hyper-parameters come from the params file)."""
        if self.optimizer_per_param is not None:
            return {"state": self.optimizer_per_param}
        if self.optim_tensors is None or "optimizer" not in self.manifest:
            return None
        return optimizer_from_tensors(self.optim_tensors, self.manifest["optimizer"])

    @property
    def rng_state(self) -> torch.Tensor | None:
        return (self.optim_tensors or {}).get("rng.torch")


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
    manifest = {"format": "cerebras-mdl", "step": step, "model_config": cfg.to_dict(), "data": {"step": step},
                "note": "; ".join(notes) or None}
    return Checkpoint(step=step, path=path, model=weights, manifest=manifest, optim_tensors=None,
                      optimizer_per_param=per_param)


def _int(v: Any) -> int:
    return int(v.item() if torch.is_tensor(v) else v)


def save_checkpoint(model_dir: Path, step: int, model: torch.nn.Module | Mapping[str, torch.Tensor],
                    model_config: dict[str, Any], *,
                    optimizer_state: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write checkpoint_{step}.* atomically; returns the manifest path."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    stem = model_dir / f"checkpoint_{step}"
    weights = stem.with_suffix(".safetensors")
    _atomic_save_tensors(unique_state_dict(model), weights)
    manifest: dict[str, Any] = {"format": FORMAT, "step": step, "model_config": model_config,
                                "files": {weights.name: weights.stat().st_size}, **(extra or {})}
    opt_tensors: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    if optimizer_state is not None:
        tensors, meta = optimizer_to_tensors(optimizer_state)
        opt_tensors.update(tensors)
        manifest["optimizer"] = meta
    optim_path = model_dir / f"checkpoint_{step}.optim.safetensors"
    _atomic_save_tensors(opt_tensors, optim_path)
    manifest["files"][optim_path.name] = optim_path.stat().st_size
    path = stem.with_suffix(".json")
    atomic_write_bytes(path, json.dumps(manifest, indent=1, default=_json_default).encode(), fsync=True)
    return path


def _json_default(o: Any) -> Any:
    if torch.is_tensor(o):
        return o.item() if o.numel() == 1 else o.tolist()
    raise TypeError(f"cannot store {type(o).__name__} in a checkpoint manifest")


def latest_checkpoint(model_dir: Path) -> Path | None:
    """The manifest of the newest checkpoint in `model_dir` (one with a manifest), or None."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in model_dir.iterdir() if (m := _NAME.match(p.name))]
    return max(found)[1] if found else None


def resolve_checkpoint_path(path: str | Path) -> Path:
    """Accept the manifest, any of its tensor files, the stem, or a model_dir (-> latest)."""
    p = Path(path)
    if p.is_dir():
        latest = latest_checkpoint(p)
        if latest is None:
            raise CheckpointError(f"no checkpoint_*.json found in {p}; train first or pass a checkpoint file")
        return latest
    for suffix in (".optim.safetensors", ".safetensors", ".json"):
        if p.name.endswith(suffix):
            p = p.with_name(p.name[: -len(suffix)])
            break
    manifest = p.with_name(p.name + ".json")
    if not manifest.exists():
        raise CheckpointError(f"checkpoint {path} not found (expected {manifest}); "
                              f"a checkpoint without its manifest is partial and cannot be loaded")
    return manifest


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of checkpoint `path` (a model_dir: its latest), checked to be one of ours."""
    manifest_path = resolve_checkpoint_path(path)
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{manifest_path} is not a waferscale checkpoint (format {fmt!r})")
    return manifest


def load_checkpoint(path: str | Path, with_optimizer: bool = True, model_config: ModelConfig | None = None,
                    optimizer_index: Mapping[str, int] | None = None, lr_scales: Mapping[str, float] | None = None
                    ) -> Checkpoint:
    """One of ours, or (given the model's config, which its parameter names are mapped for) a Cerebras .mdl, whose
    optimizer state is read given our optimizer's indices (`load_cerebras_checkpoint`)."""
    if Path(path).is_file() and is_mdl(path):
        if model_config is None:
            raise CheckpointError(f"{path} is a Cerebras checkpoint: its parameter names are mapped for a model, so "
                                  f"give the params file of the model it holds")
        return load_cerebras_checkpoint(path, model_config, optimizer_index if with_optimizer else None, lr_scales)
    manifest_path = resolve_checkpoint_path(path)
    manifest = read_manifest(manifest_path)
    for name, size in manifest["files"].items():
        f = manifest_path.with_name(name)
        if not f.exists() or f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {manifest_path.name} is partial: {name} is missing or has the wrong "
                                  f"size; use an earlier checkpoint")
    stem = manifest_path.with_suffix("")
    model = load_file(str(stem.with_suffix(".safetensors")))
    optim = load_file(str(manifest_path.with_name(stem.name + ".optim.safetensors"))) if with_optimizer else None
    return Checkpoint(step=int(manifest["step"]), path=manifest_path, model=model, manifest=manifest,
                      optim_tensors=optim)


def load_model_weights(model: torch.nn.Module | Mapping[str, torch.Tensor], weights: dict[str, torch.Tensor],
                       where: str) -> None:
    """Copy weights into `model`, refusing another architecture with the first mismatch named. Sparsity masks
    (`<name>_mask`) are optional both ways: a dense model ignores a sparse run's (dense fine-tuning after
    sparse pre-training), a sparse model without them in the checkpoint keeps the masks it has."""
    expected = unique_state_dict(model)
    weights = {k: v for k, v in weights.items() if k in expected or not k.endswith("_mask")}
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
