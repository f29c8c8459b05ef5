"""Wavelet-level event simulation of GEMM on 2D-distributed operands (SUMMA, Cannon): the slow reference that
judges `cost_gemm2d.py`. The schedules are those of `schedules_gemm2d.py`; the engine is `sim.EventSim` (every
wavelet through ramps and links at one per cycle, first come first served; one task at a time per PE).

A PE starts a panel's (or step's) block product once every wavelet of its operands has arrived and its previous
product is done; the product's AXPY tasks then run back to back (`schedules_gemm2d.block_product`: nothing else
runs on the core, so they are queued as one task of their summed cycles). When a PE sends two blocks at once
(SUMMA's owner of both panels, every Cannon shift) their wavelets alternate through its ramp.
"""

from __future__ import annotations

from collections import defaultdict

from waferscale.fabric.mesh import Coord, Mesh
from waferscale.fabric.schedules import tile_sizes
from waferscale.fabric.schedules_gemm2d import (block_product, block_wavelets, cannon_block, region, ring_slot,
                                                summa_panels)
from waferscale.fabric.sim import EventSim
from waferscale.fabric.spec import FabricSpec


def _send_both(sim: EventSim, t: int, src: Coord, streams: list[tuple[tuple, int, object]], on_deliver) -> None:
    """Inject the streams' wavelets (tree, count, payload) alternately through src's ramp."""
    for w in range(max((n for _, n, _ in streams), default=0)):
        for tree, n, payload in streams:
            if w < n:
                sim.send(t, src, tree, on_deliver, payload)


def sim_gemm2d(spec: FabricSpec, m: int, k: int, n: int, rows: int, cols: int, dtype: str = "fp16",
               algo: str = "summa", mesh: Mesh | None = None) -> int:
    """Cycle at which the last block product of Y = W X ends."""
    R, C = region(algo, m, k, n, rows, cols)
    sim = EventSim(spec, mesh, R, C)
    if algo == "summa":
        return _summa(sim, spec, m, k, n, R, C, dtype)
    return _cannon(sim, spec, m, k, n, R, dtype, algo == "cannon_folded")


def _summa(sim: EventSim, spec: FabricSpec, m: int, k: int, n: int, R: int, C: int, dtype: str) -> int:
    mts, nts = tile_sizes(m, R), tile_sizes(n, C)
    panels = summa_panels(k, R, C)
    trees: dict = {}

    def row_tree(i: int, c: int):  # (i, c) multicasts East and West along row i
        if ("r", i, c) not in trees:
            trees["r", i, c] = sim.mesh.multicast_tree([(i, j) for j in range(c, C)],
                                                       [[(i, j) for j in range(c, -1, -1)]])
        return trees["r", i, c]

    def col_tree(r: int, j: int):  # (r, j) multicasts South and North down column j
        if ("c", r, j) not in trees:
            trees["c", r, j] = sim.mesh.multicast_tree([(i, j) for i in range(r, R)],
                                                       [[(i, j) for i in range(r, -1, -1)]])
        return trees["c", r, j]

    def need(pe: Coord, p: int) -> int:
        (i, j), (_, kb, cw, rx) = pe, panels[p]
        return (block_wavelets(spec, dtype, mts[i], kb) if j != cw else 0) + \
            (block_wavelets(spec, dtype, kb, nts[j]) if i != rx else 0)

    got: dict = defaultdict(int)
    nxt: dict = defaultdict(int)  # the next panel each PE computes
    idle: set = {(i, j) for i in range(R) for j in range(C)}

    def send_panel(t: int, pe: Coord, p: int) -> None:
        (i, j), (_, kb, cw, rx) = pe, panels[p]
        streams = []
        if j == cw and C > 1:
            streams.append((row_tree(i, j), block_wavelets(spec, dtype, mts[i], kb), p))
        if i == rx and R > 1:
            streams.append((col_tree(i, j), block_wavelets(spec, dtype, kb, nts[j]), p))
        _send_both(sim, t, pe, streams, arrive)

    def try_begin(t: int, pe: Coord) -> None:
        p = nxt[pe]
        if pe in idle and p < len(panels) and got[pe, p] == need(pe, p):
            idle.discard(pe)
            if p + 1 < len(panels):
                send_panel(t, pe, p + 1)
            cyc = block_product(spec, dtype, mts[pe[0]], panels[p][1], nts[pe[1]])[0]
            sim.task(t, pe, cyc, done, pe, key=p)

    def done(t: int, pe: Coord) -> None:
        nxt[pe] += 1
        idle.add(pe)
        try_begin(t, pe)

    def arrive(t: int, pe: Coord, p: int) -> None:
        got[pe, p] += 1
        try_begin(t, pe)

    for i in range(R):
        for j in range(C):
            send_panel(0, (i, j), 0)
    for i in range(R):
        for j in range(C):
            sim.at(0, lambda t, pe: try_begin(t, pe), (i, j))
    return sim.run()


def _cannon(sim: EventSim, spec: FabricSpec, m: int, k: int, n: int, P: int, dtype: str, folded: bool) -> int:
    mts, kts, nts = tile_sizes(m, P), tile_sizes(k, P), tile_sizes(n, P)
    at = {(i, j): (ring_slot(i, P, folded), ring_slot(j, P, folded)) for i in range(P) for j in range(P)}
    ring = {v: u for u, v in at.items()}  # mesh PE -> ring position
    trees: dict = {}

    def tree(a: Coord, b: Coord):  # point to point between ring positions a and b
        if (a, b) not in trees:
            trees[a, b] = sim.mesh.multicast_tree([at[a], at[b]])
        return trees[a, b]

    def w_waves(i: int, l: int) -> int:
        return block_wavelets(spec, dtype, mts[i], kts[l])

    def x_waves(l: int, j: int) -> int:
        return block_wavelets(spec, dtype, kts[l], nts[j])

    def need(pos: Coord, s: int) -> int:
        i, j = pos
        l = cannon_block(i, j, s, P)
        return (w_waves(i, l) if s > 0 or i > 0 else 0) + (x_waves(l, j) if s > 0 or j > 0 else 0)

    got: dict = defaultdict(int)
    nxt: dict = defaultdict(int)
    idle: set = set(at)

    def try_begin(t: int, pos: Coord) -> None:
        s, (i, j) = nxt[pos], pos
        if pos in idle and s < P and got[pos, s] == need(pos, s):
            idle.discard(pos)
            l = cannon_block(i, j, s, P)
            if s + 1 < P:  # pass W West and X North (wrap-around) for the next step
                _send_both(sim, t, at[pos], [(tree(pos, (i, (j - 1) % P)), w_waves(i, l), s + 1),
                                             (tree(pos, ((i - 1) % P, j)), x_waves(l, j), s + 1)], arrive)
            sim.task(t, at[pos], block_product(spec, dtype, mts[i], kts[l], nts[j])[0], done, pos, key=s)

    def done(t: int, pos: Coord) -> None:
        nxt[pos] += 1
        idle.add(pos)
        try_begin(t, pos)

    def arrive(t: int, pe: Coord, s: int) -> None:
        pos = ring[pe]
        got[pos, s] += 1
        try_begin(t, pos)

    for (i, j) in at:  # the skew: W (i, j) to ring (i, j - i), X (i, j) to ring (i - j, j)
        streams = []
        if i > 0:
            streams.append((tree((i, j), (i, (j - i) % P)), w_waves(i, j), 0))
        if j > 0:
            streams.append((tree((i, j), ((i - j) % P, j)), x_waves(i, j), 0))
        _send_both(sim, 0, at[i, j], streams, arrive)
    for pos in at:
        sim.at(0, lambda t, p: try_begin(t, p), pos)
    return sim.run()
