"""Which layout serves a decoder: one pipelined region per layer (`inference.py`) or each layer model-parallel
across a large mesh (`model_parallel.py`). Both are planned on the same wafers; the compiler keeps the one with
the higher aggregate decode rate for the users asked for (with `--users`, the rate those users get; without,
each layout's best number of users in flight), ties going to the lower per-token latency, and says why.

`--pes RxC` is the mesh a layer runs on: for the pipelined layout the rectangle its regions are carved from
(every layer's weights resident in it), for the model-parallel layout each layer's window on the full wafer.
Without it the model-parallel layout tries square windows (and the whole wafer) and keeps the one with the lowest
per-token latency, then fills it with as many users as raise its aggregate rate.
"""

from __future__ import annotations

from waferscale.compiler import model_parallel as mp
from waferscale.compiler.context import CompileContext
from waferscale.compiler.inference import context_and_prompt, plan_inference
from waferscale.errors import ConfigError

LAYOUTS = ("auto", "pipelined", "model_parallel")
WINDOW_SIDES = (16, 32, 64, 120, 180, 240, 300, 360, 420, 480, 540, 600, 660, 720)  # squares tried without --pes


def _why_not(ctx: CompileContext) -> str | None:
    """Why the model-parallel layout does not apply (None when it does)."""
    g = ctx.g
    if ctx.defective:
        return "a wafer with defects (its windows' detours are not modelled; the pipelined layout charges them)"
    if g.moe:
        return "a mixture of experts (its experts are placed as regions of their own)"
    if g.sparse:
        return "sparse weights (the sparse kernels are modelled on the streamed weight-stationary schedule)"
    return None


def plan_decoder(ctx: CompileContext, prompt_len: int | None, context_len: int | None, users: int | None,
                 layout: str = "auto", window: tuple[int, int] | None = None) -> dict:
    """Plan a decoder's inference in `layout` ("auto": both, the better kept); the result has the shape of
    `inference.plan_inference`'s, with projection["layouts"] comparing the candidates."""
    if layout not in LAYOUTS:
        raise ConfigError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    g = ctx.g
    why_not = _why_not(ctx)
    if layout == "model_parallel" and why_not:
        raise ConfigError(f"{g.name}: the model-parallel layout does not cover {why_not}; use --layout pipelined")
    outs, errors = {}, {}
    decisions = ctx.decisions
    for kind in (("pipelined", "model_parallel") if layout == "auto" else (layout,)):
        if kind == "model_parallel" and why_not:
            errors[kind] = f"not for {why_not}"
            continue
        ctx.decisions = []
        try:
            out = plan_inference(ctx, prompt_len, context_len, users) if kind == "pipelined" else \
                _model_parallel(ctx, prompt_len, context_len, users, window)
            outs[kind] = (out, ctx.decisions)
        except ConfigError as e:
            errors[kind] = str(e)
    ctx.decisions = decisions
    if not outs:
        raise ConfigError(next(iter(errors.values())) if len(errors) == 1 else
                          "no layout fits: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))
    rate = {k: o["projection"]["aggregate_decode_tokens_per_s"] for k, (o, _) in outs.items()}
    chosen = max(outs, key=lambda k: (round(rate[k], 6), -outs[k][0]["projection"]["decode_latency_s_per_token"]))
    out, said = outs[chosen]
    ctx.decisions.extend(said)
    if layout == "auto":
        ctx.say(_explain(chosen, outs, errors, users))
    out["projection"]["layouts"] = {k: _brief(o["projection"]) for k, (o, _) in outs.items()} | \
        {k: {"refused": v} for k, v in errors.items()}
    out["projection"]["layout"] = chosen
    return out


def _brief(p: dict) -> dict:
    return {"decode_tokens_per_s_per_user": p["decode_tokens_per_s_per_user"], "users": p["users_in_flight"],
            "aggregate_decode_tokens_per_s": p["aggregate_decode_tokens_per_s"],
            "time_to_first_token_s": p["time_to_first_token_s"]}


def _explain(chosen: str, outs: dict, errors: dict, users: int | None) -> str:
    names = {"pipelined": "one pipelined region per layer", "model_parallel": "each layer model-parallel on a mesh"}
    p = {k: o["projection"] for k, (o, _) in outs.items()}
    text = f"layout: {names[chosen]} ({p[chosen]['aggregate_decode_tokens_per_s']:,.0f} tokens/s for " \
           f"{p[chosen]['users_in_flight']} user(s), {p[chosen]['decode_tokens_per_s_per_user']:,.0f} each)"
    for k in outs:
        if k != chosen:
            text += f" over {names[k]} ({p[k]['aggregate_decode_tokens_per_s']:,.0f} tokens/s for " \
                    f"{p[k]['users_in_flight']} user(s), {p[k]['decode_tokens_per_s_per_user']:,.0f} each)"
    for k, v in errors.items():
        text += f"; {names[k]}: {v}"
    return text + (f": the higher aggregate rate for the {users} user(s) asked for" if users else
                   ": the higher aggregate rate with each layout's best number of users in flight")


def _model_parallel(ctx: CompileContext, prompt_len: int | None, context_len: int | None, users: int | None,
                    window: tuple[int, int] | None) -> dict:
    g, spec = ctx.g, ctx.spec
    C, P = context_and_prompt(g, prompt_len, context_len)
    units = list(g.units)
    full = ctx.full_box
    if window:
        shapes = [window]
    else:  # a side beyond the largest matrix dimension only adds idle PEs to the all-reduces
        dim = max(max(mm.m, mm.k) for u in units for mm in u.matmuls)
        side = min(full.rows, full.cols)
        shapes = [(s, s) for s in WINDOW_SIDES if s <= side and s <= dim] or [(min(side, WINDOW_SIDES[0]),) * 2]
        shapes += [(full.rows, full.cols)] if dim >= side else []
    best, err = None, None
    for shape in shapes:  # the window with the lowest per-token latency for one user (or the users asked for)
        try:
            r = mp.plan_model_parallel(ctx, units, shape, P, C, users or 1, with_prefill=False)
        except ConfigError as e:
            err = e
            continue
        if best is None or r["latency"] < best[1]["latency"]:
            best = (shape, r)
    if best is None:
        raise err
    (R, Cc), _ = best
    r = mp.plan_model_parallel(ctx, units, (R, Cc), P, C, users)
    pl, step, B, pre = r["placement"], r["step"], r["users"], r["prefill"]
    b = g.dtype_bytes
    n_sys = max(w[0] for w in pl.at) + 1
    kv_tok = sum(u.kv_elems_per_token() for u in units) * b
    algos = mp.gemv_algorithms(ctx, units, R, Cc, B)
    ctx.say(f"model-parallel within the layer: each of the {len(units)} units runs on a {R}x{Cc} window "
            + ("(--pes)" if window else f"(the fastest of {len(shapes)} window sizes tried)")
            + f", one after another; the weights live in the windows, which overlap where SRAM allows: the most "
            f"loaded PE holds {pl.peak_bytes_per_pe / 1024:.1f} KiB of weights, KV cache and activations "
            f"(of {spec.sram_bytes_per_pe // 1024} KiB)" + (f", over {n_sys} systems" if n_sys > 1 else ""))
    ctx.say("GEMVs: partial sums all-reduced along the window's rows or columns, alternating: "
            + ", ".join(f"{n} matrices by {a}" for a, n in sorted(algos.items()))
            + " (the faster by the cost model; the chain's latency grows with the window's width)")
    longest = mp.max_context(ctx, units, R, Cc, B)
    ctx.say(f"KV cache: each layer's cache spread evenly over its window (positions along one axis, its width along "
            f"the other; a cache that shifts its oldest entries on as it grows stays even), "
            f"{kv_tok * C * B / 1e9:.2f} GB for {B} user(s) at context {C}; the longest context that still fits is "
            f"{longest:,} tokens")
    if not users:
        ctx.say(f"users in flight: {B} decode together (each matrix multiplies {B} vectors), the count with the "
                f"highest aggregate rate whose KV caches fit")
    proj = {
        "decode_latency_s_per_token": step.s, "decode_tokens_per_s_per_user": 1 / step.s,
        "users_in_flight": B, "aggregate_decode_tokens_per_s": B / step.s,
        "pipeline_limit_tokens_per_s": B / step.s,
        "prefill_tokens_per_s": P / pre.s, "prefill_chunk_tokens": P, "time_to_first_token_s": pre.s,
        "prompt_len": P, "context_len": C, "stages": len(units), "slowest_stage_s": step.s,
        "kv_cache_bytes_per_token": kv_tok, "kv_cache_bytes": kv_tok * C * B,
        "weight_bytes": sum(u.stored_weight_bytes(b) for u in units),
        "bottleneck": step.bottleneck(), "decode_time_shares": step.shares(),
        "aggregate_bottleneck": f"latency of the sequential layers ({step.bottleneck()})",
        "stage_times_s": [], "window": f"{R}x{Cc}", "peak_bytes_per_pe": pl.peak_bytes_per_pe,
        "gemv_allreduce": algos, "prefill_time_shares": pre.shares(),
        "max_context_tokens": longest,
        "unit_times_s": [mp.unit_time(ctx, u, *w[3:], B, C).s for u, w in zip(units, pl.at)],
        "unit_prefill_s": [mp.unit_prefill(ctx, u, *w[3:], P).s for u, w in zip(units, pl.at)],
    }
    return {"strategy": "model_parallel", "replicas": 1, "wafers_per_pipeline": n_sys, "fits_in_sram": True,
            "pes_used": mp.pes_covered(pl, full.rows, full.cols),
            "workload": {"prompt_len": P, "context_len": C, "users": B, "users_per_replica": B},
            "regions": mp.regions(units, pl, b), "projection": proj, "reproject": None}
