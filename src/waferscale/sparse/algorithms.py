"""Sparsity algorithms, as cerebras.pytorch.sparse names them: `Static`, `GMP`, `SET`, `RigL`, a `Group` of
them by parameter filter, and `configure(cfg)` from a params file's `sparsity:` section.

An algorithm owns the masks of the parameters given to it (`add`) and decides them: at `initialize` (the
init method at the step-0 sparsity) and at `update`, called once after every optimizer step:

    step += 1; if the update schedule says so, each mask is recomputed from the weights (and, for RigL, the
    dense gradients of the step just taken) and `version` goes up

It knows nothing of where the weights live. Whoever runs the model applies the masks: the resident model by
hooks (below), MemoryX to its master weights, optimizer state and streamed payloads.
Random choices (random init, SET's regrowth) come from the algorithm's own generator (`seed`), so every
backend and every system count draws the same masks.

The hooks (the end of this file) apply them to a resident model (one that runs whole on its device), as
cerebras.pytorch does:

    model.apply(sparsity)      each selected weight gets a persistent bool buffer `<name>_mask` on its module
                               (so `model.state_dict()` and checkpoints carry it); before each forward the
                               weights are pruned (w *= mask); each gradient is masked (outside the mask: 0)
    optimizer.apply(sparsity)  before each step, optimizer state of the weight's shape is pruned; after it the
                               weights are pruned again and the algorithm updates (recomputing masks on update
                               steps, then pruning weights and state with the new masks)

A weight-streamed model (MemoryX) does the same to its master weights instead; see runtime/memoryx.py.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn

from waferscale.errors import ConfigError
from waferscale.sparse.masks import (Shaper, drop_minimum, grow_maximum, make_filter, make_init_method,
                                     mask_for_sparsity)
from waferscale.sparse.schedules import Schedule, UpdateSchedule, make_schedule, make_update_schedule

__all__ = ["SparsityAlgorithm", "Static", "DynamicSparsityAlgorithm", "GMP", "SET", "RigL", "Group", "configure",
           "SparseParam", "sparsify_module", "sparsify_optimizer", "applied"]

Hook = Callable[["SparsityAlgorithm", str, float], None]


@dataclass
class SparseParam:
    """One sparse weight. Both are read through getters, so they follow the tensors wherever their owner moves
    them (a module's buffers are replaced by `.to(device)`; MemoryX maps flash-tier weights only when read)."""

    name: str
    get_param: Callable[[], Tensor]
    get_mask: Callable[[], Tensor]  # bool, the weight's shape; written in place
    initialized: bool = False

    @property
    def param(self) -> Tensor:
        return self.get_param()

    @property
    def mask(self) -> Tensor:
        return self.get_mask()


class SparsityAlgorithm:
    """Base: a target sparsity schedule, an init method, the masks of the parameters added to it."""

    dynamic = False

    def __init__(self, sparsity: Any = None, init_method: Any = "random", seed: int = 0) -> None:
        if sparsity is None:
            raise ConfigError(f"{type(self).__name__}: sparsity is required (a fraction in [0, 1) or a schedule)")
        self.schedule: Schedule = make_schedule(sparsity)
        _check_fractions(self.schedule, "sparsity")
        self.init_method = make_init_method(init_method)
        self.shaper = Shaper()
        self.params: OrderedDict[str, SparseParam] = OrderedDict()
        self.step = 0
        self.version = 0  # goes up whenever a mask changes
        self.generator = torch.Generator().manual_seed(seed)
        self._target_hooks: list[Hook] = []
        self._computed_hooks: list[Hook] = []

    def __call__(self, module: torch.nn.Module) -> None:
        """`model.apply(sparsity)`, as cerebras.pytorch spells it: torch's own `Module.apply` calls this on every
        submodule, children first and the model last; the masks go on at that last call, over the whole model
        (`sparsify_module(self, model)`: parameter names and filters relative to it). A call made by the
        `apply` of a parent, as every child's is, does nothing; a direct call `sparsity(model)` is the model's."""
        caller = sys._getframe(1)
        apply_code = torch.nn.Module.apply.__code__
        if caller.f_code is apply_code and caller.f_back is not None and caller.f_back.f_code is apply_code:
            return  # a submodule's turn inside the model's apply
        sparsify_module(self, module)

    # ---- parameters ----
    def add(self, name: str, param: Tensor | Callable[[], Tensor],
            mask: Tensor | Callable[[], Tensor] | None = None) -> SparseParam:
        """Make `name` sparse. `param`, `mask`: tensors or getters of them; `mask` is where the mask is kept
        (e.g. a module's `<name>_mask` buffer; by default a tensor of the algorithm's own)."""
        get_param = param if callable(param) else (lambda: param)
        shape = tuple(get_param().shape)
        self.shaper.check(name, shape)
        if mask is None:
            mask = torch.ones(shape, dtype=torch.bool)
        sp = SparseParam(name, get_param, mask if callable(mask) else (lambda: mask))
        self.params[name] = sp
        return sp

    def sparsity_at(self, step: int) -> float:
        return min(max(self.schedule(step), 0.0), 1.0)

    def initialize(self) -> None:
        """Draw the masks of parameters that have none yet (a mask loaded from a checkpoint counts as drawn)."""
        s = self.sparsity_at(self.step)
        for sp in self.params.values():
            if not sp.initialized:
                sp.mask.copy_(self._initial_mask(sp, s))
                sp.initialized = True
                self.version += 1

    def _initial_mask(self, sp: SparseParam, sparsity: float) -> Tensor:
        return self.init_method(sp.param, sparsity, self.shaper, self.generator)

    def set_mask(self, name: str, mask: Tensor) -> None:
        """Adopt a mask (from a checkpoint)."""
        sp = self.params[name]
        if tuple(mask.shape) != tuple(sp.mask.shape):
            raise ConfigError(f"the mask of {name} has shape {tuple(mask.shape)}, the weight {tuple(sp.mask.shape)}")
        sp.mask.copy_(mask.to(torch.bool))
        sp.initialized = True
        self.version += 1

    # ---- each step ----
    def wants_dense_grads(self) -> bool:
        """Whether the coming `update` needs this step's dense gradients (RigL on an update step)."""
        return False

    def update(self, dense_grads: dict[str, Tensor] | None = None, finite: bool = True,
               compute: bool = True) -> list[str]:
        """After an optimizer step: advance the step and recompute the masks on update steps. Returns the names
        whose masks changed. `finite=False` (a skipped fp16 step) advances without changing a mask;
        `compute=False` only advances (a system that holds no weights)."""
        self.step += 1
        for hook in self._target_hooks:
            hook(self, self._glob(), self.sparsity_at(self.step))
        return []

    def _glob(self) -> str:
        return os.path.commonprefix(list(self.params)) + "*"

    def _report(self) -> None:
        for hook in self._computed_hooks:
            for sp in self.params.values():
                hook(self, sp.name, 1.0 - float(sp.mask.sum()) / max(sp.mask.numel(), 1))

    def register_target_sparsity_hook(self, hook: Hook) -> None:
        """hook(algorithm, name_glob, target) after each step."""
        self._target_hooks.append(hook)

    def register_computed_sparsity_hook(self, hook: Hook) -> None:
        """hook(algorithm, name, actual) after each step, per parameter."""
        self._computed_hooks.append(hook)

    # ---- checkpoints (masks travel with the weights as `<name>_mask`) ----
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _check_fractions(schedule: Schedule, key: str) -> None:
    """A sparsity (or drop fraction) is a fraction in [0, 1): constant values and a schedule's starting points
    (an exp schedule's asymptote `final` may be 1)."""
    values = [(v, 1.0) for v in getattr(schedule, "values", [])]
    values += [(v, 1.0 if k != "final" else 1.0 + 1e-12) for k, v in schedule.params.items()
               if k in ("value", "init", "final", "minimum")]
    for v, top in values:
        if not 0.0 <= v < top:
            raise ConfigError(f"{key} must be in [0, 1), got {v:g}")


class Static(SparsityAlgorithm):
    """Masks drawn once and kept: the weights outside them stay zero."""

    def __init__(self, sparsity: Any = None, **kwargs: Any) -> None:
        super().__init__(sparsity, **kwargs)
        if self.schedule.kind != "constant":
            raise ConfigError("static sparsity is one number in [0, 1); a schedule needs a dynamic algorithm "
                              "(gmp, set or rigl)")

    def update(self, dense_grads: dict[str, Tensor] | None = None, finite: bool = True,
               compute: bool = True) -> list[str]:
        super().update()
        self._report()
        return []


class DynamicSparsityAlgorithm(SparsityAlgorithm, ABC):
    """Masks recomputed on the update schedule (`update`: {freq, start, stop} or {steps}; None = every step).
    If step 0 is not an update step, training starts dense (all-ones masks) until the first update."""

    dynamic = True

    def __init__(self, sparsity: Any = None, update: Any = None, **kwargs: Any) -> None:
        super().__init__(sparsity, **kwargs)
        self.update_schedule: UpdateSchedule = make_update_schedule(update)
        self.starts_sparse = self.update_schedule(0)

    def _initial_mask(self, sp: SparseParam, sparsity: float) -> Tensor:
        if not self.starts_sparse:
            return torch.ones(sp.mask.shape, dtype=torch.bool)
        return super()._initial_mask(sp, sparsity)

    def update(self, dense_grads: dict[str, Tensor] | None = None, finite: bool = True,
               compute: bool = True) -> list[str]:
        super().update()
        is_update = self.update_schedule(self.step) and finite
        changed = []
        if is_update and compute:
            target = self.sparsity_at(self.step)
            for sp in self.params.values():
                new = self.new_mask(sp, target, dense_grads)
                if not torch.equal(new, sp.mask):
                    sp.mask.copy_(new)
                    changed.append(sp.name)
            self.version += bool(changed)
        self.schedule.update(is_update)
        self._report()
        return changed

    @abstractmethod
    def new_mask(self, sp: SparseParam, sparsity: float, dense_grads: dict[str, Tensor] | None) -> Tensor:
        """The mask of `sp` at the target `sparsity` (this update step's), from its weights (and gradients)."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step, dtype=torch.int64), "sparsity": self.schedule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.schedule.load_state_dict(state.get("sparsity", {}))


class GMP(DynamicSparsityAlgorithm):
    """Gradual magnitude pruning: at each update, keep the largest |w| at the scheduled sparsity."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.schedule.kind == "constant":
            raise ConfigError(f"GMP with a constant sparsity ({self.schedule(0):g}) never changes its masks: give "
                              f"a schedule ({{type: linear|exp|power|cosine, ...}}), or use algorithm: static")

    def new_mask(self, sp: SparseParam, sparsity: float, dense_grads: dict[str, Tensor] | None) -> Tensor:
        return mask_for_sparsity(sp.param.detach().abs().float().cpu(), sparsity, self.shaper)


class _DropRegrow(DynamicSparsityAlgorithm):
    """Drop `drop_fraction` of the kept weights (lowest |w|), regrow as many elsewhere."""

    def __init__(self, drop_fraction: Any = 0.3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.drop_fraction = make_schedule(drop_fraction, "drop_fraction")
        _check_fractions(self.drop_fraction, "drop_fraction")

    @abstractmethod
    def regrow_score(self, sp: SparseParam, dense_grads: dict[str, Tensor] | None) -> Tensor:
        """Where to regrow: the highest scores among the pruned weights win."""

    def update(self, dense_grads: dict[str, Tensor] | None = None, finite: bool = True,
               compute: bool = True) -> list[str]:
        changed = super().update(dense_grads, finite, compute)
        self.drop_fraction.update(self.update_schedule(self.step) and finite)
        return changed

    def new_mask(self, sp: SparseParam, sparsity: float, dense_grads: dict[str, Tensor] | None) -> Tensor:
        score = sp.param.detach().abs().float().cpu()  # (called after the step has advanced)
        mask, k = drop_minimum(score, sp.mask, self.drop_fraction(self.step), self.shaper)
        return grow_maximum(self.regrow_score(sp, dense_grads), mask, sparsity, k, self.shaper)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "drop_fraction": self.drop_fraction.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.drop_fraction.load_state_dict(state.get("drop_fraction", {}))


class SET(_DropRegrow):
    """Sparse evolutionary training: regrow at random."""

    def regrow_score(self, sp: SparseParam, dense_grads: dict[str, Tensor] | None) -> Tensor:
        return torch.rand(sp.mask.shape, generator=self.generator)


class RigL(_DropRegrow):
    """Rigging the lottery: regrow where the dense gradient of the step is largest. The gradients outside the
    masks are needed only on update steps; on the others only the masked gradients are reduced."""

    def __init__(self, drop_fraction: Any = 0.3, balance_in_groups: int | None = None,
                 balance_out_groups: int | None = None, **kwargs: Any) -> None:
        super().__init__(drop_fraction, **kwargs)
        if balance_in_groups and balance_out_groups:
            raise ConfigError("RigL: give balance_in_groups or balance_out_groups, not both")
        if balance_in_groups or balance_out_groups:
            self.shaper = Shaper(balance_out_groups or balance_in_groups, "out" if balance_out_groups else "in")

    def wants_dense_grads(self) -> bool:
        return self.update_schedule(self.step + 1)

    def regrow_score(self, sp: SparseParam, dense_grads: dict[str, Tensor] | None) -> Tensor:
        if dense_grads is None or sp.name not in dense_grads:
            raise ConfigError(f"RigL needs the dense gradient of {sp.name} on an update step; none was kept")
        return dense_grads[sp.name].detach().abs().float().cpu()


class Group(SparsityAlgorithm):
    """Algorithms by parameter filter (glob(s) or a predicate); the first filter a parameter matches wins."""

    def __init__(self, groups: dict[Any, SparsityAlgorithm] | None = None) -> None:
        self.members: list[tuple[Callable[[str, Tensor], bool], SparsityAlgorithm]] = []
        self.filters: list[Any] = []
        self.dense_grads: dict[str, Tensor] = {}  # RigL's, kept on update steps by whoever runs the model
        self.streamed = False  # MemoryX applies and updates the masks (the resident hooks stand aside)
        for flt, algo in (groups or {}).items():
            self.add_group(flt, algo)

    def add_group(self, param_filter: Any, algorithm: SparsityAlgorithm) -> None:
        self.members.append((make_filter(param_filter), algorithm))
        self.filters.append(param_filter)

    def extend(self, other: "Group") -> None:
        for (_, algo), flt in zip(other.members, other.filters):
            self.add_group(flt, algo)

    def select(self, named_params: Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor, SparsityAlgorithm]]:
        """(name, param, algorithm) for each parameter some member takes; errors on a filter that takes none."""
        out, hits = [], [0] * len(self.members)
        for name, p in named_params:
            for i, (flt, algo) in enumerate(self.members):
                if flt(name, p):
                    out.append((name, p, algo))
                    hits[i] += 1
                    break
        for n, flt in zip(hits, self.filters):
            if n == 0:
                raise ConfigError(f"sparsity param_filter {flt if flt is not None else '(the default)'} matches "
                                  f"no parameter of the model; the names look like {_sample(named_params)}")
        return out

    @property
    def algorithms(self) -> list[SparsityAlgorithm]:
        return [a for _, a in self.members]

    @property
    def params(self) -> OrderedDict[str, SparseParam]:  # type: ignore[override]
        return OrderedDict((k, v) for a in self.algorithms for k, v in a.params.items())

    @property
    def step(self) -> int:  # type: ignore[override]
        return self.algorithms[0].step if self.members else 0

    @property
    def version(self) -> int:  # type: ignore[override]
        return sum(a.version for a in self.algorithms)

    def initialize(self) -> None:
        for a in self.algorithms:
            a.initialize()

    def redraw(self) -> None:
        """Draw every mask again from the weights as they are now (after loading weights that had none)."""
        for sp in self.params.values():
            sp.initialized = False
        self.initialize()

    def set_mask(self, name: str, mask: Tensor) -> None:
        for a in self.algorithms:
            if name in a.params:
                a.set_mask(name, mask)

    def wants_dense_grads(self) -> bool:
        return any(a.wants_dense_grads() for a in self.algorithms)

    def figures(self) -> dict[str, float]:
        """This step's sparsity over all sparse weights: actual (from the masks) and target (the schedules'),
        each weighted by the weights' sizes."""
        sizes = [(a, sp.mask.numel(), int(sp.mask.sum())) for a in self.algorithms for sp in a.params.values()]
        n = max(sum(k for _, k, _ in sizes), 1)
        return {"sparsity": round(1.0 - sum(kept for _, _, kept in sizes) / n, 6),
                "sparsity_target": round(sum(a.sparsity_at(a.step) * k for a, k, _ in sizes) / n, 6)}

    def updates_next(self) -> bool:
        """Whether the coming `update` may recompute masks (it then reads the weights)."""
        return any(a.dynamic and a.update_schedule(a.step + 1) for a in self.algorithms)

    def update(self, dense_grads: dict[str, Tensor] | None = None, finite: bool = True,
               compute: bool = True) -> list[str]:
        return [n for a in self.algorithms for n in a.update(dense_grads, finite, compute)]

    def register_target_sparsity_hook(self, hook: Hook) -> None:
        for a in self.algorithms:
            a.register_target_sparsity_hook(hook)

    def register_computed_sparsity_hook(self, hook: Hook) -> None:
        for a in self.algorithms:
            a.register_computed_sparsity_hook(hook)

    def state_dict(self) -> dict[str, Any]:
        return {str(i): a.state_dict() for i, a in enumerate(self.algorithms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, a in enumerate(self.algorithms):
            a.load_state_dict(state.get(str(i), {}))


def _sample(named_params: Iterable[tuple[str, Tensor]]) -> str:
    names = [n for n, _ in named_params][:4]
    return ", ".join(names) + (", ..." if names else "")


ALGORITHMS: dict[str, type[SparsityAlgorithm]] = {"static": Static, "gmp": GMP, "set": SET, "rigl": RigL}
_KEYS = {"algorithm", "type", "param_filter", "sparsity", "schedule", "init_method", "update", "drop_fraction",
         "balance_in_groups", "balance_out_groups", "seed"}


def configure(config: Any) -> Group:
    """A Group from a float (static sparsity on the default filter), a dict (one algorithm and its filter) or a
    list of dicts. Keys as Cerebras': algorithm (`type` is its older name), sparsity (or `schedule`),
    param_filter, init_method, update, drop_fraction, balance_in/out_groups; `seed` is ours."""
    if isinstance(config, Group):
        return config
    if isinstance(config, bool):
        raise ConfigError(f"sparsity: expected a number, a mapping or a list, got {config!r}")
    if isinstance(config, (int, float)):
        return configure({"sparsity": config})
    group = Group()
    if isinstance(config, (list, tuple)):
        for item in config:
            group.extend(configure(item))
        return group
    if not isinstance(config, dict):
        raise ConfigError(f"sparsity: expected a number, a mapping or a list of mappings, got {config!r}")
    cfg = copy.deepcopy(config)
    if "groups" in cfg:  # the trainer layout's {groups: [{params: {...}}]} form
        return configure([{**{k: v for k, v in g.items() if k != "params"}, **g.get("params", {})}
                          for g in cfg.pop("groups")])
    unknown = sorted(set(cfg) - _KEYS)
    if unknown:
        raise ConfigError(f"sparsity: unknown key {', '.join(unknown)}; the section takes {', '.join(sorted(_KEYS))}")
    if "type" in cfg:
        if "algorithm" in cfg:
            raise ConfigError("sparsity: give algorithm (or its older name type), not both")
        warnings.warn("sparsity: the 'type' key is deprecated, use 'algorithm'", DeprecationWarning, stacklevel=2)
        cfg["algorithm"] = cfg.pop("type")
    name = str(cfg.pop("algorithm", "static")).lower()
    if name not in ALGORITHMS:
        raise ConfigError(f"sparsity.algorithm: {name!r}; choose one of {', '.join(ALGORITHMS)}")
    if "schedule" in cfg:
        if "sparsity" in cfg:
            raise ConfigError("sparsity: give sparsity or schedule (the same thing), not both")
        cfg["sparsity"] = cfg.pop("schedule")
    param_filter = cfg.pop("param_filter", None)
    cls = ALGORITHMS[name]
    if cls is Static and ("update" in cfg or "drop_fraction" in cfg):
        raise ConfigError("sparsity: update and drop_fraction belong to the dynamic algorithms (gmp, set, rigl); "
                          "static masks never change")
    if cls is not RigL and ({"balance_in_groups", "balance_out_groups"} & set(cfg)):
        raise ConfigError("sparsity: balance_in_groups / balance_out_groups are RigL's")
    if cls is GMP and "drop_fraction" in cfg:
        raise ConfigError("sparsity: drop_fraction belongs to set and rigl; gmp follows its sparsity schedule")
    if cls.dynamic and "update" not in cfg:
        raise ConfigError(f"sparsity.update: {name} needs update: {{freq: N}} (how often the masks are "
                          f"recomputed)")
    group = Group()
    group.add_group(param_filter, cls(**cfg))
    return group


# ---- the hooks on a resident model ---------------------------------------------------------------------------


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
