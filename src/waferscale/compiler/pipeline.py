"""Layer pipelines placed on wafers, shared by inference and resident training.

A pipeline copy is its units' regions in stage order (a `Layout`), spread over `wpp` consecutive wafers when
one wafer cannot hold it (multi-wafer pipeline). Here: placing every copy, re-projecting one on its regions'
own defect maps, and the times between stages (on the fabric, or through the systems' I/O). Times in seconds.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from waferscale.compiler import moe
from waferscale.compiler import project as pj
from waferscale.compiler.context import CompileContext
from waferscale.compiler.ir import Unit
from waferscale.compiler.placement import Rect, split_contiguous
from waferscale.compiler.plan import Region
from waferscale.compiler.strategy import Layout, place_replica

MAX_REPLICAS_PER_WAFER = 64

StageTime = Callable[..., pj.Time]  # (unit, rows, cols, mesh=None) -> one stage's time on a rows x cols region


def place_pipelines(ctx: CompileContext, units: Sequence[Unit], mem: list[int], runs: list[tuple[int, int]],
                    boxes: list[Rect], sys_reps: int, wpp: int, stage_time: StageTime) -> list[Layout] | None:
    """Every pipeline copy: `sys_reps` groups of `wpp` wafers (wafer j of a group holds the units
    runs[j] = [lo, hi)), and `len(boxes)` copies inside each wafer. `mem` is bytes per unit. None when a copy
    does not place. The logical mesh is perfect, so a run placed once is the same layout in every box, moved."""
    pipes: list[Layout] = []
    placed: dict = {}
    for s_rep in range(sys_reps):
        for bi, box in enumerate(boxes):
            rep = s_rep * len(boxes) + bi
            regions, times = [], []
            for j, (lo, hi) in enumerate(runs):
                key = (lo, hi, box.rows, box.cols)
                if key not in placed:
                    placed[key] = place_replica(ctx.spec, units[lo:hi], mem[lo:hi], box, stage_time, lo), box
                lay, at = placed[key]
                if lay is None:
                    return None
                regions += [dataclasses.replace(r, system=s_rep * wpp + j, replica=rep, row=r.row - at.row + box.row,
                                                col=r.col - at.col + box.col) for r in lay.regions]
                times += lay.stage_times
            pipes.append(Layout(regions, times))
    return pipes


def with_detours(ctx: CompileContext, units: Sequence[Unit], pipe: Layout, time_fn: StageTime) -> Layout:
    """A placed pipeline's stage times re-projected with each region's own defect map, so the hops of the
    detours around its dead cores and links are charged (placement itself searched shapes on a perfect mesh:
    the logical mesh is defect-free after spare remapping, only its routes are longer)."""
    return Layout(pipe.regions, [time_fn(units[r.unit], r.rows, r.cols,
                                         ctx.region_mesh(r.system, r.row, r.col, r.rows, r.cols))
                                 for r in pipe.regions])


def handoff(ctx: CompileContext, a: Region, bnext: Region, elems: int, b: int) -> pj.Time:
    """`elems` values of `b` bytes from region `a` to the next stage's region: across the shared edge (or the
    hops between them) on one wafer, through the systems' I/O between wafers."""
    if a.system != bnext.system:
        return pj.io_time(ctx.spec, elems * b)
    edge = Rect(a.row, a.col, a.rows, a.cols).shared_edge(Rect(bnext.row, bnext.col, bnext.rows, bnext.cols))
    hops = 1 if edge else abs(a.row - bnext.row) + abs(a.col - bnext.col)
    return pj.handoff_time(ctx.spec, elems, b, edge or 1, hops)


def split_groups(units: Sequence[Unit], mem: Sequence[int], parts: int, cap: int) -> list[tuple[int, int]] | None:
    """`placement.split_contiguous` of the units into `parts` runs of at most `cap` bytes, an MoE block and its
    experts kept in one run (its router's traffic stays on one wafer)."""
    items: list[tuple[int, int]] = []  # [lo, hi) ranges of units that stay together
    for i, u in enumerate(units):
        if u.expert_of and items:
            items[-1] = (items[-1][0], i + 1)
        else:
            items.append((i, i + 1))
    if len(items) == len(units):
        return split_contiguous(mem, parts, cap)
    runs = split_contiguous([sum(mem[lo:hi]) for lo, hi in items], parts, cap)
    return None if runs is None else [(items[a][0], items[z - 1][1]) for a, z in runs]


def depth(units: Sequence[Unit]) -> int:
    """Stages a token passes one after another: every unit, an MoE layer's experts counting as one."""
    return sum(not u.expert_of for u in units) + len({u.expert_of for u in units if u.expert_of})


def occupancy(units: Sequence[Unit], pipe: Layout, tokens: int) -> list[float]:
    """Seconds each stage is busy per token when `tokens` tokens are in flight: its stage time, an expert's
    scaled by the expected load of the most loaded expert of its layer per token in flight (its layer's
    tokens wait for it; `moe.expected_max_load`)."""
    out = []
    for r, t in zip(pipe.regions, pipe.stage_times):
        u = units[r.unit]
        out.append(t.s * moe.expected_max_load(tokens, u.n_experts, u.experts_per_token) / tokens
                   if u.expert_of else t.s)
    return out


def chain(ctx: CompileContext, units: Sequence[Unit], regs: Sequence[Region], times: Sequence[pj.Time], b: int,
          tokens: int = 1, routed: int = 1) -> pj.Time:
    """`tokens` tokens through every stage and hand-off in order; at an MoE block, through its experts in
    parallel (`routed` tokens reach an expert) to the next stage (`moe.layer_latency`)."""
    t = pj.Time()
    i = 0
    while i < len(regs):
        r = regs[i]
        t += times[i]
        j = i + 1
        while j < len(regs) and units[regs[j].unit].expert_of:
            j += 1
        nxt = regs[j] if j < len(regs) else None
        u = units[r.unit]
        if j > i + 1:
            t += moe.layer_latency(ctx.spec, r, regs[i + 1:j], nxt, times[i + 1:j], u.d_out * routed, b,
                                   u.experts_per_token)
        elif nxt is not None:
            t += handoff(ctx, r, nxt, u.d_out * tokens, b)
        i = j
    return t


def decode_latency(ctx: CompileContext, units: Sequence[Unit], pipe: Layout, b: int) -> tuple[float, pj.Time]:
    """One decoded token through every stage and hand-off (an MoE layer's through its routed experts), and the
    sampled id back to the embedding region: (seconds, the time by part)."""
    t = pj.Time()
    regs = pipe.regions
    if any(units[r.unit].expert_of for r in regs):
        t += chain(ctx, units, regs, pipe.stage_times, b)
    else:
        for i, (r, st) in enumerate(zip(regs, pipe.stage_times)):
            t += st
            if i + 1 < len(regs):
                t += handoff(ctx, r, regs[i + 1], units[r.unit].d_out, b)
    first, last = regs[0], regs[-1]  # the sampled token id returns to the embedding region
    if first.system != last.system:
        t += pj.io_time(ctx.spec, 4)
    else:
        hops = abs(first.row - last.row) + abs(first.col - last.col)
        t += pj.handoff_time(ctx.spec, 1, 4, 1, hops)
    return t.s, t


def crossing_time(ctx: CompileContext, units: Sequence[Unit], pipe: Layout, b: int) -> float:
    """Seconds the slowest wafer-to-wafer activation transfer of one token occupies the I/O (latency
    excluded: transfers pipeline); 0 on one wafer."""
    regs = pipe.regions
    return max([pj.io_time(ctx.spec, units[a.unit].d_out * b).s - ctx.spec.io_latency_s
                for a, c in zip(regs, regs[1:]) if a.system != c.system] or [0.0])
