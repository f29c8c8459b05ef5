"""Encoder inference (BERT, RoBERTa): one forward pass over whole sequences, no decode.

An encoder attends bidirectionally: every token of a sequence sees every other, so there is nothing to decode
token by token and no KV cache to keep. `--mode inference` projects encoding: the weights stay on-wafer, the
layers form a pipeline of regions (several wafers when one cannot hold them), sequences of `seq_len` tokens
stream through it one after another, and k copies of the pipeline share a wafer when that encodes more
sequences per second. Latency is one sequence through every stage and hand-off; throughput is the copies over
the slowest stage. On-wafer per unit: weights + the sequence's activations in and out, double-buffered.
"""

from __future__ import annotations

import math

from waferscale.compiler import project as pj
from waferscale.compiler.context import CompileContext
from waferscale.compiler.ir import Unit
from waferscale.compiler.pipeline import MAX_REPLICAS_PER_WAFER, chain, place_pipelines, split_groups, with_detours
from waferscale.compiler.placement import grid_boxes
from waferscale.compiler.strategy import check_routing, data_bytes_per_pe, gb
from waferscale.errors import ConfigError

REPLICA_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)


def plan_encode(ctx: CompileContext, seq_len: int | None) -> dict:
    """The encode plan's strategy, workload, regions and projection. Raises ConfigError when the weights do not
    fit the systems' SRAM or the sequence is longer than the model's positions."""
    g, spec = ctx.g, ctx.spec
    T = seq_len or int(g.defaults.get("seq_len") or g.max_seq_len)
    if T > g.max_seq_len:
        raise ConfigError(f"--seq_len {T} exceeds {g.name}'s maximum sequence length {g.max_seq_len}")
    b = g.dtype_bytes
    units = list(g.units)
    mem = [u.stored_weight_bytes(b) + 2 * (u.d_in + u.d_out) * b * T for u in units]
    cap_pe = data_bytes_per_pe(spec)
    cap_w = min(w.usable_pes for w in ctx.wafers) * cap_pe
    wpp = next((n for n in range(max(1, math.ceil(sum(mem) / cap_w)), len(units) + 1)
                if split_groups(units, mem, n, cap_w)), None)
    if wpp is None or wpp > ctx.systems:
        need = wpp or math.ceil(sum(mem) / cap_w)
        raise ConfigError(f"{g.name} encoding needs {gb(sum(mem))} on-wafer (weights + a {T}-token sequence's "
                          f"activations), but {ctx.systems} x {spec.name} hold {gb(ctx.systems * cap_w)} for data "
                          f"after a {spec.program_reserve_bytes_per_pe / 1024:g} KiB/PE program reserve; it needs at "
                          f"least {need} systems (--systems {need})")
    ctx.say(f"encoder: bidirectional attention (each of a sequence's {T} tokens attends to all {T}), so inference "
            f"is one forward pass per sequence (encode), with no decode and no KV cache; the masked-LM head's "
            f"logits come out for every token")
    ctx.say(f"weights on-wafer: {gb(sum(u.stored_weight_bytes(b) for u in units))} of {g.dtype} weights + "
            f"{gb(sum(mem) - sum(u.stored_weight_bytes(b) for u in units))} of one sequence's activations "
            + (f"<= {gb(cap_w)} of one {spec.name}" if wpp == 1 else f"split over {wpp} wafers, balanced by bytes"))

    def stage_time(u: Unit, r: int, c: int, mesh=None) -> pj.Time:  # one whole sequence through one unit
        return pj.unit_time(spec, u, r, c, n_tokens=T, attn_ctx=T, dtype=g.dtype, decode=False, mesh=mesh)

    sys_reps = ctx.systems // wpp
    runs = split_groups(units, mem, wpp, cap_w)
    full = ctx.common_box
    kmax = max(1, min(MAX_REPLICAS_PER_WAFER, int(cap_w // sum(mem)))) if wpp == 1 else 1
    best = None
    for k in (k for k in REPLICA_CANDIDATES if k <= kmax):
        boxes = grid_boxes(full, k)
        if len(boxes) != k:
            continue
        pipes = place_pipelines(ctx, units, mem, runs if k == 1 else [(0, len(units))], boxes, sys_reps, wpp,
                                stage_time)
        if pipes is None:
            continue
        rate = len(pipes) / max(t.s for t in pipes[0].stage_times)
        if best is None or rate > best[0] * 1.000001:
            best = (rate, k, pipes)
    if best is None:
        raise ConfigError(f"{g.name}: could not place {len(units)} regions of a {T}-token sequence on the "
                          f"{full.rows}x{full.cols} mesh; use a larger --pes or a shorter --seq_len")
    _, k, pipes = best
    if ctx.defective:
        pipes[0] = with_detours(ctx, units, pipes[0], stage_time)
    pipe = pipes[0]
    lat = chain(ctx, units, pipe.regions, pipe.stage_times, b, tokens=T, routed=T)
    lat += pj.io_time(spec, 4 * T)  # the sequence's token ids in
    slow = max(pipe.stage_times, key=lambda t: t.s)
    seqs_per_s = len(pipes) / slow.s
    if k > 1:
        tried = [c for c in REPLICA_CANDIDATES if c <= kmax]
        ctx.say(f"data-parallel replicas: {k} copies of the encoder pipeline per wafer (each in a 1/{k} "
                f"sub-rectangle) encode the most sequences per second of {tried}")
    ctx.say(f"pipelined: {len(units)} stages (embedding, {g.n_blocks} blocks, masked-LM head), each sized by its "
            f"bytes then its FLOPs; sequences stream through one after another: {len(pipes)} copies x one sequence "
            f"per slowest stage ({slow.s * 1e6:.1f} us)")
    worst = max(check_routing(spec, u) for u in units)
    ctx.say(f"routing: at most {worst[0]} colors per region (fabric has {spec.colors}, {spec.routes_per_pe} routes/PE)")
    proj = {"encode_latency_s": lat.s, "encode_sequences_per_s": seqs_per_s, "encode_tokens_per_s": seqs_per_s * T,
            "seq_len": T, "stages": len(units), "slowest_stage_s": slow.s, "weight_bytes":
            sum(u.stored_weight_bytes(b) for u in units), "model_flops_per_token": g.model_flops_per_token(T, False),
            "mfu": g.model_flops_per_token(T, False) * seqs_per_s * T / (spec.peak_flops(g.dtype) * ctx.systems),
            "bottleneck": slow.bottleneck(), "time_shares": lat.shares(),
            "stage_times_s": [t.s for t in pipe.stage_times]}
    strategy = "multi_wafer_pipelined" if wpp > 1 else ("replicated" if len(pipes) > 1 else "pipelined")
    return {"strategy": strategy, "replicas": len(pipes), "wafers_per_pipeline": wpp, "fits_in_sram": True,
            "workload": {"seq_len": T, "task": "encode"}, "regions": [r for p in pipes for r in p.regions],
            "projection": proj}
