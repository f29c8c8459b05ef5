"""Cycle model of GEMM on 2D-distributed operands: SUMMA and Cannon (the schedules of `schedules_gemm2d.py`,
judged by `sim_gemm2d.sim_gemm2d`, executed tile by tile in `kernels/gemm2d.py`); conventions in `cost.py`.

The schedule is evaluated panel by panel (SUMMA) or step by step (Cannon) for every PE at once, each block
transfer in closed form:

* a block of n wavelets sent at t leaves the sender's ramp one wavelet per cycle once the ramp is free (two
  blocks sent together alternate: Cannon's W and X, SUMMA's owner of both panels), then pays the ramp out, one
  cycle per hop of the real route (detours on a defective mesh: `Mesh.chain_hops`), the ramp in;
* a PE receives its two blocks through one ramp: the last wavelet is in when the later stream's last has
  arrived, or when all n_W + n_X have passed the ramp since the first arrived (or the ramp freed up);
* a PE starts a block product when its operands are in and its previous product is done; the product is one
  AXPY task per X wavelet (`schedules_gemm2d.block_product`, `pe.py`'s task model);
* flow control by double buffering: SUMMA's owners send panel p + 1 when they start computing panel p; a
  Cannon PE passes its blocks on when it starts computing with them;
* Cannon's skew sends every block at once along its row (W) or column (X): a link carries the wavelets of every
  block whose route crosses it, so a block's last wavelet arrives no earlier than the row's (column's) busiest
  link in that direction has carried them all;
* on a defective mesh with real routes (`cost.exact_routes`: up to 64x64 PEs) every block follows its real
  route (multicast tree) through work-conserving link queues (`_LinkQueue`), so detours that make
  streams share a link delay the later ones, within a panel or step and across them.

`total` is the latest end of a last product over PEs; compute/SRAM are the busiest PE's; fabric the busiest
ramp or link. Meshes of more than `EXACT_PES` PEs (prefill on a large part of the wafer) are evaluated in g x g
groups of PEs, each standing for its latest member: the largest block of the group, the longest route into it,
and (Cannon) both the neighbour group and itself as the sender of its next blocks; this bounds the per-PE
evaluation from above (tests/test_fabric_gemm2d.py measures how closely).

Omitted (beyond `cost.py`'s list): the route switches between SUMMA's panels (owners change every panel;
assumed free: a control wavelet); on a defect-free mesh, link sharing between consecutive panels' multicasts
and between the Cannon skew and its first steps; on defective meshes beyond 64x64 PEs, link sharing by detours
(their extra hops are charged).
"""

from __future__ import annotations

import math

import numpy as np

from waferscale.fabric import pe as PE
from waferscale.fabric.cost import Cycles, check_positive, check_region, color_passes, exact_routes, make_cycles
from waferscale.fabric.mesh import Coord, Mesh
from waferscale.fabric.schedules import tile_sizes
from waferscale.fabric.schedules_gemm2d import (block_product, check_algo, check_sram, region, ring_slot,
                                                summa_panels)
from waferscale.fabric.spec import FabricSpec

COLORS = 4  # W and X each on 2 alternating colors (consecutive panels/steps, or the skew and the steps)
EXACT_PES = 128 * 128  # larger meshes: evaluated in groups of PEs (cost ~ steps x groups instead of x PEs)


def gemm2d_cycles(spec: FabricSpec, m: int, k: int, n: int, rows: int, cols: int, dtype: str = "fp16", *,
                  algo: str = "summa", mesh: Mesh | None = None, group: int | None = None) -> Cycles:
    """Y (m, n) = W (m, k) X (k, n) with W, X and Y in rows x cols blocks (block (i, j) on PE (i, j)); algo in
    summa, cannon, cannon_folded. Raises ConfigError when the blocks and buffers overflow a PE's SRAM.
    `group`: PEs per side of an evaluation group (default 1 up to `EXACT_PES` PEs, then the smallest g giving
    at most that many groups)."""
    check_positive(m=m, k=k, n=n)
    check_algo(algo)
    R, C = check_region(spec, rows, cols, mesh)
    R, C = region(algo, m, k, n, R, C)
    check_sram(spec, algo, m, k, n, R, C, dtype)
    g = group if group is not None else max(1, math.ceil(math.sqrt(R * C / EXACT_PES)))
    check_positive(group=g)
    rowpos, colpos = _positions(mesh, R, C)
    shared = mesh if exact_routes(mesh, R, C) and g == 1 else None  # detours may make streams share links
    mts, nts = np.array(tile_sizes(m, R)), np.array(tile_sizes(n, C))
    prod = {(a, b): block_product(spec, dtype, a, 1, b) for a in set(mts.tolist()) for b in set(nts.tolist())}
    per_k = prod[int(mts.max()), int(nts.max())]  # the busiest PE's (cycles, compute, SRAM) per unit of k
    if algo == "summa":
        total, recv, link = _summa(spec, k, R, C, dtype, mts, nts, prod, rowpos, colpos, shared, g)
    else:
        total, recv, link = _cannon(spec, k, R, dtype, mts, nts, prod, rowpos, colpos, algo == "cannon_folded",
                                    shared, g)
    passes = color_passes(spec, COLORS)
    return make_cycles(compute=per_k[1] * k, sram=per_k[2] * k, fabric=max(recv, link), total=total * passes,
                       passes=passes)


def _positions(mesh: Mesh | None, R: int, C: int) -> tuple[np.ndarray, np.ndarray]:
    """(R, C) hops from (i, 0) along row i and from (0, j) down column j: route lengths between two PEs of a
    row (column) are differences of these (real routes on a defective mesh, `Mesh.chain_hops`)."""
    if mesh is None or not mesh.has_defects:
        return np.broadcast_to(np.arange(C), (R, C)), np.broadcast_to(np.arange(R)[:, None], (R, C))
    return mesh.chain_hops_cumulative(R, C, axis=1), mesh.chain_hops_cumulative(R, C, axis=0)


def _grouped(a: np.ndarray, g: int, fn=np.maximum, axes=(0, 1)) -> np.ndarray:
    """`fn` over the g x g groups of a 2D array (g consecutive indices along each of `axes`; the last smaller)."""
    for ax in axes:
        a = fn.reduceat(a, np.arange(0, a.shape[ax], g), axis=ax)
    return a


def _work(prod: dict, mt: np.ndarray, nt: np.ndarray) -> np.ndarray:
    """(len(mt), len(nt)) cycles of a block product per unit of k."""
    return np.array([[prod[a, b][0] for b in nt.tolist()] for a in mt.tolist()], np.float64)


class _LinkQueue:
    """The physical links of a defective mesh with real routes (`exact_routes`) as work-conserving queues at block
    granularity: a link serves one wavelet per cycle, so a block of n wavelets reaching it when earlier blocks
    still have work there finishes crossing it only after that work and its own n (its last wavelet is delayed;
    its first is not: wavelets of blocks sharing a link interleave). Blocks are offered in order of send time
    (the callers sort them), so detours that make streams share a link, within a step or across steps, delay
    the later ones."""

    def __init__(self, spec: FabricSpec, mesh: Mesh) -> None:
        self.spec, self.mesh, self.free, self.trees = spec, mesh, {}, {}

    def tree(self, pes: list[Coord], back: list[Coord] = ()) -> tuple[dict, dict]:
        key = (tuple(pes), tuple(back))
        if key not in self.trees:
            self.trees[key] = self.mesh.multicast_tree(pes, [back] if back else [])
        return self.trees[key]

    def send(self, tree: tuple[dict, dict], src: Coord, first: float, last: float, n: int) -> dict:
        """A block of n wavelets leaving logical `src`'s ramp from `first` to `last` into multicast `tree`:
        {logical PE: (first, last) arrival at its router} for every PE the tree delivers to."""
        (children, deliver), r, h = tree, self.spec.ramp_latency_cycles, self.spec.hop_latency_cycles
        out, todo = {}, [(self.mesh.physical(*src), first + r, last + r)]
        while todo:
            node, f, l = todo.pop()
            if node in deliver:
                out[deliver[node]] = (f, l)
            for q in children.get(node, ()):
                start = max(f, self.free.get((node, q), -np.inf))
                self.free[node, q] = start + n  # the link's work so far (wavelets of other blocks interleave)
                todo.append((q, f + h, max(l, start + n - 1) + h))
        return out


def _offer(queue: _LinkQueue, streams: list, shape: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Offer streams (send time, tree, src, first, last, n, kind 0/1) to the queue in order of send time:
    per kind, (first, last) arrival arrays of `shape` at the receivers' routers (inf/-inf where none)."""
    arr = [np.full(shape, np.inf), np.full(shape, -np.inf), np.full(shape, np.inf), np.full(shape, -np.inf)]
    for _, tree, src, first, last, n, kind in sorted(streams, key=lambda s: s[0]):
        if n > 0:
            for pe, (f, l) in queue.send(tree, src, first, last, n).items():
                arr[2 * kind][pe], arr[2 * kind + 1][pe] = f, l
    return tuple(arr)


def _departures(d0: np.ndarray, na: np.ndarray, nb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two blocks of na and nb wavelets leaving one ramp from d0, alternating (a first): (last of a, first of
    b, last of b). A block of 0 wavelets is not sent."""
    both = np.minimum(na, nb)
    last_a = d0 + np.where(na <= nb, 2 * na - 2, na + nb - 1)
    first_b = d0 + (na > 0)
    last_b = d0 + np.where(nb <= na, 2 * nb - 1 - (na == 0), na + nb - 1)
    return np.where(both > 0, last_a, d0 + na - 1), first_b, np.where(both > 0, last_b, d0 + nb - 1)


def _received(spec: FabricSpec, a, la, na, b, lb, nb, free) -> np.ndarray:
    """When the last wavelet of two streams (first/last arrival at the PE's router a/la and b/lb, na/nb
    wavelets; 0 = not received) is through the PE's ramp, which is free after `free`; -inf if none."""
    inf = np.inf
    a, la = np.where(na > 0, a, inf), np.where(na > 0, la, -inf)
    b, lb = np.where(nb > 0, b, inf), np.where(nb > 0, lb, -inf)
    start = np.maximum(np.minimum(a, b), free + 1)
    last = np.maximum(np.maximum(la, lb), start + na + nb - 1)
    return np.where(na + nb > 0, last + spec.ramp_latency_cycles, -inf)


def _summa(spec, k, R, C, dtype, mts, nts, prod, rowpos, colpos, mesh, g) -> tuple[float, float, float]:
    r, h = spec.ramp_latency_cycles, spec.hop_latency_cycles
    epw = PE.elems_per_wavelet(spec, dtype)
    mt, nt = np.maximum.reduceat(mts, np.arange(0, R, g)), np.maximum.reduceat(nts, np.arange(0, C, g))
    Rg, Cg = len(mt), len(nt)
    single_r = [min(g, R - I * g) == 1 for I in range(Rg)]  # a group of one PE: its owner receives nothing
    single_c = [min(g, C - J * g) == 1 for J in range(Cg)]
    work = _work(prod, mt, nt)
    # the spread of route positions in each group, and of the owner's position within a group of rows/columns
    rmin, rmax = _grouped(rowpos, g, np.minimum), _grouped(rowpos, g)
    omin, omax = _grouped(rowpos, g, np.minimum, (0,)), _grouped(rowpos, g, np.maximum, (0,))  # (Rg, C)
    cmin, cmax = _grouped(colpos, g, np.minimum), _grouped(colpos, g)
    xmin, xmax = _grouped(colpos, g, np.minimum, (1,)), _grouped(colpos, g, np.maximum, (1,))  # (R, Cg)
    start = np.zeros((Rg, Cg))  # when each PE started its current product (owners send the next panel then)
    end = np.zeros((Rg, Cg))
    out_free = np.zeros((Rg, Cg))  # first cycle each PE's outgoing ramp is free
    in_free = np.full((Rg, Cg), -np.inf)  # last cycle each PE's incoming ramp was busy
    recv = np.zeros((Rg, Cg))
    w_owned, x_owned = np.zeros((R, C)), np.zeros((R, C))  # W (X) wavelets each PE multicasts, over all panels
    queue = _LinkQueue(spec, mesh) if mesh is not None else None
    for p, (_, kb, cw, rx) in enumerate(summa_panels(k, R, C)):
        Jo, Io = cw // g, rx // g
        nw = -(-mt * kb // epw) * (C > 1)  # (Rg,) W panel wavelets sent along each row
        nx = -(-nt * kb // epw) * (R > 1)  # (Cg,) X panel wavelets sent down each column
        # W owners (i, cw), X owners (rx, j), sending once their ramp is free; (rx, cw) sends both, alternating
        d0w = np.maximum(start[:, Jo] if p else 0.0, out_free[:, Jo])
        d0x = np.maximum(start[Io, :] if p else 0.0, out_free[Io, :])
        w_last, x_first, x_last = d0w + nw - 1, d0x.copy(), d0x + nx - 1
        both = _departures(d0w[Io:Io + 1], nw[Io:Io + 1], nx[Jo:Jo + 1])
        w_last[Io], x_first[Jo], x_last[Jo] = (float(v[0]) for v in both)
        out_free[:, Jo] = np.where(nw > 0, d0w + nw, out_free[:, Jo])
        out_free[Io, :] = np.where(nx > 0, d0x + nx, out_free[Io, :])
        out_free[Io, Jo] = d0w[Io] + nw[Io] + nx[Jo] if nw[Io] + nx[Jo] else out_free[Io, Jo]
        if queue is not None:  # the real multicast trees, through the queues of their links (g = 1 here)
            a, la, b, lb = _offer(queue, [
                (d0w[i], queue.tree([(i, c) for c in range(cw, C)], [(i, c) for c in range(cw, -1, -1)]), (i, cw),
                 d0w[i], w_last[i], nw[i], 0) for i in range(R)] + [
                (d0x[j], queue.tree([(q, j) for q in range(rx, R)], [(q, j) for q in range(rx, -1, -1)]), (rx, j),
                 x_first[j], x_last[j], nx[j], 1) for j in range(C)], (R, C))
        else:  # straight routes; a group's farthest member from the owner
            hw = np.maximum(rmax - omin[:, [cw]], omax[:, [cw]] - rmin) * h
            hx = np.maximum(cmax - xmin[[rx], :], xmax[[rx], :] - cmin) * h
            a, la = d0w[:, None] + r + hw, w_last[:, None] + r + hw
            b, lb = x_first[None, :] + r + hx, x_last[None, :] + r + hx
        nw_in = np.repeat(nw[:, None], Cg, axis=1)
        nx_in = np.repeat(nx[None, :], Rg, axis=0)
        if single_c[Jo]:
            nw_in[:, Jo] = 0
        if single_r[Io]:
            nx_in[Io, :] = 0
        got = _received(spec, a, la, nw_in, b, lb, nx_in, in_free)
        in_free = np.where(nw_in + nx_in > 0, got - r, in_free)
        recv += nw_in + nx_in
        start = np.maximum(end, got)
        end = start + kb * work
        w_owned[:, cw] += -(-mts * kb // epw) * (C > 1)
        x_owned[rx, :] += -(-nts * kb // epw) * (R > 1)
    # row link c -> c+1 (East) carries the panels owned at columns <= c, c+1 -> c (West) those beyond; columns alike
    links = [np.cumsum(w_owned, axis=1)[:, :-1], w_owned.sum(axis=1, keepdims=True) - np.cumsum(w_owned, axis=1),
             np.cumsum(x_owned, axis=0)[:-1], x_owned.sum(axis=0, keepdims=True) - np.cumsum(x_owned, axis=0)]
    return float(end.max()), float(recv.max()), max(float(a.max(initial=0)) for a in links)


def _line_load(src: np.ndarray, dst: np.ndarray, waves: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Wavelets per link of each line (row) when every entry sends waves[i, s] from position src[i, s] to
    dst[i, s] along its line: (East-bound link c -> c+1, West-bound link c+1 -> c), each (lines, width - 1)."""
    lines = src.shape[0]
    east, west = np.zeros((lines, width + 1)), np.zeros((lines, width + 1))
    li = np.broadcast_to(np.arange(lines)[:, None], src.shape)
    lo, hi = np.minimum(src, dst), np.maximum(src, dst)
    for acc, sel in ((east, dst > src), (west, dst < src)):  # difference arrays over the links lo..hi-1
        np.add.at(acc, (li[sel], lo[sel]), waves[sel])
        np.add.at(acc, (li[sel], hi[sel]), -waves[sel])
    return np.cumsum(east, axis=1)[:, :width - 1], np.cumsum(west, axis=1)[:, :width - 1]


def _cannon(spec, k, P, dtype, mts, nts, prod, rowpos, colpos, folded, mesh, g) -> tuple[float, float, float]:
    r, h = spec.ramp_latency_cycles, spec.hop_latency_cycles
    epw = PE.elems_per_wavelet(spec, dtype)
    kts = np.array(tile_sizes(k, P))
    slot = np.array([ring_slot(q, P, folded) for q in range(P)])
    ii, jj = np.indices((P, P))  # ring positions; the PE of ring (i, j) is mesh (slot[i], slot[j])
    rpos, cpos = rowpos[np.ix_(slot, slot)], colpos[np.ix_(slot, slot)]

    def w_waves(l):  # W (i, l) blocks, (P, P)
        return -(-mts[:, None] * kts[l] // epw)

    def x_waves(l):
        return -(-kts[l] * nts[None, :] // epw)

    # the skew (every PE at once, t = 0): W (i, j) to ring (i, j - i), X (i, j) to ring (i - j, j)
    nw0, nx0 = w_waves(jj) * (ii > 0), x_waves(ii) * (jj > 0)
    w_dst, x_dst = (jj - ii) % P, (ii - jj) % P  # ring positions the skew sends to
    w_last, x_first, x_last = _departures(np.zeros((P, P)), nw0, nx0)
    east, west = _line_load(rpos, rpos[ii, w_dst], nw0, int(rowpos.max()) + 1)  # rows (by ring row i)
    south, north = _line_load(cpos.T, cpos[x_dst, jj].T, nx0.T, int(colpos.max()) + 1)  # columns (ring col j)
    # receiver (i, j) gets W from ring (i, j + i) and X from ring (i + j, j)
    ws, xs = (ii, (jj + ii) % P), ((ii + jj) % P, jj)
    if mesh is None:  # the busiest link of its row (column) in the block's direction bounds its last wavelet
        w_busy = np.where(rpos[ii, w_dst] < rpos, west.max(axis=1, initial=0)[:, None],
                          east.max(axis=1, initial=0)[:, None])
        x_busy = np.where(cpos[x_dst, jj] < cpos, north.max(axis=1, initial=0)[None, :],
                          south.max(axis=1, initial=0)[None, :])
        hw, hx = np.abs(rpos[ws] - rpos) * h, np.abs(cpos[xs] - cpos) * h
        a, la = r + hw, np.maximum(w_last, w_busy - 1)[ws] + r + hw
        b, lb = x_first[xs] + r + hx, np.maximum(x_last, x_busy - 1)[xs] + r + hx
    else:  # the real routes, through the queues of their links
        queue = _LinkQueue(spec, mesh)
        pe = {(i, j): (int(slot[i]), int(slot[j])) for i in range(P) for j in range(P)}
        ring = np.ix_(slot, slot)  # mesh-indexed arrays -> ring-indexed
        a, la, b, lb = (v[ring] for v in _offer(queue, [
            (0, queue.tree([pe[i, j], pe[i, int(w_dst[i, j])]]), pe[i, j], 0, w_last[i, j], nw0[i, j], 0)
            for i in range(P) for j in range(P)] + [
            (0, queue.tree([pe[i, j], pe[int(x_dst[i, j]), j]]), pe[i, j], x_first[i, j], x_last[i, j], nx0[i, j], 1)
            for i in range(P) for j in range(P)], (P, P)))
    got = _received(spec, a, la, nw0[ws], b, lb, nx0[xs], np.full((P, P), -np.inf))
    link = float(max(east.max(initial=0), west.max(initial=0), south.max(initial=0), north.max(initial=0)))
    # the steps, per group of PEs (g = 1: per PE): W comes from the East ring neighbour, X from the South one
    mt, nt = np.maximum.reduceat(mts, np.arange(0, P, g)), np.maximum.reduceat(nts, np.arange(0, P, g))
    Pg, work = len(mt), _work(prod, mt, nt)
    many = np.array([min(g, P - q * g) > 1 for q in range(Pg)])
    # hops into each group's members from a sender in the same group / in the neighbour group (-1: none)
    inner_w, inner_x = (jj + 1) % P // g == jj // g, (ii + 1) % P // g == ii // g
    hw_w, hx_x = np.abs(rpos[ii, (jj + 1) % P] - rpos) * h, np.abs(cpos[(ii + 1) % P, jj] - cpos) * h
    hw_in, hw = _grouped(np.where(inner_w, hw_w, -1), g), _grouped(np.where(inner_w, -1, hw_w), g)
    hx_in, hx = _grouped(np.where(inner_x, hx_x, -1), g), _grouped(np.where(inner_x, -1, hx_x), g)
    start = np.maximum(_grouped(got, g), 0)
    in_free = _grouped(got, g) - r
    out_free = _grouped((nw0 + nx0).astype(np.float64), g)
    recv = _grouped(nw0[ws] + nx0[xs], g)
    I, J = np.indices((Pg, Pg))

    def kt_at(s):  # a group's largest k block at step s (a group of one PE: its own)
        return np.where(many[:, None] | many[None, :], kts.max(), kts[(I * g + J * g + s) % P])

    end = start + kt_at(0) * work
    for s in range(1, P):
        kl = kt_at(s - 1)  # the block each PE computed at step s - 1, passed on when it began
        nw, nx = -(-mt[:, None] * kl // epw), -(-kl * nt[None, :] // epw)
        d0 = np.maximum(start, out_free)
        w_last, x_first, x_last = _departures(d0, nw, nx)
        out_free = d0 + nw + nx
        east_of, south_of = (I, (J + 1) % Pg), ((I + 1) % Pg, J)
        # first and last arrival at the router: from the neighbour group, or (inside a group) from the group itself
        a, la = d0[east_of] + hw, w_last[east_of] + hw
        b, lb = x_first[south_of] + hx, x_last[south_of] + hx
        if mesh is not None:  # g = 1: the real routes, through the queues of their links
            a, la, b, lb = (v[ring] - r for v in _offer(queue, [
                (d0[i, j], queue.tree([pe[i, j], pe[i, (j - 1) % P]]), pe[i, j], d0[i, j], w_last[i, j], nw[i, j], 0)
                for i in range(P) for j in range(P)] + [
                (d0[i, j], queue.tree([pe[i, j], pe[(i - 1) % P, j]]), pe[i, j], x_first[i, j], x_last[i, j],
                 nx[i, j], 1) for i in range(P) for j in range(P)], (P, P)))
        elif g > 1:
            inner_a, inner_b = hw_in >= 0, hx_in >= 0
            a, la = (np.where(inner_a, np.maximum(a, d0 + hw_in), a),
                     np.where(inner_a, np.maximum(la, w_last + hw_in), la))
            b, lb = (np.where(inner_b, np.maximum(b, x_first + hx_in), b),
                     np.where(inner_b, np.maximum(lb, x_last + hx_in), lb))
        got = _received(spec, a + r, la + r, nw[east_of], b + r, lb + r, nx[south_of], in_free)
        in_free = got - r
        recv = recv + nw[east_of] + nx[south_of]
        start = np.maximum(end, got)
        end = start + kt_at(s) * work
        link += max(float(nw.max()), float(nx.max()))  # a step's shifts use distinct links: a block per link
    return float(end.max()), float(recv.max()), link
