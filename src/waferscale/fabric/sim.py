"""Discrete-event simulation of the fabric kernels at wavelet granularity (the slow reference for `cost*.py`).

What is simulated, event by event (a heap ordered by cycle):

* every 32-bit wavelet separately: injected by a core through its RAMP (a link of `ramp_latency_cycles`),
  forwarded router to router (`hop_latency_cycles` per hop) along the mesh's physical route, copied at
  multicast branch points, and delivered through the destination's RAMP;
* every link and ramp carries at most one wavelet per cycle per direction; a wavelet that finds its link busy
  waits (first come, first served), so contention and pipelining fall out of the simulation;
* every PE runs one task at a time (dataflow: a task fires when its wavelet arrives; among ready tasks the
  earliest in stream order goes first); a task's
  length comes from the PE micro-model in `pe.py` (FMAC lanes and SRAM ports);
* kernels are the schedules documented in `kernels/` (x multicast down columns, East->West partial-sum chains,
  chain/tree/2D reductions, then (once the root has the whole sum) a 2D multicast broadcast, row all-reduces
  for norms/softmax, a log-sum-exp chain for attention); the reduction trees and the row programs' phase lists
  come from `schedules.py`, the same ones the cost model reads.

Omitted: finite router buffers and back-pressure (queues are unbounded), color/route table limits (checked by
the cost model, not timed here), task-switch overhead, and sending from memory costs no core cycles.
Every `sim_*` returns the cycle at which the last event of the kernel happens.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from typing import Callable

import numpy as np

from waferscale.fabric import pe as PE
from waferscale.fabric.mesh import Coord, Mesh
from waferscale.fabric.schedules import broadcast_chains, reduce_parents, tile_sizes, used
from waferscale.fabric.spec import FabricSpec


class EventSim:
    """The engine: links with one-wavelet-per-cycle capacity, PEs with one task at a time, a time-ordered heap."""

    def __init__(self, spec: FabricSpec, mesh: Mesh | None, rows: int, cols: int) -> None:
        self.spec = spec
        self.mesh = mesh if mesh is not None else Mesh.perfect(spec.with_pes(rows, cols))
        self.rows, self.cols = self.mesh.check_region(rows, cols)
        self.heap: list = []
        self.seq = 0
        self.link_free: dict = defaultdict(int)
        self.pe_free: dict = defaultdict(int)
        self.ready: dict = defaultdict(list)
        self.busy: set = set()
        self.now = 0
        self.events = 0

    # ---- the event loop --------------------------------------------------------------------------------
    def at(self, t: int, fn: Callable, *args) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, args))

    def run(self) -> int:
        while self.heap:
            t, _, fn, args = heapq.heappop(self.heap)
            self.now = max(self.now, t)
            self.events += 1
            fn(t, *args)
        return self.now

    def _link(self, t: int, key, latency: int) -> int:
        """Take link `key` at or after cycle t (one wavelet per cycle); returns the arrival cycle."""
        depart = max(t, self.link_free[key])
        self.link_free[key] = depart + 1
        return depart + latency

    # ---- PEs -------------------------------------------------------------------------------------------
    def task(self, t: int, pe: Coord, cycles: int, then: Callable, *args, key=0) -> None:
        """Queue a task of `cycles` on logical PE `pe`; call then(end, *args) when it ends.

        A PE runs one task at a time. When it frees up it picks the ready task with the smallest `key` (ties:
        arrival order) — kernels pass the wavelet's position in its stream, so a PE serves wavelet w from all
        its inputs before wavelet w+1, as the stream order of a dataflow program does."""
        self.seq += 1
        heapq.heappush(self.ready[pe], (key, self.seq, cycles, then, args))
        if self.pe_free[pe] <= t and pe not in self.busy:
            self._start(t, pe)

    def _start(self, t: int, pe: Coord) -> None:
        _, _, cycles, then, args = heapq.heappop(self.ready[pe])
        self.busy.add(pe)
        self.pe_free[pe] = t + cycles
        self.at(t + cycles, self._end, pe, then, args)

    def _end(self, t: int, pe: Coord, then: Callable, args: tuple) -> None:
        self.busy.discard(pe)
        then(t, *args)
        if self.ready[pe] and pe not in self.busy:
            self._start(t, pe)

    # ---- streams (multicast trees from `Mesh.multicast_tree`) -------------------------------------------
    def send(self, t: int, src: Coord, tree: tuple[dict, dict], on_deliver: Callable, payload) -> None:
        """Inject one wavelet at logical `src` (through its ramp) into multicast `tree`."""
        node = self.mesh.physical(*src)
        self.at(self._link(t, ("ramp-out", node), self.spec.ramp_latency_cycles), self._hop, node, tree,
                on_deliver, payload)

    def _hop(self, t: int, node, tree, on_deliver, payload) -> None:
        children, deliver = tree
        if node in deliver:
            arrive = self._link(t, ("ramp-in", node), self.spec.ramp_latency_cycles)
            self.at(arrive, on_deliver, deliver[node], payload)
        for nxt in children.get(node, ()):
            self.at(self._link(t, (node, nxt), self.spec.hop_latency_cycles), self._hop, nxt, tree, on_deliver,
                    payload)


def split_sizes(n: int, per: int) -> list[int]:
    return [min(per, n - s) for s in range(0, n, per)]


# ---- GEMV / GEMM / SpMV ---------------------------------------------------------------------------------
def sim_gemm(spec: FabricSpec, m: int, k: int, n: int, rows: int, cols: int, dtype: str = "fp16",
             mesh: Mesh | None = None, nnz_cols: np.ndarray | None = None) -> int:
    """Weight-stationary GEMM of n streamed vectors (n=1: GEMV). With `nnz_cols` (R, C, kt) — the non-zeros in
    each column of each PE's tile — it is the sparse GEMV: one multiply-add per non-zero."""
    R, C = used(m, rows), used(k, cols)
    sim = EventSim(spec, mesh, R, C)
    mts, kts = tile_sizes(m, R), tile_sizes(k, C)
    epw = PE.elems_per_wavelet(spec, dtype)
    x_trees = [sim.mesh.multicast_tree([(i, j) for i in range(R)]) for j in range(C)]
    # the PE of row 0 also takes its own x from the stream (loop-back through its ramp)
    x_trees = [(ch, {**dl, sim.mesh.physical(0, j): (0, j)}) for j, (ch, dl) in enumerate(x_trees)]
    west = {(i, j): sim.mesh.multicast_tree([(i, j), (i, j - 1)]) for i in range(R) for j in range(1, C)}
    x_waves = [split_sizes(kt, epw) for kt in kts]
    done_x = defaultdict(int)
    ready: dict = defaultdict(set)
    stash: dict = defaultdict(list)

    def x_cost(pe: Coord, w: int, e: int) -> int:
        i, j = pe
        if nnz_cols is None:
            return PE.axpy_task(spec, dtype, e, mts[i])
        nz = int(nnz_cols[i, j, w * epw: w * epw + e].sum())  # value, index, y read; y write per non-zero
        return PE.task_cycles(spec, dtype, ops=nz, read_elems=3 * nz, write_elems=nz, vector_ops=e, fmac=True)

    def on_x(t, pe, payload):
        v, w, e = payload
        sim.task(t, pe, x_cost(pe, w, e), x_done, pe, v, key=(v, 0, w))

    def x_done(t, pe, v):
        done_x[pe, v] += 1
        if done_x[pe, v] == len(x_waves[pe[1]]):
            partial_ready(t, pe, v)

    def partial_ready(t, pe, v):
        i, j = pe
        ready[pe].add(v)
        if j == C - 1 and C > 1:
            for w, e in enumerate(split_sizes(mts[i], epw)):
                sim.send(t, pe, west[pe], on_partial, (v, w, e))
        for payload in stash.pop((pe, v), []):
            on_partial(t, pe, payload)

    def on_partial(t, pe, payload):  # an East partial is added once this PE's own partial is ready
        v, w, e = payload
        if v in ready[pe]:
            sim.task(t, pe, PE.add_task(spec, dtype, e), add_done, pe, payload, key=(v, 1, w))
        else:
            stash[pe, v].append(payload)

    def add_done(t, pe, payload):
        if pe[1] > 0:
            sim.send(t, pe, west[pe], on_partial, payload)

    for j in range(C):
        for v in range(n):
            for w, e in enumerate(x_waves[j]):
                sim.send(0, (0, j), x_trees[j], on_x, (v, w, e))
    return sim.run()


def sim_gemv(spec, m, k, rows, cols, dtype="fp16", mesh=None) -> int:
    return sim_gemm(spec, m, k, 1, rows, cols, dtype, mesh)


# ---- collectives ----------------------------------------------------------------------------------------
def broadcast_tree(sim: EventSim, R: int, C: int, algo: str = "2d", phases: int = 1):
    """Root (0, 0) multicasts East along row 0; every row-0 router also multicasts South down its column. For
    "center": the root along its column, and every router of it along its row (both ways)."""
    return sim.mesh.multicast_tree(*broadcast_chains(algo, R, C, phases))


def sim_allreduce(spec: FabricSpec, n_elems: int, rows: int, cols: int, algo: str = "2d", dtype: str = "fp32",
                  mesh: Mesh | None = None, fan_in: int = 1) -> int:
    """`schedules.reduce_parents`'s tree (for "center" with `fan_in` phases per axis), then its broadcast."""
    sim = EventSim(spec, mesh, rows, cols)
    R, C = sim.rows, sim.cols
    parents = reduce_parents(algo, R, C, fan_in)
    n_children = defaultdict(int)
    for p in parents.values():
        n_children[p] += 1
    up = {pe: sim.mesh.multicast_tree([pe, par]) for pe, par in parents.items()}
    bcast = broadcast_tree(sim, R, C, algo, fan_in)
    waves = split_sizes(n_elems, PE.elems_per_wavelet(spec, dtype))
    added = defaultdict(int)
    at_root = [0]

    def forward(t, pe, w):
        if pe in parents:
            sim.send(t, pe, up[pe], on_partial, w)
            return
        at_root[0] += 1  # the root has the full sum of wavelet w
        if R * C > 1 and at_root[0] == len(waves):  # reduce done: broadcast it all
            for b in range(len(waves)):
                sim.send(t, pe, bcast, lambda t, pe, w: None, b)

    def on_partial(t, pe, w):
        sim.task(t, pe, PE.add_task(spec, dtype, waves[w]), add_done, pe, w, key=w)

    def add_done(t, pe, w):
        added[pe, w] += 1
        if added[pe, w] == n_children[pe]:
            forward(t, pe, w)

    for i in range(R):
        for j in range(C):
            if n_children[i, j] == 0:
                for w in range(len(waves)):
                    forward(0, (i, j), w)
    return sim.run()


def sim_broadcast(spec: FabricSpec, n_elems: int, rows: int, cols: int, dtype: str = "fp32",
                  mesh: Mesh | None = None) -> int:
    sim = EventSim(spec, mesh, rows, cols)
    tree = broadcast_tree(sim, sim.rows, sim.cols)
    for w in range(PE.wavelets(n_elems, spec, dtype)):
        sim.send(0, (0, 0), tree, lambda t, pe, w: None, w)
    return sim.run()


# ---- element-wise and row programs (norms, softmax, attention) ------------------------------------------
def sim_elementwise(spec: FabricSpec, n_elems: int, rows: int, cols: int, flops_per_elem: int = 1,
                    dtype: str = "fp16") -> int:
    """Each PE streams its slice through the SIMD unit in one task (one vector instruction per op of f)."""
    sim = EventSim(spec, None, rows, cols)
    ne = -(-n_elems // (rows * cols))
    cyc = PE.task_cycles(spec, dtype, ops=ne * flops_per_elem, read_elems=2 * ne, write_elems=ne,
                         vector_ops=flops_per_elem)

    def start(t, pe):
        sim.task(t, pe, cyc, lambda *_: None)

    for i in range(rows):
        for j in range(cols):
            sim.at(0, start, (i, j))
    return sim.run()


def sim_row_program(spec: FabricSpec, phases: list[tuple], rows: int, cols: int, dtype: str = "fp32",
                    mesh: Mesh | None = None, group: int = 1) -> int:
    """Run phases (e.g. `schedules.norm_phases`) on every PE of every row, in order:

    ("local", cycles)            a task on every PE
    ("local0", cycles)           a task on column 0 of each group's first row only
    ("reduce", n_vals, ops_per)  East->West chain into column 0; each arriving wavelet costs an add task with
                                 `ops_per` ops per value (1 for sum/max, more for a log-sum-exp merge)
    ("creduce", n_vals, ops_per) the same chain South->North up column 0 into each group's first row
    ("bcast", n_vals)            column 0 of each group's first row multicasts n_vals values down column 0 and
                                 along every row of the group

    Rows form groups of `group` consecutive rows (1: every row on its own, as norms and softmax run)."""
    sim = EventSim(spec, mesh, rows, cols)
    R, C, G = sim.rows, sim.cols, group
    epw = PE.elems_per_wavelet(spec, dtype)
    west = {(i, j): sim.mesh.multicast_tree([(i, j), (i, j - 1)]) for i in range(R) for j in range(1, C)}
    north = {i: sim.mesh.multicast_tree([(i, 0), (i - 1, 0)]) for i in range(R) if i % G}
    down = {i: sim.mesh.multicast_tree([(i + r, 0) for r in range(G)], [[(i + r, j) for j in range(C)]
                                                                         for r in range(G)])
            for i in range(0, R, G)}
    phase_of: dict = defaultdict(int)
    got: dict = defaultdict(int)
    early: dict = defaultdict(list)

    def start(t, pe):
        p = phase_of[pe]
        if p == len(phases):
            return
        kind, (i, j) = phases[p][0], pe
        if kind == "local" or (kind == "local0" and j == 0 and i % G == 0):
            sim.task(t, pe, int(phases[p][1]), finish, pe, key=(p, -1))
        elif kind == "local0" or (kind == "creduce" and (j > 0 or G == 1)):
            finish(t, pe)
        elif (j, i % G) == {"reduce": (C - 1, i % G), "creduce": (0, G - 1), "bcast": (0, 0)}[kind]:  # the source
            tree = west.get(pe) if kind == "reduce" else north.get(i) if kind == "creduce" else down[i]
            if tree and tree[1]:  # someone to deliver to (not a 1-PE row or group)
                for w, e in enumerate(split_sizes(phases[p][1], epw)):
                    sim.send(t, pe, tree, arrive, (p, w, e))
            finish(t, pe)
        else:
            for payload in early.pop((pe, p), []):
                arrive(t, pe, payload)

    def finish(t, pe):
        phase_of[pe] += 1
        got[pe] = 0
        start(t, pe)

    def arrive(t, pe, payload):
        p, w, e = payload
        if phase_of[pe] != p:
            early[pe, p].append(payload)
            return
        kind, n_vals = phases[p][0], phases[p][1]
        if kind in ("reduce", "creduce"):
            sim.task(t, pe, PE.add_task(spec, dtype, e, phases[p][2]), reduced, pe, payload, key=(p, w))
        else:  # bcast: received into memory
            got[pe] += 1
            if got[pe] == len(split_sizes(n_vals, epw)):
                finish(t, pe)

    def reduced(t, pe, payload):
        p, w, e = payload
        (i, j), kind = pe, phases[p][0]
        if kind == "reduce" and j > 0:
            sim.send(t, pe, west[pe], arrive, payload)
        elif kind == "creduce" and i % G:
            sim.send(t, pe, north[i], arrive, payload)
        got[pe] += 1
        if got[pe] == len(split_sizes(phases[p][1], epw)):
            finish(t, pe)

    for i in range(R):
        for j in range(C):
            sim.at(0, start, (i, j))
    return sim.run()


def nnz_columns(W: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """(R, C, kt): non-zeros in each local column of each PE's tile, for `sim_gemm(..., nnz_cols=...)`."""
    m, k = W.shape
    R, C = used(m, rows), used(k, cols)
    mt, kt = math.ceil(m / R), math.ceil(k / C)
    P = np.zeros((R * mt, C * kt), dtype=bool)
    P[:m, :k] = W != 0
    return P.reshape(R, mt, C, kt).sum(axis=1)  # (R, C, kt)
