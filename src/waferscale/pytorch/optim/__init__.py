"""`cstorch.optim`: Cerebras' optimizers and learning-rate schedulers.

Each optimizer computes Cerebras' update with Cerebras' signature and defaults (`waferscale.runtime.optimizers`,
the one home of the formulas, which MemoryX steps too: AdamW puts eps before the bias correction, Lamb caps the
weight norm, SGD needs `lr`). Over a weight-streamed model (the "CSX" backend) the
optimizer binds to MemoryX on the model's first call: MemoryX steps the user's own param groups (their members,
settings and, each step, the rates the schedulers set), `step()` completes MemoryX's update and `state_dict()`
is MemoryX's state, numbered and grouped as this optimizer's in torch's format.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from waferscale.errors import ConfigError
from waferscale.pytorch import context
from waferscale.pytorch.optim import lr_scheduler
from waferscale.runtime import optimizers
from waferscale.runtime.optim import Adafactor as _Adafactor
from waferscale.runtime.optim import OPTIMIZERS, OptimizerSpec, build_schedule

__all__ = ["SGD", "Adam", "AdamW", "Lamb", "Lion", "Adafactor", "Adagrad", "Adamax", "RMSprop", "NAdam", "RAdam",
           "ASGD", "Adadelta", "Rprop", "configure_optimizer", "configure_lr_scheduler", "lr_scheduler"]

class _Streamable:
    """Mixin: delegates to a StreamRunner (MemoryX) once bound to a weight-streamed model."""

    _stream: Any = None

    def __init__(self, params: Any, *args: Any, **kw: Any) -> None:
        super().__init__(params, *args, **kw)  # type: ignore[call-arg]
        context.current().optimizers.add(self)

    def _bind_stream(self, runner: Any) -> None:
        if getattr(self, "_no_stream", None):
            raise ConfigError(self._no_stream)
        if self.state and runner.mx is not None:  # a state dict loaded before the model's first call: MemoryX's now
            runner.mx.load_optimizer_state_dict(super().state_dict())  # type: ignore[misc]
        self.state.clear()  # type: ignore[attr-defined]  # (MemoryX holds the state from here on)
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
            sd = self._stream.mx.optimizer_state_dict()  # (MemoryX numbers the parameters as this optimizer does)
            # the groups' settings as they are now, as torch's state_dict (a scheduler set the rates of the next step)
            sd["param_groups"], n = [], 0
            for g in self.param_groups:  # type: ignore[attr-defined]
                sd["param_groups"].append({**{k: v for k, v in g.items() if k != "params"},
                                           "params": list(range(n, n + len(g["params"])))})
                n += len(g["params"])
            return sd
        return super().state_dict()  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        if self._stream is None:
            super().load_state_dict(state_dict)  # type: ignore[misc]
            return
        # the groups take the saved settings as torch's load_state_dict gives them (its checks of the groups'
        # sizes, the class's own reading of them) without the state, which goes to MemoryX
        settings = {"state": {}, "param_groups": copy.deepcopy(state_dict["param_groups"])}
        super().load_state_dict(settings)  # type: ignore[misc]
        if self._stream.mx is not None:
            self._stream.mx.load_optimizer_state_dict(state_dict)
            self._stream.mx.set_group_settings([{k: v for k, v in g.items() if k != "params"}
                                                for g in self.param_groups])  # type: ignore[attr-defined]

    def apply(self, sparsity: Any) -> None:
        """`optimizer.apply(sparsity)` (cstorch.sparse): prune state and update the masks around each step."""
        from waferscale.sparse import sparsify_optimizer

        sparsify_optimizer(sparsity, self)  # type: ignore[arg-type]

    @property
    def last_grad_norm(self) -> float | None:
        return self._stream.last_grad_norm if self._stream is not None else None


class Lamb(_Streamable, optimizers.Lamb):
    _no_stream = ("Lamb scales each parameter's update by its own trust ratio, which MemoryX's per-unit fused "
                  "update does not compute yet: use AdamW, Adam, SGD or Lion with the CSX backend, or Lamb on "
                  "the CPU/GPU backend")


# Cerebras' update rules, signatures and defaults (`waferscale.runtime.optimizers`), made streamable
SGD, Adam, AdamW, Lion, Adagrad, Adamax, RMSprop, NAdam, RAdam, ASGD, Adadelta, Rprop = (
    type(c.__name__, (_Streamable, c), {"__doc__": c.__doc__}) for c in (
        optimizers.SGD, optimizers.Adam, optimizers.AdamW, optimizers.Lion, optimizers.Adagrad, optimizers.Adamax,
        optimizers.RMSprop, optimizers.NAdam, optimizers.RAdam, optimizers.ASGD, optimizers.Adadelta,
        optimizers.Rprop))


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


_BY_NAME = {c.__name__.lower(): c for c in (SGD, Adam, AdamW, Lamb, Lion, Adafactor, Adagrad, Adamax, RMSprop, NAdam,
                                             RAdam, ASGD, Adadelta, Rprop)}


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
    # the signature of the class that defines the optimizer (the streaming mixin passes its arguments on)
    init = next(c.__init__ for c in cls.__mro__ if "__init__" in vars(c) and c is not _Streamable)
    accepted = inspect.signature(init).parameters
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown:
        raise ConfigError(f"{cls.__name__} does not take {', '.join(unknown)}; it takes "
                          f"{', '.join(k for k in accepted if k not in ('self', 'params'))}")
    missing = [k for k, p in accepted.items() if k not in ("self", "params") and p.default is p.empty
               and k not in kwargs]
    if missing:  # (SGD and Adafactor have no default learning rate, as Cerebras')
        raise ConfigError(f"{cls.__name__} needs {', '.join(missing)} (learning_rate for lr)")
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
    found = [o for o in list(context.current().optimizers)
             if any(id(p) in ids for g in o.param_groups for p in g["params"])]
    if len(found) > 1:
        raise ConfigError("several cstorch optimizers hold this model's parameters; weight streaming binds one")
    return found[0] if found else None


Groups = tuple[list[dict[str, Any]], dict[str, int], dict[str, int]]  # settings, group and index by name


def memoryx_optimizer_params(opt: torch.optim.Optimizer | None,
                             model: nn.Module) -> tuple[OptimizerSpec, Groups | None]:
    """MemoryX's optimizer description from a user's optimizer: the class and its defaults (the first group's
    settings), and the user's own param groups (`memoryx_groups`), which MemoryX steps as they are: each
    group's membership, weight decay, betas, eps and other keys, its rate set by the user's scheduler."""
    if opt is None:
        return OptimizerSpec(optimizer_type="SGD", learning_rate=0.0), None
    kind = type(opt).__name__
    if getattr(opt, "_no_stream", None):
        raise ConfigError(opt._no_stream)
    if kind.lower() not in _BY_NAME or kind not in OPTIMIZERS:  # (Lamb, which cannot stream, was refused above)
        raise ConfigError(f"{kind} is not supported with weight streaming")
    for g in opt.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if g.get(flag):
                raise ConfigError(f"{kind}({flag}=True) is not supported with weight streaming")
        if kind == "SGD" and g.get("dampening"):
            raise ConfigError("SGD(dampening=...) is not supported with weight streaming")
    g0 = opt.param_groups[0]
    key = "l2_regularization_rate" if kind == "Adam" else "weight_decay"  # (Adam's decay: an L2 term, as built)
    kw: dict[str, Any] = {"optimizer_type": kind, "learning_rate": float(g0["lr"] or 0.0),  # (None: relative_step)
                          "weight_decay": g0.get(key, 0.0)}
    if "betas" in g0:
        kw["betas"] = tuple(g0["betas"])
    if "eps" in g0:
        kw["eps"] = tuple(g0["eps"]) if kind == "Adafactor" else g0["eps"]
    if kind == "Adafactor":
        kw.update({k: g0[k] for k in ("clip_threshold", "decay_rate", "beta1", "scale_parameter", "relative_step",
                                      "warmup_init")})
    if kind == "AdamW":
        kw["correct_bias"] = g0["correct_bias"]
    if kind == "SGD":
        kw.update(momentum=g0["momentum"], nesterov=g0["nesterov"])
    return OptimizerSpec(**kw), memoryx_groups(opt, model)


def memoryx_groups(opt: torch.optim.Optimizer, model: nn.Module) -> Groups:
    """The user's param groups as MemoryX takes them (`runtime.memoryx.resident_groups`' form): each group's
    settings (copied: MemoryX's unit optimizers own theirs), each parameter's group and its index in the
    optimizer's state dict (torch numbers the parameters group after group), by the parameter's name in
    `model`; so MemoryX's state dict is the user's optimizer's."""
    name = {id(p): n for n, p in model.named_parameters()}
    hyper: list[dict[str, Any]] = []
    group_of: dict[str, int] = {}
    index: dict[str, int] = {}
    for g, group in enumerate(opt.param_groups):
        hyper.append(copy.deepcopy({k: v for k, v in group.items() if k != "params"}))
        for p in group["params"]:
            if id(p) not in name:
                raise ConfigError(f"param group {g} of the {type(opt).__name__} holds a tensor of shape "
                                  f"{tuple(p.shape)} that is not a parameter of the compiled model; with weight "
                                  f"streaming the optimizer holds the model's parameters only")
            group_of[name[id(p)]] = g
            index[name[id(p)]] = len(index)
    missing = [n for n in name.values() if n not in group_of]
    if missing:
        raise ConfigError(f"the {type(opt).__name__} leaves out parameters of the model ({', '.join(missing[:3])}"
                          f"{', ...' if len(missing) > 3 else ''}); with weight streaming MemoryX updates every "
                          f"parameter: put each in a param group")
    return hyper, group_of, index
