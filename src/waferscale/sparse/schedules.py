"""Step-aware values for sparsity: the target sparsity and SET/RigL's drop fraction (`Schedule`), and when masks
are recomputed (`UpdateSchedule`). The keys are cerebras.pytorch.sparse's:

    float                       constant
    [v0, v1, ...]               cycling: the next value at each update step
    {type: constant, value}     {type: linear, init, slope}         y = init + slope * step
    {type: exp, init, gamma, final=1}  y = final - (final - init) * exp(gamma * step)
    {type: power, init, beta}   y = init * beta ** step
    {type: cosine, init, half_period, minimum=0}  from init down to minimum and back, period 2 * half_period
    {type: cycling, values}
    update: {freq, start=0, stop=None} | {steps: [...]} | None (every step)
"""

from __future__ import annotations

import math
from typing import Any, Callable

from waferscale.errors import ConfigError

__all__ = ["Schedule", "UpdateSchedule", "make_schedule", "make_update_schedule"]


class Schedule:
    """A hyper-parameter as a function of the step. `update` is told at each step whether it was an update step
    (only `cycling` keeps state)."""

    def __init__(self, fn: Callable[[int], float], kind: str = "lambda", **params: Any) -> None:
        self.fn, self.kind, self.params = fn, kind, params

    def __call__(self, step: int) -> float:
        return float(self.fn(step))

    def update(self, is_update_step: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _Cycling(Schedule):
    def __init__(self, values: list[float]) -> None:
        super().__init__(lambda step: self.values[self.index], "cycling")
        self.values, self.index = [float(v) for v in values], 0

    def update(self, is_update_step: bool) -> None:
        if is_update_step:
            self.index = (self.index + 1) % len(self.values)

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


def _formula(kind: str, p: dict[str, float]) -> Callable[[int], float]:
    if kind == "constant":
        return lambda step: p["value"]
    if kind == "linear":
        return lambda step: p["init"] + step * p["slope"]
    if kind == "exp":
        return lambda step: p["final"] - (p["final"] - p["init"]) * math.exp(step * p["gamma"])
    if kind == "power":
        return lambda step: p["init"] * p["beta"] ** step
    # cosine: offset (init + minimum) / 2, amplitude init - offset
    mid = (p["init"] + p["minimum"]) / 2
    return lambda step: mid + (p["init"] - mid) * math.cos(step * math.pi / p["half_period"])


# type -> (required keys, optional keys with defaults)
_KINDS: dict[str, tuple[tuple[str, ...], dict[str, float]]] = {
    "constant": (("value",), {}),
    "linear": (("init", "slope"), {}),
    "exp": (("init", "gamma"), {"final": 1.0}),
    "power": (("init", "beta"), {}),
    "cosine": (("init", "half_period"), {"minimum": 0.0}),
    "cycling": (("values",), {}),
}


def make_schedule(spec: Any, key: str = "sparsity") -> Schedule:
    """A Schedule from a float, a list (cycling), a {type: ...} dict, a callable of the step, or a Schedule."""
    if isinstance(spec, Schedule):
        return spec
    if isinstance(spec, bool) or spec is None:
        raise ConfigError(f"{key}: expected a number, a list or a {{type: ...}} schedule, got {spec!r}")
    if isinstance(spec, (int, float)):
        return Schedule(lambda step: float(spec), "constant", value=float(spec))
    if isinstance(spec, (list, tuple)):
        return make_schedule({"type": "cycling", "values": list(spec)}, key)
    if callable(spec):
        return Schedule(spec)
    if not isinstance(spec, dict):
        raise ConfigError(f"{key}: expected a number, a list or a {{type: ...}} schedule, got {spec!r}")
    spec = dict(spec)
    kind = str(spec.pop("type", "")).lower()
    if kind not in _KINDS:
        raise ConfigError(f"{key}.type: {kind or 'missing'}; choose one of {', '.join(_KINDS)}")
    required, optional = _KINDS[kind]
    unknown = sorted(set(spec) - set(required) - set(optional))
    missing = [k for k in required if k not in spec]
    if unknown or missing:
        raise ConfigError(f"{key}: a {kind} schedule takes {', '.join(required + tuple(optional))}; "
                          + (f"unknown {', '.join(unknown)}" if unknown else f"missing {', '.join(missing)}"))
    if kind == "cycling":
        values = spec["values"]
        if not isinstance(values, (list, tuple)) or not values:
            raise ConfigError(f"{key}.values: a non-empty list of numbers, got {values!r}")
        return _Cycling(list(values))
    params = {**optional, **spec}
    try:
        params = {k: float(v) for k, v in params.items()}
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: the {kind} schedule's values must be numbers, got {spec}") from None
    if kind == "cosine" and params["half_period"] <= 0:
        raise ConfigError(f"{key}.half_period must be > 0, got {params['half_period']:g}")
    return Schedule(_formula(kind, params), kind, **params)


class UpdateSchedule:
    """Which steps recompute the masks: every `freq` steps from `start` until (not including) `stop`, or the
    listed `steps`."""

    def __init__(self, freq: int = 1, start: int = 0, stop: int | None = None,
                 steps: list[int] | None = None) -> None:
        self.freq, self.start, self.stop = freq, start, stop
        self.steps = frozenset(steps) if steps is not None else None
        if self.steps is not None:
            self.start, self.stop = min(self.steps), max(self.steps) + 1

    def __call__(self, step: int) -> bool:
        if self.steps is not None:
            return step in self.steps
        return step >= self.start and (step - self.start) % self.freq == 0 and (self.stop is None or step < self.stop)


def make_update_schedule(spec: Any, key: str = "update") -> UpdateSchedule:
    if spec is None:
        return UpdateSchedule()
    if isinstance(spec, UpdateSchedule):
        return spec
    if not isinstance(spec, dict):
        raise ConfigError(f"{key}: expected {{freq, start, stop}} or {{steps: [...]}}, got {spec!r}")
    unknown = sorted(set(spec) - {"freq", "start", "stop", "steps"})
    if unknown:
        raise ConfigError(f"{key}: unknown key {', '.join(unknown)}; it takes freq, start, stop (or steps)")
    if "steps" in spec:
        steps = spec["steps"]
        if set(spec) != {"steps"} or not isinstance(steps, (list, tuple)) or not steps \
                or not all(isinstance(s, int) and s >= 0 for s in steps):
            raise ConfigError(f"{key}.steps: a non-empty list of step numbers >= 0, alone, got {spec}")
        return UpdateSchedule(steps=list(steps))
    if "freq" not in spec:
        raise ConfigError(f"{key}: needs freq (recompute the masks every freq steps), or steps: [...]")
    freq, start, stop = spec["freq"], spec.get("start", 0), spec.get("stop")
    for name, v, lo in (("freq", freq, 1), ("start", start, 0), ("stop", stop, 1)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
            raise ConfigError(f"{key}.{name} must be an integer >= {lo}, got {v!r}")
    if stop is not None and stop <= start:
        raise ConfigError(f"{key}: stop ({stop}) must come after start ({start})")
    return UpdateSchedule(freq=freq, start=start, stop=stop)
