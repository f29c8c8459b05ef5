"""Optimizers and learning-rate schedules from the params YAML's `optimizer` section.

A schedule is a pure function of the step, `lr = schedule(step)`, with no state to save: resuming at step k
gives exactly the learning rate an uninterrupted run would have had. `step` counts optimizer updates already
made, so `schedule(0)` is the rate of the first update (as Cerebras' schedulers, whose `last_epoch` starts at 0).

The formulas are those of Cerebras' `cstorch.optim.lr_scheduler` (legacy names without the `LR` suffix):

    Constant                   lr
    Linear                     initial + (end - initial) * min(s, T) / T
    Polynomial                 end + (initial - end) * (1 - min(s, T) / T) ** power
    CosineDecay                end + (initial - end) * (1 + cos(pi * min(s, T) / T)) / 2
    CosineAnnealing            eta_min + (initial - eta_min) * (1 + cos(pi * s / T_max)) / 2   (periodic)
    Exponential                initial * decay_rate ** (s / T)          (floor(s / T) if staircase)
    InverseExponentialTimeDecay initial / (1 + decay_rate * s ** step_exponent / T)   (floored if staircase)
    InverseSquareRootDecay     initial * scale / sqrt(max(s, warmup_steps))
    Step                       initial * gamma ** floor(s / step_size)
    MultiStep                  initial * gamma ** (number of milestones <= s)
    PiecewiseConstant          learning_rates[number of milestones <= s]

with T = total_iters. A list of schedulers runs them one after another (Cerebras' SequentialLR): each phase
runs its `total_iters` steps counting from its own step 0, and the last phase continues past its own
total_iters (Linear / Polynomial / CosineDecay then hold their end value).
"""

from __future__ import annotations

import bisect
import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from waferscale.params import OptimizerParams, normalize_learning_rate
from waferscale.errors import ConfigError


# ---- schedules -----------------------------------------------------------------------------------------

class LRSchedule:
    """lr = schedule(step); step >= 0 counts the optimizer updates already made."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class Constant(LRSchedule):
    learning_rate: float

    def __call__(self, step: int) -> float:
        return self.learning_rate


@dataclass(frozen=True)
class Polynomial(LRSchedule):
    """Also Linear (power 1)."""

    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int
    power: float = 1.0

    def __call__(self, step: int) -> float:
        remaining = 1.0 - min(step, self.total_iters) / self.total_iters
        return self.end_learning_rate + (self.initial_learning_rate - self.end_learning_rate) * remaining ** self.power


@dataclass(frozen=True)
class CosineDecay(LRSchedule):
    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int

    def __call__(self, step: int) -> float:
        progress = min(step, self.total_iters) / self.total_iters
        cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.end_learning_rate + (self.initial_learning_rate - self.end_learning_rate) * cos


@dataclass(frozen=True)
class CosineAnnealing(LRSchedule):
    initial_learning_rate: float
    T_max: int
    eta_min: float = 0.0

    def __call__(self, step: int) -> float:
        cos = 0.5 * (1.0 + math.cos(math.pi * step / self.T_max))
        return self.eta_min + (self.initial_learning_rate - self.eta_min) * cos


@dataclass(frozen=True)
class Exponential(LRSchedule):
    initial_learning_rate: float
    total_iters: int
    decay_rate: float
    staircase: bool = False

    def __call__(self, step: int) -> float:
        power = step / self.total_iters
        return self.initial_learning_rate * self.decay_rate ** (math.floor(power) if self.staircase else power)


@dataclass(frozen=True)
class InverseExponentialTimeDecay(LRSchedule):
    initial_learning_rate: float
    step_exponent: float
    total_iters: int
    decay_rate: float
    staircase: bool = False

    def __call__(self, step: int) -> float:
        alpha = float(step) ** self.step_exponent / self.total_iters
        if self.staircase:
            alpha = math.floor(alpha)
        return self.initial_learning_rate / (1.0 + self.decay_rate * alpha)


@dataclass(frozen=True)
class InverseSquareRootDecay(LRSchedule):
    initial_learning_rate: float = 1.0
    scale: float = 1.0
    warmup_steps: int = 1

    def __call__(self, step: int) -> float:
        return self.initial_learning_rate * self.scale / math.sqrt(max(step, self.warmup_steps))


@dataclass(frozen=True)
class Step(LRSchedule):
    initial_learning_rate: float
    step_size: int
    gamma: float

    def __call__(self, step: int) -> float:
        return self.initial_learning_rate * self.gamma ** (step // self.step_size)


@dataclass(frozen=True)
class MultiStep(LRSchedule):
    initial_learning_rate: float
    gamma: float
    milestones: tuple[int, ...]

    def __call__(self, step: int) -> float:
        return self.initial_learning_rate * self.gamma ** bisect.bisect_right(self.milestones, step)


@dataclass(frozen=True)
class PiecewiseConstant(LRSchedule):
    learning_rates: tuple[float, ...]
    milestones: tuple[int, ...]

    def __call__(self, step: int) -> float:
        return self.learning_rates[bisect.bisect_right(self.milestones, step)]


@dataclass(frozen=True)
class Sequential(LRSchedule):
    """Phases one after another; phase i starts at global step starts[i] and sees step - starts[i]."""

    phases: tuple[LRSchedule, ...]
    starts: tuple[int, ...]  # starts[0] == 0, increasing

    def __call__(self, step: int) -> float:
        i = bisect.bisect_right(self.starts, step) - 1
        return self.phases[i](step - self.starts[i])


_SCHEDULES: dict[str, type[LRSchedule]] = {
    "Constant": Constant, "Linear": Polynomial, "Polynomial": Polynomial, "CosineDecay": CosineDecay,
    "CosineAnnealing": CosineAnnealing, "Exponential": Exponential,
    "InverseExponentialTimeDecay": InverseExponentialTimeDecay, "InverseSquareRootDecay": InverseSquareRootDecay,
    "Step": Step, "MultiStep": MultiStep, "PiecewiseConstant": PiecewiseConstant,
}


def _phase(spec: dict[str, Any]) -> LRSchedule:
    cls = _SCHEDULES[spec["scheduler"]]
    accepted = inspect.signature(cls).parameters
    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in spec.items() if k in accepted}
    for key in ("total_iters", "T_max", "step_size"):
        if key in kwargs and kwargs[key] <= 0:
            raise ConfigError(f"optimizer.learning_rate: {spec['scheduler']} {key} must be positive, "
                              f"got {kwargs[key]}")
    return cls(**kwargs)


def build_schedule(learning_rate: float | dict[str, Any] | list[dict[str, Any]]) -> LRSchedule:
    """A schedule from `optimizer.learning_rate`: a number, one scheduler dict, or a list run in sequence.

    Scheduler names are matched case-insensitively with or without the `LR` suffix ('CosineDecayLR')."""
    lr = normalize_learning_rate(learning_rate)
    if isinstance(lr, float):
        return Constant(lr)
    phases = [_phase(spec) for spec in lr]
    if len(phases) == 1:
        return phases[0]
    starts = [0]
    for spec in lr[:-1]:
        starts.append(starts[-1] + spec["total_iters"])
    return Sequential(tuple(phases), tuple(starts))


# ---- optimizers ----------------------------------------------------------------------------------------

def param_groups(params: Iterable[Any], weight_decay: float) -> list[dict[str, Any]]:
    """Split trainable parameters into {"name": "decay"} (ndim >= 2: matmul and embedding weights) and
    {"name": "no_decay"} (ndim < 2: biases and norm gains), the usual GPT recipe. Empty groups are left out.

    `params` may yield tensors or (name, tensor) pairs (as `model.named_parameters()`)."""
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    for p in params:
        if isinstance(p, tuple):
            p = p[1]
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"name": "decay", "params": decay, "weight_decay": weight_decay},
              {"name": "no_decay", "params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ConfigError("the model has no trainable parameters to optimize")
    return groups


def _fused_or_foreach(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> dict[str, bool]:
    """fused=True where torch has a fused kernel for these tensors (CPU and CUDA, floating point), else
    foreach (one multi-tensor kernel per group) where the tensors allow it."""
    tensors = [p for g in groups for p in g["params"]]
    supported = "fused" in inspect.signature(cls).parameters
    fusable = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in tensors)
    if supported and fusable and len({p.device for p in tensors}) == 1:
        return {"fused": True}
    return {"foreach": True} if all(p.device.type in ("cpu", "cuda") for p in tensors) else {}


def build_optimizer(params: Iterable[Any], opt: OptimizerParams) -> torch.optim.Optimizer:
    """A torch optimizer for `params` per `opt`, starting at the schedule's step-0 learning rate.

    Weight decay goes to parameters with ndim >= 2 only (two param groups, see `param_groups`). SGD uses
    `momentum` / `nesterov`; Adam is L2-coupled weight decay, AdamW decoupled, as in torch and cstorch.
    `correct_bias: false` is refused by OptimizerParams (not implemented)."""
    if not opt.correct_bias and opt.optimizer_type in ("Adam", "AdamW"):  # objects built in code, mutated
        raise ConfigError("optimizer.correct_bias: false (Adam without bias correction) is not implemented; "
                          "set correct_bias: true")
    groups = param_groups(params, opt.weight_decay)
    lr = build_schedule(opt.learning_rate)(0)
    kind = opt.optimizer_type
    if kind in ("Lamb", "Lion"):
        from waferscale.pytorch.optim import extra

        cls = getattr(extra, kind)
    else:
        cls = getattr(torch.optim, kind)
    if kind == "SGD":
        kwargs: dict[str, Any] = {"momentum": opt.momentum, "nesterov": opt.nesterov}
        if opt.nesterov and opt.momentum <= 0:
            raise ConfigError("optimizer.nesterov: needs optimizer.momentum > 0")
    elif kind == "Lion":
        kwargs = {"betas": tuple(opt.betas)}
    elif kind in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Lamb"):
        kwargs = {"betas": tuple(opt.betas), "eps": opt.eps}
    elif kind == "RMSprop":
        kwargs = {"eps": opt.eps, "momentum": opt.momentum}
    else:  # Adagrad
        kwargs = {"eps": opt.eps}
    if kind not in ("Lamb", "Lion"):  # (ours are multi-tensor already)
        kwargs.update(_fused_or_foreach(cls, groups))
    return cls(groups, lr=lr, **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every param group's learning rate (weight decay per group is left as built)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


__all__ = ["LRSchedule", "build_schedule", "build_optimizer", "param_groups", "set_lr"]
