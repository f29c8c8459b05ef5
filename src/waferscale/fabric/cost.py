"""Analytic cycle models of the fabric kernels (the fast backend; `sim.py` is the slow reference that judges it).

Every model follows the schedule of its kernel in `kernels/` and charges:

* compute — FMAC/op cycles of the busiest PE at its SIMD width (Chip row: 4-wide fp16 FMAC on WSE-1/2, 8-wide
  on WSE-3, 1 fp32 FMAC) — and SRAM-port cycles (PE row: 16 B read + 8 B write per cycle), per task, through the
  micro-model in `pe.py`;
* fabric — wavelets (32 bits, 1 per cycle per link per direction, Fabric row) through the busiest link or ramp;
* latency — one cycle per hop, a ramp (~2 cycles) into and out of every PE on the way, one task per stage of a
  chain or tree (pipeline fill and drain), taken per PE along the schedule's critical path (the max over PEs
  of arrival + own work + trip to the root, with the real tile sizes: the last tile row/column is smaller);
* defects — with a defective `mesh`, the real detoured routes (regions up to 64x64 PEs) or per-link hop
  estimates (bigger regions), and the contention of detours that make two streams share a physical link
  (a first-come-first-served fluid queue over the windows in which each stream sends);
* routing — the colors a schedule needs against the colors a program may use (Fabric row: 24 colors, 6 reserved):
  a schedule needing more runs in several passes, each paying its fill again.

Omitted (and said so): finite router buffers/back-pressure, task-switch overhead, bank conflicts, load
imbalance other than SpMV's, routes-per-PE limits on detours, clock/power throttling.

`Cycles.total` is the critical path of the schedule. The parts are resource busy times on the busiest PE/link;
`fill_drain` is whatever of the total the busiest resource does not explain (latency, fill, drain).
`bottleneck` is "routing" when colors force extra passes, "fabric latency" when latency or link traffic
dominates, else "compute" or "SRAM"; "I/O" only when `io` dominates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric import pe as PE
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.schedules import attention_phases, norm_phases, reduce_parents, softmax_phases, tile_sizes, used
from waferscale.fabric.spec import FabricSpec

BOTTLENECKS = ("compute", "SRAM", "fabric latency", "routing", "I/O")


@dataclass(frozen=True, kw_only=True)
class Cycles:
    compute: float
    sram: float
    fabric: float
    fill_drain: float
    io: float = 0.0
    total: float
    bottleneck: str
    passes: int = 1  # > 1 when routing colors forced the schedule into several passes

    def seconds(self, spec: FabricSpec) -> float:
        return self.total / spec.clock_hz

    def as_dict(self) -> dict:
        return asdict(self)

    def __add__(self, other: "Cycles") -> "Cycles":
        """Two kernels run one after the other."""
        return make_cycles(compute=self.compute + other.compute, sram=self.sram + other.sram,
                           fabric=self.fabric + other.fabric, io=self.io + other.io,
                           total=self.total + other.total, passes=max(self.passes, other.passes))


def make_cycles(*, compute: float, sram: float, fabric: float, total: float, io: float = 0.0,
                passes: int = 1) -> Cycles:
    busiest = max(compute, sram, fabric)
    fill = max(0.0, total - busiest)
    if passes > 1:
        neck = "routing"
    elif io >= max(total - io, busiest, fill) and io > 0:
        neck = "I/O"
    else:
        neck = max((("compute", compute), ("SRAM", sram), ("fabric latency", max(fabric, fill))),
                   key=lambda kv: kv[1])[0]
    return Cycles(compute=float(compute), sram=float(sram), fabric=float(fabric), fill_drain=float(fill),
                  io=float(io), total=float(total), bottleneck=neck, passes=passes)


# ---- shared pieces --------------------------------------------------------------------------------------
def check_positive(**sizes: int) -> None:
    """Every keyword is a positive integer (a size); raises ConfigError naming the first that is not."""
    for name, v in sizes.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")


def _region(spec: FabricSpec, rows: int, cols: int, mesh: Mesh | None) -> tuple[int, int]:
    check_positive(rows=rows, cols=cols)
    if mesh is not None:
        return mesh.check_region(rows, cols)
    if rows > spec.rows or cols > spec.cols:
        raise ConfigError(f"region {rows}x{cols} exceeds {spec.name}'s {spec.rows}x{spec.cols} PEs")
    return rows, cols


def _hops(mesh: Mesh | None, rows: int, cols: int, axis: int) -> int:
    """Physical hops of the longest chain along rows (axis=1) or down columns (axis=0), detours included."""
    if mesh is None:
        return cols - 1 if axis == 1 else rows - 1
    return mesh.max_chain_hops(rows, cols, axis)


def _exact(mesh: Mesh | None, rows: int, cols: int) -> bool:
    """Charge a defective mesh's real (detoured) routes one by one? Up to 64x64 PEs (a wafer or a region of it);
    bigger meshes use the per-link hop estimates of `Mesh.chain_hops` (Manhattan + 2 per blocked segment)."""
    return mesh is not None and mesh.has_defects and mesh.usable_pes <= 4096


def _detour_extra(mesh: Mesh, R: int, C: int) -> tuple[int, int, int]:
    """Hops beyond the defect-free ones that detours add: (worst row chain, all row chains, column-0 chain),
    from the region's routes (`Mesh.chain_hops`)."""
    row = (mesh.chain_hops(R, C, axis=1) - 1).sum(axis=1) if C > 1 else np.zeros(1, np.int64)
    col = int((mesh.chain_hops(R, 1, axis=0) - 1).sum()) if R > 1 else 0
    return int(row.max(initial=0)), int(row.sum()), col


def _passes(spec: FabricSpec, colors_needed: int) -> int:
    return math.ceil(colors_needed / spec.colors)


def _chain(spec: FabricSpec, stages: int, hops: int, n_waves: int, add_c: int) -> int:
    """A pipelined chain of `stages` PEs forwarding n_waves wavelets, each combined by an add task of add_c:
    the first wavelet pays ramp out + hops + ramp in + add per stage, the rest follow one per max(1, add_c)."""
    return stages * (2 * spec.ramp_latency_cycles + add_c) + hops * spec.hop_latency_cycles \
        + (n_waves - 1) * max(1, add_c)


def _multicast(spec: FabricSpec, hops: int, n_waves: int) -> int:
    """One source multicasting n_waves wavelets to PEs up to `hops` away: ramp out, hops, ramp in, one per cycle."""
    return 2 * spec.ramp_latency_cycles + hops * spec.hop_latency_cycles + n_waves - 1


# ---- GEMV / GEMM / SpMV ---------------------------------------------------------------------------------
def _chunk_sum(n: int, per: int, fn) -> float:
    """fn summed over the chunks of n values `per` at a time, in O(1): n // per full chunks, then the rest."""
    full, rem = divmod(n, per)
    return full * fn(per) + (fn(rem) if rem else 0)


def _ws_offsets(spec: FabricSpec, R: int, C: int, mesh: Mesh | None, add_first: np.ndarray,
                keep_r: np.ndarray | None = None, keep_c: np.ndarray | None = None) -> np.ndarray:
    """(R, C) latency of PE (i, j)'s partial sum to its row's root, excluding the PE's own work: the first x
    wavelet's trip down column j (ramp out, hops of the column's multicast tree, ramp in) plus, per chain stage
    from column j to column 0, ramp out + physical hops + ramp in + the add task of the row's first partial.
    With a defective `mesh` the hops are the region's real (detoured) routes."""
    r2, hop = 2 * spec.ramp_latency_cycles, spec.hop_latency_cycles
    if mesh is None or not mesh.has_defects:  # separable: only the kept rows/columns (all by default)
        i = np.arange(R) if keep_r is None else keep_r
        j = np.arange(C) if keep_c is None else keep_c
        return r2 + i[:, None] * hop + j[None, :] * (r2 + hop + add_first[i][:, None])
    if _exact(mesh, R, C):  # the real multicast tree of each column, the real route of each chain link
        down = np.empty((R, C), np.int64)
        for j in range(C):
            tree = mesh.multicast_tree([(i, j) for i in range(R)])
            depth = mesh.tree_depths(tree, mesh.physical(0, j))
            down[:, j] = [depth[mesh.physical(i, j)] for i in range(R)]
        return r2 + down * hop + _chain_stages(spec, mesh, R, C, add_first)
    # big regions: per-link hop estimates of `Mesh.chain_hops` (Manhattan + blocked-segment detours)
    down = mesh.chain_hops_cumulative(R, C, axis=0)
    return r2 + down * hop + np.arange(C)[None, :] * (r2 + add_first[:, None]) \
        + hop * mesh.chain_hops_cumulative(R, C, axis=1)


def _chain_stages(spec: FabricSpec, mesh: Mesh, R: int, C: int, add_first: np.ndarray) -> np.ndarray:
    """(R, C): cycles from PE (i, j) West along its row chain to column 0 on the real routes, per stage ramp out +
    hops + ramp in + the add task of the row's first partial."""
    stage = np.zeros((R, C))
    if C > 1:
        hops = mesh.chain_hops(R, C, axis=1)
        stage[:, 1:] = np.cumsum(2 * spec.ramp_latency_cycles + hops * spec.hop_latency_cycles + add_first[:, None],
                                 axis=1)
    return stage


@lru_cache(maxsize=4096)
def _task_pmf(spec: FabricSpec, dtype: str, cells: int, density: float, index: bool = True) -> np.ndarray:
    """Distribution of one sparse x task's cycles (index = cycles): its non-zeros ~ Binomial(cells, density)
    (uniform random sparsity), each a multiply-add with value + index + y reads and a y write
    (`pe.task_cycles`, at least one cycle). `index=False`: dense weights (no index to read). Memoized: the
    callers never modify it."""
    if cells == 0 or density <= 0:
        return np.array([0.0, 1.0])
    mu, sd = cells * density, math.sqrt(cells * density * (1 - density))
    ks = np.arange(max(0, int(mu - 9 * sd) - 1), min(cells, int(mu + 9 * sd) + 2) + 1)
    if density >= 1:
        p = (ks == cells).astype(np.float64)
    else:
        logp = np.array([math.lgamma(cells + 1) - math.lgamma(k + 1) - math.lgamma(cells - k + 1) for k in ks]) \
            + ks * math.log(density) + (cells - ks) * math.log1p(-density)
        p = np.exp(logp - logp.max())
    p /= p.sum()
    reads = 3 if index else 2
    cyc = np.array([PE.task_cycles(spec, dtype, ops=int(k), read_elems=reads * int(k), write_elems=int(k))
                    for k in ks])
    out = np.zeros(int(cyc.max()) + 1)
    np.add.at(out, cyc, p)
    return out


def _x_task_pmfs(spec: FabricSpec, dtype: str, mt: int, chunks: list[tuple[int, int]], density: float,
                 act: float | None, index: bool) -> list[np.ndarray]:
    """Task-cycle distributions of one PE's x stream for a tile of `mt` rows. act=None: the stream as it is,
    `chunks` of (values per wavelet, wavelets), one task per wavelet. act in (0, 1]: zero activations filtered
    at the sender, so each non-zero x value travels alone (value + index) and fires its own task; a value is
    non-zero with probability `act` (a skipped value costs nothing on this PE). `index`: W stored sparse."""
    if act is None:
        return [q for e, cnt in chunks for q in [_task_pmf(spec, dtype, e * mt, density, index)] * cnt]
    q = act * _task_pmf(spec, dtype, mt, density, index)
    q[0] += 1.0 - act
    return [q] * sum(e * cnt for e, cnt in chunks)


def _work_pmf(task_pmfs: list[np.ndarray]) -> tuple[int, np.ndarray]:
    """Distribution of a sum of independent task cycles: (w0, pmf) with P(X = w0 + i) = pmf[i]. Exact
    convolution while the support stays small, else the Gaussian with the same mean and variance."""
    mean = var = 0.0
    for q in task_pmfs:
        x = np.arange(len(q))
        mu = float((q * x).sum())
        mean, var = mean + mu, var + float((q * (x - mu) ** 2).sum())
    if sum(len(q) for q in task_pmfs) <= 4096:
        acc = np.array([1.0])
        for q in task_pmfs:
            acc = np.convolve(acc, q)
        nz = np.flatnonzero(acc > 1e-15)
        return int(nz[0]), acc[nz[0]:nz[-1] + 1] / acc[nz[0]:nz[-1] + 1].sum()
    sd = max(math.sqrt(var), 1e-9)
    lo, hi = max(0, int(mean - 8 * sd)), int(mean + 8 * sd) + 1
    cdf = np.array([NormalDist(mean, sd).cdf(v + 0.5) for v in range(lo, hi + 1)])
    pmf = np.diff(np.concatenate([[NormalDist(mean, sd).cdf(lo - 0.5)], cdf]))
    return lo, pmf / pmf.sum()


def _expected_max(groups: list[tuple[np.ndarray, np.ndarray, int, np.ndarray]]) -> float:
    """E[max over PEs of (offset + work)] for independent works: `groups` of (distinct offsets, PE count per
    offset, w0, work pmf). E[max] = t0 + sum_{t >= t0} P(max > t) with P(max <= t) = prod_PE F(t - offset)."""
    lo = max(float(o.max()) + w0 for o, _, w0, _ in groups)
    hi = max(float(o.max()) + w0 + len(p) for o, _, w0, p in groups)
    ts = np.arange(math.floor(lo), math.ceil(hi) + 1, dtype=np.float64)
    log_le = np.zeros_like(ts)
    for o, c, w0, p in groups:
        f = np.cumsum(p)
        keep = o + w0 + len(p) > ts[0]  # only PEs that can still be the maximum above t0
        idx = np.floor(ts[None, :] - o[keep, None] - w0).astype(np.int64)
        val = np.where(idx < 0, 0.0, f[np.clip(idx, 0, len(f) - 1)])
        with np.errstate(divide="ignore"):
            log_le += (c[keep, None] * np.log(np.minimum(val, 1.0))).sum(axis=0)
    return float(ts[0] + (1.0 - np.exp(log_le))[:-1].sum())


def _weight_stationary(spec: FabricSpec, m: int, k: int, n: int, rows: int, cols: int, dtype: str,
                       mesh: Mesh | None, density: float | None = None, act: float | None = None) -> Cycles:
    """x segments multicast down the columns (1 color), one AXPY task per arriving x wavelet, partial sums
    chained East->West along the rows (2 alternating colors); n vectors stream back to back.

    The first vector's critical path is the max over PEs (i, j) of: the first x wavelet's arrival, the PE's
    own x tasks (`pe.task_cycles` per wavelet, for its real tile: the last tile row/column is smaller), and its
    partial's trip West through j chain stages (`_ws_offsets`), then the row's remaining partial wavelets one
    add task each. Sparse (`density`, or `act`: the fraction of non-zero x values, zeros filtered at the
    sender, `_x_task_pmfs`): a PE's work is random (binomial non-zeros per task), so the model takes the
    expectation of that maximum over independent PEs, exactly from the work distribution. Further vectors
    follow one per period of the busiest PE (its x tasks + its adds). A weight pattern is fixed, so the same PE
    is the busiest for every vector: the period is the expected maximum over PEs of their work; activation
    zeros change from vector to vector and average out in the PEs' queues (their mean is charged)."""
    R, C = _region(spec, rows, cols, mesh)
    R, C = used(m, R), used(k, C)
    mts, kts = np.array(tile_sizes(m, R)), np.array(tile_sizes(k, C))
    epw = PE.elems_per_wavelet(spec, dtype)
    per_mt = {}  # per distinct tile height: first partial's add task, the rest's adds, wavelets, all adds
    for mt in map(int, np.unique(mts)):
        add = lambda e: PE.add_task(spec, dtype, e)  # noqa: E731
        per_mt[mt] = (add(min(epw, mt)), _chunk_sum(mt, epw, lambda e: max(1, add(e))) - max(1, add(min(epw, mt))),
                      -(-mt // epw), _chunk_sum(mt, epw, add))
    uniq, inv = np.unique(mts, return_inverse=True)
    add_first, add_tail, ny = (np.array([per_mt[int(v)][f] for v in uniq], np.float64)[inv] for f in (0, 1, 2))
    add_tail = add_tail if C > 1 else np.zeros(R)
    perfect = mesh is None or not mesh.has_defects
    sparse = density is not None or act is not None
    d = 1.0 if density is None else density
    if perfect and not sparse:  # offsets grow with i and j inside a tile class: only each class's last
        keep_r = np.array(sorted({int(np.flatnonzero(mts == v).max()) for v in np.unique(mts)}))  # row/column
        keep_c = np.array(sorted({int(np.flatnonzero(kts == v).max()) for v in np.unique(kts)}))  # can be max
    else:
        keep_r, keep_c = np.arange(R), np.arange(C)
    off = _ws_offsets(spec, R, C, mesh, add_first, keep_r, keep_c) + add_tail[keep_r, None]
    mts_k, kts_k = mts[keep_r], kts[keep_c]
    comp = sram = period = 0.0
    groups, cells, busy, work = [], [], [], np.zeros(off.shape)
    for mt in np.unique(mts):
        ri, mt = np.flatnonzero(mts_k == mt), int(mt)
        adds = per_mt[mt][3] if C > 1 else 0
        for kt in np.unique(kts):
            ci, kt = np.flatnonzero(kts_k == kt), int(kt)
            full, rem = divmod(kt, epw)
            chunks = [(epw, full)] + ([(rem, 1)] if rem else [])  # (values per x wavelet, wavelets)
            if not sparse:
                x = sum(cnt * PE.axpy_task(spec, dtype, e, mt) for e, cnt in chunks)
                parts = [tuple(cnt * v for v in PE.task_parts(spec, dtype, ops=e * mt, read_elems=2 * e * mt,
                                                                write_elems=e * mt)) for e, cnt in chunks]
            else:
                w0, pmf = _work_pmf(_x_task_pmfs(spec, dtype, mt, chunks, d, act, density is not None))
                x = w0 + float((pmf * np.arange(len(pmf))).sum())
                if act is None:
                    parts = [tuple(cnt * v for v in PE.task_parts(spec, dtype, ops=e * mt * d,
                                                                    read_elems=3 * e * mt * d, write_elems=e * mt * d))
                             for e, cnt in chunks]
                else:  # one task per non-zero x value
                    reads = (2 if density is None else 3) * mt * d
                    parts = [tuple(kt * act * v for v in PE.task_parts(spec, dtype, ops=mt * d, read_elems=reads,
                                                                        write_elems=mt * d))]
                uo, cnt = np.unique(off[np.ix_(ri, ci)].ravel(), return_counts=True)
                groups.append((uo, cnt.astype(np.float64), w0, pmf))
                cells.append((ri, ci))
                if n > 1:  # the fixed weight pattern's work per vector, scaled by the mean activation density
                    a = 1.0 if act is None else act
                    fw0, fpmf = (w0, pmf) if act is None else \
                        _work_pmf(_x_task_pmfs(spec, dtype, mt, chunks, d, 1.0, density is not None))
                    busy.append((np.array([adds / a]), np.array([float(len(ri) * len(ci))]), fw0, fpmf))
            work[np.ix_(ri, ci)] = x  # sparse: the mean work
            comp = max(comp, sum(c for c, _ in parts) + adds)
            sram = max(sram, sum(s_ for _, s_ in parts))
            period = max(period, x + adds)
    if busy:
        period = (1.0 if act is None else act) * _expected_max(busy)
    # detours can make several rows' chains share a physical link; their partials then take turns on it
    share = np.ones(R)
    if C > 1 and _exact(mesh, R, C):
        extra, share = _chain_contention(mesh, R, C, off - add_tail[:, None], work, add_first, ny)
        off = off + extra[:, None]
        for g, (ri, ci) in enumerate(cells):
            uo, cnt = np.unique(off[np.ix_(ri, ci)].ravel(), return_counts=True)
            groups[g] = (uo, cnt.astype(np.float64), groups[g][2], groups[g][3])
    first = _expected_max(groups) if sparse else float((off + work).max())
    passes = _passes(spec, 1 + (2 if C > 1 else 0))
    total = (passes - 1) * _multicast(spec, _hops(mesh, R, C, axis=0), 1) + (n - 1) * period + first
    x_waves = -(-int(kts.max()) // epw) if act is None else math.ceil(act * int(kts.max()))
    fabric = n * max(x_waves, float((share * ny).max()) if C > 1 else 0)
    return make_cycles(compute=n * comp, sram=n * sram, fabric=fabric, total=total, passes=passes)


def _chain_contention(mesh: Mesh, R: int, C: int, off: np.ndarray, work: np.ndarray, add_first: np.ndarray,
                      ny: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Extra cycles per row, and the most chain edges per physical link, when detours make row chains share
    links. PE (i, j) sends its ny_i partial wavelets West once its own work is done and its East neighbour's
    partial has arrived: send_ij = max_{j' >= j}(ready_ij' + stage_ij') - stage_ij, with `off` = the first x
    wavelet's arrival + the stage latency to column 0. Each shared link is a FCFS fluid queue over those windows
    (`_fluid_finish`); the delay of a row's worst edge is carried to its root."""
    stage = _chain_stages(mesh.spec, mesh, R, C, add_first)
    ready_plus = off + work  # off = a + stage, so this is ready + stage
    send = np.maximum.accumulate(ready_plus[:, ::-1], axis=1)[:, ::-1] - stage
    links: dict = {}
    users: dict = {}
    for i in range(R):
        for j in range(1, C):
            p = mesh.route((i, j), (i, j - 1))
            links[i, j] = list(zip(p, p[1:]))
            for link in links[i, j]:
                users.setdefault(link, []).append((i, j))
    extra, share = np.zeros(R), np.ones(R)
    for (i, j), ls in links.items():
        nw = int(ny[i])
        win = (float(send[i, j]), float(send[i, j]) + nw - 1)
        for link in ls:
            us = users[link]
            if len(us) > 1:
                share[i] = max(share[i], len(us))
                done = _fluid_finish([(float(send[a, b]), float(send[a, b]) + ny[a] - 1) for a, b in us], win[1],
                                     [int(ny[a]) for a, _ in us])
                extra[i] = max(extra[i], done - win[1])
    return extra, share


def gemv_cycles(spec: FabricSpec, m: int, k: int, rows: int, cols: int, dtype: str = "fp16", *,
                mesh: Mesh | None = None) -> Cycles:
    """y(m) = W(m, k) x(k) on a rows x cols region (W stationary in tiles; at most one PE per row/column)."""
    check_positive(m=m, k=k)
    return _weight_stationary(spec, m, k, 1, rows, cols, dtype, mesh)


def gemm_cycles(spec: FabricSpec, m: int, k: int, n: int, rows: int, cols: int, dtype: str = "fp16", *,
                mesh: Mesh | None = None) -> Cycles:
    """Y(m, n) = W(m, k) X(k, n): the n columns of X stream through the stationary W one after another."""
    check_positive(m=m, k=k, n=n)
    return _weight_stationary(spec, m, k, n, rows, cols, dtype, mesh)


def spmv_cycles(spec: FabricSpec, m: int, k: int, nnz: int, rows: int, cols: int, dtype: str = "fp16", *,
                mesh: Mesh | None = None) -> Cycles:
    """Sparse y = W x with `nnz` non-zeros spread uniformly at random: one multiply-add per non-zero weight per
    arriving x value; the expected critical path over PEs of random work (`_weight_stationary`)."""
    check_positive(m=m, k=k, nnz=nnz)
    if nnz > m * k:
        raise ConfigError(f"nnz={nnz} exceeds m*k={m * k}")
    return _weight_stationary(spec, m, k, 1, rows, cols, dtype, mesh, density=nnz / (m * k))


def sparse_gemm_cycles(spec: FabricSpec, m: int, k: int, n: int, rows: int, cols: int, dtype: str = "fp16", *,
                       density: float = 1.0, act_density: float = 1.0, mesh: Mesh | None = None) -> Cycles:
    """Y(m, n) = W(m, k) X(k, n) with a `density` fraction of W non-zero (uniformly random, stored as value +
    index: one multiply-add per non-zero, as `spmv_cycles`) and an `act_density` fraction of X non-zero.

    Zero activations are either filtered at the sender (each non-zero value then travels alone with its index
    and fires its own task; the multiply is skipped) or streamed as they are; the faster is charged. What no
    sparsity removes: the x multicast's fill, one task (>= 1 cycle) per arriving wavelet, the dense partial
    sums (m per vector) and their chain reduction, and the busiest PE of a random pattern setting the pace."""
    check_positive(m=m, k=k, n=n)
    for name, v in (("density", density), ("act_density", act_density)):
        if not 0.0 < v <= 1.0:
            raise ConfigError(f"{name} must be in (0, 1], got {v!r}")
    dens = density if density < 1 else None
    plain = _weight_stationary(spec, m, k, n, rows, cols, dtype, mesh, density=dens)
    if act_density >= 1:
        return plain
    return min(plain, _weight_stationary(spec, m, k, n, rows, cols, dtype, mesh, density=dens, act=act_density),
               key=lambda c: c.total)


def sparse_imbalance(spec: FabricSpec, m: int, k: int, rows: int, cols: int, density: float,
                     dtype: str = "fp16") -> float:
    """The busiest PE's x-task cycles over the mean PE's for a uniformly random pattern of `density` on a
    rows x cols region (the expected maximum over PEs): the load imbalance of unstructured sparsity."""
    check_positive(m=m, k=k)
    R, C = used(m, rows), used(k, cols)
    epw = PE.elems_per_wavelet(spec, dtype)
    groups, total, pes = [], 0.0, 0
    for mt, cm in zip(*np.unique(tile_sizes(m, R), return_counts=True)):
        for kt, ck in zip(*np.unique(tile_sizes(k, C), return_counts=True)):
            full, rem = divmod(int(kt), epw)
            chunks = [(epw, full)] + ([(rem, 1)] if rem else [])
            w0, pmf = _work_pmf(_x_task_pmfs(spec, dtype, int(mt), chunks, density, None, True))
            groups.append((np.zeros(1), np.array([float(cm * ck)]), w0, pmf))
            total += (w0 + float((pmf * np.arange(len(pmf))).sum())) * cm * ck
            pes += int(cm * ck)
    return _expected_max(groups) / (total / pes)


# ---- collectives ----------------------------------------------------------------------------------------
def _node_times(arrivals: list[tuple[float, float]], nw: int, add_c: int) -> tuple[float, float]:
    """(first, last) send time of a PE given its children's (first, last) wavelet arrival times: it adds every
    child's wavelet (add_c cycles each, at most one wavelet per cycle through its ramp). Its first wavelet waits
    for the slowest child's first; its last for the slowest child's last, or for all fan_in * nw adds counted
    from the first arrival, whichever is later. A leaf sends its nw wavelets one per cycle from t = 0."""
    if not arrivals:
        return 0.0, float(nw - 1)
    r = max(1, add_c)
    first = max(f for f, _ in arrivals) + add_c
    last = max(max(l for _, l in arrivals) + add_c, min(f for f, _ in arrivals) + len(arrivals) * nw * r)
    return first, last


def _edge(times: tuple[float, float], hops: int, spec: FabricSpec) -> tuple[float, float]:
    d = 2 * spec.ramp_latency_cycles + hops * spec.hop_latency_cycles  # ramp out, hops, ramp in
    return times[0] + d, times[1] + d


def _tree_finish(parents: dict, root, mesh: Mesh, nw: int, add_c: int, spec: FabricSpec) -> float:
    """Critical path of a reduction tree given as child -> parent: `last` of the root (all wavelets summed).

    Detoured routes may make several tree edges share a physical link. Whether they contend depends on when
    they carry their wavelets (a chain's far-apart stages never overlap in time), so the tree is evaluated
    twice: first as if every link were private, which gives each edge's sending window [first, last]; then
    each edge's last wavelet is delayed by the wavelets the other edges on its busiest link send inside its
    window (the overlap of the windows times the other edge's rate)."""
    kids: dict = {}
    for c, p in parents.items():
        kids.setdefault(p, []).append(c)
    links: dict = {c: list(zip(mesh.route(c, p), mesh.route(c, p)[1:])) for c, p in parents.items()}
    users: dict = {}
    for c, ls in links.items():
        for link in ls:
            users.setdefault(link, []).append(c)
    order, stack = [], [root]
    while stack:  # iterative post-order
        v = stack.pop()
        order.append(v)
        stack.extend(kids.get(v, ()))

    def evaluate(windows: dict | None) -> dict:
        times: dict = {}

        def edge(c, v):
            f, last = _edge(times[c], mesh.hops(c, v), spec)
            if windows is not None:  # FCFS fluid queue on each link of the route: the last wavelet of c
                for link in links[c]:  # leaves when all work that arrived on the link before it is served
                    last = max(last, _fluid_finish([windows[o] for o in users[link]], windows[c][1], nw) + (
                        f - windows[c][0]))
            return f, last

        for v in reversed(order):
            times[v] = _node_times([edge(c, v) for c in kids.get(v, ())], nw, add_c)
        return times

    times = evaluate(None)
    for _ in range(3):
        times = evaluate(times)
    return times[root][1]


def _fluid_finish(windows: list[tuple[float, float]], until: float, nw) -> float:
    """A link shared by streams each sending nw wavelets (an int, or one per stream) evenly over its window
    [first, last], serving one wavelet per cycle first come first served: when the wavelet arriving at `until`
    leaves. The queue holds the work that arrived since the busy period began: max over start points s of
    s + arrivals in [s, until]."""
    nws = nw if isinstance(nw, list) else [nw] * len(windows)

    def arrived(t: float) -> float:  # wavelets arrived at or before t
        return sum(n * min(1.0, max(0.0, (t - f + 1) / (l - f + 1))) for (f, l), n in zip(windows, nws))

    done = arrived(until)
    return max(s + done - arrived(s - 1) - 1 for s in {f for f, _ in windows if f <= until} | {until})


def _regular_finish(algo: str, R: int, C: int, nw: int, add_c: int, spec: FabricSpec) -> float:
    """`_tree_finish` for a defect-free region in O(R + C): every row's tree is the same, then column 0."""
    if algo == "chain":
        return nw - 1 + (R * C - 1) * (2 * spec.ramp_latency_cycles + spec.hop_latency_cycles + add_c)

    def into_root(n: int, inputs: list) -> list:
        """Arrivals at position 0 of a line of n PEs reducing by `algo`, each PE also combining `inputs`."""
        kids: dict = {}
        for (_, c), (_, p) in reduce_parents(algo, 1, n).items():
            kids.setdefault(p, []).append(c)
        times: dict = {}
        for v in range(n - 1, 0, -1):  # children are always after their parent
            times[v] = _node_times(inputs + [_edge(times[c], c - v, spec) for c in kids.get(v, ())], nw, add_c)
        return [_edge(times[c], c, spec) for c in kids.get(0, ())]

    row_in = into_root(C, [])  # every row's partials into column 0 (all rows alike), then up column 0
    return _node_times(row_in + into_root(R, row_in), nw, add_c)[1]


def reduce_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, algo: str = "2d", dtype: str = "fp32", *,
                  mesh: Mesh | None = None) -> Cycles:
    """Reduce (sum) of one n_elems vector per PE into PE (0, 0). The HPDC'24 form (Fabric row of WSE.md),

        T = max(C, E/N) + L + (2 T_R + 1) D,

    is evaluated node by node up the tree: a PE's last wavelet leaves after its slowest child's last one arrives
    (L + (2 T_R + 1) D along the path: hops, ramp out and in, one add per stage) or after its fan-in times nw
    adds counted from its first arrival (the contention C), whichever is later. E/N (= nw per active link) never
    exceeds C here. With a defective `mesh`, hops are the real detoured routes."""
    check_positive(n_elems=n_elems)
    R, C = _region(spec, rows, cols, mesh)
    nw = PE.wavelets(n_elems, spec, dtype)
    add_c = PE.add_task(spec, dtype, PE.elems_per_wavelet(spec, dtype))
    if algo not in ("chain", "2d", "tree"):
        raise ConfigError(f"unknown all-reduce algorithm {algo!r}; use chain, tree or 2d")
    if R * C == 1:
        return make_cycles(compute=0, sram=0, fabric=0, total=0)
    fan_in = {"chain": 1, "2d": 2 if R > 1 and C > 1 else 1,
              "tree": (C - 1).bit_length() + (R - 1).bit_length()}[algo]
    colors = {"chain": 2, "2d": 4, "tree": fan_in}[algo]  # chains alternate 2 colors; a tree uses one per level
    if _exact(mesh, R, C):
        total = _tree_finish(reduce_parents(algo, R, C), (0, 0), mesh, nw, add_c, spec)
    else:
        total = _regular_finish(algo, R, C, nw, add_c, spec)
        if mesh is not None and mesh.has_defects:  # big region: the detours' extra hops on the critical path
            row_max, row_sum, col = _detour_extra(mesh, R, C)
            total += (row_sum + col if algo == "chain" else row_max + col) * spec.hop_latency_cycles
    passes = _passes(spec, colors)
    if passes > 1:  # levels beyond the available colors wait for the previous group: pay the fill again
        total += (passes - 1) * (total - (nw - 1) * fan_in * max(1, add_c))
    return make_cycles(compute=fan_in * nw * add_c, sram=fan_in * nw * add_c, fabric=fan_in * nw,
                       total=total, passes=passes)


def broadcast_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, dtype: str = "fp32", *,
                     mesh: Mesh | None = None) -> Cycles:
    """PE (0, 0) multicasts n_elems along row 0 and down every column (1 color): fill + one wavelet per cycle."""
    check_positive(n_elems=n_elems)
    R, C = _region(spec, rows, cols, mesh)
    nw = PE.wavelets(n_elems, spec, dtype)
    if R * C == 1:
        return make_cycles(compute=0, sram=0, fabric=0, total=0)
    if _exact(mesh, R, C):  # the real multicast tree: row 0, then every column
        tree = mesh.multicast_tree([(0, j) for j in range(C)], [[(i, j) for i in range(R)] for j in range(C)])
        hops = mesh.tree_depth(tree, mesh.physical(0, 0))
    else:  # row 0 then a column; a big defective region adds the extra hops of its worst row chain and column 0
        row_max, _, col = _detour_extra(mesh, R, C) if mesh is not None and mesh.has_defects else (0, 0, 0)
        hops = (C - 1) + (R - 1) + row_max + col
    return make_cycles(compute=0, sram=0, fabric=nw, total=_multicast(spec, hops, nw))


def allreduce_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, algo: str = "2d", dtype: str = "fp32",
                     *, mesh: Mesh | None = None) -> Cycles:
    """Reduce into (0, 0) (`reduce_cycles`, HPDC'24 form), then broadcast the sum (`broadcast_cycles`);
    algo in {"chain", "tree", "2d"}. The broadcast starts when the root holds the whole sum."""
    return reduce_cycles(spec, n_elems, rows, cols, algo, dtype, mesh=mesh) + \
        broadcast_cycles(spec, n_elems, rows, cols, dtype, mesh=mesh)


def alltoall_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, dtype: str = "fp16") -> Cycles:
    """n_elems spread evenly over the region, each sent to a uniformly random PE of it (a mixture of experts'
    dispatch of tokens to the experts' PEs): a quarter of the data crosses the region's narrower bisection each
    way, min(R, C) links wide, one wavelet per link per cycle, after the diameter's hops. A bandwidth bound:
    no contention beyond the bisection's is modelled."""
    check_positive(n_elems=n_elems)
    R, C = _region(spec, rows, cols, None)
    if R * C == 1:
        return make_cycles(compute=0, sram=0, fabric=0, total=0)
    nw = -(-PE.wavelets(n_elems, spec, dtype) // (4 * min(R, C)))
    return make_cycles(compute=0, sram=0, fabric=nw, total=nw + (R + C - 2) * spec.hop_latency_cycles)


# ---- element-wise, norms, softmax, attention ------------------------------------------------------------
def elementwise_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, flops_per_elem: int = 1,
                       dtype: str = "fp16") -> Cycles:
    """z = f(x, y) on n_elems spread over the region: per PE, one SIMD op of `lanes` values at a time, reading
    two operands and writing one. No fabric traffic."""
    check_positive(n_elems=n_elems, flops_per_elem=flops_per_elem)
    R, C = _region(spec, rows, cols, None)
    ne = -(-n_elems // (R * C))
    total = comp = sram = 0
    lanes = PE.lanes(spec, dtype)
    for e, count in ((lanes, ne // lanes), (ne % lanes, 1 if ne % lanes else 0)):  # full vector ops, then the rest
        kw = dict(ops=e * flops_per_elem, read_elems=2 * e, write_elems=e)
        total += count * PE.task_cycles(spec, dtype, **kw)
        c, s = PE.task_parts(spec, dtype, **kw)
        comp, sram = comp + count * c, sram + count * s
    return make_cycles(compute=comp, sram=sram, fabric=0, total=total)


def row_program_cycles(spec: FabricSpec, phases: list[tuple], rows: int, cols: int, dtype: str = "fp32",
                       mesh: Mesh | None = None, colors: int = 3) -> Cycles:
    """Phases run one after another on every row (the phase lists of `schedules.py`, which
    `sim.sim_row_program` executes wavelet by wavelet): local tasks, East->West chain reductions into column 0,
    and West->East multicasts back."""
    R, C = _region(spec, rows, cols, mesh)
    epw = PE.elems_per_wavelet(spec, dtype)
    hops = _hops(mesh, R, C, axis=1)
    total = comp = fabric = 0
    for ph in phases:
        kind = ph[0]
        if kind in ("local", "local0"):
            total += ph[1]
            comp += ph[1]
        elif C > 1 and kind == "reduce":
            nw, add_c = -(-ph[1] // epw), PE.add_task(spec, dtype, epw, ph[2])
            total += _chain(spec, C - 1, hops, nw, add_c)
            comp += nw * add_c
            fabric += nw
        elif C > 1 and kind == "bcast":
            nw = -(-ph[1] // epw)
            total += _multicast(spec, hops, nw)
            fabric += nw
    passes = _passes(spec, colors)
    return make_cycles(compute=comp, sram=comp, fabric=fabric, total=total * passes, passes=passes)


def _rows_region(spec: FabricSpec, n_elems: int, width: int, rows: int, cols: int,
                 mesh: Mesh | None) -> tuple[int, int, int, int]:
    """Rows of `width` values: tokens over the region's rows, the width over its columns. Returns the PEs
    used (R, C), tokens per row and values per PE of a token."""
    check_positive(n_elems=n_elems, width=width)
    tokens = -(-n_elems // width)
    R, C = _region(spec, rows, cols, mesh)
    R, C = used(tokens, R), used(width, C)
    return R, C, -(-tokens // R), -(-width // C)


def norm_cycles(spec: FabricSpec, n_elems: int, width: int, rows: int, cols: int, rms: bool = False,
                dtype: str = "fp32", *, mesh: Mesh | None = None) -> Cycles:
    """LayerNorm (or RMSNorm) of n_elems/width vectors of `width`: tokens over rows, width over columns; local
    statistics, a row all-reduce of them, then the normalisation (see `schedules.norm_phases`)."""
    R, C, tokens_per_row, width_per_pe = _rows_region(spec, n_elems, width, rows, cols, mesh)
    return row_program_cycles(spec, norm_phases(spec, tokens_per_row, width_per_pe, rms, dtype), R, C, dtype, mesh)


def softmax_cycles(spec: FabricSpec, n_elems: int, width: int, rows: int, cols: int, dtype: str = "fp32", *,
                   mesh: Mesh | None = None) -> Cycles:
    """Softmax over rows of `width`: a max all-reduce and a sum all-reduce along each mesh row; exp() is
    assumed to cost `schedules.EXP_OPS` SIMD ops (not in WSE.md: an assumption)."""
    R, C, tokens_per_row, width_per_pe = _rows_region(spec, n_elems, width, rows, cols, mesh)
    return row_program_cycles(spec, softmax_phases(spec, tokens_per_row, width_per_pe, dtype), R, C, dtype, mesh,
                              colors=5)


def attention_decode_cycles(spec: FabricSpec, n_heads: int, head_dim: int, context_len: int, rows: int, cols: int,
                            dtype: str = "fp16", *, n_kv_heads: int | None = None,
                            mesh: Mesh | None = None) -> Cycles:
    """One decode step of attention over a KV cache of context_len positions: KV heads over rows (each KV
    slice stored once), context over columns; q multicast along each row, local scores/exp/P.V for every
    query head of the row's KV heads (n_heads / n_kv_heads per KV head: grouped-query attention), a
    log-sum-exp merge chain into column 0. n_kv_heads defaults to n_heads (multi-head attention)."""
    n_kv = n_heads if n_kv_heads is None else n_kv_heads
    check_positive(n_heads=n_heads, head_dim=head_dim, context_len=context_len, n_kv_heads=n_kv)
    if n_heads % n_kv:
        raise ConfigError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv} (grouped-query attention)")
    R, C = _region(spec, rows, cols, mesh)
    R, C = used(n_kv, R), used(context_len, C)
    kv_per_row, ctx_per_pe = -(-n_kv // R), -(-context_len // C)
    kv_bytes = 2 * kv_per_row * ctx_per_pe * head_dim * PE.dtype_bytes(dtype)
    if kv_bytes > spec.sram_bytes_per_pe:
        raise ConfigError(f"KV cache slice of {kv_bytes:,} B per PE exceeds {spec.sram_bytes_per_pe:,} B SRAM; "
                          f"use more PEs or a shorter context")
    phases = attention_phases(spec, kv_per_row * (n_heads // n_kv), ctx_per_pe, head_dim, dtype)
    return row_program_cycles(spec, phases, R, C, dtype, mesh)
