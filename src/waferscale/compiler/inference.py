"""Inference plans: weights and KV cache stay on-wafer, the layers form a pipeline of regions, users fill it.

1. `_wafers_per_pipeline`: the fewest wafers (`wpp`) whose SRAM holds the weights + one user's KV cache,
   split into contiguous runs of units balanced by bytes (a multi-wafer pipeline when wpp > 1); the systems
   then hold `systems // wpp` independent pipeline copies (data-parallel serving).
2. `_choose_replicas`: on one wafer, how many copies k of the pipeline to place in a k-way grid (each copy
   in a 1/k sub-rectangle) and how many users each serves (up to one per stage, as many as the KV cache
   holds), picked by the cost model's aggregate decode rate.
3. On a defective wafer, the chosen copy re-projected on its regions' own routes (detours).
4. `_explain_choice` and `_result`: the remaining decisions, then decode latency and rate, prefill
   (`_prefill`: the prompt streamed through the stages in chunks) and what limits the aggregate rate.

Bytes per unit: weights (+ a copy of a tied matrix), KV cache per token per user, double-buffered
activations in and out. Times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from waferscale.compiler import moe
from waferscale.compiler import project as pj
from waferscale.compiler.context import CompileContext
from waferscale.compiler.ir import Graph, Unit
from waferscale.compiler.pipeline import (MAX_REPLICAS_PER_WAFER, StageTime, chain, crossing_time, decode_latency,
                                          depth, handoff, occupancy, place_pipelines, split_groups, with_detours)
from waferscale.compiler.placement import grid_boxes
from waferscale.compiler.strategy import Layout, check_routing, data_bytes_per_pe, gb
from waferscale.errors import ConfigError

REPLICA_CANDIDATES = (1, 2, 3, 4, 6, 8, 9, 12, 16, 20, 24, 25, 32, 36, 48, 49, 64)  # copies per wafer tried


@dataclass(frozen=True)
class Footprint:
    """On-wafer bytes per unit of one pipeline copy at a context of `context` tokens."""

    weights: list[int]  # (params + a tied copy) x dtype bytes, sparse matrices compressed
    kv_per_token: list[int]  # KV cache bytes per token, per user
    acts: list[int]  # activations in and out, double-buffered
    context: int

    @classmethod
    def of(cls, units: Sequence[Unit], b: int, context: int) -> "Footprint":
        return cls([u.stored_weight_bytes(b) for u in units], [u.kv_elems_per_token() * b for u in units],
                   [2 * (u.d_in + u.d_out) * b for u in units], context)

    def mem(self, users: int) -> list[int]:
        """Bytes per unit with `users` users' KV caches in flight."""
        return [w + k_ * self.context * users + a for w, k_, a in zip(self.weights, self.kv_per_token, self.acts)]

    @property
    def kv_per_token_total(self) -> int:
        return sum(self.kv_per_token)


@dataclass(frozen=True)
class _Choice:
    """A placement: k copies per wafer (`copies` over all systems), users_r users per copy, and the first
    copy's decode projection."""

    k: int
    pipes: list[Layout]
    users_r: int
    copies: int
    lat: float  # decode latency, s per token
    breakdown: pj.Time
    stage_max: float  # slowest stage (or wafer crossing), s
    agg: float  # aggregate decode tokens/s over all copies

    @classmethod
    def project(cls, ctx: CompileContext, units: list[Unit], pipes: list[Layout], k: int, users_r: int,
                copies: int, users: int | None, b: int) -> "_Choice":
        lat, breakdown = decode_latency(ctx, units, pipes[0], b)
        busy = occupancy(units, pipes[0], users_r) if ctx.g.moe else [t.s for t in pipes[0].stage_times]
        stage_max = max(max(busy), crossing_time(ctx, units, pipes[0], b))
        agg = min((users or users_r * copies) / lat, copies / stage_max)  # users spread over the copies
        return cls(k, pipes, users_r, copies, lat, breakdown, stage_max, agg)


def plan_inference(ctx: CompileContext, prompt_len: int | None, context_len: int | None,
                   users: int | None) -> dict:
    """The inference plan's strategy, workload, regions and projection (see the module docstring). Raises
    ConfigError when the model cannot stay on the systems' SRAM or the users' KV caches do not fit."""
    g = ctx.g
    C, P = context_and_prompt(g, prompt_len, context_len)
    b = g.dtype_bytes
    units = list(g.units)
    fp = Footprint.of(units, b, C)
    cap_pe = data_bytes_per_pe(ctx.spec)
    cap_w = min(w.usable_pes for w in ctx.wafers) * cap_pe
    wpp = _wafers_per_pipeline(ctx, fp, cap_w, cap_pe)
    sys_reps = ctx.systems // wpp

    def stage_time(u: Unit, r: int, c: int, mesh=None) -> pj.Time:
        return pj.unit_time(ctx.spec, u, r, c, n_tokens=1, attn_ctx=C, dtype=g.dtype, mesh=mesh)

    choice, candidates, kmax = _choose_replicas(ctx, units, fp, wpp, sys_reps, users, cap_w, cap_pe, stage_time)
    if ctx.defective:  # the first copy re-projected on its regions' own routes around dead cores and links
        lat0 = choice.lat
        pipes = [with_detours(ctx, units, choice.pipes[0], stage_time), *choice.pipes[1:]]
        choice = _Choice.project(ctx, units, pipes, choice.k, choice.users_r, choice.copies, users, b)
        ctx.say(f"detours: each placed region's kernels re-projected on its own routes around dead cores and links "
                f"(exact routes for regions up to 4,096 PEs, per-link hop estimates above): decode latency "
                f"{lat0 * 1e6:.2f} -> {choice.lat * 1e6:.2f} us per token (+{(choice.lat / lat0 - 1):.2%})")
    _explain_choice(ctx, units, fp, choice, candidates, kmax, cap_w, users, b)
    out = _result(ctx, units, fp, choice, wpp, users, P, b)
    pipe = choice.pipes[0]

    def reproject(us: list[Unit]) -> tuple[pj.Time, list[float]]:  # a decode token on this placement
        times = [stage_time(us[r.unit], r.rows, r.cols) for r in pipe.regions]
        return decode_latency(ctx, us, Layout(pipe.regions, times), b)[1], [t.s for t in times]

    out["reproject"] = reproject
    return out


def context_and_prompt(g: Graph, prompt_len: int | None, context_len: int | None) -> tuple[int, int]:
    """(context C, prompt P) in tokens: C defaults to min(max_seq_len, 2048), P to half of it (at most 1024)."""
    C = context_len or min(g.max_seq_len, 2048)
    P = prompt_len or max(1, min(1024, C // 2))
    if C > g.max_seq_len:
        raise ConfigError(f"--context_len {C} exceeds {g.name}'s maximum sequence length {g.max_seq_len}")
    if P > C:
        raise ConfigError(f"--prompt_len {P} is longer than --context_len {C}; the context holds the prompt")
    return C, P


def _wafers_per_pipeline(ctx: CompileContext, fp: Footprint, cap_w: int, cap_pe: int) -> int:
    """The fewest wafers one pipeline copy (weights + one user's KV cache) splits over; ConfigError when that
    is more than the systems given (inference never streams weights: decode would be I/O-bound)."""
    g, spec = ctx.g, ctx.spec
    units, mem1, wb, kv_tok, C = ctx.g.units, fp.mem(1), fp.weights, fp.kv_per_token_total, fp.context
    wpp = next((n for n in range(max(1, math.ceil(sum(mem1) / cap_w)), min(len(units), ctx.systems + 64) + 1)
                if split_groups(units, mem1, n, cap_w)), None)
    if wpp is None or wpp > ctx.systems:
        need = wpp or math.ceil(sum(mem1) / cap_w)
        raise ConfigError(
            f"{g.name} inference needs {gb(sum(wb))} of {g.dtype} weights + {gb(kv_tok * C)} of KV cache (one user, "
            f"context {C}) on-wafer, but {ctx.systems} x {spec.name} hold {gb(ctx.systems * cap_w)} for data "
            f"({min(w.usable_pes for w in ctx.wafers):,} PEs x {cap_pe:,} B after a "
            f"{spec.program_reserve_bytes_per_pe / 1024:g} KiB/PE program reserve); it needs at least {need} systems "
            f"(--systems {need}); streaming weights from MemoryX for decode would be I/O-bound (WSE.md), so "
            f"inference keeps them on-wafer" + (f". Why so many: {_moe_why(g)}" if g.moe else ""))
    sys_reps = ctx.systems // wpp
    b = g.dtype_bytes
    if g.moe:
        ctx.say(_moe_why(g) + (f"; {wpp} systems hold them" if wpp > 1 else ""))
    if wpp > 1:
        ctx.say(f"multi-wafer pipeline: {gb(sum(wb))} of weights + KV cache exceed one {spec.name} "
                f"({gb(cap_w)} for data), so the layers are split over {wpp} wafers, balanced by bytes; only "
                f"activations ({units[0].d_out * b:,} B per token) cross between systems")
    else:
        ctx.say(f"fits one wafer: {gb(sum(wb))} of {g.dtype} weights + {gb(kv_tok * C)} KV per user at context "
                f"{C} <= {gb(cap_w)} of SRAM for data ({cap_pe // 1024} KiB of each PE's "
                f"{spec.sram_bytes_per_pe // 1024} KiB)")
    if ctx.systems > wpp:
        ctx.say(f"{sys_reps} independent pipeline copies over {ctx.systems} systems (data-parallel serving)"
                + (f"; {ctx.systems - sys_reps * wpp} system(s) left idle" if ctx.systems % wpp else ""))
    return wpp


def _users_to_try(fp: Footprint, users: int | None, copies: int, box_cap: int, wpp: int, stages: int) -> list[int]:
    """Users per copy to try, most first: the requested users spread over `copies`, else up to one per stage
    as the KV cache in a `box_cap`-byte box allows (eighths of that maximum)."""
    if users:
        return [math.ceil(users / copies)]
    kv_tok, C = fp.kv_per_token_total, fp.context
    free = box_cap * wpp - sum(fp.weights) - sum(fp.acts)
    top = min(stages, int(free // (kv_tok * C))) if kv_tok else stages
    return sorted({max(1, top * f // 8) for f in range(8, 0, -1)}, reverse=True) if top >= 1 else []


def _choose_replicas(ctx: CompileContext, units: list[Unit], fp: Footprint, wpp: int, sys_reps: int,
                     users: int | None, cap_w: int, cap_pe: int,
                     stage_time: StageTime) -> tuple[_Choice, list[int], int]:
    """Try k copies per wafer (one wafer's pipeline only: kmax = 1 when wpp > 1) with the most users each
    whose KV caches still place; keep the highest aggregate decode rate. Returns (choice, the k tried, kmax);
    ConfigError when no k places the users."""
    b = ctx.g.dtype_bytes
    full = ctx.common_box
    kmax = max(1, min(MAX_REPLICAS_PER_WAFER, int(cap_w // sum(fp.mem(1))))) if wpp == 1 else 1
    candidates = sorted({k for k in REPLICA_CANDIDATES if k <= kmax})
    best: _Choice | None = None
    for k in candidates:
        boxes = grid_boxes(full, k)
        if len(boxes) != k:
            continue
        R_total = sys_reps * k
        box_cap = boxes[0].area * cap_pe
        pipes = None
        for users_r in _users_to_try(fp, users, R_total, box_cap, wpp, depth(units)):
            mem = fp.mem(users_r)  # the most users (up to one per stage) whose KV cache still places
            runs_k = split_groups(units, mem, wpp, cap_w) if k == 1 else [(0, len(units))]
            if runs_k is None:
                continue
            pipes = place_pipelines(ctx, units, mem, runs_k, boxes, sys_reps, wpp, stage_time)
            if pipes is not None:
                break
        if pipes is None:
            continue
        choice = _Choice.project(ctx, units, pipes, k, users_r, R_total, users, b)
        if best is None or choice.agg > best.agg * 1.000001:
            best = choice
    if best is None:
        kv_tok, C = fp.kv_per_token_total, fp.context
        max_users = int((wpp * cap_w - sum(fp.weights) - sum(fp.acts)) // max(1, kv_tok * C))
        n = users or 1
        raise ConfigError(f"{ctx.g.name}: {n} user(s) x context {C} need {gb(n * kv_tok * C)} of KV "
                          f"cache beyond the weights; at most {max(0, max_users) * sys_reps} users fit at this context "
                          f"(lower --users or --context_len)")
    return best, candidates, kmax


def _explain_choice(ctx: CompileContext, units: list[Unit], fp: Footprint, c: _Choice, candidates: list[int],
                    kmax: int, cap_w: int, users: int | None, b: int) -> None:
    """The decisions behind the chosen placement: copies, stages, a tied embedding, users, routing colors."""
    g, spec = ctx.g, ctx.spec
    if c.k > 1:
        ctx.say(f"data-parallel replicas: the model needs {sum(fp.mem(1)) / cap_w:.1%} of the wafer, so {c.k} "
                f"copies (each in a 1/{c.k} sub-rectangle) give the highest aggregate decode rate of the candidates "
                f"{candidates} by the cost model ({c.agg:,.0f} tokens/s vs one copy)")
    elif kmax > 1:
        ctx.say(f"one copy: more replicas (up to {kmax} fit in memory) project no higher aggregate throughput")
    p0 = c.pipes[0]
    S = depth(units)
    n_exp = sum(bool(u.expert_of) for u in units)
    ctx.say(f"pipelined: {S} stages (embedding, {g.n_blocks} blocks"
            + (f" each followed by its experts ({n_exp} expert regions)" if n_exp else "")
            + f", head) as rectangles in a snake of bands, "
            f"each sized by its bytes then by its FLOPs (balanced: slowest stage {c.stage_max * 1e6:.2f} us, "
            f"fastest {min(t.s for t in p0.stage_times) * 1e6:.2f} us); consecutive stages share an edge, one hop "
            f"apart")
    if n_exp:
        _explain_moe(ctx, units, c, b)
    if units[0].tied_to:
        ctx.say(f"tied embedding: the embedding region keeps its own copy of the {units[0].tied_params:,}-parameter "
                f"matrix so the lookup is local ({gb(units[0].tied_params * b)})")
    if not users:
        ctx.say(f"users in flight: {c.users_r} per pipeline copy = min(stages {S}, KV cache capacity at context "
                f"{fp.context})")
    worst = max(check_routing(spec, u) for u in units)
    ctx.say(f"routing: at most {worst[0]} colors per region (fabric has {spec.colors}, {spec.routes_per_pe} routes/PE)"
            + ("" if worst[1] == 1 else f"; regions needing more run in {worst[1]} phases"))


def _result(ctx: CompileContext, units: list[Unit], fp: Footprint, c: _Choice, wpp: int, users: int | None,
            P: int, b: int) -> dict:
    """The plan's strategy, workload, regions and projection for the chosen placement."""
    C, kv_tok = fp.context, fp.kv_per_token_total
    total_users = users or c.users_r * c.copies
    ttft, chunk, pre_tps = (_prefill_moe if ctx.g.moe else _prefill)(ctx, units, c.pipes[0], b, P)
    proj = {
        "decode_latency_s_per_token": c.lat,
        "decode_tokens_per_s_per_user": 1 / c.lat,
        "users_in_flight": total_users,
        "aggregate_decode_tokens_per_s": c.agg,
        "pipeline_limit_tokens_per_s": c.copies / c.stage_max,
        "prefill_tokens_per_s": pre_tps * c.copies,
        "prefill_chunk_tokens": chunk,
        "time_to_first_token_s": ttft,
        "prompt_len": P, "context_len": C,
        "stages": len(units), "slowest_stage_s": c.stage_max,
        "kv_cache_bytes_per_token": kv_tok,
        "kv_cache_bytes": kv_tok * C * total_users,
        "weight_bytes": sum(fp.weights),
        "bottleneck": c.breakdown.bottleneck(),
        "decode_time_shares": c.breakdown.shares(),
        "aggregate_bottleneck": _aggregate_bottleneck(ctx, units, c, b),
        "stage_times_s": [t.s for t in c.pipes[0].stage_times],
    }
    if ctx.g.moe:
        proj["moe"] = _moe_projection(ctx, units, c, b)
    regions = [r for pipe in c.pipes for r in pipe.regions]
    strategy = "multi_wafer_pipelined" if wpp > 1 else ("replicated" if c.copies > 1 else "pipelined")
    return {"strategy": strategy, "replicas": c.copies, "wafers_per_pipeline": wpp, "fits_in_sram": True,
            "workload": {"prompt_len": P, "context_len": C, "users": total_users, "users_per_replica": c.users_r},
            "regions": regions, "projection": proj}


def _aggregate_bottleneck(ctx: CompileContext, units: list[Unit], c: _Choice, b: int) -> str:
    """What limits the aggregate decode rate: too few users to fill the pipeline, a wafer crossing, or the
    slowest stage's own bottleneck."""
    if c.users_r / c.lat < 1 / c.stage_max:
        return "too few users to fill the pipeline (latency-bound)"
    busy = occupancy(units, c.pipes[0], c.users_r) if ctx.g.moe else [t.s for t in c.pipes[0].stage_times]
    slow = c.pipes[0].stage_times[busy.index(max(busy))]
    if ctx.g.moe and units[c.pipes[0].regions[busy.index(max(busy))].unit].expert_of and \
            crossing_time(ctx, units, c.pipes[0], b) < max(busy):
        return f"the most loaded expert ({slow.bottleneck()} of its region; routing imbalance)"
    if crossing_time(ctx, units, c.pipes[0], b) >= slow.s:
        return "I/O"
    return slow.bottleneck()


def _prefill(ctx: CompileContext, units: list[Unit], pipe: Layout, b: int, P: int) -> tuple[float, int, float]:
    """A P-token prompt streamed through the stages in chunks of c tokens (c a power of two up to P, the one
    with the earliest first token): (time to first token s, chunk tokens, prefill tokens/s of one copy)."""
    spec, g = ctx.spec, ctx.g
    chunks = sorted({min(P, 2 ** i) for i in range(0, 20)})
    best = None
    for c in chunks:
        times = [pj.unit_time(spec, units[r.unit], r.rows, r.cols, n_tokens=c, attn_ctx=max(1, P // 2),
                              dtype=g.dtype, decode=False,
                              mesh=ctx.region_mesh(r.system, r.row, r.col, r.rows, r.cols)) for r in pipe.regions]
        hands = [handoff(ctx, a, n, units[a.unit].d_out * c, b) for a, n in zip(pipe.regions, pipe.regions[1:])]
        slow = max([t.s for t in times] + [h.s for h in hands if h.parts.get("I/O")])
        ttft = sum(t.s for t in times) + sum(h.s for h in hands) + (math.ceil(P / c) - 1) * slow + \
            pj.io_time(spec, 4 * P).s
        if best is None or ttft < best[0]:
            best = (ttft, c, c / slow)
    return best


# ---- mixture of experts ----------------------------------------------------------------------------------------

def _moe_why(g: Graph) -> str:
    """Why a mixture of experts needs the SRAM it needs: every expert is resident, a token uses only k."""
    blocks = [u for u in g.units if u.n_experts and not u.expert_of]
    u = blocks[0]
    expert = next(x for x in g.units if x.expert_of)
    return (f"mixture of experts: {len(blocks)} layers x {u.n_experts} experts of {expert.params / 1e6:,.0f} M "
            f"parameters, each expert in a region of its own; a token is routed to {u.experts_per_token} per layer "
            f"and computes with {g.active_params / 1e9:.3g} B of the {g.params / 1e9:.3g} B parameters, but all "
            f"experts' weights ({gb(g.params * g.dtype_bytes)} at {g.dtype}) must stay resident: an idle expert is "
            f"the next token's")


def _moe_layers(units: list[Unit], pipe: Layout) -> list[tuple[int, list[int], int | None]]:
    """Per MoE layer of a placed copy: (the block's position in pipe.regions, its experts', the next stage's)."""
    regs = pipe.regions
    out = []
    for i, r in enumerate(regs):
        if units[r.unit].n_experts and not units[r.unit].expert_of:
            j = i + 1
            while j < len(regs) and units[regs[j].unit].expert_of:
                j += 1
            out.append((i, list(range(i + 1, j)), j if j < len(regs) else None))
    return out


def _moe_projection(ctx: CompileContext, units: list[Unit], c: _Choice, b: int) -> dict:
    """The routing figures of the chosen placement: active parameters and weight bytes per token, the traffic
    a token's routing adds per layer (bytes and hops), and the load imbalance at the users in flight."""
    g, pipe = ctx.g, c.pipes[0]
    layers = _moe_layers(units, pipe)
    regs = pipe.regions
    tr = [moe.traffic(ctx.spec, regs[i], [regs[e] for e in es], regs[n] if n is not None else None,
                      units[regs[i].unit].d_out, b, units[regs[i].unit].experts_per_token) for i, es, n in layers]
    u = units[regs[layers[0][0]].unit]
    E, k, B = u.n_experts, u.experts_per_token, c.users_r
    return {"experts_per_layer": E, "experts_per_token": k, "moe_layers": len(layers),
            "params": g.params, "active_params": g.active_params,
            "weight_bytes_resident": g.params * b, "weight_bytes_read_per_token": g.active_params * b,
            "routing_bytes_per_token": sum(t["bytes_per_token"] for t in tr),
            "routing_mean_hops": sum(t["mean_hops"] for t in tr) / len(tr),
            "routing_max_hops": max(t["max_hops"] for t in tr),
            "tokens_in_flight_per_copy": B, "expected_max_expert_load": moe.expected_max_load(B, E, k),
            "mean_expert_load": B * k / E, "load_imbalance": moe.imbalance(B, E, k),
            "load_assumption": "uniform routing: each token picks k distinct experts, every k-subset equally likely "
                               f"(expected max load over {moe.LOAD_SAMPLES} seeded draws of the batch's routing)"}


def _explain_moe(ctx: CompileContext, units: list[Unit], c: _Choice, b: int) -> None:
    m = _moe_projection(ctx, units, c, b)
    E, k, B = m["experts_per_layer"], m["experts_per_token"], m["tokens_in_flight_per_copy"]
    ctx.say(f"routing: each token's activations ({units[0].d_out * b:,} B) go from its block's region to the "
            f"{k} of {E} expert regions its router picks and the outputs come back to the next block: "
            f"{m['routing_bytes_per_token'] / 1e3:,.0f} kB per token over {m['moe_layers']} layers, "
            f"{m['routing_mean_hops']:.0f} hops per routed path on average (at most {m['routing_max_hops']}); a "
            f"token waits for the slower of its {k} experts (expected over the uniformly routed {k}-subsets)")
    ctx.say(f"load imbalance: with {B} token(s) in flight per copy, the most loaded expert of a layer gets "
            f"{m['expected_max_expert_load']:.2f} of them on average against a mean of {m['mean_expert_load']:.2f} "
            f"(x{m['load_imbalance']:.2f}; uniform routing, {moe.LOAD_SAMPLES} seeded draws), so each expert "
            f"region's time per token in flight is its time x {m['expected_max_expert_load'] / max(1, B):.3f}; "
            f"weights read per token {m['weight_bytes_read_per_token'] / 1e9:.1f} GB (active) of "
            f"{m['weight_bytes_resident'] / 1e9:.1f} GB resident")


def _prefill_moe(ctx: CompileContext, units: list[Unit], pipe: Layout, b: int, P: int) -> tuple[float, int, float]:
    """`_prefill` for a mixture of experts: a chunk of c tokens reaches each expert as the expected most loaded
    expert's share (`moe.expected_max_load`), the layer's experts run in parallel and the chunk waits for the
    slowest; the chunk's hand-offs and routed activations cross the fabric as in `pipeline.chain`."""
    spec, g = ctx.spec, ctx.g
    u = next(x for x in units if x.expert_of)
    best = None
    for c in sorted({min(P, 2 ** i) for i in range(0, 20)}):
        routed = math.ceil(moe.expected_max_load(c, u.n_experts, u.experts_per_token))
        times = [pj.unit_time(spec, units[r.unit], r.rows, r.cols, n_tokens=routed if units[r.unit].expert_of else c,
                              attn_ctx=max(1, P // 2), dtype=g.dtype, decode=False,
                              mesh=ctx.region_mesh(r.system, r.row, r.col, r.rows, r.cols)) for r in pipe.regions]
        through = chain(ctx, units, pipe.regions, times, b, tokens=c, routed=routed)
        hands = [handoff(ctx, a, n, units[a.unit].d_out * c, b) for a, n in zip(pipe.regions, pipe.regions[1:])
                 if a.system != n.system]
        slow = max([t.s for t in times] + [h.s for h in hands])
        ttft = through.s + (math.ceil(P / c) - 1) * slow + pj.io_time(spec, 4 * P).s
        if best is None or ttft < best[0]:
            best = (ttft, c, c / slow)
    return best
