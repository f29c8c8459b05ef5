"""compile_model: capture -> strategy -> placement -> projection -> Plan."""

from __future__ import annotations

import math
from dataclasses import dataclass
from dataclasses import field as dataclasses_field
from typing import Any

from waferscale.compiler import project as pj
from waferscale.compiler._fabric import WaferMap, wafer_map
from waferscale.compiler.ir import Graph, Unit
from waferscale.compiler.placement import Rect, grid_boxes, live_count
from waferscale.compiler.plan import Plan, Region
from waferscale.compiler.strategy import (ADAM_STATE_BYTES_PER_PARAM, PROGRAM_RESERVE_BYTES_PER_PE, Layout,
                                          check_routing, data_bytes_per_pe, gb, place_replica, split_contiguous)
from waferscale.errors import ConfigError
from waferscale.fabric.presets import fabric_from_name
from waferscale.fabric.spec import FabricSpec

MODES = {"inference": "inference", "infer": "inference", "train": "train", "training": "train"}
MAX_REPLICAS_PER_WAFER = 64


@dataclass
class _Ctx:
    g: Graph
    spec: FabricSpec
    wafers: list[WaferMap]
    systems: int
    decisions: list[str]
    _meshes: dict = dataclasses_field(default_factory=dict)

    def say(self, text: str) -> None:
        self.decisions.append(text)

    @property
    def defective(self) -> bool:
        return any(w.mesh is not None and w.mesh.has_defects for w in self.wafers)

    def region_mesh(self, system: int, row: int, col: int, rows: int, cols: int):
        """The placed rectangle's own defect map (`Mesh.subregion`), or None on a perfect wafer."""
        w = self.wafers[system]
        if w.mesh is None or not w.mesh.has_defects:
            return None
        key = (system, row, col, rows, cols)
        if key not in self._meshes:
            self._meshes[key] = w.mesh.subregion(row, col, rows, cols)
        return self._meshes[key]


def _with_detours(ctx: "_Ctx", units, pipe: Layout, time_fn) -> Layout:
    """A placed pipeline's stage times re-projected with each region's own defect map, so the hops of the
    detours around its dead cores and links are charged (placement itself searched shapes on a perfect mesh:
    the logical mesh is defect-free after spare remapping, only its routes are longer)."""
    if not ctx.defective:
        return pipe
    return Layout(pipe.regions, [time_fn(units[r.unit], r.rows, r.cols,
                                         ctx.region_mesh(r.system, r.row, r.col, r.rows, r.cols))
                                 for r in pipe.regions])


def compile_model(*, model: str | None = None, graph: Graph | None = None, module=None, target: str = "wse3",
                  systems: int = 1, pes: tuple[int, int] | None = None, mode: str = "inference",
                  batch_size: int | None = None, seq_len: int | None = None, prompt_len: int | None = None,
                  context_len: int | None = None, users: int | None = None, defects: float = 0.0, seed: int = 0,
                  clock_hz: float | None = None) -> Plan:
    """Compile a zoo model (`model`), a captured graph (`graph`: a params file's comes from
    `waferscale.zoo.wafer.params_graph`) or an nn.Module (`module`, or `(module, sample_input_shape)`) for
    `systems` x `target` wafers. Raises ConfigError on bad input or an impossible request (the message has the
    numbers)."""
    if sum(x is not None for x in (model, graph, module)) != 1:
        raise ConfigError("give exactly one of --model NAME, --params P.yaml (or a module)")
    mode_key = MODES.get(str(mode).lower())
    if mode_key is None:
        raise ConfigError(f"--mode must be 'inference' or 'train', got {mode!r}")
    for name, v in (("systems", systems), ("batch_size", batch_size), ("seq_len", seq_len),
                    ("prompt_len", prompt_len), ("context_len", context_len), ("users", users)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ConfigError(f"--{name} must be a positive integer, got {v!r}")
    if not isinstance(defects, (int, float)) or not 0.0 <= defects < 1.0:
        raise ConfigError(f"--defects must be a rate in [0, 1), got {defects!r}")
    spec = fabric_from_name(target, pes=tuple(pes) if pes else None, clock_hz=clock_hz)

    from waferscale.compiler import capture  # the only torch import, deferred

    if model is not None:
        g = capture.capture_zoo(model)
    elif graph is not None:
        g = graph
    else:
        mod, example = module if isinstance(module, tuple) else (module, None)
        g = capture.capture_module(mod, example)

    wafers = [wafer_map(spec, defects, seed + s) for s in range(systems)]
    ctx = _Ctx(g, spec, wafers, systems, [])
    usable = min(w.usable_pes for w in wafers)
    if usable < len(g.units):
        raise ConfigError(f"the {wafers[0].rows}x{wafers[0].cols} mesh has {usable} usable PEs, fewer than the "
                          f"{len(g.units)} units of {g.name} (one PE per unit at least); use a larger --pes")
    if defects:
        ctx.say(f"defects: rate {defects:g}, seed {seed}: wafer 0 has {wafers[0].spare_note}; no tile is mapped "
                f"onto a dead core, {usable:,} usable PEs per wafer (min over systems)")
    out = _inference(ctx, prompt_len, context_len, users) if mode_key == "inference" else \
        _training(ctx, batch_size, seq_len)
    regions: list[Region] = out.pop("regions")
    proj = out.pop("projection")
    assumptions = pj.assumptions(spec, systems, g.dtype)
    if defects:
        assumptions["defect_detours"] = ("charged per placed region on its own routes (fabric.mesh: exact routes for "
                                         "regions up to 4,096 PEs, Manhattan + 2 hops per blocked segment above); "
                                         "placement searches shapes on the defect-free logical mesh")
    assumptions.update(program_reserve_bytes_per_pe=PROGRAM_RESERVE_BYTES_PER_PE,
                       data_bytes_per_pe=data_bytes_per_pe(spec), **out.pop("assumptions", {}))
    return Plan(model=g.name, source=g.source, target=spec.name, systems=systems, mode=mode_key,
                strategy=out["strategy"], replicas=out["replicas"], wafers_per_pipeline=out["wafers_per_pipeline"],
                fits_in_sram=out["fits_in_sram"], fabric=_spec_dict(spec),
                wafers=[{"system": i, "logical_rows": w.rows, "logical_cols": w.cols, "usable_pes": w.usable_pes,
                         "dead_pes": int(len(w.dead_physical)), "defect_rate": defects, "seed": seed + i}
                        for i, w in enumerate(wafers)],
                workload=out["workload"], graph=g.to_dict(), regions=regions, decisions=ctx.decisions,
                projection=proj, assumptions=assumptions, bottleneck=proj["bottleneck"],
                pes_used=sum(r.live_pes for r in regions))


def _spec_dict(spec: FabricSpec) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(spec)


# ---- inference ---------------------------------------------------------------------------------------------

def _inference(ctx: _Ctx, prompt_len: int | None, context_len: int | None, users: int | None) -> dict:
    g, spec = ctx.g, ctx.spec
    C = context_len or min(g.max_seq_len, 2048)
    P = prompt_len or max(1, min(1024, C // 2))
    if C > g.max_seq_len:
        raise ConfigError(f"--context_len {C} exceeds {g.name}'s maximum sequence length {g.max_seq_len}")
    if P > C:
        raise ConfigError(f"--prompt_len {P} is longer than --context_len {C}; the context holds the prompt")
    b = g.dtype_bytes
    units = list(g.units)
    wb = [(u.params + u.tied_params) * b for u in units]
    kvb = [u.kv_elems_per_token() * b for u in units]
    actb = [2 * (u.d_in + u.d_out) * b for u in units]
    cap_pe = data_bytes_per_pe(spec)
    cap_w = min(w.usable_pes for w in ctx.wafers) * cap_pe
    mem1 = [w + k * C + a for w, k, a in zip(wb, kvb, actb)]
    kv_tok = sum(kvb)

    wpp = None
    for n in range(max(1, math.ceil(sum(mem1) / cap_w)), min(len(units), max(ctx.systems, 1) + 64) + 1):
        if split_contiguous(mem1, n, cap_w):
            wpp = n
            break
    if wpp is None or wpp > ctx.systems:
        need = wpp or math.ceil(sum(mem1) / cap_w)
        raise ConfigError(
            f"{g.name} inference needs {gb(sum(wb))} of {g.dtype} weights + {gb(kv_tok * C)} of KV cache (one user, "
            f"context {C}) on-wafer, but {ctx.systems} x {spec.name} hold {gb(ctx.systems * cap_w)} for data "
            f"({min(w.usable_pes for w in ctx.wafers):,} PEs x {cap_pe:,} B after a {PROGRAM_RESERVE_BYTES_PER_PE // 1024} "
            f"KiB/PE program reserve); it needs at least {need} systems (--systems {need})"
            + ("" if sum(wb) <= need * cap_w else "") +
            "; streaming weights from MemoryX for decode would be I/O-bound (WSE.md), so inference keeps them on-wafer")
    sys_reps = ctx.systems // wpp
    if wpp > 1:
        ctx.say(f"multi-wafer pipeline: {gb(sum(wb))} of weights + KV cache exceed one {spec.name} "
                f"({gb(cap_w)} for data), so the layers are split over {wpp} wafers, balanced by bytes; only "
                f"activations ({units[0].d_out * b:,} B per token) cross between systems")
    else:
        ctx.say(f"fits one wafer: {gb(sum(wb))} of {g.dtype} weights + {gb(kv_tok * C)} KV per user at context {C} "
                f"<= {gb(cap_w)} of SRAM for data ({cap_pe // 1024} KiB of each PE's {spec.sram_bytes_per_pe // 1024} KiB)")
    if ctx.systems > wpp:
        ctx.say(f"{sys_reps} independent pipeline copies over {ctx.systems} systems (data-parallel serving)"
                + (f"; {ctx.systems - sys_reps * wpp} system(s) left idle" if ctx.systems % wpp else ""))

    def stage_time(u: Unit, r: int, c: int, mesh=None) -> pj.Time:
        return pj.unit_time(spec, u, r, c, n_tokens=1, attn_ctx=C, dtype=g.dtype, mesh=mesh)

    full = Rect(0, 0, ctx.wafers[0].rows, ctx.wafers[0].cols)
    runs = split_contiguous(mem1, wpp, cap_w)
    assert runs is not None
    kmax = 1
    if wpp == 1:
        kmax = max(1, min(MAX_REPLICAS_PER_WAFER, int(cap_w // sum(mem1))))
    candidates = sorted({k for k in (1, 2, 3, 4, 6, 8, 9, 12, 16, 20, 24, 25, 32, 36, 48, 49, 64) if k <= kmax})
    prefixes = [w.dead_prefix() if len(w.dead) else None for w in ctx.wafers]
    best = None
    for k in candidates:
        boxes = grid_boxes(full, k)
        if len(boxes) != k:
            continue
        R_total = sys_reps * k
        S = len(units)
        box_cap = min(live_count(p, boxes[0]) for p in prefixes[:1]) * cap_pe
        if users:
            tries = [math.ceil(users / R_total)]
        else:
            free = box_cap * wpp - sum(wb) - sum(actb)
            top = min(S, int(free // (kv_tok * C))) if kv_tok else S
            tries = sorted({max(1, top * f // 8) for f in range(8, 0, -1)}, reverse=True) if top >= 1 else []
        pipes = None
        for users_r in tries:  # the most users (up to one per stage) whose KV cache still places
            mem = [w + k_ * C * users_r + a for w, k_, a in zip(wb, kvb, actb)]
            runs_k = split_contiguous(mem, wpp, cap_w) if k == 1 else [(0, len(units))]
            if runs_k is None:
                continue
            pipes = _place_pipelines(ctx, units, mem, runs_k, boxes, sys_reps, wpp, prefixes, stage_time)
            if pipes is not None:
                break
        if pipes is None:
            continue
        p0 = pipes[0]
        lat, breakdown = _decode_latency(ctx, units, p0, b)
        stage_max = max(max(t.s for t in p0.stage_times), _crossing_time(ctx, units, p0, b))
        agg = min((users or users_r * R_total) / lat, R_total / stage_max)  # users spread over the copies
        if best is None or agg > best[0] * 1.000001:
            best = (agg, k, pipes, users_r, lat, breakdown, stage_max, mem)
    if best is None:
        max_users = int((wpp * cap_w - sum(wb) - sum(actb)) // max(1, kv_tok * C))
        raise ConfigError(f"{g.name}: {users} users x context {C} need {gb((users or 1) * kv_tok * C)} of KV cache "
                          f"beyond the weights; at most {max(0, max_users) * sys_reps} users fit at this context "
                          f"(lower --users or --context_len)")
    agg, k, pipes, users_r, lat, breakdown, stage_max, mem = best
    if ctx.defective:  # charge the detours inside the placed regions (real routes of each region)
        lat0 = lat
        pipes[0] = _with_detours(ctx, units, pipes[0], stage_time)
        lat, breakdown = _decode_latency(ctx, units, pipes[0], b)
        stage_max = max(max(t.s for t in pipes[0].stage_times), _crossing_time(ctx, units, pipes[0], b))
        agg = min((users or users_r * sys_reps * k) / lat, sys_reps * k / stage_max)
        ctx.say(f"detours: each placed region's kernels re-projected on its own routes around dead cores and links "
                f"(exact routes for regions up to 4,096 PEs, per-link hop estimates above): decode latency "
                f"{lat0 * 1e6:.2f} -> {lat * 1e6:.2f} us per token (+{(lat / lat0 - 1):.2%})")
    if k > 1:
        ctx.say(f"data-parallel replicas: the model needs {sum(mem1) / cap_w:.1%} of the wafer, so {k} copies "
                f"(each in a 1/{k} sub-rectangle) give the highest aggregate decode rate of the candidates "
                f"{candidates} by the cost model ({agg:,.0f} tokens/s vs one copy)")
    elif kmax > 1:
        ctx.say(f"one copy: more replicas (up to {kmax} fit in memory) project no higher aggregate throughput")
    R_total = sys_reps * k
    total_users = users or users_r * R_total
    p0 = pipes[0]
    S = len(units)
    ctx.say(f"pipelined: {S} stages (embedding, {g.n_blocks} blocks, head) as rectangles in a snake of bands, "
            f"each sized by its bytes then by its FLOPs (balanced: slowest stage {stage_max * 1e6:.2f} us, "
            f"fastest {min(t.s for t in p0.stage_times) * 1e6:.2f} us); consecutive stages share an edge, one hop apart")
    if units[0].tied_to:
        ctx.say(f"tied embedding: the embedding region keeps its own copy of the {units[0].tied_params:,}-parameter "
                f"matrix so the lookup is local ({gb(units[0].tied_params * b)})")
    if not users:
        ctx.say(f"users in flight: {users_r} per pipeline copy = min(stages {S}, KV cache capacity at context {C})")
    routing = [check_routing(spec, u) for u in units]
    worst = max(routing)
    ctx.say(f"routing: at most {worst[0]} colors per region (fabric has {spec.colors}, {spec.routes_per_pe} routes/PE)"
            + ("" if worst[1] == 1 else f"; regions needing more run in {worst[1]} phases"))

    # prefill: prompt tokens stream through the stages in chunks (the pipeline fills with prompt tokens)
    ttft, chunk, pre_tps = _prefill(ctx, units, p0, b, P)
    proj = {
        "decode_latency_s_per_token": lat,
        "decode_tokens_per_s_per_user": 1 / lat,
        "users_in_flight": total_users,
        "aggregate_decode_tokens_per_s": min(total_users / lat, R_total / stage_max),
        "pipeline_limit_tokens_per_s": R_total / stage_max,
        "prefill_tokens_per_s": pre_tps * R_total,
        "prefill_chunk_tokens": chunk,
        "time_to_first_token_s": ttft,
        "prompt_len": P, "context_len": C,
        "stages": S, "slowest_stage_s": stage_max,
        "kv_cache_bytes_per_token": kv_tok,
        "kv_cache_bytes": kv_tok * C * total_users,
        "weight_bytes": sum(wb),
        "bottleneck": breakdown.bottleneck(),
        "decode_time_shares": breakdown.shares(),
        "aggregate_bottleneck": _aggregate_bottleneck(p0, stage_max, lat, users_r, ctx, units, b),
        "stage_times_s": [t.s for t in p0.stage_times],
    }
    regions = [r for pipe in pipes for r in pipe.regions]
    strategy = "multi_wafer_pipelined" if wpp > 1 else ("replicated" if R_total > 1 else "pipelined")
    return {"strategy": strategy, "replicas": R_total, "wafers_per_pipeline": wpp, "fits_in_sram": True,
            "workload": {"prompt_len": P, "context_len": C, "users": total_users, "users_per_replica": users_r},
            "regions": regions, "projection": proj}


def _place_pipelines(ctx: _Ctx, units, mem, runs, boxes, sys_reps, wpp, prefixes, stage_time) -> list[Layout] | None:
    """Every pipeline copy: `sys_reps` groups of `wpp` wafers, and `len(boxes)` copies inside each wafer."""
    pipes: list[Layout] = []
    cache: dict = {}
    for s_rep in range(sys_reps):
        for bi, box in enumerate(boxes):
            regions, times = [], []
            for j, (lo, hi) in enumerate(runs):
                system = s_rep * wpp + j
                pre = prefixes[system]
                key = (lo, hi, box.rows, box.cols)
                if pre is None and key in cache:  # no defects: the same layout, moved
                    base = cache[key]
                    lay = Layout([Region(r.unit, r.name, system, 0, r.stage, r.row - base[1].row + box.row,
                                         r.col - base[1].col + box.col, r.rows, r.cols, r.live_pes, r.bytes)
                                  for r in base[0].regions], base[0].stage_times)
                else:
                    lay = place_replica(ctx.spec, units[lo:hi], list(range(lo, hi)), mem[lo:hi], box, pre, stage_time,
                                        system=system, replica=0, stage0=lo)
                    if lay is None:
                        return None
                    if pre is None:
                        cache[key] = (lay, box)
                regions += lay.regions
                times += lay.stage_times
            rep = s_rep * len(boxes) + bi
            pipes.append(Layout([Region(r.unit, r.name, r.system, rep, r.stage, r.row, r.col, r.rows, r.cols,
                                        r.live_pes, r.bytes) for r in regions], times))
    return pipes


def _rect(r: Region) -> Rect:
    return Rect(r.row, r.col, r.rows, r.cols)


def _hand(ctx: _Ctx, a: Region, bnext: Region, elems: int, b: int) -> pj.Time:
    if a.system != bnext.system:
        return pj.io_time(ctx.spec, elems * b)
    edge = _rect(a).shared_edge(_rect(bnext))
    hops = 1 if edge else abs(a.row - bnext.row) + abs(a.col - bnext.col)
    return pj.handoff_time(ctx.spec, elems, b, edge or 1, hops)


def _decode_latency(ctx: _Ctx, units, pipe: Layout, b: int) -> tuple[float, pj.Time]:
    t = pj.Time()
    regs = pipe.regions
    for i, (r, st) in enumerate(zip(regs, pipe.stage_times)):
        t += st
        if i + 1 < len(regs):
            t += _hand(ctx, r, regs[i + 1], units[r.unit].d_out, b)
    first, last = regs[0], regs[-1]  # the sampled token id returns to the embedding region
    if first.system != last.system:
        t += pj.io_time(ctx.spec, 4)
    else:
        hops = abs(first.row - last.row) + abs(first.col - last.col)
        t += pj.handoff_time(ctx.spec, 1, 4, 1, hops)
    return t.s, t


def _crossing_time(ctx: _Ctx, units, pipe: Layout, b: int) -> float:
    regs = pipe.regions
    return max([pj.io_time(ctx.spec, units[a.unit].d_out * b).s - ctx.spec.io_latency_s
                for a, c in zip(regs, regs[1:]) if a.system != c.system] or [0.0])


def _aggregate_bottleneck(pipe: Layout, stage_max: float, lat: float, users_r: int, ctx, units, b) -> str:
    if users_r / lat < 1 / stage_max:
        return "too few users to fill the pipeline (latency-bound)"
    slow = max(pipe.stage_times, key=lambda t: t.s)
    if _crossing_time(ctx, units, pipe, b) >= slow.s:
        return "I/O"
    return slow.bottleneck()


def _prefill(ctx: _Ctx, units, pipe: Layout, b: int, P: int) -> tuple[float, int, float]:
    spec, g = ctx.spec, ctx.g
    chunks = sorted({min(P, 2 ** i) for i in range(0, 20)})
    best = None
    for c in chunks:
        times = [pj.unit_time(spec, units[r.unit], r.rows, r.cols, n_tokens=c, attn_ctx=max(1, P // 2),
                              dtype=g.dtype, decode=False,
                              mesh=ctx.region_mesh(r.system, r.row, r.col, r.rows, r.cols)) for r in pipe.regions]
        hands = [_hand(ctx, a, n, units[a.unit].d_out * c, b) for a, n in zip(pipe.regions, pipe.regions[1:])]
        slow = max([t.s for t in times] + [h.s for h in hands if h.parts.get("I/O")])
        ttft = sum(t.s for t in times) + sum(h.s for h in hands) + (math.ceil(P / c) - 1) * slow + \
            pj.io_time(spec, 4 * P).s
        if best is None or ttft < best[0]:
            best = (ttft, c, c / slow)
    return best


# ---- training ----------------------------------------------------------------------------------------------

def _training(ctx: _Ctx, batch_size: int | None, seq_len: int | None) -> dict:
    g, spec = ctx.g, ctx.spec
    seq = seq_len or int(g.defaults.get("seq_len") or g.max_seq_len)
    if seq > g.max_seq_len:
        raise ConfigError(f"--seq_len {seq} exceeds {g.name}'s maximum sequence length {g.max_seq_len}")
    b = g.dtype_bytes
    mixed = g.dtype != "fp32"
    units = list(g.units)
    usable = min(w.usable_pes for w in ctx.wafers)
    F = usable * spec.fp16_flops_per_cycle_per_pe * spec.clock_hz if mixed else \
        usable * spec.fp32_flops_per_cycle_per_pe * spec.clock_hz
    BW = spec.io_bytes_per_s
    t_min = math.ceil((b / 3) * F / BW)  # WSE.md: T >= (b/3) F / BW
    if batch_size is None and g.defaults.get("batch_size"):
        batch_size = int(g.defaults["batch_size"])
    if batch_size is None:
        batch_size = ctx.systems * max(1, math.ceil(t_min / seq))
        ctx.say(f"batch size: none given, so {batch_size} sequences of {seq} ({batch_size // ctx.systems} per "
                f"system) = the weight-streaming no-stall minimum T >= (b/3)F/BW = {t_min:,} tokens per system")
    if batch_size % ctx.systems:
        raise ConfigError(f"--batch_size {batch_size} is not divisible by --systems {ctx.systems}; the global batch "
                          f"is split evenly across systems")
    per_sys = batch_size // ctx.systems
    micro = int(g.defaults.get("micro_batch_size") or per_sys)
    if per_sys % micro:
        micro = per_sys
    state = ADAM_STATE_BYTES_PER_PARAM["mixed" if mixed else "fp32"]
    spp = sum(state)
    cap_pe = data_bytes_per_pe(spec)
    cap_w = usable * cap_pe
    S = len(units)
    resident = [(u.params + u.tied_params) * spp + u.train_act_elems_per_token * b * seq * min(S - i, per_sys)
                for i, u in enumerate(units)]
    params_b = sum((u.params + u.tied_params) * spp for u in units)
    workload = {"batch_size": batch_size, "seq_len": seq, "micro_batch_size": micro,
                "tokens_per_step": batch_size * seq, "systems": ctx.systems}
    common = {"no_stall_min_tokens_per_step": t_min, "peak_flops_per_wafer": F, "io_bytes_per_s": BW,
              "streamed_bytes_per_weight": b}
    if sum(resident) <= cap_w:
        ctx.say(f"resident training: weights + gradients + Adam state ({spp} B/param: {gb(params_b)}) + activations "
                f"of the sequences in flight ({gb(sum(resident) - params_b)}) = {gb(sum(resident))} <= "
                f"{gb(cap_w)} of SRAM: layer-pipelined on the wafer, no streaming")
        return _train_pipelined(ctx, units, resident, per_sys, seq, workload, common, b, cap_w)
    ctx.say(f"weight streaming: resident training would need {gb(sum(resident))} (weights + gradients + Adam state "
            f"at {spp} B/param = {gb(params_b)}, + activations of a 1F1B layer pipeline {gb(sum(resident) - params_b)}) "
            f"> {gb(cap_w)} of SRAM, so weights live in MemoryX (fp32 master + Adam moments there, the update runs "
            f"there), stream in one layer at a time across the whole wafer, gradients stream out")
    return _train_streaming(ctx, units, per_sys, micro, seq, workload, common, b, cap_w, t_min, F)


def _train_pipelined(ctx, units, mem, per_sys, seq, workload, common, b, cap_w) -> dict:
    g, spec = ctx.g, ctx.spec
    full = Rect(0, 0, ctx.wafers[0].rows, ctx.wafers[0].cols)
    prefixes = [w.dead_prefix() if len(w.dead) else None for w in ctx.wafers]

    def stage_time(u: Unit, r: int, c: int, mesh=None) -> pj.Time:  # forward + backward (2x) of one sequence
        return pj.unit_time(spec, u, r, c, n_tokens=seq, attn_ctx=seq, dtype=g.dtype, decode=False,
                            mesh=mesh).scaled(3)

    kmax = max(1, min(MAX_REPLICAS_PER_WAFER, per_sys, int(cap_w // sum(mem))))
    best = None
    for k in sorted({k for k in (1, 2, 4, 8, 16, 32, 64) if k <= kmax}):
        boxes = grid_boxes(full, k)
        if len(boxes) != k:
            continue
        pipes = _place_pipelines(ctx, units, mem, [(0, len(units))], boxes, ctx.systems, 1, prefixes, stage_time)
        if pipes is None:
            continue
        p0 = pipes[0]
        seqs_r = math.ceil(per_sys / k)
        slow = max(t.s for t in p0.stage_times)
        fill = sum(t.s for t in p0.stage_times)
        opt = max(pj.Time().add_cycles(pj.cost.elementwise_cycles(spec, max(1, r.bytes // 16), r.rows, r.cols, 12),
                                       spec.clock_hz).s for r in p0.regions)
        step = (seqs_r - 1) * slow + fill + opt
        tps = workload["tokens_per_step"] / step
        if best is None or tps > best[0] * 1.000001:
            best = (tps, k, pipes, step, slow, p0, opt)
    if best is None:
        raise ConfigError(f"{g.name}: could not place {len(units)} resident training regions on the "
                          f"{full.rows}x{full.cols} mesh; use a larger --pes or fewer sequences per step")
    tps, k, pipes, step, slow, p0, opt = best
    if ctx.defective:  # charge the detours inside the placed regions (real routes of each region)
        p0 = pipes[0] = _with_detours(ctx, units, p0, stage_time)
        slow = max(t.s for t in p0.stage_times)
        step0, step = step, (math.ceil(per_sys / k) - 1) * slow + sum(t.s for t in p0.stage_times) + opt
        ctx.say(f"detours: the placed regions re-projected on their own routes around dead cores and links: "
                f"step {step0 * 1e3:.3f} -> {step * 1e3:.3f} ms (+{step / step0 - 1:.2%})")
    if k > 1:
        ctx.say(f"data-parallel replicas on the wafer: {k} copies of the layer pipeline (small model) give the "
                f"highest projected tokens/s")
    grads = sum(u.params + u.tied_params for u in units) * b
    sync = _swarmx_allreduce(ctx, grads, ctx.systems)
    step += sync.s
    tps = workload["tokens_per_step"] / step
    if ctx.systems > 1:
        ctx.say(f"data parallel across {ctx.systems} systems, {per_sys} sequences each: after each step the "
                f"gradients ({gb(grads)}) go out through SwarmX, are summed in its 1:4 tree and come back "
                f"({sync.s * 1e3:.2f} ms, not overlapped with compute; weights stay resident)")
    slow_t = max(p0.stage_times, key=lambda t: t.s)
    flops = ctx.g.model_flops_per_token(seq, training=True)
    proj = {"step_time_s": step, "tokens_per_s": tps, "mfu": flops * tps / (common["peak_flops_per_wafer"] * ctx.systems),
            "weights_streamed": False, "bottleneck": slow_t.bottleneck(), "time_shares": slow_t.shares(),
            "slowest_stage_s_per_sequence": slow, "model_flops_per_token": flops, **common,
            "scaling": _weak_scaling(ctx, per_sys, seq, lambda n: step - sync.s + _swarmx_allreduce(ctx, grads, n).s,
                                     lambda n: _swarmx_allreduce(ctx, grads, n).s)}
    return {"strategy": "replicated" if k > 1 else "pipelined", "replicas": k * ctx.systems, "wafers_per_pipeline": 1,
            "fits_in_sram": True, "workload": workload, "projection": proj,
            "regions": [r for p in pipes for r in p.regions]}


def _swarmx(ctx: _Ctx, n: int):
    from waferscale.fabric.spec import SystemSpec
    return SystemSpec(ctx.spec, n)


def _swarmx_allreduce(ctx: _Ctx, nbytes: float, n: int) -> pj.Time:
    """Resident training's gradient all-reduce over n systems through SwarmX: every system streams its
    gradients out, the tree sums them at line rate, the sum is broadcast back; each way costs the bytes at the
    per-system bandwidth plus one I/O latency per hop (tree levels + 1). Nothing to do for one system."""
    if n <= 1:
        return pj.Time()
    sx = _swarmx(ctx, n)
    return pj.Time().add("I/O", 2 * (nbytes / sx.swarmx_bytes_per_s + sx.swarmx_hops * ctx.spec.io_latency_s))


def _weak_scaling(ctx: _Ctx, per_sys: int, seq: int, step_at, exposed_at) -> list[dict]:
    """Data-parallel scaling over 1..N systems at a fixed per-system batch (weak scaling, as Cerebras'
    --num_csx does: the global batch grows with N, every system runs the same step). `step_at(n)` is the step
    time on n systems; `exposed_at(n)` the part of it SwarmX adds that compute does not hide. Efficiency =
    tokens/s(n) / (n x tokens/s(1)) <= 1, and the table says what it loses to."""
    rows = []
    for n in _scaling_points(ctx.systems):
        st = step_at(n)
        rows.append({"systems": n, "global_batch": n * per_sys, "per_system_batch": per_sys, "step_time_s": st,
                     "tokens_per_s": n * per_sys * seq / st, "swarmx_levels": _swarmx(ctx, n).swarmx_levels,
                     "swarmx_exposed_s": exposed_at(n)})
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        r["efficiency"] = r["speedup"] / r["systems"]
    return rows


def _scaling_points(systems: int) -> list[int]:
    top = max(systems, 16)
    pts = sorted({2 ** i for i in range(0, int(math.log2(top)) + 1)} | {systems})
    return pts


def _stream_micro(ctx: _Ctx, units, t_mb: int, seq: int, b: int, recompute: bool, n_systems: int,
                  free_bytes: float) -> tuple[pj.Time, pj.Time, pj.Time, list[int]]:
    """One micro-batch of t_mb tokens, layer by layer over the whole wafer: (total, compute-only, io-only,
    groups per layer). A streamed layer may be multicast into g copies (a g-way grid of the wafer), each
    taking t_mb/g tokens, when g copies of its weights + gradients fit in `free_bytes`; the copies' gradients
    are reduced before streaming out. g is chosen per layer by the cost model."""
    spec, g = ctx.spec, ctx.g
    R, Cc = ctx.wafers[0].rows, ctx.wafers[0].cols
    BW = spec.io_bytes_per_s
    sx = _swarmx(ctx, n_systems)  # MemoryX -> SwarmX 1:4 broadcast-reduce tree -> each system
    BW = sx.swarmx_bytes_per_s
    total, comp, io = pj.Time(), pj.Time(), pj.Time()
    groups = []
    for u in units:
        best = None
        for gg in (1, 4, 16, 64, 256):
            if gg > 1 and (3 * u.params * b * gg > free_bytes or not u.matmuls or t_mb < gg):
                continue
            box = grid_boxes(Rect(0, 0, R, Cc), gg)[0] if gg > 1 else Rect(0, 0, R, Cc)
            f = pj.unit_time(spec, u, box.rows, box.cols, n_tokens=math.ceil(t_mb / gg), attn_ctx=seq,
                             dtype=g.dtype, decode=False)
            red = pj.Time()
            if gg > 1:  # reduce the copies' gradient tiles across the g-way grid (tile per PE, grid hops)
                gr = R // box.rows
                tile = max(1, math.ceil(u.params / (box.rows * box.cols)))
                red.add_cycles(pj.cost.reduce_cycles(spec, tile, gr, gg // gr), spec.clock_hz)
                red.add("fabric latency", (R + Cc) * spec.hop_latency_cycles / spec.clock_hz)
            t = f.s * (3 + recompute) + red.s
            if best is None or t < best[0]:
                best = (t, gg, f, red)
        _, gg, f, red = best
        if ctx.defective:  # the chosen split's kernels on the wafer's own routes (detours charged)
            box = grid_boxes(Rect(0, 0, R, Cc), gg)[0] if gg > 1 else Rect(0, 0, R, Cc)
            f = pj.unit_time(spec, u, box.rows, box.cols, n_tokens=math.ceil(t_mb / gg), attn_ctx=seq,
                             dtype=g.dtype, decode=False, mesh=ctx.region_mesh(0, box.row, box.col, box.rows, box.cols))
        groups.append(gg)
        w = u.params * b / BW + sx.swarmx_hops * spec.io_latency_s  # a layer's request pays the tree latency
        for mult in (1, 2 + (1 if recompute else 0)):  # forward, then backward (+ recomputed forward)
            c = f.scaled(mult)
            if mult > 1:
                c += red
            comp += c
            io.add("I/O", w)
            total += c if c.s >= w else pj.Time().add("I/O", w)
    if units[0].kind == "embed":  # the micro-batch's embedded tokens enter through the wafer edge
        total += pj.io_time(spec, units[0].d_out * b * t_mb)
    return total, comp, io, groups


def _step_boundary(ctx: _Ctx, units, b: int, n_systems: int) -> pj.Time:
    """What a step cannot overlap: the last backward layer's gradients reach MemoryX through the SwarmX reduce
    tree, the optimizer updates it there (time not modelled: MemoryX's CPU is not in WSE.md), and the next
    step's first layer comes back through the broadcast tree. Within a step the next layer is always
    prefetched; across micro-batches the weights do not change, so only the step boundary waits."""
    sx = _swarmx(ctx, n_systems)
    first = next((u for u in units if u.params), units[0])
    last = first  # backward ends at the first layer
    return pj.Time().add("I/O", (first.params + last.params) * b / sx.swarmx_bytes_per_s
                         + 2 * sx.swarmx_hops * ctx.spec.io_latency_s)


def _train_streaming(ctx, units, per_sys, micro, seq, workload, common, b, cap_w, t_min, F) -> dict:
    g, spec = ctx.g, ctx.spec
    biggest = max(u.params for u in units)
    layer_buf = 3 * biggest * b  # two weight buffers (compute one, receive the next) + its gradients
    if layer_buf > cap_w:
        raise ConfigError(f"{g.name}: even streamed, its largest layer ({biggest:,} parameters) needs "
                          f"{gb(layer_buf)} on-wafer (double-buffered weights + gradients) > {gb(cap_w)} of SRAM")
    d = max(u.d_out for u in units if u.kind != "head")
    act_tok_all = sum(u.train_act_elems_per_token for u in units) * b
    act_tok_ckpt = g.n_blocks * d * b + max(u.train_act_elems_per_token for u in units) * b
    t_mb = micro * seq
    recompute = False
    if act_tok_all * t_mb + layer_buf > cap_w:
        recompute = True
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
    total, comp, io, groups = _stream_micro(ctx, units, t_mb, seq, b, recompute, ctx.systems, cap_w - act * t_mb)
    if ctx.defective:
        ctx.say("detours: the streamed layers' kernels are projected on the wafer's own routes around its dead "
                "cores and links (per-link hop estimates of fabric.mesh for regions over 4,096 PEs)")
    if max(groups) > 1:
        ctx.say(f"layer copies: a streamed layer is too small to keep every PE busy as one GEMM, so the cost model "
                f"picks per layer a g-way split of the wafer (g copies multicast from one stream, each on t/g "
                f"tokens, gradients reduced before streaming out): g = {sorted(set(groups))}")
    boundary = _step_boundary(ctx, units, b, ctx.systems)
    total_1 = total.s  # one step on this many systems, and the same step's parts on n systems (weak scaling)
    step = n_micro * total.s + boundary.s
    tps = workload["tokens_per_step"] / step
    flops = g.model_flops_per_token(seq, training=True)
    bott = total.bottleneck()
    ctx.say(f"no-stall condition (WSE.md): tokens per micro-batch T >= (b/3)F/BW = ({b}/3) x {F / 1e15:.2f} PF / "
            f"{spec.io_bytes_per_s / 1e9:.0f} GB/s = {t_min:,}; this plan streams per {t_mb:,} tokens: "
            + ("compute-bound" if t_mb >= t_min else "I/O-bound (the wafer waits for weights)"))
    free = cap_w - act * t_mb

    def step_at(n: int) -> float:
        tot = total_1 if n == ctx.systems else _stream_micro(ctx, units, t_mb, seq, b, recompute, n, free)[0].s
        return n_micro * tot + _step_boundary(ctx, units, b, n).s

    base = n_micro * _stream_micro(ctx, units, t_mb, seq, b, recompute, 1, free)[0].s + \
        _step_boundary(ctx, units, b, 1).s
    scaling = _weak_scaling(ctx, per_sys, seq, step_at, lambda n: step_at(n) - base)
    for r in scaling:
        r["tokens_per_micro_batch"], r["stalls"] = t_mb, t_mb < t_min
    levels = _swarmx(ctx, ctx.systems).swarmx_levels
    ctx.say(f"data parallel (weak scaling): each system keeps {per_sys} sequences per step ({n_micro} micro-batches "
            f"of {micro}), so the global batch is {per_sys} x N; every system runs the same layer-by-layer "
            f"execution. Weights are broadcast and gradients reduced through SwarmX, a tree of 1:4 nodes at line "
            f"rate (the system's 150 GB/s for any N) whose depth ceil(log4 N) adds {spec.io_latency_s * 1e6:.0f} us "
            f"per level to each layer's request and to the step boundary (last gradients out, first weights in): "
            f"what compute does not hide is the only loss"
            + (f"; here {ctx.systems} systems, {levels} level(s)" if ctx.systems > 1 else ""))
    proj = {"step_time_s": step, "tokens_per_s": tps, "mfu": flops * tps / (F * ctx.systems),
            "weights_streamed": True, "recompute": recompute, "bottleneck": bott, "time_shares": total.shares(),
            "compute_time_per_micro_batch_s": comp.s, "io_time_per_micro_batch_s": io.s,
            "micro_batches_per_step": n_micro, "layer_copies": groups, "tokens_per_micro_batch": t_mb, "model_flops_per_token": flops,
            "no_stall_met": t_mb >= t_min, **common, "scaling": scaling}
    R, Cc = ctx.wafers[0].rows, ctx.wafers[0].cols
    regions = [Region(-1, f"all {len(units)} layers, streamed one at a time", s, s, 0, 0, 0, R, Cc,
                      ctx.wafers[s].usable_pes, int(layer_buf + act * t_mb))
               for s in range(ctx.systems)]
    return {"strategy": "weight_streaming", "replicas": ctx.systems, "wafers_per_pipeline": 1, "fits_in_sram": False,
            "workload": workload, "projection": proj, "regions": regions,
            "assumptions": {"optimizer_update": "in MemoryX, overlapped with the next step's streaming",
                            "gradients_out": "on the egress direction of the same links, concurrent with weights in",
                            "swarmx": "tree of 1:4 broadcast-reduce nodes, 100 Gb/s ports at line rate (12 parallel "
                                      "trees = the system's I/O bandwidth for any N), one I/O latency per level",
                            "swarmx_latency_per_level_s": spec.io_latency_s,
                            "scaling": "weak: per-system batch fixed, global batch = N x per-system batch"}}
