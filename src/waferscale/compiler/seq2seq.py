"""Encoder-decoders (T5) on the wafer: what each stack computes per sequence, and the inference plan.

A training sequence is L encoder tokens (the input) and T decoder tokens (the target): the encoder's units
compute L tokens attending over L (bidirectionally), each decoder layer's cross-attention key/value unit
projects the L encoder outputs, the decoder's units compute T tokens attending causally over T and across
over L, the embedding embeds both. T defaults to the span-corruption target length of an L-token input
(`data.span_corruption.compute_input_and_target_lengths`: 114 for 512 at T5's noise density 0.15, mean
span 3). Tokens per step count both: (L + T) per sequence.

Inference (`plan_seq2seq`): the weights, every user's decoder KV cache (T tokens) and cross-attention keys and
values (L positions per decoder layer, computed once per input) stay on-wafer; all units form one snake of
regions. A request is encoded once (the encoder's stages over the whole prompt, then every decoder layer's
cross K/V unit over the encoder's output, in parallel, each handing its keys and values to its layer's region),
then the decoder's stages (embedding, decoder layers, head) decode token by token while the encoder's regions
take the next request. Times in seconds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from waferscale.compiler import project as pj
from waferscale.compiler.context import CompileContext
from waferscale.compiler.ir import Graph, Unit
from waferscale.compiler.pipeline import (MAX_REPLICAS_PER_WAFER, crossing_time, decode_latency, handoff,
                                          place_pipelines, split_groups, with_detours)
from waferscale.compiler.placement import grid_boxes
from waferscale.compiler.strategy import Layout, check_routing, data_bytes_per_pe, gb
from waferscale.errors import ConfigError

DEFAULT_OUTPUT_TOKENS = 128  # decode context of an inference request when --context_len is not given


def target_len(L: int) -> int:
    """The decoder's tokens for an L-token encoder input: span corruption's target length."""
    from waferscale.data.span_corruption import compute_input_and_target_lengths

    return compute_input_and_target_lengths(L)[1]


def per_sequence(g: Graph, seq: int, target: int | None = None
                 ) -> tuple[list[Unit], Callable[[Unit], int], Callable[[Unit], int], int]:
    """(units, tokens a unit computes per sequence, keys each of its queries attends to, tokens per sequence).
    A single-stack model: every unit computes `seq` tokens over `seq`. An encoder-decoder: `seq` = L encoder
    tokens, `target` (default `target_len(L)`) = T decoder tokens; its units' cross-attention spans L."""
    if g.arch != "encoder_decoder":
        return list(g.units), lambda u: seq, lambda u: seq, seq
    L, T = seq, target or target_len(seq)
    units = [dataclasses.replace(u, cross_ctx=L) if u.cross_heads else u for u in g.units]
    return (units, lambda u: L if u.stack == "encoder" else T if u.stack == "decoder" else L + T,
            lambda u: L if u.stack == "encoder" else T, L + T)


def model_flops_per_token(units: list[Unit], tokens: Callable[[Unit], int], ctx: Callable[[Unit], int],
                          per_seq: int, training: bool) -> float:
    """An encoder-decoder's model FLOPs per token of a sequence (PaLM's counting, as `Graph.model_flops_per_token`):
    every unit's matmuls and attention times the tokens it computes, over the sequence's tokens."""
    fwd = sum(tokens(u) * (u.matmul_flops_per_token + u.attn_flops_per_token(ctx(u))) for u in units) / per_seq
    return 3 * fwd if training else fwd


# ---- inference ---------------------------------------------------------------------------------------------

def plan_seq2seq(ctx: CompileContext, prompt_len: int | None, context_len: int | None, users: int | None) -> dict:
    """The encoder-decoder inference plan (module docstring): P = --prompt_len input tokens (default the model's
    max_seq_len), C = --context_len output tokens (default DEFAULT_OUTPUT_TOKENS)."""
    g, spec = ctx.g, ctx.spec
    P = prompt_len or g.max_seq_len
    C = context_len or DEFAULT_OUTPUT_TOKENS
    if P > g.max_seq_len:
        raise ConfigError(f"--prompt_len {P} exceeds {g.name}'s encoder input length {g.max_seq_len}")
    b = g.dtype_bytes
    units = [dataclasses.replace(u, cross_ctx=P) if u.cross_heads else u for u in g.units]
    weights = [u.stored_weight_bytes(b) for u in units]
    per_user = [(u.kv_elems_per_token() * C + u.cross_kv_elems_per_token() * P) * b for u in units]
    acts = [2 * (u.d_in + u.d_out) * b * (P if u.stack == "encoder" else 1) for u in units]

    def mem(n: int) -> list[int]:
        return [w + k * n + a for w, k, a in zip(weights, per_user, acts)]

    cap_pe = data_bytes_per_pe(spec)
    cap_w = min(w.usable_pes for w in ctx.wafers) * cap_pe
    wpp = next((n for n in range(max(1, math.ceil(sum(mem(1)) / cap_w)), len(units) + 1)
                if split_groups(units, mem(1), n, cap_w)), None)
    if wpp is None or wpp > ctx.systems:
        need = wpp or math.ceil(sum(mem(1)) / cap_w)
        raise ConfigError(f"{g.name} inference needs {gb(sum(weights))} of {g.dtype} weights + {gb(sum(per_user))} "
                          f"per user (decoder KV cache for {C} output tokens, cross-attention keys and values of a "
                          f"{P}-token input) on-wafer, but {ctx.systems} x {spec.name} hold "
                          f"{gb(ctx.systems * cap_w)} for data after a {spec.program_reserve_bytes_per_pe / 1024:g} "
                          f"KiB/PE program reserve; it needs at least {need} systems (--systems {need})")
    dec_depth = sum(u.stack != "encoder" for u in units)
    sys_reps = ctx.systems // wpp

    def decode_time(u: Unit, r: int, c: int, mesh=None) -> pj.Time:  # decoder stages: one token
        return pj.unit_time(spec, u, r, c, n_tokens=1, attn_ctx=C, dtype=g.dtype, mesh=mesh)

    def encode_time(u: Unit, r: int, c: int, mesh=None) -> pj.Time:  # encoder stages: the whole input
        return pj.unit_time(spec, u, r, c, n_tokens=P, attn_ctx=P, dtype=g.dtype, decode=False, mesh=mesh)

    def stage_time(u: Unit, r: int, c: int, mesh=None) -> pj.Time:
        return (encode_time if u.stack == "encoder" else decode_time)(u, r, c, mesh)

    full = ctx.common_box
    kmax = max(1, min(MAX_REPLICAS_PER_WAFER, int(cap_w // sum(mem(1))))) if wpp == 1 else 1
    best = None
    for k in (k for k in (1, 2, 4, 8, 16, 32, 64) if k <= kmax):
        boxes = grid_boxes(full, k)
        if len(boxes) != k:
            continue
        copies = sys_reps * k
        want = math.ceil(users / copies) if users else None
        free = boxes[0].area * cap_pe * wpp - sum(mem(0))
        top = want or max(1, min(dec_depth, int(free // max(1, sum(per_user)))))
        for n in ([want] if want else sorted({max(1, top * f // 8) for f in range(8, 0, -1)}, reverse=True)):
            runs = split_groups(units, mem(n), wpp, cap_w) if k == 1 else [(0, len(units))]
            pipes = place_pipelines(ctx, units, mem(n), runs, boxes, sys_reps, wpp, stage_time) if runs else None
            if pipes is None:
                continue
            dec = _decoder_layout(units, pipes[0])
            lat = decode_latency(ctx, units, dec, b)[0]
            stage_max = max(max(t.s for t in dec.stage_times), crossing_time(ctx, units, dec, b))
            agg = min((users or n * copies) / lat, copies / stage_max)
            if best is None or agg > best[0] * 1.000001:
                best = (agg, k, n, copies, pipes)
            break
    if best is None:
        raise ConfigError(f"{g.name}: {users} users with a {P}-token input and {C} output tokens do not fit beside "
                          f"the weights (lower --users, --prompt_len or --context_len)")
    agg, k, n, copies, pipes = best
    if ctx.defective:
        pipes[0] = with_detours(ctx, units, pipes[0], stage_time)
    pipe = pipes[0]
    dec = _decoder_layout(units, pipe)
    lat, breakdown = decode_latency(ctx, units, dec, b)
    stage_max = max(max(t.s for t in dec.stage_times), crossing_time(ctx, units, dec, b))
    agg = min((users or n * copies) / lat, copies / stage_max)
    enc_s, enc_stage_max = _encode_time(ctx, units, pipe, b, P)
    ttft = enc_s + lat
    ctx.say(f"encoder-decoder: a request's {P}-token input is encoded once (the encoder's "
            f"{sum(u.kind == 'block' and u.stack == 'encoder' for u in units)} layers over the whole input, "
            f"bidirectionally), then each of the {sum(u.stack == 'decoder' and u.kind == 'block' for u in units)} "
            f"decoder layers' cross-attention keys and values are projected from the encoder's output once, in "
            f"their own regions in parallel, and handed to the layer's region; decoding then runs only the "
            f"embedding, the decoder layers and the head per token, attending over its own KV cache (up to {C} "
            f"tokens) and the {P} cross-attention keys")
    ctx.say(f"memory: {gb(sum(weights))} of {g.dtype} weights + per user {gb(sum(per_user))} (self-attention KV "
            f"cache at {C} output tokens + cross-attention keys and values of {P} input positions)"
            + (f"; the layers split over {wpp} wafers, balanced by bytes" if wpp > 1 else ""))
    ctx.say(f"pipelined: {len(units)} regions in a snake (embedding, encoder layers, the encoder's norm, the "
            f"decoder layers' cross K/V units, decoder layers, head), each sized by its bytes then its FLOPs; {n} users in "
            f"flight per copy (up to one per decoder stage, {dec_depth}, as the KV caches allow), {copies} "
            f"cop{'y' if copies == 1 else 'ies'}; while the decoder's stages decode, the encoder's regions encode the "
            f"next request (one per {enc_stage_max * 1e6:.1f} us per copy)")
    worst = max(check_routing(spec, u) for u in units)
    ctx.say(f"routing: at most {worst[0]} colors per region (fabric has {spec.colors}, {spec.routes_per_pe} routes/PE)")
    slow = max(dec.stage_times, key=lambda t: t.s)
    proj = {"decode_latency_s_per_token": lat, "decode_tokens_per_s_per_user": 1 / lat,
            "users_in_flight": users or n * copies, "aggregate_decode_tokens_per_s": agg,
            "pipeline_limit_tokens_per_s": copies / stage_max, "prefill_tokens_per_s": P * copies / enc_stage_max,
            "prefill_chunk_tokens": P, "time_to_first_token_s": ttft, "encode_time_s": enc_s,
            "prompt_len": P, "context_len": C, "stages": len(units), "slowest_stage_s": stage_max,
            "kv_cache_bytes_per_token": sum(u.kv_elems_per_token() for u in units) * b,
            "cross_kv_bytes_per_user": sum(u.cross_kv_elems_per_token() for u in units) * P * b,
            "kv_cache_bytes": sum(per_user) * (users or n * copies), "weight_bytes": sum(weights),
            "bottleneck": breakdown.bottleneck(), "decode_time_shares": breakdown.shares(),
            "aggregate_bottleneck": ("too few users to fill the pipeline (latency-bound)"
                                     if (users or n * copies) / lat < copies / stage_max else slow.bottleneck()),
            "stage_times_s": [t.s for t in pipe.stage_times]}
    strategy = "multi_wafer_pipelined" if wpp > 1 else ("replicated" if copies > 1 else "pipelined")
    return {"strategy": strategy, "replicas": copies, "wafers_per_pipeline": wpp, "fits_in_sram": True,
            "workload": {"prompt_len": P, "context_len": C, "users": users or n * copies, "users_per_replica": n},
            "regions": [r for p in pipes for r in p.regions], "projection": proj}


def _decoder_layout(units: list[Unit], pipe: Layout) -> Layout:
    """The stages a decoded token passes: every region but the encoder stack's, in order."""
    keep = [i for i, r in enumerate(pipe.regions) if units[r.unit].stack != "encoder"]
    return Layout([pipe.regions[i] for i in keep], [pipe.stage_times[i] for i in keep])


def _encode_time(ctx: CompileContext, units: list[Unit], pipe: Layout, b: int, P: int) -> tuple[float, float]:
    """(seconds to encode one P-token input: the embedding and the encoder's stages one after another with their
    hand-offs, then the slowest decoder layer's cross K/V unit: the encoder output's route to it, its projection,
    the keys and values handed to its layer; the slowest encoder-side stage, which bounds requests per second)."""
    regs, times = pipe.regions, pipe.stage_times
    enc = [i for i, r in enumerate(regs) if units[r.unit].stack == "encoder" and units[r.unit].kind != "module"
           or units[r.unit].name == "enc_norm"]
    chain = [0] + enc  # the embedding first
    t = pj.Time().add("I/O", pj.io_time(ctx.spec, 4 * P).s)
    t += pj.unit_time(ctx.spec, units[regs[0].unit], regs[0].rows, regs[0].cols, n_tokens=P, attn_ctx=P,
                      dtype=ctx.g.dtype, decode=False)
    for a, z in zip(chain, chain[1:]):
        t += handoff(ctx, regs[a], regs[z], units[regs[a].unit].d_out * P, b)
        t += times[z]
    last = regs[chain[-1]]
    layer = {units[r.unit].name: r for r in regs}
    cross = []
    for i, r in enumerate(regs):
        name = units[r.unit].name
        if name.endswith(".cross_kv"):
            c = handoff(ctx, last, r, units[last.unit].d_out * P, b)
            c += times[i]
            c += handoff(ctx, r, layer[name.removesuffix(".cross_kv")], units[r.unit].d_out * P, b)
            cross.append(c.s)
    enc_stages = [times[i].s for i, r in enumerate(regs) if units[r.unit].stack == "encoder"]
    return t.s + max(cross or [0.0]), max(enc_stages)
