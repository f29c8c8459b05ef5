"""How a plan's headline figures move with its target's unpublished hardware assumptions (`wsc compile
--sensitivity`).

Each assumption of the generation (`fabric.assumptions.unpublished`) is set to -p% and +p% of the plan's value,
one at a time, and the whole request is compiled again (placement included: a smaller program reserve may
fit another replica), so the table shows what each figure rests on. The workload is held at the plan's (its
batch and sequence length, or its users, prompt and context), so a default that follows the hardware (the
no-stall batch follows the clock) does not move with it. A perturbed request that no longer compiles (e.g. the
users' KV caches stop fitting) is reported as such, with the compiler's reason. A decoder's layout is held at
the one the plan chose, too: comparing both layouts at every recompile costs ~3.6 s each for llama3.1-8b
instead of ~0.35 s, and a layout that wins by a margin does not flip at +-10%.
"""

from __future__ import annotations

import time
from typing import Any

from waferscale.compiler.plan import Plan
from waferscale.errors import ConfigError
from waferscale.fabric import assumptions as hw

# (projection key, label, a time: + is slower) per kind of plan
DECODE = (("decode_tokens_per_s_per_user", "decode/user", False),
          ("aggregate_decode_tokens_per_s", "aggregate", False), ("time_to_first_token_s", "TTFT", True))
ENCODE = (("encode_tokens_per_s", "tokens/s", False), ("encode_latency_s", "latency", True))
TRAIN = (("tokens_per_s", "tokens/s", False), ("step_time_s", "step time", True))
SPECULATIVE = ("speculative_tokens_per_s_per_user", "speculative/user", False)
WORKLOAD = ("batch_size", "seq_len", "prompt_len", "context_len", "users")  # compile_model's workload arguments


def headlines(plan: Plan) -> list[tuple[str, str, bool]]:
    """The headline figures of `plan`'s kind, as (key, label, is a time)."""
    p = plan.projection
    if plan.mode == "train":
        return list(TRAIN)
    if "encode_latency_s" in p:
        return list(ENCODE)
    return list(DECODE) + ([SPECULATIVE] if "speculative" in p else [])


def figure(plan: Plan, key: str) -> float:
    p = plan.projection
    return p["speculative"]["tokens_per_s_per_user"] if key == SPECULATIVE[0] else p[key]


def sensitivity(request: dict[str, Any], base: Plan, pct: float = 10.0) -> dict[str, Any]:
    """`base` = compile_model(**request) recompiled with each unpublished assumption of its target at -pct% and
    +pct% of its value in `base`: per assumption the two values used and each headline figure's change in
    percent. `request` should carry a captured `graph` rather than a `model` name (one capture for all)."""
    from waferscale.compiler.compile import compile_model

    if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 < pct < 100:
        raise ConfigError(f"--sensitivity takes a percentage in (0, 100), got {pct!r}")
    target = request.get("target", "wse3")
    held = {k: base.workload[k] for k in WORKLOAD if k in base.workload and request.get(k) is None}
    if "layout" in base.projection and request.get("layout", "auto") == "auto":
        held["layout"] = base.projection["layout"]
    request = {**request, **held}
    keys = headlines(base)
    baseline = {k: figure(base, k) for k, _, _ in keys}
    rows, t0, n = [], time.perf_counter(), 0
    for a in hw.unpublished(target):
        v0 = base.fabric[a.name]
        row: dict[str, Any] = {"name": a.name, "unit": a.unit, "value": v0, "source": a.source}
        for side, f in (("minus", 1 - pct / 100), ("plus", 1 + pct / 100)):
            req = _with(request, a.name, v0 * f)
            n += 1
            try:
                plan = compile_model(**req)
            except ConfigError as e:
                row[side] = {"value": req["assume"][a.name], "infeasible": str(e)}
                continue
            row[side] = {"value": plan.fabric[a.name],
                         **{k: 100 * (figure(plan, k) / baseline[k] - 1) if baseline[k] else 0.0 for k, _, _ in keys}}
        rows.append(row)
    return {"pct": pct, "target": target, "held": held, "figures": {k: label for k, label, _ in keys},
            "times": [k for k, _, is_time in keys if is_time], "baseline": baseline, "rows": rows,
            "compiles": n, "seconds": round(time.perf_counter() - t0, 2)}


def _with(request: dict[str, Any], name: str, value: float) -> dict[str, Any]:
    """`request` with assumption `name` at `value` (a --clock_hz given with the request moves into `assume`)."""
    req = dict(request)
    assume = dict(req.get("assume") or {})
    if name == "clock_hz":
        req["clock_hz"] = None
    assume[name] = value
    req["assume"] = assume
    return req


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The sensitivity table for `plan_summary`."""
    figs = s["figures"]
    head = f"    {'assumption':<30}{'value':>14}" + "".join(f"{figs[k]:>19}" for k in figs)
    lines = [f"  sensitivity   each unpublished assumption of {s['target']} at -{s['pct']:g}% / +{s['pct']:g}%, one "
             f"at a time, {', '.join(s['held']) or 'the request'} held: % change of each figure ({', '.join(figs[k] for k in s['times'])}: + is slower); "
             f"{s['compiles']} recompiles, {s['seconds']:.1f} s", head]
    for r in s["rows"]:
        cells = []
        for k in figs:
            m, p = (_cell(r[side], k) for side in ("minus", "plus"))
            cells.append(f"{m} / {p}".rjust(19))
        lines.append(f"    {r['name']:<30}{r['value']:>10.4g} {r['unit']:<3}" + "".join(cells))
    bad = [(r["name"], side, r[side]["infeasible"]) for r in s["rows"] for side in ("minus", "plus")
           if "infeasible" in r[side]]
    lines += [f"    ({name} {'-' if side == 'minus' else '+'}{s['pct']:g}% does not compile: {why})"
              for name, side, why in bad]
    return lines


def _cell(d: dict, key: str) -> str:
    return "n/a" if "infeasible" in d else f"{round(d[key], 1) + 0.0:+.1f}%"  # + 0.0: no "-0.0%"
