"""`cstorch.optim`: optimizers with Cerebras' defaults, and its learning-rate schedulers.

Each optimizer is the torch optimizer (fused CPU/CUDA kernels where torch has them) with Cerebras' signature
and defaults (AdamW's eps is 1e-6, `correct_bias`). Over a weight-streamed model (the "CSX" backend) the
optimizer binds to MemoryX on the model's first call: `step()` then completes MemoryX's update and
`state_dict()` is MemoryX's state, in torch's format.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn

from waferscale.errors import ConfigError
from waferscale.pytorch.optim import lr_scheduler
from waferscale.runtime.optim import Adafactor as _Adafactor
from waferscale.runtime.optim import Lamb as _Lamb
from waferscale.runtime.optim import Lion as _Lion
from waferscale.runtime.optim import OptimizerSpec, build_schedule, fused_or_foreach

__all__ = ["SGD", "Adam", "AdamW", "Lamb", "Lion", "Adafactor", "Adagrad", "Adamax", "RMSprop", "NAdam", "RAdam",
           "configure_optimizer", "configure_lr_scheduler", "lr_scheduler"]

_registry: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


class _Streamable:
    """Mixin: delegates to a StreamRunner (MemoryX) once bound to a weight-streamed model."""

    _stream: Any = None

    def __init__(self, params: Any, *args: Any, **kw: Any) -> None:
        super().__init__(params, *args, **kw)  # type: ignore[call-arg]
        _registry.add(self)  # type: ignore[arg-type]

    def _bind_stream(self, runner: Any) -> None:
        if getattr(self, "_no_stream", None):
            raise ConfigError(self._no_stream)
        self._stream = runner

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self._stream is not None:
            if closure is not None:
                raise ConfigError("optimizer.step(closure) is not supported with weight streaming")
            self._stream.finish_step()
            return None
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._stream is None:  # streamed gradients live in MemoryX, a step at a time
            super().zero_grad(set_to_none)  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        if self._stream is not None and self._stream.mx is not None:
            return self._stream.mx.optimizer_state_dict()
        return super().state_dict()  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        if self._stream is not None:
            if self._stream.mx is not None:
                self._stream.mx.load_optimizer_state_dict(state_dict)
            return
        super().load_state_dict(state_dict)  # type: ignore[misc]

    def apply(self, sparsity: Any) -> None:
        """`optimizer.apply(sparsity)` (cstorch.sparse): prune state and update the masks around each step."""
        from waferscale.sparse import sparsify_optimizer

        sparsify_optimizer(sparsity, self)  # type: ignore[arg-type]

    @property
    def last_grad_norm(self) -> float | None:
        return self._stream.last_grad_norm if self._stream is not None else None


def _fast(cls: type, params: Any) -> tuple[list[Any], dict[str, bool]]:
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    return params, fused_or_foreach(cls, [{"params": list(g["params"])} for g in groups])


class SGD(_Streamable, torch.optim.SGD):
    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, **kw: Any) -> None:
        params, fast = _fast(torch.optim.SGD, params)
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, **{**fast, **kw})


class Adam(_Streamable, torch.optim.Adam):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, amsgrad: bool = False, correct_bias: bool = True,
                 **kw: Any) -> None:
        _no_bias_correction(correct_bias)
        params, fast = _fast(torch.optim.Adam, params)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         **{**fast, **kw})


class AdamW(_Streamable, torch.optim.AdamW):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, correct_bias: bool = True, amsgrad: bool = False,
                 **kw: Any) -> None:
        _no_bias_correction(correct_bias)
        params, fast = _fast(torch.optim.AdamW, params)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         **{**fast, **kw})


class Lion(_Streamable, _Lion):
    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


class Lamb(_Streamable, _Lamb):
    _no_stream = ("Lamb scales each parameter's update by its own trust ratio, which MemoryX's per-unit fused "
                  "update does not compute yet: use AdamW, Adam, SGD or Lion with the CSX backend, or Lamb on "
                  "the CPU/GPU backend")

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class Adafactor(_Streamable, _Adafactor):
    """Cerebras' signature: `lr` is required and `relative_step` defaults to False, so the rate is the one given
    (a scheduler sets it each step), scaled by each parameter's RMS (`scale_parameter`); transformers' other
    options compute as transformers does (`waferscale.runtime.optim.Adafactor`)."""

    def __init__(self, params: Any, lr: float | None, eps: tuple[float, float] = (1e-30, 1e-3),
                 clip_threshold: float = 1.0, decay_rate: float = -0.8, beta1: float | None = None,
                 weight_decay: float = 0.0, scale_parameter: bool = True, relative_step: bool = False,
                 warmup_init: bool = False) -> None:
        try:
            super().__init__(params, lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate,
                             beta1=beta1, weight_decay=weight_decay, scale_parameter=scale_parameter,
                             relative_step=relative_step, warmup_init=warmup_init)
        except ValueError as e:
            raise ConfigError(str(e)) from None


# torch's own signatures and defaults, made streamable
Adagrad, Adamax, RMSprop, NAdam, RAdam = (type(c.__name__, (_Streamable, c), {}) for c in (
    torch.optim.Adagrad, torch.optim.Adamax, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam))

_BY_NAME = {c.__name__.lower(): c for c in (SGD, Adam, AdamW, Lamb, Lion, Adafactor, Adagrad, Adamax, RMSprop, NAdam,
                                             RAdam)}


def _no_bias_correction(correct_bias: bool) -> None:
    if not correct_bias:
        raise ConfigError("correct_bias=False (Adam without bias correction) is not implemented; use the default")


def configure_optimizer(optimizer_type: str, params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """An optimizer by name, as Cerebras' `configure_optimizer` (Model Zoo YAML keys are accepted)."""
    cls = _BY_NAME.get(str(optimizer_type).lower())
    if cls is None:
        raise ConfigError(f"optimizer_type {optimizer_type!r} is not one of "
                          f"{', '.join(c.__name__ for c in _BY_NAME.values())}")
    if "learning_rate" in kwargs:
        lr = kwargs.pop("learning_rate")
        kwargs["lr"] = lr if isinstance(lr, (int, float)) else 0.0  # a schedule sets it: configure_lr_scheduler
    if "weight_decay_rate" in kwargs:
        kwargs["weight_decay"] = kwargs.pop("weight_decay_rate")
    accepted = inspect.signature(cls.__init__).parameters
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
        raise ConfigError(f"{cls.__name__} does not take {', '.join(unknown)}")
    return cls(params, **kwargs)


def configure_lr_scheduler(optimizer: torch.optim.Optimizer, learning_rate: Any) -> "lr_scheduler.LRScheduler":
    """A scheduler from a Model Zoo `learning_rate`: a number, a scheduler dict, or a list of them run in
    sequence (`{"scheduler": "CosineDecayLR", "initial_learning_rate": ..., "total_iters": ...}`; see
    `waferscale.runtime.optim.build_schedule`)."""
    return lr_scheduler.LRScheduler(optimizer, build_schedule(learning_rate))


# ---- binding to MemoryX ----------------------------------------------------------------------------------

def find_optimizer(model: nn.Module) -> torch.optim.Optimizer | None:
    """The cstorch optimizer built over this model's parameters (the most recent one)."""
    ids = {id(p) for p in model.parameters()}
    found = [o for o in list(_registry) if any(id(p) in ids for g in o.param_groups for p in g["params"])]
    if len(found) > 1:
        raise ConfigError("several cstorch optimizers hold this model's parameters; weight streaming binds one")
    return found[0] if found else None


def memoryx_optimizer_params(opt: torch.optim.Optimizer | None, model: nn.Module) -> tuple[OptimizerSpec, float]:
    """MemoryX's optimizer description from a user's optimizer, and the weight decay of vectors (MemoryX
    groups a unit's matrices and its vectors: the decay may differ between the two, not within one)."""
    if opt is None:
        return OptimizerSpec(optimizer_type="SGD", learning_rate=0.0), 0.0
    kind = type(opt).__name__
    if getattr(opt, "_no_stream", None):
        raise ConfigError(opt._no_stream)
    if kind.lower() not in _BY_NAME:  # (Lamb, the one that cannot stream, was refused just above)
        raise ConfigError(f"{kind} is not supported with weight streaming")
    groups = opt.param_groups
    if len({g["lr"] for g in groups}) > 1:
        raise ConfigError("with weight streaming every parameter group must share one learning rate")
    decay = {matrix: {g.get("weight_decay", 0.0) for g in groups for p in g["params"] if (p.ndim >= 2) == matrix}
             for matrix in (True, False)}
    if len(decay[True]) > 1 or len(decay[False]) > 1:
        raise ConfigError("with weight streaming weight decay may differ between matrices and vectors, not within "
                          "them: MemoryX updates each unit's matrices (and its vectors) in one fused call")
    g0 = groups[0]
    for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
        if g0.get(flag):
            raise ConfigError(f"{kind}({flag}=True) is not supported with weight streaming")
    kw: dict[str, Any] = {"optimizer_type": kind, "learning_rate": float(g0["lr"] or 0.0),  # (None: relative_step)
                          "weight_decay": next(iter(decay[True]), 0.0)}
    if "betas" in g0:
        kw["betas"] = tuple(g0["betas"])
    if "eps" in g0:
        kw["eps"] = tuple(g0["eps"]) if kind == "Adafactor" else g0["eps"]
    if kind == "Adafactor":
        kw.update({k: g0[k] for k in ("clip_threshold", "decay_rate", "beta1", "scale_parameter", "relative_step",
                                      "warmup_init")})
    if kind == "SGD":
        kw.update(momentum=g0["momentum"], nesterov=g0["nesterov"])
        if g0.get("dampening"):
            raise ConfigError("SGD(dampening=...) is not supported with weight streaming")
    return OptimizerSpec(**kw), next(iter(decay[False]), 0.0)
