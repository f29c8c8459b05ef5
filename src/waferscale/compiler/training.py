"""Training plans: resident (the layer pipeline keeps weights, gradients and Adam state in SRAM) or weight
streaming (`weight_streaming.py`), data-parallel over systems through SwarmX (`data_parallel.py`).

Resident memory per unit and the choice between the two: `memory.training_memory` (what `wsc estimate` prints).
Times in seconds.
"""

from __future__ import annotations

import math

from waferscale.compiler import moe
from waferscale.compiler import project as pj
from waferscale.compiler.context import CompileContext
from waferscale.compiler.data_parallel import swarmx_allreduce, weak_scaling
from waferscale.compiler.ir import Unit
from waferscale.compiler.pipeline import MAX_REPLICAS_PER_WAFER, chain, place_pipelines, with_detours
from waferscale.compiler.memory import training_memory
from waferscale.compiler.seq2seq import model_flops_per_token
from waferscale.compiler.placement import grid_boxes
from waferscale.compiler.strategy import Layout, gb
from waferscale.compiler.weight_streaming import plan_weight_streaming
from waferscale.errors import ConfigError
from waferscale.fabric import cost


def plan_training(ctx: CompileContext, batch_size: int | None, seq_len: int | None) -> dict:
    """The training plan: sequence length and batch (default: the weight-streaming no-stall minimum), then
    resident (`_train_pipelined`) when weights + gradients + Adam state + activations fit in SRAM, else weight
    streaming (`weight_streaming.plan_weight_streaming`): the decision is `memory.training_memory`'s, the answer
    `wsc estimate` prints. Raises ConfigError on a bad request."""
    g = ctx.g
    mem = training_memory(g, ctx.spec, min(w.usable_pes for w in ctx.wafers), ctx.systems, batch_size, seq_len)
    w = mem.workload
    seq, batch_size, per_sys, b = w.seq_len, w.batch_size, w.per_system, g.dtype_bytes
    if w.batch_defaulted:
        ctx.say(f"batch size: none given, so {batch_size} sequences of {seq} ({per_sys} per system) = the "
                f"weight-streaming no-stall minimum {w.rule} = {w.t_min:,} tokens per system")
    if g.arch == "encoder_decoder":
        ctx.say(f"encoder-decoder: a sequence is {seq} encoder tokens (bidirectional) and {w.seq_tok - seq} decoder "
                f"tokens (the span-corruption target of a {seq}-token input; causal self-attention, and "
                f"cross-attention over the {seq} encoder outputs, whose keys and values each decoder layer's cross "
                f"K/V unit projects); tokens per step count both ({w.seq_tok} per sequence)")
    micro = int(g.defaults.get("micro_batch_size") or per_sys)
    if per_sys % micro:
        micro = per_sys
    if g.arch == "encoder":
        ctx.say(f"encoder: bidirectional attention (each of a sequence's {seq} tokens attends to all {seq}), "
                f"trained on the masked-LM objective: the head computes every token's vocabulary logits, the loss "
                f"reads the masked ones")
    workload = {"batch_size": batch_size, "seq_len": seq, "micro_batch_size": micro,
                "tokens_per_step": batch_size * w.seq_tok, "systems": ctx.systems}
    common = {"no_stall_min_tokens_per_step": w.t_min, "peak_flops_per_wafer": w.peak_flops,
              "io_bytes_per_s": ctx.spec.io_bytes_per_s, "streamed_bytes_per_weight": b}
    if mem.fits:
        ctx.say(f"resident training: {mem.why()}, layer-pipelined on the wafer")
        out = _train_pipelined(ctx, w.units, list(mem.per_unit), per_sys, seq, workload, common, b, mem.sram, w.tok,
                               w.actx, w.seq_tok)
        return out | {"memory": mem.summary()}
    ctx.say(f"weight streaming: resident training would need {mem.why()} (fp32 master + Adam moments there, the "
            f"update runs there), gradients stream out")
    out = plan_weight_streaming(ctx, w.units, per_sys, micro, seq, workload, common, b, mem.sram, w.t_min,
                                w.peak_flops, **({"tok": w.tok, "actx": w.actx, "seq_tok": w.seq_tok}
                                                 if w.seq_tok != seq else {}))
    return out | {"memory": mem.summary()}


def _train_pipelined(ctx: CompileContext, units: list[Unit], mem: list[int], per_sys: int, seq: int, workload: dict,
                     common: dict, b: int, cap_w: int, tok, actx, seq_tok: int) -> dict:
    """Resident training: the layers pipelined on the wafer (1F1B), `mem` bytes per unit; k copies of the
    pipeline per wafer (a k-way grid) when that projects more tokens/s; the optimizer runs in place; with
    several systems the gradients are all-reduced through SwarmX after every step."""
    g, spec = ctx.g, ctx.spec
    full = ctx.common_box

    # an expert computes the tokens of the sequence routed to it; its layer waits for the most loaded expert
    routed = {u.n_experts: math.ceil(moe.expected_max_load(seq, u.n_experts, u.experts_per_token))
              for u in units if u.expert_of}

    def stage_time(u: Unit, r: int, c: int, mesh=None) -> pj.Time:  # forward + backward (2x) of one sequence
        kw = dict(n_tokens=routed[u.n_experts] if u.expert_of else tok(u), attn_ctx=actx(u), dtype=g.dtype,
                  decode=False, mesh=mesh)
        f = pj.unit_time(spec, u, r, c, **kw)
        f += pj.backward_time(spec, u, r, c, f, **kw)
        return f

    kmax = max(1, min(MAX_REPLICAS_PER_WAFER, per_sys, int(cap_w // sum(mem))))
    best = None
    for k in sorted({k for k in (1, 2, 4, 8, 16, 32, 64) if k <= kmax}):
        boxes = grid_boxes(full, k)
        if len(boxes) != k:
            continue
        pipes = place_pipelines(ctx, units, mem, [(0, len(units))], boxes, ctx.systems, 1, stage_time)
        if pipes is None:
            continue
        opt = max(pj.Time().add_cycles(cost.elementwise_cycles(spec, max(1, r.bytes // 16), r.rows, r.cols, 12),
                                       spec.clock_hz).s for r in pipes[0].regions)
        step = _step_1f1b(ctx, units, pipes[0], math.ceil(per_sys / k), opt, seq, b)
        tps = workload["tokens_per_step"] / step
        if best is None or tps > best[0] * 1.000001:
            best = (tps, k, pipes, step, opt)
    if best is None:
        raise ConfigError(f"{g.name}: could not place {len(units)} resident training regions on the "
                          f"{full.rows}x{full.cols} mesh; use a larger --pes or fewer sequences per step")
    _, k, pipes, step, opt = best
    if ctx.defective:  # charge the detours inside the placed regions (real routes of each region)
        pipes[0] = with_detours(ctx, units, pipes[0], stage_time)
        step0, step = step, _step_1f1b(ctx, units, pipes[0], math.ceil(per_sys / k), opt, seq, b)
        ctx.say(f"detours: the placed regions re-projected on their own routes around dead cores and links: "
                f"step {step0 * 1e3:.3f} -> {step * 1e3:.3f} ms (+{step / step0 - 1:.2%})")
    if k > 1:
        ctx.say(f"data-parallel replicas on the wafer: {k} copies of the layer pipeline (small model) give the "
                f"highest projected tokens/s")
    if g.moe:
        u = next(x for x in units if x.expert_of)
        E, kk = u.n_experts, u.experts_per_token
        ctx.say(f"mixture of experts, resident: each expert in a region of its own with its weights and Adam state; "
                f"a sequence's {seq} tokens go to {kk} of {E} experts each, and a layer waits for its most loaded "
                f"expert: {routed[E]} tokens expected (mean {seq * kk / E:g}, uniform routing, "
                f"{moe.LOAD_SAMPLES} seeded draws); MFU counts the routed experts' FLOPs only "
                f"({g.active_params:,} of {g.params:,} parameters per token)")
    grads = sum(u.nonzero_params + u.tied_params for u in units) * b  # sparse: only kept weights' grads
    sync = swarmx_allreduce(ctx, grads, ctx.systems)
    step += sync.s
    tps = workload["tokens_per_step"] / step
    if ctx.systems > 1:
        ctx.say(f"data parallel across {ctx.systems} systems, {per_sys} sequences each: after each step the "
                f"gradients ({gb(grads)}) go out through SwarmX, are summed in its 1:4 tree and come back "
                f"({sync.s * 1e3:.2f} ms, not overlapped with compute; weights stay resident)")
    slow_t = max(pipes[0].stage_times, key=lambda t: t.s)
    flops = ctx.g.model_flops_per_token(seq, training=True, nonzero=ctx.g.sparse) if seq_tok == seq else \
        model_flops_per_token(units, tok, actx, seq_tok, training=True)
    proj = {"step_time_s": step, "tokens_per_s": tps, "mfu": flops * tps / (common["peak_flops_per_wafer"] * ctx.systems),
            "weights_streamed": False, "bottleneck": slow_t.bottleneck(), "time_shares": slow_t.shares(),
            "slowest_stage_s_per_sequence": slow_t.s, "model_flops_per_token": flops, **common,
            "scaling": weak_scaling(ctx, per_sys, seq_tok, lambda n: step - sync.s + swarmx_allreduce(ctx, grads, n).s,
                                     lambda n: swarmx_allreduce(ctx, grads, n).s)}
    seqs = math.ceil(per_sys / k)

    def reproject(us: list[Unit]) -> tuple[pj.Time, list[float]]:  # one step on this placement, other densities
        times = [stage_time(us[r.unit], r.rows, r.cols) for r in pipes[0].regions]
        t = pj.Time()
        for st in times:
            t += st
        t += max(times, key=lambda x: x.s).scaled(seqs - 1)
        pipe = t.s
        return t.add("compute", opt).add("I/O", sync.s), [x.s * pipe / sum(y.s for y in times) for x in times]

    return {"strategy": "replicated" if k > 1 else "pipelined", "replicas": k * ctx.systems, "wafers_per_pipeline": 1,
            "fits_in_sram": True, "workload": workload, "projection": proj,
            "regions": [r for p in pipes for r in p.regions], "reproject": reproject}


def _step_1f1b(ctx: CompileContext, units: list[Unit], pipe: Layout, seqs: int, opt: float, seq: int,
               b: int) -> float:
    """Seconds for `seqs` sequences through a 1F1B pipeline: fill it, then one per slowest stage, then the
    optimizer update (`opt`). An MoE layer's experts fill as one stage: the sequence's routed tokens go to
    them and come back, forward and backward (`pipeline.chain`), and the layer waits for the most loaded."""
    times = [t.s for t in pipe.stage_times]
    if not ctx.g.moe:
        return (seqs - 1) * max(times) + sum(times) + opt
    u = next(x for x in units if x.expert_of)
    routed = 2 * math.ceil(moe.expected_max_load(seq, u.n_experts, u.experts_per_token))  # activations + grads
    fill = chain(ctx, units, pipe.regions, pipe.stage_times, b, tokens=0, routed=routed)
    return (seqs - 1) * max(times) + fill.s + opt
