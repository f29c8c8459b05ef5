"""`cstorch.optim.lr_scheduler`: Cerebras' learning-rate schedulers over any optimizer. Each wraps a schedule of
`waferscale.runtime.optim` (a pure function of the step): `step()` sets the optimizer's rate for the next update,
and `state_dict()` is just the step."""

from __future__ import annotations

from typing import Any

import torch

from waferscale.errors import ConfigError
from waferscale.runtime import optim as _sched

__all__ = ["LRScheduler", "ConstantLR", "LinearLR", "PolynomialLR", "CosineDecayLR", "CosineAnnealingLR",
           "ExponentialLR", "InverseExponentialTimeDecayLR", "InverseSquareRootDecayLR", "StepLR", "MultiStepLR",
           "PiecewiseConstantLR", "SequentialLR"]


class LRScheduler:
    def __init__(self, optimizer: torch.optim.Optimizer, schedule: _sched.LRSchedule) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"a learning-rate scheduler needs an optimizer, got {type(optimizer).__name__}")
        self.optimizer, self.schedule = optimizer, schedule
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        lr = float(self.schedule(self.last_epoch))
        _sched.set_lr(self.optimizer, lr)
        self._last_lr = [lr] * len(self.optimizer.param_groups)

    def step(self, *args: Any) -> None:
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def get_lr(self, step: int | None = None) -> float:
        return float(self.schedule(self.last_epoch if step is None else step))

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "_last_lr": self._last_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self._apply()


def _positive(name: str, v: int) -> int:
    if not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    return v


class ConstantLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, learning_rate: float, total_iters: int | None = None) -> None:
        super().__init__(optimizer, _sched.Constant(learning_rate))


class PolynomialLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, end_learning_rate: float,
                 total_iters: int, power: float = 1.0) -> None:
        super().__init__(optimizer, _sched.Polynomial(initial_learning_rate, end_learning_rate,
                                                      _positive("total_iters", total_iters), power))


class LinearLR(PolynomialLR):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, end_learning_rate: float,
                 total_iters: int) -> None:
        super().__init__(optimizer, initial_learning_rate, end_learning_rate, total_iters, 1.0)


class CosineDecayLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, end_learning_rate: float,
                 total_iters: int) -> None:
        super().__init__(optimizer, _sched.CosineDecay(initial_learning_rate, end_learning_rate,
                                                       _positive("total_iters", total_iters)))


class CosineAnnealingLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, T_max: int,
                 eta_min: float = 0.0) -> None:
        super().__init__(optimizer, _sched.CosineAnnealing(initial_learning_rate, _positive("T_max", T_max), eta_min))


class ExponentialLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, total_iters: int,
                 decay_rate: float, staircase: bool = False) -> None:
        super().__init__(optimizer, _sched.Exponential(initial_learning_rate, _positive("total_iters", total_iters),
                                                       decay_rate, staircase))


class InverseExponentialTimeDecayLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, step_exponent: float,
                 total_iters: int, decay_rate: float, staircase: bool = False) -> None:
        super().__init__(optimizer, _sched.InverseExponentialTimeDecay(
            initial_learning_rate, step_exponent, _positive("total_iters", total_iters), decay_rate, staircase))


class InverseSquareRootDecayLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float = 1.0, scale: float = 1.0,
                 warmup_steps: int = 1) -> None:
        super().__init__(optimizer, _sched.InverseSquareRootDecay(initial_learning_rate, scale, warmup_steps))


class StepLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, step_size: int,
                 gamma: float) -> None:
        super().__init__(optimizer, _sched.Step(initial_learning_rate, _positive("step_size", step_size), gamma))


class MultiStepLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, initial_learning_rate: float, gamma: float,
                 milestones: list[int]) -> None:
        super().__init__(optimizer, _sched.MultiStep(initial_learning_rate, gamma, tuple(sorted(milestones))))


class PiecewiseConstantLR(LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer, learning_rates: list[float], milestones: list[int]) -> None:
        if len(learning_rates) != len(milestones) + 1:
            raise ConfigError(f"PiecewiseConstantLR needs one more learning rate than milestones, got "
                              f"{len(learning_rates)} rates and {len(milestones)} milestones")
        super().__init__(optimizer, _sched.PiecewiseConstant(tuple(learning_rates), tuple(milestones)))


class SequentialLR(LRScheduler):
    """`schedulers` one after another; scheduler i+1 starts at global step milestones[i] (counting from 0)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedulers: list[LRScheduler], milestones: list[int]) -> None:
        if len(milestones) != len(schedulers) - 1 or list(milestones) != sorted(set(milestones)) \
                or (milestones and milestones[0] <= 0):
            raise ConfigError(f"SequentialLR needs {len(schedulers) - 1} increasing positive milestones, "
                              f"got {list(milestones)}")
        super().__init__(optimizer, _sched.Sequential(tuple(s.schedule for s in schedulers),
                                                      (0, *milestones)))
