"""Cycle models of the collectives: reduce, broadcast, all-reduce and all-to-all on a rows x cols region (the
schedules of `kernels/collectives.py`, trees from `schedules.reduce_parents`, judged by `sim.sim_allreduce` and
`sim.sim_broadcast`); conventions and shared pieces in `cost.py`.

A reduction tree is evaluated node by node (`_node_times`): a PE's first wavelet leaves after its slowest
child's first has arrived and been added, its last after the slowest child's last or after its fan-in times
nw add tasks, whichever is later, each edge costing ramp out + hops + ramp in (`_edge`). This is the HPDC'24
form of the Fabric row of WSE.md, T = max(C, E/N) + L + (2 T_R + 1) D, taken per node. On a defective mesh the
real detoured routes are used and edges sharing a physical link queue on it (`_tree_finish`).

"center" roots the reduction at the centre PE (rows into the middle column, that column into the centre, each
as two chains meeting there) and broadcasts from it, so the sum travels about half the rows and columns in and
half out, where the corner-rooted "2d" crosses the whole mesh both ways (Rocki et al., SC20). With fan_in = K
phases per axis, each row and then the middle column reduce by the K-phase tree of `schedules_gemv` (groups of
about n^(1/K) PEs as two chains into their centres, then the group roots likewise): a chain stage costs ramp out
+ hop + ramp in + add, so K phases pay about K n^(1/K) stages per axis instead of n / 2. Its nodes are
evaluated with the GEMV all-reduce's `cost_matmul.node_window` (`_centre_node`): a middle-column PE adds its
row halves' streams early and its column chain's late, and the busy period that starts at a later arrival is
what sets its last wavelet; the other algorithms keep `_node_times`.
"""

from __future__ import annotations

from waferscale.fabric import pe as PE
from waferscale.fabric.cost import (Cycles, check_positive, check_region, color_passes, detour_extra, exact_routes,
                                    fluid_finish, make_cycles, multicast_latency)
from waferscale.fabric.cost_matmul import node_window
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.schedules import broadcast_chains, check_reduce, reduce_parents, reduce_root
from waferscale.fabric.schedules_gemv import bottom_up, row_reduce_depth, row_reduce_parents, row_root
from waferscale.fabric.spec import FabricSpec


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


def _centre_node(arrivals: list[tuple[float, float]], nw: int, add_c: int) -> tuple[float, float]:
    """`_node_times` for "center": every PE's own vector is ready at t = 0, each arriving wavelet one add task,
    and busy periods starting at any child's first arrival (`cost_matmul.node_window`)."""
    return node_window(0.0, arrivals, [add_c] * nw)


def _edge(times: tuple[float, float], hops: int, spec: FabricSpec) -> tuple[float, float]:
    d = 2 * spec.ramp_latency_cycles + hops * spec.hop_latency_cycles  # ramp out, hops, ramp in
    return times[0] + d, times[1] + d


def _tree_finish(parents: dict, root, mesh: Mesh, nw: int, add_c: int, spec: FabricSpec, node=_node_times) -> float:
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
                    last = max(last, fluid_finish([windows[o] for o in users[link]], windows[c][1], nw) + (
                        f - windows[c][0]))
            return f, last

        for v in reversed(order):
            times[v] = node([edge(c, v) for c in kids.get(v, ())], nw, add_c)
        return times

    times = evaluate(None)
    for _ in range(3):
        times = evaluate(times)
    return times[root][1]


def _line_parents(algo: str, n: int, phases: int) -> dict[int, int]:
    """child -> parent positions of one row (or of the root's column) of n PEs in `algo`'s tree."""
    if algo == "center":
        return row_reduce_parents("phases", n, phases)
    return {c: p for (_, c), (_, p) in reduce_parents(algo, 1, n).items()}


def _regular_finish(algo: str, R: int, C: int, nw: int, add_c: int, spec: FabricSpec, phases: int = 1) -> float:
    """`_tree_finish` for a defect-free region in O(R + C): every row's tree is the same, then the root's
    column (column 0, or the rows' root column for "center")."""
    if algo == "chain":
        return nw - 1 + (R * C - 1) * (2 * spec.ramp_latency_cycles + spec.hop_latency_cycles + add_c)
    node = _centre_node if algo == "center" else _node_times

    def into_root(n: int, inputs: list) -> list:
        """Arrivals at the root of a line of n PEs reducing by `algo`, each PE also combining `inputs`."""
        par = _line_parents(algo, n, phases)
        kids: dict = {}
        for c, p in par.items():
            kids.setdefault(p, []).append(c)
        root = row_root(par, n)
        times: dict = {}
        for v in bottom_up(par, n)[:-1]:  # children before their parents, the root (last) left out
            times[v] = node(inputs + [_edge(times[c], abs(c - v), spec) for c in kids.get(v, ())], nw, add_c)
        return [_edge(times[c], abs(c - root), spec) for c in kids.get(root, ())]

    row_in = into_root(C, [])  # every row's partials into column 0 (all rows alike), then up column 0
    return node(row_in + into_root(R, row_in), nw, add_c)[1]


def reduce_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, algo: str = "2d", dtype: str = "fp32", *,
                  mesh: Mesh | None = None, fan_in: int = 1) -> Cycles:
    """Reduce (sum) of one n_elems vector per PE into PE (0, 0) (the centre PE for "center", in `fan_in`
    phases per axis). The HPDC'24 form
    (Fabric row of WSE.md),

        T = max(C, E/N) + L + (2 T_R + 1) D,

    is evaluated node by node up the tree: a PE's last wavelet leaves after its slowest child's last one arrives
    (L + (2 T_R + 1) D along the path: hops, ramp out and in, one add per stage) or after its fan-in times nw
    adds counted from its first arrival (the contention C), whichever is later. E/N (= nw per active link) never
    exceeds C here. With a defective `mesh`, hops are the real detoured routes."""
    check_positive(n_elems=n_elems)
    check_reduce(algo, fan_in)
    R, C = check_region(spec, rows, cols, mesh)
    nw = PE.wavelets(n_elems, spec, dtype)
    add_c = PE.add_task(spec, dtype, PE.elems_per_wavelet(spec, dtype))
    if R * C == 1:
        return make_cycles(compute=0, sram=0, fabric=0, total=0)
    phases, (r, c) = fan_in, reduce_root(algo, R, C, fan_in)
    if algo == "center":  # the root's children: two per phase of each axis (one where a side is empty)
        row, col = row_reduce_parents("phases", C, phases), row_reduce_parents("phases", R, phases)
        fan_in = sum(p == c for p in row.values()) + sum(p == r for p in col.values())
        # 4 colors per phase of each axis (its two chains alternate 2 each), as the GEMV's "phases"
        colors = 4 * (row_reduce_depth("phases", C, phases) + row_reduce_depth("phases", R, phases))
    else:
        fan_in = {"chain": 1, "2d": 2 if R > 1 and C > 1 else 1,
                  "tree": (C - 1).bit_length() + (R - 1).bit_length()}[algo]
        colors = {"chain": 2, "2d": 4, "tree": fan_in}[algo]  # chains alternate 2 colors; a tree uses one per level
    if exact_routes(mesh, R, C):
        total = _tree_finish(reduce_parents(algo, R, C, phases), (r, c), mesh, nw, add_c, spec,
                             _centre_node if algo == "center" else _node_times)
    else:
        total = _regular_finish(algo, R, C, nw, add_c, spec, phases)
        if mesh is not None and mesh.has_defects:  # big region: the detours' extra hops on the critical path
            row_max, row_sum, col = detour_extra(mesh, R, C)
            total += (row_sum + col if algo == "chain" else row_max + col) * spec.hop_latency_cycles
    passes = color_passes(spec, colors)
    if passes > 1:  # levels beyond the available colors wait for the previous group: pay the fill again
        total += (passes - 1) * (total - (nw - 1) * fan_in * max(1, add_c))
    return make_cycles(compute=fan_in * nw * add_c, sram=fan_in * nw * add_c, fabric=fan_in * nw,
                       total=total, passes=passes)


def broadcast_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, dtype: str = "fp32", *,
                     mesh: Mesh | None = None, algo: str = "2d", fan_in: int = 1) -> Cycles:
    """PE (0, 0) multicasts n_elems along row 0 and down every column (1 color): fill + one wavelet per cycle.
    algo="center" (the broadcast of that all-reduce, of `fan_in` phases): its root along the root's column,
    then every row, both ways at once (`schedules.broadcast_chains`)."""
    check_positive(n_elems=n_elems)
    check_reduce(algo, fan_in)
    R, C = check_region(spec, rows, cols, mesh)
    nw = PE.wavelets(n_elems, spec, dtype)
    if R * C == 1:
        return make_cycles(compute=0, sram=0, fabric=0, total=0)
    r, c = reduce_root(algo, R, C, fan_in)
    if exact_routes(mesh, R, C):  # the real multicast tree
        hops = mesh.tree_depth(mesh.multicast_tree(*broadcast_chains(algo, R, C, fan_in)), mesh.physical(r, c))
    else:  # the farthest row, then along it; a big defective region adds its worst row chain's and a column's detours
        row_max, _, col = detour_extra(mesh, R, C) if mesh is not None and mesh.has_defects else (0, 0, 0)
        hops = max(c, C - 1 - c) + max(r, R - 1 - r) + row_max + col
    return make_cycles(compute=0, sram=0, fabric=nw, total=multicast_latency(spec, hops, nw))


def allreduce_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, algo: str = "2d", dtype: str = "fp32",
                     *, mesh: Mesh | None = None, fan_in: int = 1) -> Cycles:
    """Reduce into (0, 0) (`reduce_cycles`, HPDC'24 form), then broadcast the sum (`broadcast_cycles`);
    algo in {"chain", "tree", "2d", "center"} ("center": into the centre PE and back out from it, in `fan_in`
    phases per axis; the other algorithms take fan_in 1). The broadcast starts when the root holds the whole
    sum."""
    return reduce_cycles(spec, n_elems, rows, cols, algo, dtype, mesh=mesh, fan_in=fan_in) + \
        broadcast_cycles(spec, n_elems, rows, cols, dtype, mesh=mesh, algo=algo, fan_in=fan_in)


def alltoall_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, dtype: str = "fp16") -> Cycles:
    """n_elems spread evenly over the region, each sent to a uniformly random PE of it (a mixture of experts'
    dispatch of tokens to the experts' PEs): a quarter of the data crosses the region's narrower bisection each
    way, min(R, C) links wide, one wavelet per link per cycle, after the diameter's hops. A bandwidth bound:
    no contention beyond the bisection's is modelled."""
    check_positive(n_elems=n_elems)
    R, C = check_region(spec, rows, cols, None)
    if R * C == 1:
        return make_cycles(compute=0, sram=0, fabric=0, total=0)
    nw = -(-PE.wavelets(n_elems, spec, dtype) // (4 * min(R, C)))
    return make_cycles(compute=0, sram=0, fabric=nw, total=nw + (R + C - 2) * spec.hop_latency_cycles)

