"""The schema of `optimizer.learning_rate`: a number, or scheduler mappings run one after the other.

Each scheduler's keys, types and defaults are the fields of its schedule class in `waferscale.runtime.optim`
(`SCHEDULES`); the params file adds only what is below: Model Zoo's legacy key spellings (`steps`, `decay_steps`
-> `total_iters`), `total_iters` as the phase length of a schedule that has no length of its own, and
PiecewiseConstant's checks. `normalize_learning_rate` turns what a user wrote into the canonical form
`build_schedule` reads: a float, or a list of dicts with the canonical `scheduler` name first ('Linear',
'CosineDecay', ...), legacy spellings mapped, defaults filled in and unset optional keys left out. Every phase but
the last needs its `total_iters`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, get_args, get_origin, get_type_hints

from waferscale.params.typed import Ctx, FieldError, build_dataclass, join_path, show
from waferscale.params.yaml_lines import LinedDict
from waferscale.runtime.optim import SCHEDULES, canonical_scheduler

_ALIASES = {"steps": "total_iters", "decay_steps": "total_iters"}  # legacy key -> field
_CONSTANT_ALIASES = {"steps": "total_iters", "val": "learning_rate"}


def _check_piecewise(self: Any) -> None:
    if len(self.learning_rates) != len(self.milestones) + 1:
        raise FieldError("milestones", f"needs one entry fewer than learning_rates "
                         f"({len(self.learning_rates)}), got {len(self.milestones)}")
    if any(b <= a for a, b in zip(self.milestones, self.milestones[1:])):
        raise FieldError("milestones", f"must increase, got {self.milestones}")


def _schema(name: str, schedule: type) -> type:
    """The params dataclass of one scheduler: the schedule's fields (YAML lists where it keeps tuples), then
    `total_iters: int | None = None` (the phase length) if it has none."""
    hints = {name: list[get_args(tp)[0]] if get_origin(tp) is tuple else tp
             for name, tp in get_type_hints(schedule).items()}
    fields: list[tuple[str, Any, Any]] = [(f.name, hints[f.name], dataclasses.field(default=f.default))
                                          for f in dataclasses.fields(schedule)]
    if "total_iters" not in hints:
        fields.append(("total_iters", int | None, dataclasses.field(default=None)))
    namespace = {"ALIASES": _CONSTANT_ALIASES if name == "Constant" else _ALIASES}
    if name == "PiecewiseConstant":
        namespace["__post_init__"] = _check_piecewise
    return dataclasses.make_dataclass(f"{name}LR", fields, namespace=namespace)


# canonical name (Model Zoo's legacy spelling, without the "LR" suffix) -> schema
SCHEDULERS: dict[str, type] = {name: _schema(name, schedule) for name, schedule in SCHEDULES.items()}


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


__all__ = ["SCHEDULERS", "normalize_learning_rate", "convert_learning_rate"]
