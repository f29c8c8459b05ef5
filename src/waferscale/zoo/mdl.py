"""A run's optimizer as a Model Zoo checkpoint sees it: the index of each parameter in the resident optimizer's
state dict (what `runtime.checkpoint` renumbers a Model Zoo optimizer state to, and from), and one of our
checkpoints as the state a Model Zoo run saves, for `cstorch.save(..., format="mdl")`."""

from __future__ import annotations

from typing import Any

from waferscale.errors import ConfigError
from waferscale.models import ModelConfig, build
from waferscale.models.modelzoo import state_dict_to_zoo
from waferscale.models.modelzoo_optim import optimizer_state_to_zoo
from waferscale.params import OptimizerParams
from waferscale.runtime.checkpoint import Checkpoint
from waferscale.runtime.memoryx import resident_groups
from waferscale.zoo.lm import zoo_group_rules
from waferscale.zoo.optim import optimizer_spec


def resident_param_index(cfg: ModelConfig, optimizer: OptimizerParams) -> dict[str, int]:
    """Parameter name -> its index in the state dict of the optimizer `compile_lm_step` builds for `cfg` (MemoryX
    keeps the same indices: `runtime.memoryx.resident_groups`), found on a model with meta tensors."""
    model = build(cfg, device="meta")
    lr_scale, decays = zoo_group_rules(model, optimizer)
    return resident_groups(model, optimizer_spec(optimizer), lr_scale, decays)[2]


def zoo_checkpoint(ckpt: Checkpoint, cfg: ModelConfig, optimizer: OptimizerParams) -> dict[str, Any]:
    """One of our checkpoints as Model Zoo 2.x saves a run: {"model": its wrapper's names, "optimizer": numbered
    in its param groups, "global_step"}. The learning-rate scheduler's state is not written: its layout depends on
    the scheduler classes the Model Zoo run builds."""
    out: dict[str, Any] = {"model": state_dict_to_zoo(ckpt.model, cfg)}
    state = ckpt.optimizer_state()
    if state is not None:
        scales, index = optimizer.adjust_learning_rate or {}, resident_param_index(cfg, optimizer)
        names = [n for g in state.get("param_groups", []) for n in g.get("param_names", [])]
        if names and names != [n for _, n in sorted((i, n) for n, i in index.items())]:
            raise ConfigError(f"{ckpt.path}: its optimizer state is grouped as the script that saved it grouped "
                              "it, not as a run of this params file; resume it once with `wsc run "
                              "--checkpoint_path` (which regroups it by parameter name) and convert that run's "
                              "checkpoint, or save the script's checkpoint without its optimizer")
        out["optimizer"] = optimizer_state_to_zoo(state, cfg, index, scales)
    out["global_step"] = ckpt.step
    return out


__all__ = ["resident_param_index", "zoo_checkpoint"]
