"""Strategy helpers shared by the plans: region sizing (`waterfill`), one pipeline copy placed in a box
(`place_replica`), routing colors, and the memory a PE has for data.

A per-PE program reserve (code, routing configuration, queues: `FabricSpec.program_reserve_bytes_per_pe`, an
assumption) is not available to data; what each plan keeps on the wafer is in its module's docstring
(`inference.py`, `training.py`, `weight_streaming.py`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from waferscale.compiler import project as pj
from waferscale.compiler.ir import Unit
from waferscale.compiler.placement import Rect, snake
from waferscale.compiler.plan import Region
from waferscale.fabric.spec import FabricSpec

ADAM_STATE_BYTES_PER_PARAM = {"mixed": (2, 2, 4, 4, 4), "fp32": (4, 4, 0, 4, 4)}  # weight, grad, master, m, v


def data_bytes_per_pe(spec: FabricSpec) -> int:
    """SRAM a PE has for data: its SRAM less the program reserve (an assumption, stated in every plan)."""
    return spec.sram_bytes_per_pe - spec.program_reserve_bytes_per_pe


def gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB" if x >= 1e8 else f"{x / 1e6:.2f} MB"


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


def place_replica(spec: FabricSpec, units: list[Unit], mem: list[int], box: Rect, stage_time,
                  stage0: int) -> Layout | None:
    """Units stage0, stage0+1, ... (`mem` bytes each) as a snake of regions in `box` (system 0, replica 0),
    sized by memory first, then by FLOPs (dense, and non-zero when sparse); the layout whose slowest stage
    (`stage_time`) is fastest, or None."""
    cap = data_bytes_per_pe(spec)
    need = [max(1, math.ceil(m / cap)) for m in mem]
    if sum(need) > box.area:
        return None
    works = [[u.fwd_flops_per_token(1) + 1.0 for u in units]]
    if any(u.sparse for u in units):  # sparse: also sized by the non-zero work (fixed costs make it optimistic)
        works.append([u.fwd_flops_per_token(1, nonzero=True) + 1.0 for u in units])
    best: Layout | None = None
    best_key = None

    def cost(i: int, r: int, c: int) -> float:
        return stage_time(units[i], r, c).s

    # a fuller budget gives bigger regions but lumpier bands: try a few fill levels, keep the fastest layout
    for work, f in itertools.product(works, (0.98, 0.95, 0.9, 0.8, 0.65, 0.5)):
        rects = snake(waterfill(need, work, int(box.area * f)), box, stage_cost=cost)
        if rects is None:
            continue
        regions = [Region(stage0 + i, u.name, 0, 0, stage0 + i, r.row, r.col, r.rows, r.cols, r.area, int(mem[i]))
                   for i, (u, r) in enumerate(zip(units, rects))]
        times = [stage_time(u, r.rows, r.cols) for u, r in zip(units, rects)]
        key = (max(t.s for t in times), sum(t.s for t in times))
        if math.isfinite(key[0]) and (best_key is None or key < best_key):
            best, best_key = Layout(regions, times), key
    return best


def check_routing(spec: FabricSpec, u: Unit) -> tuple[int, int]:
    """Colors a region needs: per matrix an input broadcast and a partial-sum reduce, attention's score
    reduce / softmax broadcast / output reduce, one for norm statistics, and the pipeline's in and out.
    Returns (colors needed, phases): more colors than the fabric has means running the unit in phases,
    re-loading routes between them."""
    colors = 2 * len(u.matmuls) + (3 if u.n_heads else 0) + (1 if u.n_norms else 0) + 2
    usable = min(spec.colors, spec.routes_per_pe)
    return colors, max(1, math.ceil((colors - 2) / max(1, usable - 2)))
