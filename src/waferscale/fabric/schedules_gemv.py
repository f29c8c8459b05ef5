"""The schedule of the GEMV of the in-layer model-parallel layout, as data (shared by the tile-level execution
`kernels/gemv.gemv_allreduce`, the cycle model `cost_matmul.gemv_allreduce_cycles` and the event simulation
`sim_gemv.sim_gemv_allreduce`).

x_j already sits on every PE of mesh column j (the previous GEMV's all-reduce left it there); W (m, k) stays
in rows x cols tiles (m over rows, k over columns); every PE computes its partial y_ij = W_ij x_j; then a row
all-reduce leaves y_i on every PE of row i: the partials reduce into column 0 along a tree given here, then
column 0 multicasts the sum back along the row (once it holds all of it, as `cost_collectives.allreduce_cycles`).

Row trees, over the positions 0..n-1 of one row (the parent is always West of its child):

* "chain": p sends to p - 1 (pipelined, 2 alternating colors): n - 1 stages of ramp + add, fan-in 1.
* "ktree": a K-ary tree (K = fan_in) of depth ceil(log_K n). At level l the groups are K PEs K^l apart and the
  K - 1 members send straight to their group's leader (the West-most): p = K^l (t + K q) with 0 < t < K
  sends to p - t K^l. One ramp + add stage per level, so the stage overhead is paid depth times while the
  hops still add up to about n; a leader takes K - 1 partials per level (contention), and column 0 takes
  (K - 1) * depth. K = 2 is the recursive halving of `reduce_parents("tree", ...)`. WaferLLM's MeshGEMV
  (He et al., OSDI'25, section 6) counts its "K-tree" by phases instead: K phases of groups of n^(1/K) PEs,
  each group reduced into a root at its centre; its K = 2 has the depth of our fan_in = ceil(sqrt(n)), but
  its groups reduce as two chains into the centre where ours send straight to the leader.
* "phases": that MeshGEMV K-tree, rooted at the row's centre. Here fan_in = K is the number of phases (K >= 1),
  not a fan-in: the row is cut into groups of about n^(1/K) consecutive PEs, each group reduces as two pipelined
  chains flowing into its centre PE (the West part East, the East part West); then the group roots, about
  n^(1/K) apart, are grouped and reduced the same way, and so on: at most K phases. Built top-down: a span of m
  PEs with p phases to go is cut into an odd number (the smallest g with g^p >= m, made odd) of near-equal parts,
  so the middle part's root is the span's centre and the final root sits at the row's centre (within two PEs);
  it multicasts the sum along the whole row, East and West at once, so the sum travels ~n/2 hops in and ~n/2
  out instead of n and n from column 0. K = 2 is the HPDC'24 "Two-Phase" reduce; K = 1 is two chains into the
  centre. Each phase takes 4 colors (its two chains alternate 2 each), the multicast one more.
"""

from __future__ import annotations

from waferscale.errors import ConfigError

ROW_REDUCE_ALGOS = ("chain", "ktree", "phases")


def check_row_reduce(algo: str, fan_in: int) -> None:
    """ConfigError naming the valid choices for a bad algorithm or fan-in (for "phases": number of phases)."""
    if algo not in ROW_REDUCE_ALGOS:
        raise ConfigError(f"unknown GEMV all-reduce algorithm {algo!r}; use one of {', '.join(ROW_REDUCE_ALGOS)}")
    if isinstance(fan_in, bool) or not isinstance(fan_in, int) or fan_in < (1 if algo == "phases" else 2):
        if algo == "phases":
            raise ConfigError(f"fan_in of algo 'phases' is its number of phases K, an integer >= 1; got {fan_in!r}")
        raise ConfigError(f"fan_in must be an integer >= 2 (the PEs of a reduction group), got {fan_in!r}")


def row_reduce_parents(algo: str, n: int, fan_in: int = 2) -> dict[int, int]:
    """child -> parent positions of a row of n PEs reducing into position 0 (see the module docstring)."""
    check_row_reduce(algo, fan_in)
    if algo == "chain":
        return {p: p - 1 for p in range(1, n)}
    if algo == "phases":
        return _phase_parents(n, fan_in)[0]
    par = {}
    for p in range(1, n):
        s = 1
        while p % (s * fan_in) == 0:  # the level at which p is a member, not a leader
            s *= fan_in
        par[p] = p - p % (s * fan_in)
    return par


def row_reduce_depth(algo: str, n: int, fan_in: int = 2) -> int:
    """Levels of the row tree: n - 1 for the chain, ceil(log_fan_in n) for the K-ary tree, the phases used
    (at most K) for "phases"."""
    check_row_reduce(algo, fan_in)
    if algo == "chain":
        return n - 1
    if algo == "phases":
        return _phase_parents(n, fan_in)[1]
    depth, span = 0, 1
    while span < n:
        depth, span = depth + 1, span * fan_in
    return depth


def _group_size(n: int, phases: int) -> int:
    """The smallest g with g^phases >= n: groups of about n^(1/K) PEs."""
    g = max(1, round(n ** (1 / phases)))
    while g ** phases < n:
        g += 1
    while g > 1 and (g - 1) ** phases >= n:
        g -= 1
    return g


def _phase_tree(lo: int, hi: int, phases: int, par: dict[int, int], used: set) -> int:
    """Reduce positions lo..hi-1 in at most `phases` phases, recording child -> parent in `par` and the phases
    that have edges in `used`; returns the root. The span is cut into an odd number k ~ m^(1/phases) of near-equal
    consecutive parts (odd, so the middle part's root is the span's centre), each reduced in phases - 1; then
    the parts' roots chain into the middle one from both sides. One phase left: two chains into the centre."""
    m = hi - lo
    if m == 1:
        return lo
    if phases == 1:
        parts = list(range(lo, hi))
    else:
        k = min(m, _group_size(m, phases) | 1)
        parts = [_phase_tree(lo + q * m // k, lo + (q + 1) * m // k, phases - 1, par, used) for q in range(k)]
    r = (len(parts) - 1) // 2
    par.update({parts[t]: parts[t + 1] for t in range(r)})
    par.update({parts[t]: parts[t - 1] for t in range(r + 1, len(parts))})
    used.add(phases)
    return parts[r]


def _phase_parents(n: int, phases: int) -> tuple[dict[int, int], int]:
    """child -> parent of "phases" (in every group the members West of its centre chain East into it, those East
    of it West), and the number of phases it really uses."""
    par: dict = {}
    used: set = set()
    _phase_tree(0, n, phases, par, used)
    return par, len(used)


def row_root(parents: dict[int, int], n: int) -> int:
    """The position a row tree reduces into (0 for "chain" and "ktree", about n / 2 for "phases")."""
    return next(p for p in range(n) if p not in parents)


def bottom_up(parents: dict[int, int], n: int) -> list[int]:
    """Positions of a row tree, every child before its parent (deepest first, then from the East)."""
    depth: dict = {}
    for p in range(n):
        path = []
        while p in parents and p not in depth:  # walk up to a known depth (or the root), then fill the path in
            path.append(p)
            p = parents[p]
        d = depth.get(p, 0)
        for q in reversed(path):
            d += 1
            depth[q] = d
    return sorted(range(n), key=lambda p: (-depth.get(p, 0), -p))


def row_multicast(i: int, root: int, n: int) -> tuple[list[tuple[int, int]], list[list[tuple[int, int]]]]:
    """`Mesh.multicast_tree` arguments of row i's multicast of the sum from position `root` along the whole
    row: West from the root, and a branch East from it (both directions at once)."""
    west = [(i, j) for j in range(root, -1, -1)]
    return (west, [[(i, j) for j in range(root, n)]]) if root < n - 1 else (west, [])
