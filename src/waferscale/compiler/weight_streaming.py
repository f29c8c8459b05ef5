"""Weight-streaming training: weights live in MemoryX and stream in one layer at a time across the whole wafer.

Per micro-batch, every layer's weights arrive through SwarmX (a layer's compute hides its transfer, or waits
for it), its forward and backward (2 forward-equivalents, +1 when the forward is recomputed) run on the whole
wafer, or on g copies of it when a layer is too small to keep every PE busy, and its gradients stream out;
the optimizer runs in MemoryX (`OptimizerUpdate`: by the bytes Adam moves, at an assumed MemoryX bandwidth).
On-wafer: one layer's weights double-buffered + its gradients, and the micro-batch's activations (all layers, or
layer-boundary checkpoints + one layer's with recomputation). Times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from waferscale.compiler import project as pj
from waferscale.compiler.context import CompileContext
from waferscale.compiler.data_parallel import weak_scaling
from waferscale.compiler.ir import Unit
from waferscale.compiler.placement import Rect, grid_boxes
from waferscale.compiler.plan import Region
from waferscale.compiler.seq2seq import model_flops_per_token
from waferscale.compiler.strategy import ADAM_STATE_BYTES_PER_PARAM, gb
from waferscale.errors import ConfigError
from waferscale.fabric import cost_collectives
from waferscale.fabric.spec import SystemSpec


def _stream_micro(ctx: CompileContext, units: list[Unit], t_mb: int, seq: int, b: int, recompute: bool, n_systems: int,
                  free_bytes: float, tok=None, actx=None) -> tuple[pj.Time, pj.Time, pj.Time, list[int], list[float]]:
    """One micro-batch of t_mb tokens, layer by layer over the whole wafer: (total, compute-only, io-only,
    groups per layer, seconds per layer). A streamed layer may be multicast into g copies (a g-way grid of the
    wafer), each taking t_mb/g tokens, when g copies of its weights + gradients fit in `free_bytes`; the
    copies' gradients are reduced before streaming out. g is chosen per layer by the cost model. An
    encoder-decoder: `tok(u)` / `actx(u)` are a unit's tokens per sequence of `seq` and the keys it attends to."""
    spec, g = ctx.spec, ctx.g
    R, Cc = ctx.wafers[0].rows, ctx.wafers[0].cols
    full = Rect(0, 0, R, Cc)
    sx = SystemSpec(ctx.spec, n_systems)  # MemoryX -> SwarmX 1:4 broadcast-reduce tree -> each system
    BW = sx.swarmx_bytes_per_s
    total, comp, io = pj.Time(), pj.Time(), pj.Time()
    groups, per = [], []
    for u in units:
        best = None
        # an expert computes the tokens routed to it: the experts of a layer run one after another on the wafer,
        # so their loads sum to t_mb * k whatever the routing; each at the mean load t_mb * k / E
        toks = math.ceil(t_mb * u.token_share) if u.expert_of else t_mb if tok is None else t_mb // seq * tok(u)
        ctx_u = seq if actx is None else actx(u)
        for gg in (1, 4, 16, 64, 256):
            if gg > 1 and (3 * u.nonzero_params * b * gg > free_bytes or not (u.matmuls or u.n_heads) or toks < gg):
                continue
            box = grid_boxes(full, gg)[0]
            kw = dict(n_tokens=math.ceil(toks / gg), attn_ctx=ctx_u, dtype=g.dtype, decode=False)
            f = pj.unit_time(spec, u, box.rows, box.cols, **kw)
            bwd = pj.backward_time(spec, u, box.rows, box.cols, f, recompute, **kw)
            red = pj.Time()
            if gg > 1:  # reduce the copies' gradient tiles across the g-way grid (tile per PE, grid hops)
                gr = R // box.rows
                tile = max(1, math.ceil(u.nonzero_params / (box.rows * box.cols)))  # only kept weights' grads
                red.add_cycles(cost_collectives.reduce_cycles(spec, tile, gr, gg // gr), spec.clock_hz)
                red.add("fabric latency", (R + Cc) * spec.hop_latency_cycles / spec.clock_hz)
            t = (f.s * (3 + recompute) if not u.act_sparse else f.s + bwd.s) + red.s
            if best is None or t < best[0]:
                best = (t, gg, box, f, bwd, red)
        _, gg, box, f, bwd, red = best
        if ctx.defective:  # the chosen split's kernels on the wafer's own routes (detours charged)
            kw = dict(n_tokens=math.ceil(toks / gg), attn_ctx=ctx_u, dtype=g.dtype, decode=False,
                      mesh=ctx.region_mesh(0, box.row, box.col, box.rows, box.cols))
            f = pj.unit_time(spec, u, box.rows, box.cols, **kw)
            bwd = pj.backward_time(spec, u, box.rows, box.cols, f, recompute, **kw)
        groups.append(gg)
        # a layer's request pays the tree latency; sparse: the non-zero values + the bitmask
        w = u.streamed_weight_bytes(b) / BW + sx.swarmx_hops * spec.io_latency_s
        before = total.s
        bwd += red  # the copies' gradients are reduced before they stream out
        if u.n_experts and not u.expert_of:  # the router's dispatch and combine (backward: their gradients)
            shuffle = _dispatch_time(spec, u, t_mb, R, Cc, g.dtype)
            f += shuffle
            bwd += shuffle
        for c in (f, bwd):  # forward, then backward (+ recomputed forward)
            comp += c
            io.add("I/O", w)
            total += c if c.s >= w else pj.Time().add("I/O", w)
        per.append(total.s - before)
    if units[0].kind == "embed":  # the micro-batch's embedded tokens enter through the wafer edge
        total += pj.io_time(spec, units[0].d_out * b * t_mb)
    return total, comp, io, groups, per


def _explain_update(ctx: CompileContext, upd: OptimizerUpdate, per: list[float], step: float) -> None:
    w = upd.window(per)
    exposed = upd.exposed(per)
    ctx.say(f"optimizer update in MemoryX: Adam moves {upd.bytes_per_param} B per parameter (reads gradient, master, "
            f"moments; writes master, moments, the streamed weight): {gb(upd.params * upd.bytes_per_param)} for "
            f"{upd.params / 1e9:.3g} B parameters at {upd.bytes_per_s / 1e9:.0f} GB/s (MemoryX's I/O rate, an "
            f"assumption) = {upd.seconds * 1e3:.1f} ms per step; it runs while the last backward and the next "
            f"forward pass the layers below the top one ({w * 1e3:.1f} ms), "
            + (f"so the step waits only for the first layer's update ({upd.first_s * 1e3:.2f} ms: its gradients "
               f"arrive last and its weights are needed first)" if exposed == upd.first_s else
               f"too short: the step waits {exposed * 1e3:.1f} ms more for it ({exposed / step:.0%} of the step), and "
               f"in the window the step follows MemoryX, not the wafer (MemoryX would need "
               f"{(upd.params - upd.first_params) * upd.bytes_per_param / max(w, 1e-30) / 1e9:.0f} GB/s to hide all "
               f"but the first layer's)"))


def _dispatch_time(spec, u: Unit, t_mb: int, R: int, C: int, dtype: str) -> pj.Time:
    """An MoE block's routing on the wafer: each of the micro-batch's t_mb tokens sends its activations to its
    k experts' tokens and their outputs come back, two all-to-alls over the whole wafer
    (`fabric.cost_collectives.alltoall_cycles`)."""
    cyc = cost_collectives.alltoall_cycles(spec, t_mb * u.experts_per_token * u.d_out, R, C, dtype)
    return pj.Time().add("routing", 2 * cyc.total / spec.clock_hz)


def _first(units: list[Unit]) -> Unit:
    """The layer whose gradients reach MemoryX last and whose weights the next step needs first: backward ends
    where the next forward begins."""
    return next((u for u in units if u.params), units[0])


def _step_boundary(ctx: CompileContext, units: list[Unit], b: int, n_systems: int) -> pj.Time:
    """What a step cannot overlap on the links: the last backward layer's gradients reach MemoryX through the
    SwarmX reduce tree and, once updated there (`OptimizerUpdate`), come back through the broadcast tree as the
    next step's first layer. Within a step the next layer is always prefetched; across micro-batches the weights
    do not change, so only the step boundary waits."""
    sx = SystemSpec(ctx.spec, n_systems)
    return pj.Time().add("I/O", 2 * _first(units).streamed_weight_bytes(b) / sx.swarmx_bytes_per_s
                         + 2 * sx.swarmx_hops * ctx.spec.io_latency_s)


@dataclass(frozen=True)
class OptimizerUpdate:
    """Adam in MemoryX, once per step on the gradients summed over micro-batches and systems, by the bytes it
    moves: per parameter it reads the gradient, the fp32 master (the weight itself in fp32 training) and both
    moments, and writes the master, the moments and the weight streamed next step, at MemoryX's bandwidth
    (`FabricSpec.memoryx_bytes_per_s`, an assumption). A layer's update can start when its last gradients
    arrive and must end before the next step streams it, so the step waits for the first layer's update (its
    gradients arrive last, its weights are needed first) or, when the whole update is longer than the time it
    can overlap (the last micro-batch's backward and the next one's forward of every layer below the top one),
    for the excess."""

    params: int  # parameters updated (the kept ones when sparse)
    first_params: int  # those whose gradients are complete only when the step's backward ends
    bytes_per_param: int
    bytes_per_s: float

    @classmethod
    def of(cls, ctx: CompileContext, units: list[Unit]) -> "OptimizerUpdate":
        w, g, master, m, v = ADAM_STATE_BYTES_PER_PARAM["mixed" if ctx.g.dtype != "fp32" else "fp32"]
        first = _first(units)  # a matrix it shares with the head has its last gradients from it too
        return cls(sum(u.nonzero_params for u in units), first.nonzero_params + first.tied_params,
                   (g + (master or w) + m + v) + (w + master + m + v), ctx.spec.memoryx_bytes_per_s)

    @property
    def seconds(self) -> float:
        return self.params * self.bytes_per_param / self.bytes_per_s

    @property
    def first_s(self) -> float:
        return self.first_params * self.bytes_per_param / self.bytes_per_s

    @staticmethod
    def window(per: list[float]) -> float:
        """Seconds the update overlaps: every layer's forward and backward below the top one (`per`: seconds per
        layer of one micro-batch, forward + backward)."""
        return sum(per[:-1])

    def exposed(self, per: list[float]) -> float:
        return max(self.first_s, self.seconds - self.window(per))

    def step(self, micro: pj.Time, n_micro: int, per: list[float], boundary: pj.Time) -> pj.Time:
        """A step's critical path by part: `n_micro` micro-batches of `micro` (`per`: its seconds per layer), the
        step boundary's transfers and the update. When the update outlasts its window, the wafer's work in that
        window runs under it, so the step follows MemoryX there and its time is booked to the update."""
        hidden = self.window(per) if self.exposed(per) > self.first_s else 0.0
        t = micro.scaled(n_micro - hidden / micro.s)
        t += boundary
        return t.add("MemoryX update", self.exposed(per) + hidden)


def plan_weight_streaming(ctx: CompileContext, units: list[Unit], per_sys: int, micro: int, seq: int, workload: dict,
                          common: dict, b: int, cap_w: int, t_min: int, F: float, tok=None, actx=None,
                          seq_tok: int | None = None) -> dict:
    """The weight-streaming plan for `per_sys` sequences of `seq` tokens per system and step, in micro-batches
    of `micro` (fewer when their activation checkpoints do not fit); `b` bytes per streamed weight, `cap_w`
    data bytes per wafer, `t_min` the no-stall minimum tokens per micro-batch, `F` peak FLOP/s per wafer.
    `workload` gains the micro-batch size actually used. An encoder-decoder: `tok`, `actx` as `_stream_micro`'s,
    `seq_tok` its tokens per sequence (encoder's + decoder's), by which micro-batches and activations are counted
    (every unit's activations at all of them: an upper bound)."""
    g, spec = ctx.g, ctx.spec
    seq = seq_tok or seq
    biggest = max(u.params for u in units)
    layer_buf = 3 * biggest * b  # two weight buffers (compute one, receive the next) + its gradients
    if layer_buf > cap_w:
        raise ConfigError(f"{g.name}: even streamed, its largest layer ({biggest:,} parameters) needs "
                          f"{gb(layer_buf)} on-wafer (double-buffered weights + gradients) > {gb(cap_w)} of SRAM")
    d = max(u.d_out for u in units if u.kind != "head")
    act_tok_all = sum(u.train_act_elems_per_token for u in units) * b
    act_tok_ckpt = g.n_blocks * d * b + max(u.train_act_elems_per_token for u in units) * b
    t_mb = micro * seq
    recompute = act_tok_all * t_mb + layer_buf > cap_w
    if recompute:
        if act_tok_ckpt * t_mb + layer_buf > cap_w:
            fit = int((cap_w - layer_buf) // (act_tok_ckpt * seq))
            if fit < 1:
                raise ConfigError(f"{g.name}: one sequence of {seq} tokens needs {gb(act_tok_ckpt * seq)} of "
                                  f"activation checkpoints > {gb(cap_w - layer_buf)} free SRAM; use a shorter --seq_len")
            ctx.say(f"micro-batch: {micro} sequences need {gb(act_tok_ckpt * t_mb)} of activation checkpoints; "
                    f"the largest that fits is {fit}, used for gradient accumulation")
            micro = max(m for m in range(1, fit + 1) if per_sys % m == 0)
            t_mb = micro * seq
        ctx.say(f"activations: the micro-batch's full activations ({gb(act_tok_all * t_mb)}) exceed SRAM, so layer "
                f"inputs are checkpointed ({gb(g.n_blocks * d * b * t_mb)}) and each layer's forward is recomputed "
                f"in backward (4 instead of 3 forward-equivalents per layer)")
    else:
        ctx.say(f"activations: the micro-batch's activations ({gb(act_tok_all * t_mb)}) stay on the wafer between "
                f"forward and backward")
    workload["micro_batch_size"] = micro
    n_micro = per_sys // micro
    act = (act_tok_ckpt if recompute else act_tok_all)
    free = cap_w - act * t_mb
    total, comp, io, groups, per = _stream_micro(ctx, units, t_mb, seq, b, recompute, ctx.systems, free, tok, actx)
    upd = OptimizerUpdate.of(ctx, units)
    R0, C0 = ctx.wafers[0].rows, ctx.wafers[0].cols
    if ctx.defective:
        ctx.say("detours: the streamed layers' kernels are projected on the wafer's own routes around its dead "
                "cores and links (per-link hop estimates of fabric.mesh for regions over 4,096 PEs)")
    if g.moe:
        u = next(x for x in units if x.expert_of)
        E, k = u.n_experts, u.experts_per_token
        ctx.say(f"mixture of experts, streamed: every expert's weights stream in each micro-batch ({gb(g.params * b)} "
                f"per pass, all {E} experts of each layer) but a token computes with only {k} of them "
                f"({g.active_params / 1e9:.3g} B of {g.params / 1e9:.3g} B parameters: the FLOPs and MFU count "
                f"those); the experts of a layer run one after another on the wafer, each on the tokens routed to "
                f"it (mean {t_mb * k / E:,.0f}), so their loads sum to {t_mb:,} x {k} whatever the routing and "
                f"load imbalance costs nothing here; routing costs two all-to-alls of the micro-batch's "
                f"activations per MoE layer and direction ({_dispatch_time(spec, u, t_mb, R0, C0, g.dtype).s * 1e3:.3f}"
                f" ms); an expert's weights serve {k}/{E} of the tokens, so the no-stall minimum is {E}/{k} times a "
                f"dense layer's")
    if max(groups) > 1:
        ctx.say(f"layer copies: a streamed layer is too small to keep every PE busy as one GEMM, so the cost model "
                f"picks per layer a g-way split of the wafer (g copies multicast from one stream, each on t/g "
                f"tokens, gradients reduced before streaming out): g = {sorted(set(groups))}")

    steps: dict[int, pj.Time] = {}
    exposed: dict[int, float] = {}  # the update's wait per step, on n systems

    def step_time(n: int) -> pj.Time:  # one step on n systems, each doing the same work (weak scaling)
        if n not in steps:
            tot, per_n = (total, per) if n == ctx.systems else \
                _stream_micro(ctx, units, t_mb, seq, b, recompute, n, free, tok, actx)[::4]
            steps[n] = upd.step(tot, n_micro, per_n, _step_boundary(ctx, units, b, n))
            exposed[n] = upd.exposed(per_n)
        return steps[n]

    def step_at(n: int) -> float:
        return step_time(n).s

    step = step_at(ctx.systems)
    _explain_update(ctx, upd, per, step)
    tps = workload["tokens_per_step"] / step
    flops = g.model_flops_per_token(seq, training=True, nonzero=g.sparse) if tok is None else \
        model_flops_per_token(units, tok, actx, seq, training=True)
    ex = next((u for u in units if u.expert_of), None)  # a mixture of experts: x E/k (an expert's share)
    rule, nums = ("", "") if ex is None else (" x E/k", f" x {ex.n_experts}/{ex.experts_per_token}")
    ctx.say(f"no-stall condition (WSE.md): tokens per micro-batch T >= (b/3)F/BW{rule} = ({b}/3) x {F / 1e15:.2f} PF / "
            f"{spec.io_bytes_per_s / 1e9:.0f} GB/s{nums} = {t_min:,}; this plan streams per {t_mb:,} tokens: "
            + ("compute-bound" if t_mb >= t_min else "I/O-bound (the wafer waits for weights)"))
    base = step_at(1)
    scaling = weak_scaling(ctx, per_sys, seq, step_at, lambda n: step_at(n) - base)
    for r in scaling:
        r["tokens_per_micro_batch"], r["stalls"] = t_mb, t_mb < t_min
        r["memoryx_update_exposed_s"] = exposed[r["systems"]]
    levels = SystemSpec(ctx.spec, ctx.systems).swarmx_levels
    ctx.say(f"data parallel (weak scaling): each system keeps {per_sys} sequences per step ({n_micro} micro-batches "
            f"of {micro}), so the global batch is {per_sys} x N; every system runs the same layer-by-layer "
            f"execution. Weights are broadcast and gradients reduced through SwarmX, a tree of 1:4 nodes at line "
            f"rate (the system's 150 GB/s for any N) whose depth ceil(log4 N) adds {spec.io_latency_s * 1e6:.0f} us "
            f"per level to each layer's request and to the step boundary (last gradients out, first weights in): "
            f"what compute does not hide is the only loss"
            + (f"; here {ctx.systems} systems, {levels} level(s)" if ctx.systems > 1 else ""))
    proj = {"step_time_s": step, "tokens_per_s": tps, "mfu": flops * tps / (F * ctx.systems),
            "weights_streamed": True, "recompute": recompute,
            "bottleneck": steps[ctx.systems].bottleneck(),
            "time_shares": steps[ctx.systems].shares(), "compute_time_per_micro_batch_s": comp.s,
            "io_time_per_micro_batch_s": io.s, "micro_batch_time_shares": total.shares(),
            "optimizer_update": {"params": upd.params, "bytes_per_param": upd.bytes_per_param,
                                 "memoryx_bytes_per_s": upd.bytes_per_s, "update_s": upd.seconds,
                                 "first_layer_update_s": upd.first_s, "overlap_window_s": upd.window(per),
                                 "exposed_s": exposed[ctx.systems]},
            "micro_batches_per_step": n_micro, "layer_copies": groups, "tokens_per_micro_batch": t_mb,
            "model_flops_per_token": flops, "no_stall_met": t_mb >= t_min, **common, "scaling": scaling}
    R, Cc = ctx.wafers[0].rows, ctx.wafers[0].cols
    regions = [Region(-1, f"all {len(units)} layers, streamed one at a time", s, s, 0, 0, 0, R, Cc,
                      ctx.wafers[s].usable_pes, int(layer_buf + act * t_mb))
               for s in range(ctx.systems)]

    def reproject(us: list[Unit]) -> tuple[pj.Time, list[float]]:  # one step with other densities (g re-chosen)
        t, _, _, _, per = _stream_micro(ctx, us, t_mb, seq, b, recompute, ctx.systems, free, tok, actx)
        step = OptimizerUpdate.of(ctx, us).step(t, n_micro, per, _step_boundary(ctx, us, b, ctx.systems))
        return step, [n_micro * x for x in per]

    return {"strategy": "weight_streaming", "replicas": ctx.systems, "wafers_per_pipeline": 1, "fits_in_sram": False,
            "workload": workload, "projection": proj, "regions": regions, "reproject": reproject,
            "assumptions": {"optimizer_update": "Adam in MemoryX by bytes at memoryx_bytes_per_s, overlapped with "
                                                "the last backward and the next forward except the first layer's",
                            "gradients_out": "on the egress direction of the same links, concurrent with weights in",
                            "swarmx": "tree of 1:4 broadcast-reduce nodes, 100 Gb/s ports at line rate (12 parallel "
                                      "trees = the system's I/O bandwidth for any N), one I/O latency per level",
                            "swarmx_latency_per_level_s": spec.io_latency_s,
                            "scaling": "weak: per-system batch fixed, global batch = N x per-system batch"}}
