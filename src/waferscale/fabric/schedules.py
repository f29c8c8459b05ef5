"""The schedules of the fabric kernels, as data: who sends to whom, in what order, in which phases.

One home for what the three views of a kernel share — the functional tile-level execution (`kernels/`), the
analytic cycle model (`cost*.py`) and the wavelet-level event simulation that judges it (`sim.py`) — so the
model never needs the simulation to know what it models: tile splits, the reduction trees into PE (0, 0), and
the per-row phase lists of the row programs (`sim.sim_row_program` runs them, `cost.row_program_cycles`
models them; task lengths come from `pe.py`). Numpy-free pure functions of the sizes and the `FabricSpec`.
"""

from __future__ import annotations

from waferscale.errors import ConfigError
from waferscale.fabric import pe as PE
from waferscale.fabric.schedules_gemv import row_reduce_parents, row_root
from waferscale.fabric.spec import FabricSpec

Coord = tuple[int, int]  # a logical PE (row, col), as `mesh.Coord`


# ---- tiling ---------------------------------------------------------------------------------------------
def used(n: int, parts: int) -> int:
    """PEs a block split of n values over at most `parts` PEs really uses (no PE left with an empty tile)."""
    return -(-n // -(-n // parts))


def tile_sizes(n: int, parts: int) -> list[int]:
    """Tile sizes of a block split of n over `parts` PEs (ceil tiles, the last ones smaller), as the kernels do."""
    t = -(-n // parts)
    return [max(0, min(t, n - p * t)) for p in range(parts)]


# ---- reductions -----------------------------------------------------------------------------------------
def snake(rows: int, cols: int) -> list[Coord]:
    """Logical PEs in boustrophedon order starting at (0, 0): consecutive entries are neighbours."""
    return [(i, j if i % 2 == 0 else cols - 1 - j) for i in range(rows) for j in range(cols)]


REDUCE_ALGOS = ("chain", "tree", "2d", "center")


def check_reduce(algo: str, fan_in: int) -> None:
    """ConfigError naming the valid choices for a bad reduction algorithm, or a bad `fan_in` (for "center" its
    number of phases per axis, 1 = one chain from each side; the other algorithms take none)."""
    if algo not in REDUCE_ALGOS:
        raise ConfigError(f"unknown all-reduce algorithm {algo!r}; use {', '.join(REDUCE_ALGOS)}")
    if algo == "center" and (isinstance(fan_in, bool) or not isinstance(fan_in, int) or fan_in < 1):
        raise ConfigError(f"fan_in of all-reduce 'center' is its number of phases per axis, an integer >= 1; "
                          f"got {fan_in!r}")
    if algo != "center" and fan_in != 1:
        raise ConfigError(f"fan_in (the number of phases per axis) applies to all-reduce 'center' only; "
                          f"got fan_in={fan_in!r} with {algo!r}")


def _lowbit(x: int) -> int:
    return x & -x


def reduce_parents(algo: str, R: int, C: int, phases: int = 1) -> dict[Coord, Coord]:
    """Who sends to whom in each reduction schedule (see kernels/collectives.py); the root (`reduce_root`)
    has none.

    "chain": the snake order, each PE to the one before it; "2d": East->West along every row into column 0,
    then South->North up column 0; "tree": recursive halving (PE j sends to j - lowbit(j)) along every row,
    then the same up column 0; "center": every row reduces into its middle column by the `phases`-phase tree of
    `schedules_gemv` (groups of about C^(1/phases) PEs as two chains into their centres, then the group roots
    likewise, ...; one phase: the West part chains East, the East part West), then the middle column the same
    way into the centre PE."""
    if algo == "chain":
        order = snake(R, C)
        return {order[p]: order[p - 1] for p in range(1, len(order))}
    if algo == "2d":
        par = {(i, j): (i, j - 1) for i in range(R) for j in range(1, C)}
        par.update({(i, 0): (i - 1, 0) for i in range(1, R)})
        return par
    if algo == "tree":
        par = {(i, j): (i, j - _lowbit(j)) for i in range(R) for j in range(1, C)}
        par.update({(i, 0): (i - _lowbit(i), 0) for i in range(1, R)})
        return par
    if algo == "center":
        row, col = row_reduce_parents("phases", C, phases), row_reduce_parents("phases", R, phases)
        c = row_root(row, C)
        par = {(i, j): (i, p) for i in range(R) for j, p in row.items()}
        par.update({(i, c): (p, c) for i, p in col.items()})
        return par
    raise ConfigError(f"unknown all-reduce algorithm {algo!r}; use {', '.join(REDUCE_ALGOS)}")


def reduce_root(algo: str, R: int, C: int, phases: int = 1) -> Coord:
    """The PE a reduction ends on: (0, 0), or for "center" the roots of the column's and the rows' trees (the
    centre PE, the West/North one of two middles, for one phase; within two PEs of it for more)."""
    if algo != "center":
        return 0, 0
    return row_root(row_reduce_parents("phases", R, phases), R), row_root(row_reduce_parents("phases", C, phases), C)


def broadcast_chains(algo: str, R: int, C: int, phases: int = 1) -> tuple[list[Coord], list[list[Coord]]]:
    """`Mesh.multicast_tree` arguments of the broadcast that follows a reduction (one color): from (0, 0) East
    along row 0 and down every column; for "center", from its root both ways along the root's column, and
    from every PE of that column both ways along its row."""
    if algo != "center":
        return [(0, j) for j in range(C)], [[(i, j) for i in range(R)] for j in range(C)]
    r, c = reduce_root(algo, R, C, phases)
    rows = [[(i, j) for j in js] for i in range(R) for js in (range(c, -1, -1), range(c, C))]
    return [(i, c) for i in range(r, -1, -1)], [[(i, c) for i in range(r, R)], *rows]


# ---- row programs (norms, softmax, attention) -----------------------------------------------------------
# A row program may run on groups of `group` consecutive rows (decode attention: the rows of one KV head):
# "bcast" then starts at column 0 of the group's first row and goes down column 0 and along every row,
# "creduce" chains column 0 South->North into the group's first row, and "local0" runs there only.
def norm_phases(spec: FabricSpec, tokens_per_row: int, width_per_pe: int, rms: bool, dtype: str) -> list[tuple]:
    """LayerNorm: local sum and sum of squares, row all-reduce of 2 stats per token, normalize (2 FMAs/value:
    (x - mean) * rstd, then * gamma + beta). RMSNorm: one stat, one FMA plus a multiply."""
    n_loc, stats = tokens_per_row * width_per_pe, (1 if rms else 2) * tokens_per_row
    local1 = PE.task_cycles(spec, dtype, ops=n_loc * (1 if rms else 2), read_elems=n_loc, write_elems=stats,
                            vector_ops=stats)  # one vector instruction per token and statistic
    local2 = PE.task_cycles(spec, dtype, ops=2 * n_loc, read_elems=n_loc + 2 * width_per_pe, write_elems=n_loc,
                            vector_ops=2 * tokens_per_row)
    return [("local", local1), ("reduce", stats, 1), ("bcast", stats), ("local", local2)]


def softmax_phases(spec: FabricSpec, tokens_per_row: int, width_per_pe: int, dtype: str) -> list[tuple]:
    """Softmax: local max, row max all-reduce, exp (`spec.exp_ops` ops per value: an assumption) and local
    sum, row sum all-reduce, divide."""
    n_loc = tokens_per_row * width_per_pe
    t = tokens_per_row  # one vector instruction per token and op
    lmax = PE.task_cycles(spec, dtype, ops=n_loc, read_elems=n_loc, write_elems=t, vector_ops=t)
    lexp = PE.task_cycles(spec, dtype, ops=(spec.exp_ops + 1) * n_loc, read_elems=n_loc, write_elems=n_loc,
                          vector_ops=(spec.exp_ops + 1) * t)
    ldiv = PE.task_cycles(spec, dtype, ops=n_loc, read_elems=n_loc, write_elems=n_loc, vector_ops=t)
    return [("local", lmax), ("reduce", tokens_per_row, 1), ("bcast", tokens_per_row), ("local", lexp),
            ("reduce", tokens_per_row, 1), ("bcast", tokens_per_row), ("local", ldiv)]


def attention_phases(spec: FabricSpec, heads_per_row: int, ctx_per_pe: int, head_dim: int, dtype: str) -> list:
    """q multicast from the head's first row down column 0 and along the rows; scores (ctx*d FMAs per head),
    exp, P.V (ctx*d FMAs per head); the (m, l, o) partials merge East->West along every row (a rescale FMA on
    each side per value: 2 ops + exps amortised), then South->North up column 0 over the head's rows (a no-op
    when a head has one row); out = o / l on the head's first row."""
    h, c, d = heads_per_row, ctx_per_pe, head_dim
    local = PE.task_cycles(spec, dtype, ops=2 * h * c * d + (spec.exp_ops + 2) * h * c,
                           read_elems=2 * h * c * d + h * d, write_elems=h * (c + d + 2),
                           vector_ops=2 * h * c + (spec.exp_ops + 2) * h)  # a dot and an AXPY per position
    div = PE.task_cycles(spec, dtype, ops=h * d, read_elems=h * (d + 1), write_elems=h * d, vector_ops=h)
    return [("bcast", h * d), ("local", local), ("reduce", h * (d + 2), 2), ("creduce", h * (d + 2), 2),
            ("local0", div)]
