"""Model-parallel within the layer: each layer runs across one large mesh, the layers one after another.

The layout wafer-scale inference papers use for single-user latency, and the WSE-1 compiler deck's "model-parallel
within a layer" (WSE.md). A layer's matrices are cut into R x C tiles over a *window* of R x C PEs (`--pes RxC`:
the mesh a layer runs on); the layers run in sequence, a token's activations moving from one layer's window to
the next. Where the weights live: every unit has a window; windows may overlap (layers that run one after
another never compute at the same time), so a PE holds the tiles of every unit whose window covers it. The
windows are laid on the wafer at evenly spaced positions and each unit goes to the position that keeps the most
loaded PE lightest (`_place`); a window as large as the wafer puts a tile of every layer on every PE. Models
larger than a wafer split into contiguous runs of units, one run per system, activations crossing by the I/O.

Per decoded token, per unit on its window (`_unit_time`):
* every matrix is a GEMV whose partial sums are all-reduced along the window's rows, the next matrix stored
  transposed so its input is where that all-reduce left it (consecutive matrices alternate rows and columns,
  no transposes), `cost_matmul.gemv_allreduce_cycles`, with the fastest of a pipelined chain, K-way trees and
  centre-rooted phase trees per matrix (the hops grow with the window's width: why decode can get slower on a
  larger mesh);
* attention over the KV cache spread over the whole window (positions along one axis, the cache's width along
  the other, every PE an equal share: a cache that shifts its oldest entries along as it grows keeps it so):
  q.K^T and P.V as two such GEMVs of the cache, softmax's max and sum as two all-reduces of the scores;
* norms (an all-reduce of one statistic per token, then local work) and element-wise work on the window.
B users decode together: each matrix multiplies B vectors through its stationary tiles, which costs what one
vector of B times the rows does (the same multiply-adds per PE, B times the partial sums to all-reduce).
Prefill runs the whole prompt through each unit as GEMMs (`project.unit_time`: per matrix the fastest of the
weight-stationary streamed GEMM and the 2D-blocked SUMMA on the window). Omitted: the SRAM the
2D schedules' blocks take beside the windows' weights (each schedule checks only its own blocks). Times in seconds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from waferscale.compiler import project as pj
from waferscale.compiler.context import CompileContext
from waferscale.compiler.ir import Unit
from waferscale.compiler.pipeline import split_groups
from waferscale.compiler.plan import Region
from waferscale.compiler.strategy import data_bytes_per_pe, gb
from waferscale.errors import ConfigError
from waferscale.fabric import cost as K
from waferscale.fabric import cost_collectives as CC
from waferscale.fabric import cost_matmul as CM
from waferscale.fabric.spec import FabricSpec

# the row all-reduces the compiler chooses from: corner-rooted chain and K-ary trees, and centre-rooted phases
# (WaferLLM's MeshGEMV K-tree: fan_in is its number of phases)
GEMV_ALGOS = (("chain", 2), ("ktree", 2), ("ktree", 4), ("phases", 2), ("phases", 3))
MAX_USERS = 1024  # users decoding together tried (powers of two) when --users is not given
MAX_POSITIONS_PER_AXIS = 8  # window positions tried per wafer axis beyond the fewest that cover it


@dataclass(frozen=True)
class Placement:
    """Every unit's window (system, row, col, rows, cols); the blocks' windows are rows x cols."""

    rows: int
    cols: int
    at: list[tuple[int, int, int, int, int]]
    peak_bytes_per_pe: float  # the most loaded PE's bytes (weights + KV caches + activations)


# ---- one unit on its window ------------------------------------------------------------------------------

@lru_cache(maxsize=65536)
def _gemv(spec: FabricSpec, m: int, k: int, rows: int, cols: int, dtype: str) -> tuple[K.Cycles, str]:
    """The fastest GEMV + row all-reduce of W (m, k) on rows x cols, and its algorithm's name."""
    best = None
    for algo, fan_in in GEMV_ALGOS:
        c = CM.gemv_allreduce_cycles(spec, m, k, rows, cols, dtype, algo=algo, fan_in=fan_in)
        if best is None or c.total < best[0].total:
            best = (c, {"chain": "chain", "ktree": f"{fan_in}-way tree", "phases": f"{fan_in}-phase centre tree"}[algo])
    return best


@lru_cache(maxsize=64)
def _transposed(spec: FabricSpec) -> FabricSpec:
    """The same wafer seen with rows and columns swapped: a kernel reducing down a window's columns is the
    row-reducing kernel on the transposed window."""
    return dataclasses.replace(spec, rows=spec.cols, cols=spec.rows)


@lru_cache(maxsize=65536)
def _row_allreduce(spec: FabricSpec, n: int, cols: int) -> K.Cycles:
    """An all-reduce of n fp32 values along a row of `cols` PEs (a softmax or norm statistic): the faster tree."""
    return min((CC.allreduce_cycles(spec, n, 1, cols, algo) for algo in ("chain", "tree")), key=lambda x: x.total)


def _parts(c: K.Cycles) -> list[tuple[str, float]]:
    """A kernel's cycles split for the breakdown: its busiest PE's work (compute or SRAM), and the rest of its
    critical path (hops, ramps, the reduction's depth, pipeline fill: "fabric latency", or "routing" when colors
    forced extra passes)."""
    busy, label = (c.compute, "compute") if c.compute >= c.sram else (c.sram, "SRAM")
    busy = min(busy, c.total)
    return [(label, busy), ("routing" if c.passes > 1 else "fabric latency", c.total - busy)]


@lru_cache(maxsize=65536)
def unit_cycles(spec: FabricSpec, ukey: tuple, rows: int, cols: int, users: int, ctx: int,
                dtype: str) -> tuple[tuple[str, float], ...]:
    """(label, cycles) of every kernel of one decode step of `users` tokens through one unit (`project._key`)
    on its rows x cols window, split by `_parts`; the matrices alternate orientation (module docstring)."""
    kind, matmuls, n_heads, head_dim, kv_heads, norm_width, n_norms, ew, d_out = ukey[:9]
    out: list[K.Cycles] = []
    along = [(spec, rows, cols), (_transposed(spec), cols, rows)]  # a transposed matrix reduces down the columns
    for i, mm in enumerate(matmuls):
        sp, r, c = along[i % 2]
        out.append(_gemv(sp, mm.m * users, mm.k, r, c, dtype)[0])
    if n_heads and ctx > 0:  # the cache: positions along the rows axis, its width (kv_heads x head_dim) along columns
        group = n_heads // max(1, kv_heads)
        out.append(_gemv(spec, ctx * group * users, kv_heads * head_dim, rows, cols, dtype)[0])  # scores = K q
        out += [_row_allreduce(_transposed(spec), n_heads * users, rows)] * 2  # softmax: max, sum over positions
        out.append(_gemv(_transposed(spec), n_heads * head_dim * users, ctx, cols, rows, dtype)[0])  # V^T p
    for _ in range(n_norms if norm_width else 0):  # sum of squares all-reduced, then scaled locally
        out.append(_row_allreduce(spec, users, cols))
        out.append(K.elementwise_cycles(spec, -(-norm_width * users // rows), 1, cols, 3, dtype))
    if ew:
        out.append(K.elementwise_cycles(spec, -(-ew * users // rows), 1, cols, 1, dtype))
    if kind == "head":  # sampling: the arg-max all-reduced over the vocabulary's PEs
        out.append(_row_allreduce(spec, users, cols))
    return tuple(part for c in out for part in _parts(c) if part[1] > 0)


def unit_time(ctx: CompileContext, u: Unit, rows: int, cols: int, users: int, context: int) -> pj.Time:
    t = pj.Time()
    spec = ctx.wafer_spec
    for label, cyc in unit_cycles(spec, pj._key(u), rows, cols, users, context, ctx.g.dtype):
        t.add(label, cyc / spec.clock_hz)
    return t


# ---- where the weights live -------------------------------------------------------------------------------

def _positions(extent: int, size: int, n: int) -> list[int]:
    """n window starts spread evenly over [0, extent - size]."""
    if n == 1:
        return [0]
    return sorted({round(i * (extent - size) / (n - 1)) for i in range(n)})


def _place_windows(per_pe: list[float], rows: int, cols: int, wafer_rows: int, wafer_cols: int,
                   cap: float) -> tuple[list[tuple[int, int]], np.ndarray, list[int], list[int]] | None:
    """rows x cols windows for units of `per_pe` bytes per PE each. When the wafer has room for one window per
    unit they sit side by side in a snake. Otherwise, for the fewest evenly spaced positions per axis upwards,
    each unit in order goes to the position whose window keeps its most loaded PE lightest (ties: the position
    nearest the previous unit's), then each position takes a run of consecutive units (`_contiguous`) if that
    still fits. Returns the top-left corners, the load (bytes per PE) of the cells the windows' edges cut the
    wafer into, and those cuts; None if nothing fits."""
    fit_r, fit_c = wafer_rows // rows, wafer_cols // cols
    if fit_r * fit_c >= len(per_pe):  # windows side by side, one unit each (a snake, so neighbours stay close)
        spots = [(i * rows, (j if i % 2 == 0 else fit_c - 1 - j) * cols) for i in range(fit_r) for j in range(fit_c)]
        if max(per_pe) > cap:
            return None
        load = np.array([[max(per_pe)]])
        return spots[:len(per_pe)], load, [0, wafer_rows], [0, wafer_cols]
    base_r, base_c = math.ceil(wafer_rows / rows), math.ceil(wafer_cols / cols)
    for extra in range(MAX_POSITIONS_PER_AXIS):
        rs = _positions(wafer_rows, rows, min(wafer_rows - rows + 1, base_r + extra))
        cs = _positions(wafer_cols, cols, min(wafer_cols - cols + 1, base_c + extra))
        cuts_r = sorted({0, wafer_rows, *rs, *(r + rows for r in rs)})
        cuts_c = sorted({0, wafer_cols, *cs, *(c + cols for c in cs)})
        load = np.zeros((len(cuts_r) - 1, len(cuts_c) - 1))
        cover = {(r, c): (slice(cuts_r.index(r), cuts_r.index(r + rows)),
                          slice(cuts_c.index(c), cuts_c.index(c + cols))) for r in rs for c in cs}
        at, prev = [], (0, 0)
        for b in per_pe:
            pick = min(cover, key=lambda p: (round(float(load[cover[p]].max()) + b, 6),
                                             abs(p[0] - prev[0]) + abs(p[1] - prev[1])))
            load[cover[pick]] += b
            at.append(pick)
            prev = pick
        if float(load.max()) <= cap:
            runs, run_load = _contiguous(at, per_pe, cover, load.shape, rs, cs)
            if float(run_load.max()) <= cap:  # the same counts per position, consecutive units together
                at, load = runs, run_load
            return at, load, cuts_r, cuts_c
        if len(rs) == wafer_rows - rows + 1 and len(cs) == wafer_cols - cols + 1:
            break
    return None


def _contiguous(at: list, per_pe: list[float], cover: dict, shape: tuple, rs: list[int],
                cs: list[int]) -> tuple[list, np.ndarray]:
    """The balanced placement `at` rearranged so each position takes a run of consecutive units (as many as it
    had), positions in snake order: a token then hops between windows once per run, not once per unit."""
    counts = {p: at.count(p) for p in set(at)}
    snake_order = [(r, c) for i, r in enumerate(rs) for c in (cs if i % 2 == 0 else cs[::-1]) if (r, c) in counts]
    out = [p for p in snake_order for _ in range(counts[p])]
    load = np.zeros(shape)
    for p, b in zip(out, per_pe):
        load[cover[p]] += b
    return out, load


def _free_band(load: np.ndarray, cuts_r: list[int], cuts_c: list[int]) -> tuple[int, int, int, int] | None:
    """The largest full-width band of rows or full-height band of columns no window covers (row, col, rows,
    cols), or None."""
    best = None
    for axis, cuts, other in ((0, cuts_r, cuts_c), (1, cuts_c, cuts_r)):
        empty = ~(load > 0).any(axis=1 - axis)
        i = 0
        while i < len(empty):
            j = i
            while j < len(empty) and empty[j]:
                j += 1
            if j > i:
                lo, hi = cuts[i], cuts[j]
                band = (lo, 0, hi - lo, other[-1]) if axis == 0 else (0, lo, other[-1], hi - lo)
                if best is None or band[2] * band[3] > best[2] * best[3]:
                    best = band
            i = j + 1
    return best


def _place(units: list[Unit], mem: list[int], rows: int, cols: int, wafer_rows: int, wafer_cols: int,
           cap: float) -> tuple[list[tuple[int, int, int, int]], float] | None:
    """Windows (row, col, rows, cols) for one wafer's units and the most loaded PE's bytes, or None. The blocks
    run on rows x cols windows (`_place_windows`); the embedding and head (little compute, large tables) take
    the largest band the blocks' windows leave free, sharing it (they never run at the same time), when it holds
    them, else rows x cols windows like the blocks."""
    area = rows * cols
    blocks = [i for i, u in enumerate(units) if u.kind == "block"] or list(range(len(units)))
    others = [i for i in range(len(units)) if i not in blocks]
    got = _place_windows([mem[i] / area for i in blocks], rows, cols, wafer_rows, wafer_cols, cap)
    if got is None:
        return None
    at_b, load, cuts_r, cuts_c = got
    at: dict[int, tuple[int, int, int, int]] = {i: (r, c, rows, cols) for i, (r, c) in zip(blocks, at_b)}
    peak = float(load.max())
    band = _free_band(load, cuts_r, cuts_c) if others else None
    if others and band is not None and sum(mem[i] for i in others) / (band[2] * band[3]) <= cap:
        at.update({i: band for i in others})
        peak = max(peak, sum(mem[i] for i in others) / (band[2] * band[3]))
    elif others:
        got = _place_windows([mem[i] / area for i in blocks + others], rows, cols, wafer_rows, wafer_cols, cap)
        if got is None:
            return None
        at = {i: (r, c, rows, cols) for i, (r, c) in zip(blocks + others, got[0])}
        peak = float(got[1].max())
    return [at[i] for i in range(len(units))], peak


def plan_windows(ctx: CompileContext, units: list[Unit], rows: int, cols: int, users: int,
                 context: int) -> Placement | None:
    """Every unit's window on the fewest systems whose wafers hold the weights + `users` KV caches of `context`
    tokens (contiguous runs of units, one per system), or None when `ctx.systems` wafers cannot."""
    b = ctx.g.dtype_bytes
    mem = [u.stored_weight_bytes(b) + u.kv_elems_per_token() * b * context * users + 2 * (u.d_in + u.d_out) * b * users
           for u in units]
    wr, wc = ctx.full_box.rows, ctx.full_box.cols
    if rows > wr or cols > wc:
        raise ConfigError(f"--pes {rows}x{cols} exceeds {ctx.spec.name}'s {wr}x{wc} PEs")
    cap = data_bytes_per_pe(ctx.spec)
    for n_sys in range(max(1, math.ceil(sum(mem) / (wr * wc * cap))), ctx.systems + 1):
        runs = split_groups(units, mem, n_sys, int(wr * wc * cap))
        if runs is None:
            continue
        at, peak = [], 0.0
        for s, (lo, hi) in enumerate(runs):
            got = _place(units[lo:hi], mem[lo:hi], rows, cols, wr, wc, cap)
            if got is None:
                break
            at += [(s, *w) for w in got[0]]
            peak = max(peak, got[1])
        else:
            return Placement(rows, cols, at, peak)
    return None


# ---- the plan ----------------------------------------------------------------------------------------------

def decode_step(ctx: CompileContext, units: list[Unit], pl: Placement, users: int, context: int) -> pj.Time:
    """One decode step of `users` tokens: every unit on its window in order, the activations' hops from window to
    window (or the I/O between systems), and the sampled ids back to the embedding's window."""
    spec, b = ctx.spec, ctx.g.dtype_bytes
    t = pj.Time()
    for i, u in enumerate(units):
        t += unit_time(ctx, u, *pl.at[i][3:], users, context)
        if i + 1 < len(units):
            t += _hop(ctx, pl.at[i], pl.at[i + 1], u.d_out * users, b)
    t += _hop(ctx, pl.at[-1], pl.at[0], users, 4)
    return t


def _hop(ctx: CompileContext, a: tuple, z: tuple, elems: int, b: int) -> pj.Time:
    """Activations from one window (system, row, col, rows, cols) to the next: the copies along the window's
    side move in parallel, as far as the windows' corners are apart (or through the I/O between systems)."""
    if a[0] != z[0]:
        return pj.io_time(ctx.spec, elems * b)
    hops = abs(a[1] - z[1]) + abs(a[2] - z[2])
    return pj.handoff_time(ctx.spec, elems, b, min(a[3], z[3]), max(1, hops))


def max_context(ctx: CompileContext, units: list[Unit], rows: int, cols: int, users: int) -> int:
    """The longest context whose `users` KV caches still place on rows x cols windows (binary search on
    `plan_windows`): the KV cache grows evenly over each window's PEs, so capacity is SRAM, not a single PE."""
    lo, hi, top = 0, 1, ctx.g.max_seq_len  # no context beyond the model's own
    while hi <= top and plan_windows(ctx, units, rows, cols, users, hi) is not None:
        lo, hi = hi, min(hi * 2, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan_windows(ctx, units, rows, cols, users, mid) is not None else (lo, mid)
    return lo


def unit_prefill(ctx: CompileContext, u: Unit, rows: int, cols: int, P: int) -> pj.Time:
    """A P-token prompt through one unit on its rows x cols window (its matrices as GEMMs)."""
    return pj.unit_time(ctx.wafer_spec, u, rows, cols, n_tokens=P, attn_ctx=max(1, P // 2), dtype=ctx.g.dtype,
                        decode=False, gemm2d=True)


def prefill(ctx: CompileContext, units: list[Unit], pl: Placement, P: int) -> pj.Time:
    """The P-token prompt through every unit on its window as GEMMs, then the first token out."""
    spec, b = ctx.spec, ctx.g.dtype_bytes
    t = pj.Time()
    for i, u in enumerate(units):
        t += unit_prefill(ctx, u, *pl.at[i][3:], P)
        if i + 1 < len(units):
            t += _hop(ctx, pl.at[i], pl.at[i + 1], u.d_out * P, b)
    t += pj.io_time(spec, 4 * P)
    return t


def plan_model_parallel(ctx: CompileContext, units: list[Unit], shape: tuple[int, int], P: int, C: int,
                        users: int | None, with_prefill: bool = True) -> dict:
    """The model-parallel plan on windows of `shape` PEs: the users (given, or the count with the highest
    aggregate decode rate whose KV caches fit: powers of two while the rate still grows by 5%), the windows,
    decode, prefill. ConfigError when nothing fits."""
    rows, cols = shape
    best = None
    for B in [users] if users else [2 ** i for i in range(MAX_USERS.bit_length())]:
        pl = plan_windows(ctx, units, rows, cols, B, C)
        if pl is None:
            break  # more users only need more SRAM
        step = decode_step(ctx, units, pl, B, C)
        if best is not None and B / step.s < best[0] * 1.05:
            break  # the rate has stopped growing with the users
        best = (B / step.s, B, pl, step)
    if best is None:
        b = ctx.g.dtype_bytes
        need = sum(u.stored_weight_bytes(b) for u in units) + sum(u.kv_elems_per_token() for u in units) * b * C
        raise ConfigError(
            f"{ctx.g.name}: the model-parallel layout on {rows}x{cols} windows cannot hold {gb(need)} of weights + one "
            f"user's KV cache (context {C}) on {ctx.systems} x {ctx.spec.name}: overlapping windows leave at most "
            f"{data_bytes_per_pe(ctx.spec):,} B per PE; use more --systems, a larger --pes or a shorter --context_len")
    agg, B, pl, step = best
    pre = prefill(ctx, units, pl, P) if with_prefill else None
    return {"users": B, "placement": pl, "step": step, "aggregate": agg, "latency": step.s, "prefill": pre}


def regions(units: list[Unit], pl: Placement, b: int) -> list[Region]:
    """One region per unit: its window (they may overlap: see the module docstring) and the bytes it keeps."""
    return [Region(i, u.name, s, 0, i, r, c, R, C, R * C, int(u.stored_weight_bytes(b)))
            for i, (u, (s, r, c, R, C)) in enumerate(zip(units, pl.at))]


def pes_covered(pl: Placement, wafer_rows: int, wafer_cols: int) -> int:
    """PEs some window covers, over all systems (windows overlap, so not the sum of their areas)."""
    total = 0
    for s in sorted({w[0] for w in pl.at}):
        mask = np.zeros((wafer_rows, wafer_cols), bool)
        for _, r, c, R, C in (w for w in pl.at if w[0] == s):
            mask[r:r + R, c:c + C] = True
        total += int(mask.sum())
    return total


def gemv_algorithms(ctx: CompileContext, units: list[Unit], rows: int, cols: int, users: int) -> dict[str, int]:
    """How many matrices of a decode step use each all-reduce (for the plan's explanation)."""
    count: dict[str, int] = {}
    spec = ctx.wafer_spec
    for u in units:
        for i, mm in enumerate(u.matmuls):  # on the blocks' window shape (the embedding and head counted alike)
            sp, r, c = ((spec, rows, cols), (_transposed(spec), cols, rows))[i % 2]
            algo = _gemv(sp, mm.m * users, mm.k, r, c, ctx.g.dtype)[1]
            count[algo] = count.get(algo, 0) + 1
    return count
