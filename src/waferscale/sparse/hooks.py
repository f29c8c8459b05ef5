"""Sparsity on a resident model (one that runs whole on its device), by hooks, as cerebras.pytorch applies it:

    model.apply(sparsity)      each selected weight gets a persistent bool buffer `<name>_mask` on its module
                               (so `model.state_dict()` and checkpoints carry it); before each forward the
                               weights are pruned (w *= mask); each gradient is masked (outside the mask: 0)
    optimizer.apply(sparsity)  before each step, optimizer state of the weight's shape is pruned; after it the
                               weights are pruned again and the algorithm updates (recomputing masks on update
                               steps, then pruning weights and state with the new masks)

A weight-streamed model (MemoryX) does the same to its master weights instead; see runtime/memoryx.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from waferscale.errors import ConfigError
from waferscale.sparse.algorithms import Group, SparsityAlgorithm, configure

__all__ = ["sparsify_module", "sparsify_optimizer", "applied"]


def _as_group(algorithm: SparsityAlgorithm) -> Group:
    """A lone algorithm works as the Group of it with the default filter (the same Group each time)."""
    if isinstance(algorithm, Group):
        return algorithm
    if getattr(algorithm, "_group", None) is None:
        algorithm._group = Group({None: algorithm})  # type: ignore[attr-defined]
    return algorithm._group  # type: ignore[attr-defined]


def applied(module: nn.Module) -> list[Group]:
    """The sparsity groups applied to `module` (in order)."""
    return module.__dict__.setdefault("_wsc_sparsity", [])


def sparsify_module(algorithm: SparsityAlgorithm | Any, module: nn.Module) -> Group:
    """Give the selected weights of `module` masks (drawn now, unless a checkpoint's `<name>_mask` is loaded
    later), and prune them before every forward and their gradients after every backward."""
    group = configure(algorithm) if not isinstance(algorithm, SparsityAlgorithm) else _as_group(algorithm)
    taken = {n for g in applied(module) for n in g.params}
    named = [(n, p) for n, p in module.named_parameters() if n not in taken]
    for name, p, algo in group.select(named):
        owner_name, _, pname = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        key = f"{pname}_mask"
        owner.register_buffer(key, torch.ones(p.shape, dtype=torch.bool, device=p.device), persistent=True)
        sp = algo.add(name, p, lambda o=owner, k=key: o._buffers[k])
        owner._register_load_state_dict_pre_hook(_mark_loaded(sp, algo, key))
    group.initialize()
    applied(module).append(group)
    module.register_forward_pre_hook(lambda m, args: _prune_weights(group))
    return group


def _mark_loaded(sp: Any, algo: SparsityAlgorithm, key: str) -> Any:
    """A mask loaded with the model's state dict counts as drawn, and as a change of masks."""
    def hook(state_dict: dict[str, Tensor], prefix: str, *args: Any) -> None:
        if prefix + key in state_dict:
            sp.initialized = True
            algo.version += 1
    return hook


@torch.no_grad()
def _prune_weights(group: Group) -> None:
    if group.streamed:
        return
    for algo in group.algorithms:
        for sp in algo.params.values():
            p = sp.param
            p.mul_(sp.mask)
            if p.requires_grad and not getattr(p, "_wsc_grad_hooked", False):
                p.register_hook(_grad_hook(group, algo, sp))
                p._wsc_grad_hooked = True


def _grad_hook(group: Group, algo: SparsityAlgorithm, sp: Any) -> Any:
    def hook(grad: Tensor) -> Tensor:
        if group.streamed:
            return grad
        if algo.wants_dense_grads():
            dense = group.dense_grads
            dense[sp.name] = dense[sp.name] + grad if sp.name in dense else grad.detach().clone()
        return torch.where(sp.mask, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    return hook


def sparsify_optimizer(algorithm: SparsityAlgorithm, optimizer: torch.optim.Optimizer) -> None:
    """Prune the optimizer's state before each step; after it, prune the weights and update the masks."""
    if getattr(optimizer, "factored_state", False):  # (runtime.optim.Adafactor)
        raise ConfigError(f"weight sparsity with {type(optimizer).__name__} is not supported: its second moment is "
                          "factored into row and column averages, which a mask cannot prune; use AdamW, Adam, SGD "
                          "or Lion with sparsity")
    group = _as_group(algorithm)
    if not group.params:
        raise ConfigError("optimizer.apply(sparsity) needs model.apply(sparsity) first, with the same object "
                          "(the one cstorch.sparse.configure returned)")
    by_param = {id(sp.param): sp for sp in group.params.values()}

    @torch.no_grad()
    def prune_state(*_: Any) -> None:
        if group.streamed:
            return
        for pg in optimizer.param_groups:
            for p in pg["params"]:
                sp = by_param.get(id(p))
                if sp is not None:
                    for v in optimizer.state.get(p, {}).values():
                        if torch.is_tensor(v) and v.shape == p.shape:
                            v.mul_(sp.mask)

    # torch runs an optimizer's step hooks again when a subclass's step calls a patched super().step(): act on
    # the outermost call only
    depth = [0]

    def before_step(*_: Any) -> None:
        depth[0] += 1
        if depth[0] == 1:
            prune_state()

    def after_step(*_: Any) -> None:
        depth[0] -= 1
        if depth[0] or group.streamed:  # (MemoryX updates the masks of a streamed model)
            return
        _prune_weights(group)
        if group.update(group.dense_grads):
            _prune_weights(group)
            prune_state()
        group.dense_grads.clear()

    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
