"""Strategy: choose pipelined / replicated / multi-wafer / weight-streaming, size the regions, place them,
and project speed. Every choice appends a sentence to `decisions` (what `plan.explain()` prints).

Memory accounting (bytes on the wafer, per region):
- inference: weights (+ a copy of a tied embedding matrix in the embedding region, so the lookup is local)
  + KV cache for the users in flight x context + double-buffered activations;
- training, resident: fp16/bf16 weights + gradients + fp32 master weights + two Adam moments (16 B/param)
  + activations kept for backward (1F1B layer pipeline: stage i holds the sequences between its forward
  and its backward, min(stages - i, sequences per step));
- training, weight streaming: one layer's weights double-buffered + its gradients, and the micro-batch's
  activations (all layers; or layer-boundary checkpoints + one layer's, with recomputation).
A per-PE program reserve (code, routing configuration, queues) is not available to data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from waferscale.compiler import project as pj
from waferscale.compiler.ir import Unit
from waferscale.compiler.placement import Rect, live_count, snake
from waferscale.compiler.plan import Region
from waferscale.fabric.spec import FabricSpec

# Assumption (not published): each PE keeps this much of its SRAM for code, routing tables, queues and
# stack; the rest holds data. Stated in every plan's assumptions.
PROGRAM_RESERVE_BYTES_PER_PE = 6 * 1024
ADAM_STATE_BYTES_PER_PARAM = {"mixed": (2, 2, 4, 4, 4), "fp32": (4, 4, 0, 4, 4)}  # weight, grad, master, m, v
GB = 1e9


def data_bytes_per_pe(spec: FabricSpec) -> int:
    return spec.sram_bytes_per_pe - PROGRAM_RESERVE_BYTES_PER_PE


def gb(x: float) -> str:
    return f"{x / GB:.1f} GB" if x >= 0.1 * GB else f"{x / 1e6:.2f} MB"


@dataclass
class Layout:
    """One pipeline replica's regions (in stage order), and the stage costs it was chosen by."""

    regions: list[Region]
    stage_times: list[pj.Time]


# ---- sizing and placement ----------------------------------------------------------------------------------

def waterfill(need: list[int], work: list[float], budget: int) -> list[int]:
    """pes_i = max(need_i, lam * work_i) with sum = budget: memory first, the rest in proportion to work
    (so every stage takes about the same time: a balanced pipeline)."""
    if sum(need) >= budget or not any(work):
        return list(need)
    lo, hi = 0.0, budget / max(1e-30, min(w for w in work if w > 0))
    for _ in range(80):
        lam = (lo + hi) / 2
        if sum(max(n, lam * w) for n, w in zip(need, work)) > budget:
            hi = lam
        else:
            lo = lam
    return [max(n, int(lo * w)) for n, w in zip(need, work)]


def place_replica(spec: FabricSpec, units: list[Unit], unit_ids: list[int], mem: list[int], box: Rect,
                  prefix, stage_time, *, system: int, replica: int, stage0: int) -> Layout | None:
    cap = data_bytes_per_pe(spec)
    need = [max(1, math.ceil(m / cap)) for m in mem]
    live = live_count(prefix, box)
    if sum(need) > live:
        return None
    work = [u.fwd_flops_per_token(1) + 1.0 for u in units]
    dead_frac = 1 - live / box.area
    best: Layout | None = None
    best_key = None

    def cost(i: int, r: int, c: int, lv: int) -> float:
        return stage_time(units[i], r, c).s

    # a fuller budget gives bigger regions but lumpier bands: try a few fill levels, keep the fastest layout
    for f in (0.98, 0.95, 0.9, 0.8, 0.65, 0.5):
        want = waterfill(need, work, int(live * f))
        # ask for a little more than the need where dead cores may sit inside the rectangle
        want = [max(w, math.ceil(n / max(1e-9, 1 - 2 * dead_frac))) if dead_frac else w for w, n in zip(want, need)]
        rects = snake(want, box, prefix=prefix, stage_cost=cost)
        if rects is None:
            continue
        regions, times = [], []
        for i, (uid, u, r) in enumerate(zip(unit_ids, units, rects)):
            lv = live_count(prefix, r)
            if lv < need[i]:
                break
            regions.append(Region(uid, u.name, system, replica, stage0 + i, r.row, r.col, r.rows, r.cols, lv,
                                  int(mem[i])))
            times.append(stage_time(u, r.rows, r.cols))
        else:
            key = (max(t.s for t in times), sum(t.s for t in times))
            if not math.isfinite(key[0]):
                continue
            if best_key is None or key < best_key:
                best, best_key = Layout(regions, times), key
    return best


def split_contiguous(mem: list[int], parts: int, cap: int) -> list[tuple[int, int]] | None:
    """Split units into `parts` contiguous runs balanced by bytes, each <= cap bytes (None if impossible)."""
    n = len(mem)
    if parts > n:
        return None
    total = sum(mem)
    lo, hi = max(mem), total
    if lo > cap:
        return None

    def greedy(limit: int):
        runs, start, s = [], 0, 0
        for i, m in enumerate(mem):
            if s + m > limit:
                runs.append((start, i))
                start, s = i, 0
            s += m
        runs.append((start, n))
        return runs

    while lo < hi:
        mid = (lo + hi) // 2
        if len(greedy(mid)) <= parts:
            hi = mid
        else:
            lo = mid + 1
    if lo > cap:
        return None
    runs = greedy(lo)
    while len(runs) < parts:  # spread over exactly `parts` wafers: split the biggest run
        k = max((i for i in range(len(runs)) if runs[i][1] - runs[i][0] > 1), key=lambda i: sum(mem[runs[i][0]:runs[i][1]]),
                default=None)
        if k is None:
            return None
        a, b = runs[k]
        half, acc, cut = sum(mem[a:b]) / 2, 0, a + 1
        for i in range(a, b - 1):
            acc += mem[i]
            cut = i + 1
            if acc >= half:
                break
        runs[k:k + 1] = [(a, cut), (cut, b)]
    return runs


def check_routing(spec: FabricSpec, u: Unit) -> tuple[int, int]:
    """Colors a region needs: per matrix an input broadcast and a partial-sum reduce, attention's score
    reduce / softmax broadcast / output reduce, one for norm statistics, and the pipeline's in and out.
    Returns (colors needed, phases): more colors than the fabric has means running the unit in phases,
    re-loading routes between them."""
    colors = 2 * len(u.matmuls) + (3 if u.n_heads else 0) + (1 if u.n_norms else 0) + 2
    usable = min(spec.colors, spec.routes_per_pe)
    return colors, max(1, math.ceil((colors - 2) / max(1, usable - 2)))
