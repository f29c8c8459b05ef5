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
  link in that direction has carried them all.

`total` is the latest end of a last product over PEs; compute/SRAM are the busiest PE's; fabric the busiest
ramp or link. Omitted (beyond `cost.py`'s list): the route switches between SUMMA's panels (owners change every
panel; assumed free: a control wavelet), link sharing between consecutive panels' multicasts, and link
contention of the Cannon steps on detoured routes.
"""

from __future__ import annotations

import numpy as np

from waferscale.fabric import pe as PE
from waferscale.fabric.cost import Cycles, check_positive, check_region, color_passes, exact_routes, make_cycles
from waferscale.fabric.mesh import Coord, Mesh
from waferscale.fabric.schedules import tile_sizes
from waferscale.fabric.schedules_gemm2d import (block_product, check_algo, check_sram, region, ring_slot,
                                                summa_panels)
from waferscale.fabric.spec import FabricSpec

COLORS = 4  # W and X each on 2 alternating colors (consecutive panels/steps, or the skew and the steps)


def gemm2d_cycles(spec: FabricSpec, m: int, k: int, n: int, rows: int, cols: int, dtype: str = "fp16", *,
                  algo: str = "summa", mesh: Mesh | None = None) -> Cycles:
    """Y (m, n) = W (m, k) X (k, n) with W, X and Y in rows x cols blocks (block (i, j) on PE (i, j)); algo in
    summa, cannon, cannon_folded. Raises ConfigError when the blocks and buffers overflow a PE's SRAM."""
    check_positive(m=m, k=k, n=n)
    check_algo(algo)
    R, C = check_region(spec, rows, cols, mesh)
    R, C = region(algo, m, k, n, R, C)
    check_sram(spec, algo, m, k, n, R, C, dtype)
    rowpos, colpos = _positions(mesh, R, C)
    shared = mesh if exact_routes(mesh, R, C) else None  # detours may make streams share links
    mts, nts = np.array(tile_sizes(m, R)), np.array(tile_sizes(n, C))
    per_k = np.array([[block_product(spec, dtype, int(a), 1, int(b)) for b in nts] for a in mts])  # (R, C, 3)
    if algo == "summa":
        total, recv, link = _summa(spec, k, R, C, dtype, mts, nts, per_k[..., 0], rowpos, colpos, shared)
        kw = np.array([w for _, w, _, _ in summa_panels(k, R, C)]).sum()
    else:
        total, recv, link = _cannon(spec, k, R, dtype, mts, nts, per_k[..., 0], rowpos, colpos,
                                    algo == "cannon_folded", shared)
        kw = k
    passes = color_passes(spec, COLORS)
    return make_cycles(compute=float(per_k[..., 1].max()) * kw, sram=float(per_k[..., 2].max()) * kw,
                       fabric=max(recv, link), total=total * passes, passes=passes)


def _positions(mesh: Mesh | None, R: int, C: int) -> tuple[np.ndarray, np.ndarray]:
    """(R, C) hops from (i, 0) along row i and from (0, j) down column j: route lengths between two PEs of a
    row (column) are differences of these (real routes on a defective mesh, `Mesh.chain_hops`)."""
    if mesh is None or not mesh.has_defects:
        return np.broadcast_to(np.arange(C), (R, C)), np.broadcast_to(np.arange(R)[:, None], (R, C))
    return mesh.chain_hops_cumulative(R, C, axis=1), mesh.chain_hops_cumulative(R, C, axis=0)


class _Sharing:
    """Streams whose detoured routes share physical links (a defective mesh with real routes, `exact_routes`):
    each stream is a list of (from, to) logical hops; `busiest(waves)` gives, per stream, the wavelets that the
    busiest link on its route carries when every stream sends its `waves` at once (itself included)."""

    def __init__(self, mesh: Mesh, streams: list[list[tuple[Coord, Coord]]], ids: dict | None = None) -> None:
        self.ids = {} if ids is None else ids
        link_idx, stream_idx = [], []
        for s, hops in enumerate(streams):
            links = {(p, q) for a, b in hops for p, q in zip(mesh.route(a, b), mesh.route(a, b)[1:])}
            link_idx += [self.ids.setdefault(link, len(self.ids)) for link in links]
            stream_idx += [s] * len(links)
        self.link, self.stream, self.n = np.array(link_idx, np.int64), np.array(stream_idx, np.int64), len(streams)

    def busiest(self, waves: np.ndarray) -> np.ndarray:
        load = np.bincount(self.link, weights=waves[self.stream], minlength=len(self.ids))
        out = np.zeros(self.n)
        np.maximum.at(out, self.stream, load[self.link])
        return out


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


def _summa(spec, k, R, C, dtype, mts, nts, per_k, rowpos, colpos, mesh) -> tuple[float, float, float]:
    r, h = spec.ramp_latency_cycles, spec.hop_latency_cycles
    epw = PE.elems_per_wavelet(spec, dtype)
    ii, jj = np.indices((R, C))
    start = np.zeros((R, C))  # when each PE started its current product (owners send the next panel then)
    end = np.zeros((R, C))
    out_free = np.zeros((R, C))  # first cycle each PE's outgoing ramp is free
    in_free = np.full((R, C), -np.inf)  # last cycle each PE's incoming ramp was busy
    recv = np.zeros((R, C))
    w_link = np.zeros((R, 2 * max(C - 1, 1)))  # W wavelets per row link: East-bound c -> c+1, West-bound
    x_link = np.zeros((2 * max(R - 1, 1), C))
    sharing: dict = {}  # (W owner column, X owner row) -> _Sharing of that panel's multicasts
    ids: dict = {}
    for p, (_, kb, cw, rx) in enumerate(summa_panels(k, R, C)):
        nw = -(-mts * kb // epw) * (C > 1)  # (R,) W panel wavelets sent along each row
        nx = -(-nts * kb // epw) * (R > 1)  # (C,) X panel wavelets sent down each column
        t = start if p else np.zeros((R, C))
        # W owners (i, cw), X owners (rx, j); (rx, cw) sends both, alternating
        nw_o, nx_o = np.zeros((R, C), np.int64), np.zeros((R, C), np.int64)
        nw_o[:, cw], nx_o[rx, :] = nw, nx
        d0 = np.maximum(t, out_free)
        w_last, x_first, x_last = _departures(d0, nw_o, nx_o)
        out_free = np.where(nw_o + nx_o > 0, d0 + nw_o + nx_o, out_free)
        w_last, x_last = w_last[:, [cw]], x_last[[rx], :]
        if mesh is not None:  # a multicast is no faster than the busiest link its tree shares with others
            if (cw, rx) not in sharing:
                sharing[cw, rx] = _Sharing(mesh, [_line_hops(i, cw, C, True) for i in range(R)]
                                           + [_line_hops(j, rx, R, False) for j in range(C)], ids)
            busy = sharing[cw, rx].busiest(np.concatenate([nw, nx]).astype(np.float64))
            w_last = np.maximum(w_last, d0[:, [cw]] + busy[:R, None] - 1)
            x_last = np.maximum(x_last, x_first[[rx], :] + busy[None, R:] - 1)
        hw = np.abs(rowpos - rowpos[:, [cw]]) * h
        hx = np.abs(colpos - colpos[[rx], :]) * h
        nw_in = np.where(jj != cw, nw[:, None], 0)
        nx_in = np.where(ii != rx, nx[None, :], 0)
        got = _received(spec, d0[:, [cw]] + r + hw, w_last + r + hw, nw_in,
                        x_first[[rx], :] + r + hx, x_last + r + hx, nx_in, in_free)
        in_free = np.where(nw_in + nx_in > 0, got - r, in_free)
        recv += nw_in + nx_in
        start = np.maximum(end, got)
        end = start + kb * per_k
        if C > 1:  # East-bound links c -> c+1 carry the panel when cw <= c, West-bound ones when cw > c
            w_link[:, :C - 1] += np.where(np.arange(C - 1) >= cw, nw[:, None], 0)
            w_link[:, C - 1:] += np.where(np.arange(C - 1) < cw, nw[:, None], 0)
        if R > 1:
            x_link[:R - 1] += np.where(np.arange(R - 1)[:, None] >= rx, nx[None, :], 0)
            x_link[R - 1:] += np.where(np.arange(R - 1)[:, None] < rx, nx[None, :], 0)
    return float(end.max()), float(recv.max()), float(max(w_link.max(), x_link.max()))


def _line_hops(line: int, owner: int, length: int, along_row: bool) -> list[tuple[Coord, Coord]]:
    """The hops of a multicast from `owner` to both ends of row (or column) `line`."""
    hops = [(q, q + 1) for q in range(owner, length - 1)] + [(q, q - 1) for q in range(owner, 0, -1)]
    return [((line, a), (line, b)) if along_row else ((a, line), (b, line)) for a, b in hops]


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


def _cannon(spec, k, P, dtype, mts, nts, per_k, rowpos, colpos, folded, mesh) -> tuple[float, float, float]:
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

    # the skew: W (i, j) to ring (i, j - i), X (i, j) to ring (i - j, j), all at t = 0
    nw0, nx0 = w_waves(jj) * (ii > 0), x_waves(ii) * (jj > 0)
    w_dst, x_dst = (jj - ii) % P, (ii - jj) % P  # ring positions the skew sends to
    w_last, x_first, x_last = _departures(np.zeros((P, P)), nw0, nx0)
    out_free = (nw0 + nx0).astype(np.float64)
    east, west = _line_load(rpos, rpos[ii, w_dst], nw0, int(rowpos.max()) + 1)  # rows (by ring row i)
    south, north = _line_load(cpos.T, cpos[x_dst, jj].T, nx0.T, int(colpos.max()) + 1)  # columns (ring col j)
    # the busiest link of its row (column) in the direction a block travels bounds when its last wavelet can
    # arrive; with detours, the busiest link on its own route, whatever else crosses it
    if mesh is None:
        w_busy = np.where(rpos[ii, w_dst] < rpos, west.max(axis=1, initial=0)[:, None],
                          east.max(axis=1, initial=0)[:, None])
        x_busy = np.where(cpos[x_dst, jj] < cpos, north.max(axis=1, initial=0)[None, :],
                          south.max(axis=1, initial=0)[None, :])
    else:
        pe = {(i, j): (int(slot[i]), int(slot[j])) for i in range(P) for j in range(P)}
        busy = _Sharing(mesh, [[(pe[i, j], pe[i, int(w_dst[i, j])])] for i in range(P) for j in range(P)]
                        + [[(pe[i, j], pe[int(x_dst[i, j]), j])] for i in range(P) for j in range(P)]).busiest(
            np.concatenate([nw0.ravel(), nx0.ravel()]).astype(np.float64))
        w_busy, x_busy = busy[:P * P].reshape(P, P), busy[P * P:].reshape(P, P)
        steps = _Sharing(mesh, [[(pe[i, j], pe[i, (j - 1) % P])] for i in range(P) for j in range(P)]
                         + [[(pe[i, j], pe[(i - 1) % P, j])] for i in range(P) for j in range(P)])
    # receiver (i, j) gets W from ring (i, j + i) and X from ring (i + j, j) (busy: by sender)
    ws, xs = (ii, (jj + ii) % P), ((ii + jj) % P, jj)
    w_busy, x_busy = w_busy[ws], x_busy[xs]
    hw, hx = np.abs(rpos[ws] - rpos) * h, np.abs(cpos[xs] - cpos) * h
    got = _received(spec, r + hw, np.maximum(w_last[ws], w_busy - 1) + r + hw, nw0[ws],
                    x_first[xs] + r + hx, np.maximum(x_last[xs], x_busy - 1) + r + hx, nx0[xs],
                    np.full((P, P), -np.inf))
    in_free = got - r
    recv = nw0[ws] + nx0[xs]
    start = np.maximum(got, 0)
    end = start + kts[(ii + jj) % P] * per_k  # tiles follow ring positions
    link = float(max(east.max(initial=0), west.max(initial=0), south.max(initial=0), north.max(initial=0)))
    for s in range(1, P):
        l_prev = (ii + jj + s - 1) % P  # the block each PE computed at step s - 1, passed on when it began
        nw, nx = w_waves(l_prev), x_waves(l_prev)
        d0 = np.maximum(start, out_free)
        w_last, x_first, x_last = _departures(d0, nw, nx)
        if mesh is not None:
            busy = steps.busiest(np.concatenate([nw.ravel(), nx.ravel()]).astype(np.float64))
            w_last = np.maximum(w_last, d0 + busy[:P * P].reshape(P, P) - 1)
            x_last = np.maximum(x_last, x_first + busy[P * P:].reshape(P, P) - 1)
        out_free = d0 + nw + nx
        ws, xs = (ii, (jj + 1) % P), ((ii + 1) % P, jj)  # W comes from the East ring neighbour, X from the South
        hw, hx = np.abs(rpos[ws] - rpos) * h, np.abs(cpos[xs] - cpos) * h
        got = _received(spec, d0[ws] + r + hw, w_last[ws] + r + hw, nw[ws],
                        x_first[xs] + r + hx, x_last[xs] + r + hx, nx[xs], in_free)
        in_free = got - r
        recv = recv + nw[ws] + nx[xs]
        start = np.maximum(end, got)
        end = start + kts[(ii + jj + s) % P] * per_k
        link += max(float(nw.max()), float(nx.max()))  # a step's shifts use distinct links: a block per link
    return float(end.max()), float(recv.max()), link
