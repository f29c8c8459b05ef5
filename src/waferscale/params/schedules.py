"""The schema of `optimizer.learning_rate`: a number, or scheduler mappings run one after the other.

One dataclass per Cerebras scheduler (the keys, their types and defaults); `normalize_learning_rate` turns what a
user wrote into the canonical form the runtime's schedule math reads (`waferscale.runtime.optim.build_schedule`):
a float, or a list of dicts with the canonical `scheduler` name first ('Linear', 'CosineDecay', ...: Model Zoo's
legacy spelling without the 'LR' suffix), legacy key spellings mapped (`steps`, `decay_steps` -> `total_iters`),
defaults filled in and unset optional keys left out. Every phase but the last needs its `total_iters`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from waferscale.params.typed import Ctx, FieldError, build_dataclass, join_path, show
from waferscale.params.yaml_lines import LinedDict


class _Phase:
    """Base of the scheduler schemas: legacy Model Zoo spellings of the phase length."""

    ALIASES: ClassVar[dict[str, str]] = {"steps": "total_iters", "decay_steps": "total_iters"}


@dataclass
class ConstantLR(_Phase):
    learning_rate: float
    total_iters: int | None = None  # required unless it is the last phase

    ALIASES: ClassVar[dict[str, str]] = {"steps": "total_iters", "val": "learning_rate"}


@dataclass
class LinearLR(_Phase):
    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int


@dataclass
class PolynomialLR(_Phase):
    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int
    power: float = 1.0


@dataclass
class CosineDecayLR(_Phase):
    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int


@dataclass
class CosineAnnealingLR(_Phase):
    initial_learning_rate: float
    T_max: int
    eta_min: float = 0.0
    total_iters: int | None = None  # phase length inside a sequence


@dataclass
class ExponentialLR(_Phase):
    initial_learning_rate: float
    total_iters: int  # the decay period: lr = initial * decay_rate ** (step / total_iters)
    decay_rate: float
    staircase: bool = False


@dataclass
class InverseExponentialTimeDecayLR(_Phase):
    initial_learning_rate: float
    step_exponent: float
    total_iters: int
    decay_rate: float
    staircase: bool = False


@dataclass
class InverseSquareRootDecayLR(_Phase):
    initial_learning_rate: float = 1.0
    scale: float = 1.0
    warmup_steps: int = 1
    total_iters: int | None = None


@dataclass
class StepLR(_Phase):
    initial_learning_rate: float
    step_size: int
    gamma: float
    total_iters: int | None = None


@dataclass
class MultiStepLR(_Phase):
    initial_learning_rate: float
    gamma: float
    milestones: list[int]
    total_iters: int | None = None


@dataclass
class PiecewiseConstantLR(_Phase):
    learning_rates: list[float]
    milestones: list[int]  # one fewer than learning_rates, increasing
    total_iters: int | None = None

    def __post_init__(self) -> None:
        if len(self.learning_rates) != len(self.milestones) + 1:
            raise FieldError("milestones", f"needs one entry fewer than learning_rates "
                             f"({len(self.learning_rates)}), got {len(self.milestones)}")
        if any(b <= a for a, b in zip(self.milestones, self.milestones[1:])):
            raise FieldError("milestones", f"must increase, got {self.milestones}")


_SCHEDULER_CLASSES = (ConstantLR, LinearLR, PolynomialLR, CosineDecayLR, CosineAnnealingLR, ExponentialLR,
                      InverseExponentialTimeDecayLR, InverseSquareRootDecayLR, StepLR, MultiStepLR,
                      PiecewiseConstantLR)
# canonical name (Model Zoo's legacy spelling, without the "LR" suffix) -> schema
SCHEDULERS: dict[str, type] = {cls.__name__.removesuffix("LR"): cls for cls in _SCHEDULER_CLASSES}
_SCHEDULER_ALIASES = {"polynomialdecay": "Polynomial", "cosine": "CosineDecay", "inversetimedecay":
                      "InverseExponentialTimeDecay", "exponentialdecay": "Exponential"}


def canonical_scheduler(name: str) -> str | None:
    """'cosinedecaylr', 'CosineDecay', 'CosineDecayLR' -> 'CosineDecay'; None when unknown."""
    key = name.strip().lower()
    key = key[:-2] if key.endswith("lr") and key != "lr" else key
    by_lower = {n.lower(): n for n in SCHEDULERS}
    return by_lower.get(key) or _SCHEDULER_ALIASES.get(key)


def normalize_learning_rate(value: Any) -> float | list[dict[str, Any]]:
    """Validate a `learning_rate` (a number, one scheduler dict, or a list of them) -> float | list[dict]."""
    return convert_learning_rate(value, "optimizer.learning_rate", Ctx("<params>"), None)


def convert_learning_rate(value: Any, path: str, ctx: Ctx, line: int | None) -> float | list[dict[str, Any]]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ctx.error(path, f"must be >= 0, got {value}", line)
        return float(value)
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ctx.error(path, f"expected a number, a scheduler mapping or a non-empty list of them, got "
                        f"{show(value)}", line)
    phases = [_scheduler_dict(item, f"{path}[{i}]", ctx, line) for i, item in enumerate(value)]
    for i, phase in enumerate(phases[:-1]):
        if phase.get("total_iters") is None:
            raise ctx.error(f"{path}[{i}].total_iters", f"is required for every phase but the last (a "
                            f"{phase['scheduler']} phase followed by another needs its length in steps)", line)
    return phases


def _scheduler_dict(item: Any, path: str, ctx: Ctx, line: int | None) -> dict[str, Any]:
    line = getattr(item, "key_lines", {}).get("scheduler", line)
    if not isinstance(item, Mapping):
        raise ctx.error(path, f"expected a scheduler mapping like {{scheduler: Linear, ...}}, got {show(item)}",
                        line)
    if "scheduler" not in item:
        for key in item:  # a misspelt 'scheduler' is the likely cause
            if difflib.get_close_matches(str(key), ["scheduler"], n=1, cutoff=0.6):
                raise ctx.error(join_path(path, key), f"unknown key {key!r} (did you mean 'scheduler'?)",
                                getattr(item, "key_lines", {}).get(key, line))
        raise ctx.error(path, f"missing required key 'scheduler' (one of {', '.join(SCHEDULERS)})", line)
    name = item["scheduler"]
    canonical = canonical_scheduler(name) if isinstance(name, str) else None
    if canonical is None:
        close = difflib.get_close_matches(str(name).lower(), [n.lower() for n in SCHEDULERS], n=1)
        hint = f" (did you mean {canonical_scheduler(close[0])!r}?)" if close else ""
        raise ctx.error(join_path(path, "scheduler"), f"unknown scheduler {name!r}{hint}; known: "
                        f"{', '.join(SCHEDULERS)} (an 'LR' suffix is fine)", line)
    rest = LinedDict({k: v for k, v in item.items() if k != "scheduler"})
    rest.key_lines = getattr(item, "key_lines", {})
    spec = build_dataclass(SCHEDULERS[canonical], rest, path, ctx, line)
    return {"scheduler": canonical, **{k: v for k, v in dataclasses.asdict(spec).items() if v is not None}}


__all__ = ["SCHEDULERS", "canonical_scheduler", "normalize_learning_rate", "convert_learning_rate"]
