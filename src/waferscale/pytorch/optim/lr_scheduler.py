"""`cstorch.optim.lr_scheduler`: Cerebras' learning-rate schedulers over any optimizer. Each wraps a schedule of
`waferscale.runtime.optim` (a pure function of the step): `step()` sets the optimizer's rate for the next update,
and `state_dict()` is just the step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch

from waferscale.errors import ConfigError
from waferscale.runtime import optim as _sched

__all__ = ["LRScheduler", "ConstantLR", "LinearLR", "PolynomialLR", "CosineDecayLR", "CosineAnnealingLR",
           "ExponentialLR", "InverseExponentialTimeDecayLR", "InverseSquareRootDecayLR", "StepLR", "MultiStepLR",
           "PiecewiseConstantLR", "SequentialLR"]


Tags = Union[str, None, Sequence[Union[str, None]]]


class LRScheduler:
    """`param_group_tags` (Cerebras'): the scheduler sets the rate of the param groups whose `tags` (a name or a
    set of names) share one of these, `None` standing for the groups without tags; left out, every group."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: _sched.LRSchedule,
                 param_group_tags: Tags = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"a learning-rate scheduler needs an optimizer, got {type(optimizer).__name__}")
        self.optimizer, self.schedule = optimizer, schedule
        self.param_group_tags = _tag_set(param_group_tags)
        if not any(self._applies_to(g) for g in optimizer.param_groups):
            known = sorted({str(t) for g in optimizer.param_groups for t in _group_tags(g)})
            raise ConfigError(f"{type(self).__name__}: param_group_tags {sorted(map(str, self.param_group_tags))} "
                              f"match no param group of the optimizer (its groups' tags: {', '.join(known)})")
        self.last_epoch = 0
        self._apply()

    def _applies_to(self, group: dict[str, Any]) -> bool:
        return self.param_group_tags is None or bool(self.param_group_tags & _group_tags(group))

    def _apply(self) -> None:
        _sched.set_lr(self.optimizer, float(self.schedule(self.last_epoch)), self._applies_to)
        self._last_lr = [g["lr"] if self._applies_to(g) else None for g in self.optimizer.param_groups]

    def step(self, *args: Any) -> None:
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list[float | None]:
        """The rate per param group (muP's `adjust_learning_rate` applied); None for groups this scheduler does not
        set (Cerebras' `get_last_value`)."""
        return list(self._last_lr)

    def get_lr(self, step: int | None = None) -> float:
        return float(self.schedule(self.last_epoch if step is None else step))

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "_last_lr": self._last_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self._apply()


def _group_tags(group: dict[str, Any]) -> set[str | None]:
    """A param group's tags as a set; {None} for a group without (an empty list: no tag, matched by none)."""
    tags = group.get("tags", None)
    if tags is None:
        return {None}
    return set(tags) if isinstance(tags, (list, tuple, set)) else {tags}


def _tag_set(tags: Tags) -> set[str | None] | None:
    """Tags as a set (None left as None: no tags given); a list with repeats is refused, as Cerebras does."""
    if tags is None:
        return None
    if isinstance(tags, (list, tuple, set)):
        if len(set(tags)) != len(tags):
            raise ConfigError(f"param_group_tags {list(tags)} holds a tag twice")
        return set(tags)
    return {tags}


def _positive(name: str, v: int) -> int:
    if not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    return v


class ConstantLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, learning_rate: float, total_iters: int | None = None,
                 param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, _sched.Constant(learning_rate), param_group_tags)


class PolynomialLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, end_learning_rate: float,
                 total_iters: int, power: float = 1.0, cycle: bool = False, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, _sched.Polynomial(initial_learning_rate, end_learning_rate,
                                                      _positive("total_iters", total_iters), cycle=cycle,
                                                      power=power), param_group_tags)


class LinearLR(PolynomialLR):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, end_learning_rate: float,
                 total_iters: int, cycle: bool = False, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, initial_learning_rate, end_learning_rate, total_iters, 1.0, cycle,
                         param_group_tags)


class CosineDecayLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, end_learning_rate: float,
                 total_iters: int, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, _sched.CosineDecay(initial_learning_rate, end_learning_rate,
                                                       _positive("total_iters", total_iters)), param_group_tags)


class CosineAnnealingLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, T_max: int,
                 eta_min: float = 0.0, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, _sched.CosineAnnealing(initial_learning_rate, _positive("T_max", T_max), eta_min),
                         param_group_tags)


class ExponentialLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, total_iters: int,
                 decay_rate: float, staircase: bool = False, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, _sched.Exponential(initial_learning_rate, _positive("total_iters", total_iters),
                                                       decay_rate, staircase), param_group_tags)


class InverseExponentialTimeDecayLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, step_exponent: float,
                 total_iters: int, decay_rate: float, staircase: bool = False, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, _sched.InverseExponentialTimeDecay(
            initial_learning_rate, step_exponent, _positive("total_iters", total_iters), decay_rate, staircase),
            param_group_tags)


class InverseSquareRootDecayLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float = 1.0, scale: float = 1.0,
                 warmup_steps: int = 1, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, _sched.InverseSquareRootDecay(initial_learning_rate, scale, warmup_steps),
                         param_group_tags)


class StepLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, step_size: int,
                 gamma: float, param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, _sched.Step(initial_learning_rate, _positive("step_size", step_size), gamma),
                         param_group_tags)


class MultiStepLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, gamma: float,
                 milestones: list[int], param_group_tags: Tags = None) -> None:
        super().__init__(optimizer, _sched.MultiStep(initial_learning_rate, gamma, tuple(sorted(milestones))),
                         param_group_tags)


class PiecewiseConstantLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, learning_rates: list[float], milestones: list[int],
                 param_group_tags: Tags = None) -> None:
        if len(learning_rates) != len(milestones) + 1:
            raise ConfigError(f"PiecewiseConstantLR needs one more learning rate than milestones, got "
                              f"{len(learning_rates)} rates and {len(milestones)} milestones")
        super().__init__(optimizer, _sched.PiecewiseConstant(tuple(learning_rates), tuple(milestones)),
                         param_group_tags)


class SequentialLR(LRScheduler):
    """`schedulers` one after another; scheduler i+1 starts at global step milestones[i] (counting from 0).
    `last_epoch` as Cerebras' (see `runtime.optim.Sequential`); the schedulers share this one's tags."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedulers: list[LRScheduler], milestones: list[int],
                 last_epoch: int = -1, param_group_tags: Tags = None) -> None:
        if len(milestones) != len(schedulers) - 1 or list(milestones) != sorted(set(milestones)) \
                or (milestones and milestones[0] <= 0):
            raise ConfigError(f"SequentialLR needs {len(schedulers) - 1} increasing positive milestones, "
                              f"got {list(milestones)}")
        if not isinstance(last_epoch, int) or last_epoch < -1:
            raise ConfigError(f"SequentialLR: last_epoch must be an integer >= -1, got {last_epoch!r}")
        tags = _tag_set(param_group_tags)
        for i, s in enumerate(schedulers):
            if s.optimizer is not optimizer:
                raise ConfigError(f"SequentialLR: schedulers[{i}] schedules another optimizer")
            if s.param_group_tags != tags:
                raise ConfigError(f"SequentialLR: schedulers[{i}] has param_group_tags {s.param_group_tags}, the "
                                  f"sequence {tags}: they must be the same")
        super().__init__(optimizer, _sched.Sequential(tuple(s.schedule for s in schedulers), (0, *milestones),
                                                      last_epoch), param_group_tags)
