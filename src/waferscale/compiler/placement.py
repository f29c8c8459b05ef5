"""Placement: rectangles on the logical wafer, laid out as a snake of bands so stage i+1 is one hop from stage i.

A replica's units are split into B horizontal bands (contiguous runs of units); within a band, regions sit
side by side (left to right in even bands, right to left in odd bands), so consecutive regions share an edge,
and at each band turn the last region of band b sits directly above the first region of band b+1. Widths are
scaled up to fill each band, so no PE is left idle inside a band. Cost: O(units x bands) per candidate.
The logical mesh has no dead PE (spare remapping, `fabric.mesh`), so a region's PEs are its area.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class Rect:
    row: int
    col: int
    rows: int
    cols: int

    @property
    def area(self) -> int:
        return self.rows * self.cols

    def overlaps(self, o: "Rect") -> bool:
        return not (self.row + self.rows <= o.row or o.row + o.rows <= self.row or
                    self.col + self.cols <= o.col or o.col + o.cols <= self.col)

    def touches(self, o: "Rect") -> bool:
        """Share an edge of at least one PE (the next stage is one hop away)."""
        rows_meet = self.row < o.row + o.rows and o.row < self.row + self.rows
        cols_meet = self.col < o.col + o.cols and o.col < self.col + self.cols
        return ((self.col + self.cols == o.col or o.col + o.cols == self.col) and rows_meet) or \
               ((self.row + self.rows == o.row or o.row + o.rows == self.row) and cols_meet)

    def shared_edge(self, o: "Rect") -> int:
        """Length of the shared edge in PEs (links available for the hand-off), 0 if not adjacent."""
        if self.col + self.cols == o.col or o.col + o.cols == self.col:
            return max(0, min(self.row + self.rows, o.row + o.rows) - max(self.row, o.row))
        if self.row + self.rows == o.row or o.row + o.rows == self.row:
            return max(0, min(self.col + self.cols, o.col + o.cols) - max(self.col, o.col))
        return 0


def grid_boxes(box: Rect, k: int) -> list[Rect]:
    """Split `box` into k equal sub-rectangles (gr x gc = k, the most square cells), row-major snake order."""
    best = None
    for gr in range(1, k + 1):
        if k % gr:
            continue
        gc = k // gr
        h, w = box.rows // gr, box.cols // gc
        if h == 0 or w == 0:
            continue
        score = abs(math.log(h / w))
        if best is None or score < best[0]:
            best = (score, gr, gc, h, w)
    if best is None:
        return []
    _, gr, gc, h, w = best
    out = []
    for i in range(gr):
        cols = range(gc) if i % 2 == 0 else reversed(range(gc))
        out += [Rect(box.row + i * h, box.col + j * w, h, w) for j in cols]
    return out


def snake(need: Sequence[int], box: Rect, *,
          stage_cost: Callable[[int, int, int], float] | None = None) -> list[Rect] | None:
    """Place len(need) regions in `box`, region i with at least need[i] PEs, as a snake of bands.

    Tries every band count B (1..min(units, rows)); keeps the layout whose slowest stage is fastest
    (`stage_cost(i, rows, cols)` -> seconds; default: need/area). None when nothing fits.
    """
    n = len(need)
    if n == 0:
        return []
    cost = stage_cost or (lambda i, r, c: need[i] / (r * c))
    best: tuple[tuple[float, float], list[Rect]] | None = None
    for B in range(1, min(n, box.rows) + 1):
        rects = _bands(need, box, B)
        if rects is None:
            continue
        times = [cost(i, r.rows, r.cols) for i, r in enumerate(rects)]
        key = (max(times), sum(times))
        if not math.isfinite(key[0]):
            continue
        if best is None or key < best[0]:
            best = (key, rects)
    return best[1] if best else None


def _bands(need: Sequence[int], box: Rect, B: int) -> list[Rect] | None:
    heights = [box.rows // B] * B
    heights[-1] += box.rows - sum(heights)  # the last band takes the remainder rows
    widths = [max(1, math.ceil(x / heights[0])) for x in need]
    groups = split_contiguous(widths, B, box.cols)
    if groups is None:
        return None
    rects: list[Rect] = []
    row = box.row
    for b, (lo, hi) in enumerate(groups):
        ws = _fill(widths[lo:hi], box.cols)
        for off, w in zip(itertools.accumulate([0, *ws]), ws):  # odd bands run right to left
            rects.append(Rect(row, box.col + (off if b % 2 == 0 else box.cols - off - w), heights[b], w))
        row += heights[b]
    return rects


def split_contiguous(sizes: Sequence[int], parts: int, cap: int) -> list[tuple[int, int]] | None:
    """Split `sizes` into exactly `parts` non-empty contiguous runs [lo, hi), each summing to <= cap, the
    largest run as small as possible (binary search on the cap, greedy fill; then the biggest multi-item run
    is halved until there are `parts`). None when impossible."""
    n = len(sizes)
    if parts > n:
        return None

    def greedy(limit: int) -> list[tuple[int, int]] | None:
        runs, lo, s = [], 0, 0
        for i, w in enumerate(sizes):
            if w > limit:
                return None
            if s + w > limit:
                runs.append((lo, i))
                lo, s = i, 0
            s += w
        runs.append((lo, n))
        return runs if len(runs) <= parts else None

    lo_cap, hi_cap = max(sizes), cap
    if greedy(hi_cap) is None:
        return None
    while lo_cap < hi_cap:
        mid = (lo_cap + hi_cap) // 2
        if greedy(mid) is None:
            lo_cap = mid + 1
        else:
            hi_cap = mid
    runs = greedy(lo_cap)
    while len(runs) < parts:
        multi = [r for r in runs if r[1] - r[0] > 1]
        if not multi:
            return None
        a, b = max(multi, key=lambda r: sum(sizes[r[0]:r[1]]))
        k = runs.index((a, b))
        tot, acc, cut = sum(sizes[a:b]), 0, a + 1
        for i in range(a, b - 1):
            acc += sizes[i]
            cut = i + 1
            if acc * 2 >= tot:
                break
        runs[k:k + 1] = [(a, cut), (cut, b)]
    return runs


def _fill(ws: Sequence[int], total: int) -> list[int]:
    """Scale widths up to sum exactly to `total`, never below the requested width (the widest get the rest)."""
    s = sum(ws)
    out = [max(w, w * total // s) for w in ws]
    order = sorted(range(len(ws)), key=lambda j: -ws[j])
    for i in range(total - sum(out)):
        out[order[i % len(ws)]] += 1
    return out
