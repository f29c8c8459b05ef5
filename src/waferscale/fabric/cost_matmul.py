"""Cycle models of the weight-stationary matrix kernels: GEMV, GEMM (streamed vectors), SpMV and sparse GEMM
(the schedules of `kernels/gemv.py`, judged by `sim.sim_gemm`); conventions and shared pieces in `cost.py`.

W (m, k) stays in rows x cols tiles; x segments are multicast down the columns (1 color), every arriving x
wavelet fires one AXPY task (`pe.axpy_task`), and the partial sums chain East->West along the rows (2
alternating colors). The critical path is the max over PEs of the first x wavelet's arrival, the PE's own x
tasks (for its real tile: the last tile row/column is smaller) and its partial's trip West, then the row's
remaining partial wavelets one add task each; further vectors follow one per period of the busiest PE.
Unstructured sparsity makes a PE's work random (binomial non-zeros per task): the models take the expectation
of the maximum over independent PEs, exactly from the work distribution (`_task_pmf`, `_expected_max`), which
is where SpMV's load imbalance comes from. Detours on a defective mesh lengthen the routes and can make two
rows' chains share a physical link (`_chain_contention`, a fluid queue).

`gemv_allreduce_cycles` is the GEMV of the in-layer model-parallel layout (`schedules_gemv.py`): x already on
every PE of its column, the partials summed by a row all-reduce (a chain or a K-ary tree into column 0, or
K phases of two chains into group centres ending at the row's centre; then a multicast back); judged by
`sim_gemv.sim_gemv_allreduce`.
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric import pe as PE
from waferscale.fabric.cost import (Cycles, check_positive, check_region, color_passes, detour_extra, exact_routes,
                                    fluid_finish, longest_chain_hops, make_cycles, multicast_latency)
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.schedules import tile_sizes, used
from waferscale.fabric.schedules_gemv import (bottom_up, check_row_reduce, row_multicast, row_reduce_depth,
                                             row_reduce_parents, row_root)
from waferscale.fabric.spec import FabricSpec


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
    if exact_routes(mesh, R, C):  # the real multicast tree of each column, the real route of each chain link
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
def _task_pmf(spec: FabricSpec, dtype: str, cells: int, density: float, index: bool = True,
              vector_ops: int = 1) -> np.ndarray:
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
    cyc = np.array([PE.task_cycles(spec, dtype, ops=int(k), read_elems=reads * int(k), write_elems=int(k),
                                   vector_ops=vector_ops, fmac=True) for k in ks])
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
        return [q for e, cnt in chunks for q in [_task_pmf(spec, dtype, e * mt, density, index, e)] * cnt]
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
    R, C = check_region(spec, rows, cols, mesh)
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
                parts = [tuple(cnt * v for v in PE.axpy_parts(spec, dtype, e, mt)) for e, cnt in chunks]
            else:
                w0, pmf = _work_pmf(_x_task_pmfs(spec, dtype, mt, chunks, d, act, density is not None))
                x = w0 + float((pmf * np.arange(len(pmf))).sum())
                if act is None:
                    parts = [tuple(cnt * v for v in PE.task_parts(spec, dtype, ops=e * mt * d,
                                                                    read_elems=3 * e * mt * d, write_elems=e * mt * d,
                                                                    vector_ops=e, fmac=True))
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
    if C > 1 and exact_routes(mesh, R, C):
        extra, share = _chain_contention(mesh, R, C, off - add_tail[:, None], work, add_first, ny)
        off = off + extra[:, None]
        for g, (ri, ci) in enumerate(cells):
            uo, cnt = np.unique(off[np.ix_(ri, ci)].ravel(), return_counts=True)
            groups[g] = (uo, cnt.astype(np.float64), groups[g][2], groups[g][3])
    first = _expected_max(groups) if sparse else float((off + work).max())
    passes = color_passes(spec, 1 + (2 if C > 1 else 0))
    refill = multicast_latency(spec, longest_chain_hops(mesh, R, C, axis=0), 1)
    total = (passes - 1) * refill + (n - 1) * period + first
    x_waves = -(-int(kts.max()) // epw) if act is None else math.ceil(act * int(kts.max()))
    fabric = n * max(x_waves, float((share * ny).max()) if C > 1 else 0)
    return make_cycles(compute=n * comp, sram=n * sram, fabric=fabric, total=total, passes=passes)


def _chain_contention(mesh: Mesh, R: int, C: int, off: np.ndarray, work: np.ndarray, add_first: np.ndarray,
                      ny: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Extra cycles per row, and the most chain edges per physical link, when detours make row chains share
    links. PE (i, j) sends its ny_i partial wavelets West once its own work is done and its East neighbour's
    partial has arrived: send_ij = max_{j' >= j}(ready_ij' + stage_ij') - stage_ij, with `off` = the first x
    wavelet's arrival + the stage latency to column 0. Each shared link is a FCFS fluid queue over those windows
    (`fluid_finish`); the delay of a row's worst edge is carried to its root."""
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
                done = fluid_finish([(float(send[a, b]), float(send[a, b]) + ny[a] - 1) for a, b in us], win[1],
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


# ---- GEMV of the in-layer model-parallel layout (schedules_gemv.py) -------------------------------------
def node_window(ready: float, arrivals: list[tuple[float, float]], adds: list[int]) -> tuple[float, float]:
    """(first, last) time a PE of a row tree has a wavelet of its partial fully summed, given its own partial's
    ready time and its children's (first, last) wavelet arrivals. Every arriving wavelet fires one add task
    (`adds[w]` cycles for wavelet w), run one at a time and not before `ready`. The first wavelet waits for
    every child's first, added in arrival order; the last for the last arrival plus its add, or for the work
    queued behind the busy period that starts at `ready` or at a child's first arrival (each child's wavelets
    spread evenly over its window). A leaf sends its wavelets one per cycle from `ready`."""
    if not arrivals:
        return ready, ready + len(adds) - 1
    t = ready
    for f in sorted(f for f, _ in arrivals):
        t = max(t, f) + adds[0]
    per_child = sum(adds)
    last = max(max(la for _, la in arrivals) + adds[-1], ready + len(arrivals) * per_child)
    for s in {f for f, _ in arrivals if f > ready}:  # a busy period starting at a later first arrival
        later = sum(min(1.0, max(0.0, (la - s + 1) / (la - f + 1))) for f, la in arrivals)
        last = max(last, s + later * per_child)
    return t, last


def _row_tree_times(spec: FabricSpec, parents: dict[int, int], ready: list[float], adds: list[int],
                    hops: dict[int, int], row: int = 0, links: dict | None = None,
                    windows: dict | None = None) -> dict:
    """Send windows (first, last) of every position of one row's tree (children before their parents,
    `schedules_gemv.bottom_up`). An edge costs ramp out + its hops + ramp in. With `windows`
    from an earlier evaluation, an edge whose route shares a physical link with others (`links`: (row, child)
    -> links, and link -> users) has its last wavelet delayed by a first-come-first-served fluid queue over
    their sending windows (`fluid_finish`), as `cost_collectives._tree_finish` does."""
    kids: dict = {}
    for c, p in parents.items():
        kids.setdefault(p, []).append(c)
    times: dict = {}
    nw = len(adds)
    for p in bottom_up(parents, len(ready)):
        arr = []
        for c in kids.get(p, ()):
            f, la = times[row, c]
            d = 2 * spec.ramp_latency_cycles + hops[c] * spec.hop_latency_cycles
            fa, la = f + d, la + d
            if windows is not None:
                for link in links["edge"][row, c]:
                    us = links["users"][link]
                    if len(us) > 1:
                        done = fluid_finish([windows[o] for o in us], windows[row, c][1], nw)
                        la = max(la, done + fa - windows[row, c][0])
            arr.append((fa, la))
        times[row, p] = node_window(ready[p], arr, adds)
    return times


def _multicast_queueing(mcast: dict, done: np.ndarray, ny: list[int]) -> np.ndarray:
    """Per row, the wait of its multicast's last wavelet where detours make its tree share a physical link with
    other rows' multicasts (`mcast`: row -> (link, cycles from the root's send to the link)): a first-come-
    first-served fluid queue over their windows (`fluid_finish`); the worst link holds back the rest of the
    tree. (The reductions are over by then on the critical row, so only multicasts meet.)"""
    users: dict = {}
    for i, ls in mcast.items():
        for link, off in ls:
            users.setdefault(link, []).append(i)
    extra = np.zeros(len(done))
    for i, ls in mcast.items():
        for link, off in ls:
            if len(users[link]) > 1:
                end = done[i] + off + ny[i] - 1
                wins = [(done[o] + off, done[o] + off + ny[o] - 1) for o in users[link]]
                extra[i] = max(extra[i], fluid_finish(wins, end, [ny[o] for o in users[link]]) - end)
    return extra


def gemv_allreduce_cycles(spec: FabricSpec, m: int, k: int, rows: int, cols: int, dtype: str = "fp16", *,
                          algo: str = "ktree", fan_in: int = 2, mesh: Mesh | None = None) -> Cycles:
    """y(m) = W(m, k) x(k) in the in-layer model-parallel layout (`schedules_gemv.py`): x_j already on every
    PE of column j, W in rows x cols tiles; every PE runs its AXPY tasks (one per x wavelet's worth of local
    x values, `pe.axpy_task`) from t = 0, then the row all-reduce ("chain" or "ktree" of `fan_in`) sums the
    partials into column 0, or ("phases", fan_in = the number of phases K) into the row's centre, and that root
    multicasts y_i back along its row (both ways from the centre) once it holds all of it.

    The critical path is evaluated node by node up each row's tree (`node_window`: arrival order of first
    wavelets, the adds a PE of fan-in n must do, pipelining of the ny = ceil(mt / values per wavelet)
    wavelets), then the multicast (ramp out, the row's hops, ramp in, ny wavelets). Rows with the same tile
    height are alike on a perfect mesh; a defective mesh takes each row's real (detoured) routes and the
    queueing where detours make edges share a link (regions up to 64x64 PEs), or adds the worst row's detour
    hops to the reduction and to the multicast (bigger regions). Colors: the chain alternates 2, the tree
    takes one per (level, member) offset, "phases" 4 per phase; the multicast one more. A schedule needing
    more colors than a program has runs its reduction once per pass."""
    check_positive(m=m, k=k)
    check_row_reduce(algo, fan_in)
    R, C = check_region(spec, rows, cols, mesh)
    R, C = used(m, R), used(k, C)
    mts, kts = tile_sizes(m, R), tile_sizes(k, C)
    epw = PE.elems_per_wavelet(spec, dtype)
    parents = row_reduce_parents(algo, C, fan_in)
    n_kids = np.bincount(list(parents.values()), minlength=C) if C > 1 else np.zeros(1, np.int64)
    root = row_root(parents, C)

    @lru_cache(maxsize=None)  # a call meets few distinct tile sizes, each asked for by many rows and columns
    def x_work(mt: int, kt: int) -> tuple[int, int, int]:  # (cycles, compute, SRAM) of a PE's AXPY tasks
        full, rem = divmod(kt, epw)
        cyc = comp = sram = 0
        for e, cnt in ((epw, full), (rem, 1 if rem else 0)):
            c, s = PE.axpy_parts(spec, dtype, e, mt)
            cyc, comp, sram = cyc + cnt * PE.axpy_task(spec, dtype, e, mt), comp + cnt * c, sram + cnt * s
        return cyc, comp, sram

    @lru_cache(maxsize=None)
    def adds(mt: int) -> list[int]:  # callers only read it
        return [PE.add_task(spec, dtype, min(epw, mt - s)) for s in range(0, mt, epw)]

    exact = C > 1 and exact_routes(mesh, R, C)
    done = np.zeros(R)  # per row: the time column 0 holds the whole sum
    mcast_hops = np.full(R, max(root, C - 1 - root))  # both ways at once from a centre root
    if C == 1:
        done[:] = [x_work(mt, kts[0])[0] for mt in mts]
    elif not exact:  # rows of the same tile height are alike
        hops = {c: abs(c - p) for c, p in parents.items()}
        for mt in set(mts):
            ready = [x_work(mt, kt)[0] for kt in kts]
            done[np.array(mts) == mt] = _row_tree_times(spec, parents, ready, adds(mt), hops)[0, root][1]
        if mesh is not None and mesh.has_defects:  # big region: the worst row's detours, on the way in and out
            row_max = detour_extra(mesh, R, C)[0]
            done += row_max * spec.hop_latency_cycles
            mcast_hops += row_max
    else:
        hops, links, mcast = {}, {"edge": {}, "users": {}}, {}
        for i in range(R):
            for c, p in parents.items():
                route = mesh.route((i, c), (i, p))
                hops[i, c] = len(route) - 1
                links["edge"][i, c] = list(zip(route, route[1:]))
                for link in links["edge"][i, c]:
                    links["users"].setdefault(link, []).append((i, c))
            tree = mesh.multicast_tree(*row_multicast(i, root, C))
            depth = mesh.tree_depths(tree, mesh.physical(i, root))
            mcast_hops[i] = max(depth[node] for node in tree[1])
            mcast[i] = [((a, b), spec.ramp_latency_cycles + depth[a] * spec.hop_latency_cycles)
                        for a, bs in tree[0].items() for b in bs]
        readies = [[x_work(mts[i], kt)[0] for kt in kts] for i in range(R)]
        windows = None
        for _ in range(4):  # private links first, then queueing over the previous evaluation's windows
            new = {}
            for i in range(R):
                new.update(_row_tree_times(spec, parents, readies[i], adds(mts[i]),
                                           {c: hops[i, c] for c in parents}, i, links, windows))
            windows = new
        done = np.array([windows[i, root][1] for i in range(R)], np.float64)
        done += _multicast_queueing(mcast, done, [len(adds(mt)) for mt in mts])
    ny = np.array([len(adds(mt)) for mt in mts])
    passes = 1
    if C > 1:
        colors = {"chain": 2, "phases": 4 * row_reduce_depth(algo, C, fan_in)}.get(
            algo, len({c - p for c, p in parents.items()}))
        passes = color_passes(spec, colors + 1)
        first_ready = min(x_work(mt, kt)[0] for mt in set(mts) for kt in set(kts))
        done = done + (passes - 1) * (done - first_ready)  # the reduction once per pass
        done = done + [multicast_latency(spec, int(h), int(n)) for h, n in zip(mcast_hops, ny)]
    comp = sram = 0
    for mt in set(mts):
        add_parts = [PE.task_parts(spec, dtype, ops=e, read_elems=e, write_elems=e, vector_ops=0)
                     for e in (min(epw, mt - s) for s in range(0, mt, epw))]
        add_c, add_s = sum(c for c, _ in add_parts), sum(s_ for _, s_ in add_parts)
        for j, kt in enumerate(kts):  # a PE's AXPY tasks, then the adds of its children's partials
            _, xc, xs = x_work(mt, kt)
            comp = max(comp, xc + n_kids[j] * add_c)
            sram = max(sram, xs + n_kids[j] * add_s)
    west, east = np.zeros(C), np.zeros(C)
    for c, p in parents.items():  # partials crossing each West-bound link (q+1 -> q) or East-bound (q -> q+1)
        if c > p:
            west[p:c] += 1
        else:
            east[c:p] += 1
    fabric = float(ny.max()) * max(west.max(), east.max(), n_kids.max())
    return make_cycles(compute=comp, sram=sram, fabric=fabric, total=float(done.max()), passes=passes)
