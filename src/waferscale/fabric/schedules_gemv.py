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
"""

from __future__ import annotations

from waferscale.errors import ConfigError

ROW_REDUCE_ALGOS = ("chain", "ktree")


def check_row_reduce(algo: str, fan_in: int) -> None:
    """ConfigError naming the valid choices for a bad algorithm or fan-in."""
    if algo not in ROW_REDUCE_ALGOS:
        raise ConfigError(f"unknown GEMV all-reduce algorithm {algo!r}; use one of {', '.join(ROW_REDUCE_ALGOS)}")
    if isinstance(fan_in, bool) or not isinstance(fan_in, int) or fan_in < 2:
        raise ConfigError(f"fan_in must be an integer >= 2 (the PEs of a reduction group), got {fan_in!r}")


def row_reduce_parents(algo: str, n: int, fan_in: int = 2) -> dict[int, int]:
    """child -> parent positions of a row of n PEs reducing into position 0 (see the module docstring)."""
    check_row_reduce(algo, fan_in)
    if algo == "chain":
        return {p: p - 1 for p in range(1, n)}
    par = {}
    for p in range(1, n):
        s = 1
        while p % (s * fan_in) == 0:  # the level at which p is a member, not a leader
            s *= fan_in
        par[p] = p - p % (s * fan_in)
    return par


def row_reduce_depth(algo: str, n: int, fan_in: int = 2) -> int:
    """Levels of the row tree: n - 1 for the chain, ceil(log_fan_in n) for the K-ary tree."""
    check_row_reduce(algo, fan_in)
    if algo == "chain":
        return n - 1
    depth, span = 0, 1
    while span < n:
        depth, span = depth + 1, span * fan_in
    return depth
