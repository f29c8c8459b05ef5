"""Event simulation of the GEMV of the in-layer model-parallel layout (`schedules_gemv.py`), wavelet by wavelet
on the engine of `sim.py` (links of one wavelet per cycle, PEs running one task at a time, the mesh's routes):
the slow reference that judges `cost_matmul.gemv_allreduce_cycles`.

Every PE starts with its x segment in memory and queues one AXPY task per x wavelet's worth of values at t = 0.
A leaf of the row tree sends its partial's wavelets to its parent once its tasks are done; a PE adds each
arriving wavelet of a child (one add task per wavelet, in wavelet order, not before its own partial is ready)
and forwards wavelet w once every child's wavelet w is in; the root (column 0, or the row's centre for
"phases"), once it holds the whole sum, multicasts it along the row (both ways from a centre). Returns the
cycle the last PE of the last row receives its last wavelet of y.
"""

from __future__ import annotations

from collections import defaultdict

from waferscale.fabric import pe as PE
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.schedules import tile_sizes, used
from waferscale.fabric.schedules_gemv import row_multicast, row_reduce_parents, row_root
from waferscale.fabric.sim import EventSim, split_sizes
from waferscale.fabric.spec import FabricSpec


def sim_gemv_allreduce(spec: FabricSpec, m: int, k: int, rows: int, cols: int, dtype: str = "fp16",
                       algo: str = "ktree", fan_in: int = 2, mesh: Mesh | None = None) -> int:
    R, C = used(m, rows), used(k, cols)
    sim = EventSim(spec, mesh, R, C)
    mts, kts = tile_sizes(m, R), tile_sizes(k, C)
    epw = PE.elems_per_wavelet(spec, dtype)
    parents = row_reduce_parents(algo, C, fan_in)
    n_kids = defaultdict(int)
    for p in parents.values():
        n_kids[p] += 1
    up = {(i, c): sim.mesh.multicast_tree([(i, c), (i, p)]) for i in range(R) for c, p in parents.items()}
    root = row_root(parents, C)
    along = {i: sim.mesh.multicast_tree(*row_multicast(i, root, C)) for i in range(R)}
    y_waves = [split_sizes(mt, epw) for mt in mts]
    x_left = {(i, j): len(split_sizes(kts[j], epw)) for i in range(R) for j in range(C)}
    ready: set = set()
    stash: dict = defaultdict(list)
    added: dict = defaultdict(int)
    at_root: dict = defaultdict(int)

    def x_done(t, pe):
        x_left[pe] -= 1
        if x_left[pe] == 0:
            ready.add(pe)
            if n_kids[pe[1]] == 0:  # a leaf (or a row of one PE): its partial is what it sends
                for w in range(len(y_waves[pe[0]])):
                    forward(t, pe, w)
            for w in stash.pop(pe, []):
                on_partial(t, pe, w)

    def forward(t, pe, w):
        i, j = pe
        if j in parents:
            sim.send(t, pe, up[pe], on_partial, w)
            return
        at_root[i] += 1  # the root has the whole sum of wavelet w
        if C > 1 and at_root[i] == len(y_waves[i]):
            for b in range(len(y_waves[i])):
                sim.send(t, pe, along[i], lambda t, pe, w: None, b)

    def on_partial(t, pe, w):  # a child's wavelet w: added once this PE's own partial is ready
        if pe not in ready:
            stash[pe].append(w)
            return
        sim.task(t, pe, PE.add_task(spec, dtype, y_waves[pe[0]][w]), add_done, pe, w, key=(1, w))

    def add_done(t, pe, w):
        added[pe, w] += 1
        if added[pe, w] == n_kids[pe[1]]:
            forward(t, pe, w)

    for i in range(R):
        for j in range(C):
            for e in split_sizes(kts[j], epw):
                sim.task(0, (i, j), PE.axpy_task(spec, dtype, e, mts[i]), x_done, (i, j), key=(0, 0))
    return sim.run()
