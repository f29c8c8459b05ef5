"""Placement: rectangles on the logical wafer, laid out as a snake of bands so stage i+1 is one hop from stage i.

A replica's units are split into B horizontal bands (contiguous runs of units); within a band, regions sit
side by side (left to right in even bands, right to left in odd bands), so consecutive regions share an edge,
and at each band turn the last region of band b sits directly above the first region of band b+1. Widths are
scaled up to fill each band, so no PE is left idle inside a band. Cost: O(units x bands) per candidate;
regions are rectangles, dead cores are counted per rectangle from a 2D prefix sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


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


def live_count(prefix: np.ndarray | None, r: Rect) -> int:
    """PEs in `r` that are not dead (prefix: WaferMap.dead_prefix())."""
    if prefix is None:
        return r.area
    a, b, c, d = r.row, r.col, r.row + r.rows, r.col + r.cols
    dead = int(prefix[c, d] - prefix[a, d] - prefix[c, b] + prefix[a, b])
    return r.area - dead


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


def snake(need: Sequence[int], box: Rect, *, prefix: np.ndarray | None = None,
          stage_cost: Callable[[int, int, int, int], float] | None = None,
          max_bands: int | None = None) -> list[Rect] | None:
    """Place len(need) regions in `box`, region i with at least need[i] live PEs, as a snake of bands.

    Tries every band count B (1..min(units, rows)); keeps the layout whose slowest stage is fastest
    (`stage_cost(i, rows, cols, live_pes)` -> seconds; default: need/live). None when nothing fits.
    """
    n = len(need)
    if n == 0:
        return []
    cost = stage_cost or (lambda i, r, c, live: need[i] / max(live, 1))
    best: tuple[tuple[float, float], list[Rect]] | None = None
    for B in range(1, min(n, box.rows, max_bands or n) + 1):
        rects = _bands(need, box, B, prefix)
        if rects is None:
            continue
        lives = [live_count(prefix, r) for r in rects]
        if any(lv < nd for lv, nd in zip(lives, need)):
            continue
        times = [cost(i, r.rows, r.cols, lv) for i, (r, lv) in enumerate(zip(rects, lives))]
        key = (max(times), sum(times))
        if not math.isfinite(key[0]):
            continue
        if best is None or key < best[0]:
            best = (key, rects)
    return best[1] if best else None


def _bands(need: Sequence[int], box: Rect, B: int, prefix: np.ndarray | None) -> list[Rect] | None:
    heights = [box.rows // B] * B
    heights[-1] += box.rows - sum(heights)  # the last band takes the remainder rows
    h = heights[0]
    widths = [max(1, math.ceil(x / h)) for x in need]
    if max(widths) > box.cols:
        return None
    groups = _partition(widths, B, box.cols)
    if groups is None:
        return None
    rects: list[Rect] = []
    row = box.row
    for b, (lo, hi) in enumerate(groups):
        ws = _fill(widths[lo:hi], box.cols)
        order = range(lo, hi)
        col = box.col
        band = []
        for i, w in zip(order, ws):
            band.append(Rect(row, col, heights[b], w))
            col += w
        if b % 2 == 1:  # right to left: mirror inside the box
            band = [Rect(r.row, box.col + box.cols - (r.col - box.col) - r.cols, r.rows, r.cols) for r in band]
        rects += band
        row += heights[b]
    if len(rects) != len(need):
        return None
    return rects


def _partition(widths: Sequence[int], B: int, cap_max: int) -> list[tuple[int, int]] | None:
    """Contiguous split of widths into exactly B non-empty bands (or fewer if there are fewer units), each
    summing to <= cap_max, minimizing the widest band (binary search on the cap, greedy fill)."""
    n = len(widths)
    if B > n:
        return None

    def greedy(cap: int) -> list[tuple[int, int]] | None:
        groups, lo, s = [], 0, 0
        for i, w in enumerate(widths):
            if w > cap:
                return None
            if s + w > cap:
                groups.append((lo, i))
                lo, s = i, 0
            s += w
        groups.append((lo, n))
        return groups if len(groups) <= B else None

    lo_cap, hi_cap = max(widths), cap_max
    if greedy(hi_cap) is None:
        return None
    while lo_cap < hi_cap:
        mid = (lo_cap + hi_cap) // 2
        if greedy(mid) is None:
            lo_cap = mid + 1
        else:
            hi_cap = mid
    groups = greedy(lo_cap)
    # use exactly B bands: split the widest multi-unit band until there are B (keeps every band non-empty)
    while groups is not None and len(groups) < B:
        splittable = [g for g in groups if g[1] - g[0] > 1]
        if not splittable:
            return None
        g = max(splittable, key=lambda g: sum(widths[g[0]:g[1]]))
        k = groups.index(g)
        tot, acc, cut = sum(widths[g[0]:g[1]]), 0, g[0] + 1
        for i in range(g[0], g[1] - 1):
            acc += widths[i]
            cut = i + 1
            if acc * 2 >= tot:
                break
        groups[k:k + 1] = [(g[0], cut), (cut, g[1])]
    return groups


def _fill(ws: Sequence[int], total: int) -> list[int]:
    """Scale widths up to sum exactly to `total`, never below the requested width."""
    s = sum(ws)
    out = [w * total // s for w in ws]
    out = [max(o, w) for o, w in zip(out, ws)]
    left = total - sum(out)
    i = 0
    order = sorted(range(len(ws)), key=lambda j: -ws[j])
    while left > 0:
        out[order[i % len(ws)]] += 1
        left -= 1
        i += 1
    return out
