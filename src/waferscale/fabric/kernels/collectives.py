"""Broadcast, reduce and all-reduce on a rows x cols region, moved hop by hop along the mesh routes.

Algorithms (the same schedules `sim.py` simulates and `cost_collectives.py` models; the trees are
`schedules.reduce_parents`):

* broadcast: the root (0, 0) multicasts East along row 0, and every router of row 0 also multicasts South down
  its column (hardware multicast on one color, Fabric row of WSE.md).
* reduce "chain": one chain through all PEs in snake order (row 0 West->East, row 1 East->West, ...); each PE
  adds its neighbour's partial and forwards it toward (0, 0). Bandwidth-optimal, latency ~ P.
* reduce "2d": every row reduces East->West into column 0 (all rows at once), then column 0 reduces South->North
  into (0, 0). Latency ~ rows + cols.
* reduce "tree": recursive halving along each row into column 0 (level l: PE j with j % 2^(l+1) == 2^l sends
  2^l hops West), then the same down column 0. Latency ~ log; the root's fan-in costs bandwidth.
* reduce "center": every row as two chains meeting at its middle column, then that column as two chains
  meeting at the centre PE (`schedules.reduce_root`). Latency ~ (rows + cols) / 2. With fan_in = K phases per
  axis, every row and then that column reduce by the K-phase tree of `schedules_gemv` (groups of about n^(1/K)
  PEs as two chains into their centres, then the group roots likewise), ending within two PEs of the centre.
* all-reduce = reduce to the root + broadcast from it ("center": the centre PE multicasts both ways along the
  middle column, and every PE of that column both ways along its row).

Each returns a TileRun whose `out` is (rows, cols, n) for broadcast/all-reduce, or (n,) at the root for reduce.
"""

from __future__ import annotations

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric.kernels.tiles import TileRun, Tiles
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.schedules import REDUCE_ALGOS, check_reduce, reduce_root, snake
from waferscale.fabric.schedules_gemv import bottom_up, row_reduce_parents, row_root

ALGOS = REDUCE_ALGOS


def row_reduce_chain(t: Tiles, buf: np.ndarray, combine=np.add) -> None:
    """buf[:, 0] <- combine over the row, East -> West, one hop per step (all rows at once)."""
    for j in range(t.cols - 1, 0, -1):
        buf[:, j - 1] = combine(buf[:, j - 1], t.shift(buf, axis=1, step=-1, index=j))


def row_broadcast(t: Tiles, buf: np.ndarray, root: int = 0) -> None:
    """buf[:, j] <- buf[:, root] for every column, forwarded hop by hop from column `root` East and West
    (multicast along the row)."""
    for j in range(root + 1, t.cols):
        buf[:, j] = t.shift(buf, axis=1, step=1, index=j - 1)
    for j in range(root - 1, -1, -1):
        buf[:, j] = t.shift(buf, axis=1, step=-1, index=j + 1)


def col_broadcast(t: Tiles, buf: np.ndarray) -> None:
    for i in range(1, t.rows):
        buf[i] = t.shift(buf, axis=0, step=1, index=i - 1)


def _tree_levels(n: int) -> list[int]:
    return [1 << lvl for lvl in range(max(0, (n - 1).bit_length()))]


def _reduce_inplace(t: Tiles, buf: np.ndarray, algo: str, fan_in: int) -> None:
    check_reduce(algo, fan_in)
    R, C = t.rows, t.cols
    if algo == "chain":
        order = snake(R, C)
        for p in range(len(order) - 1, 0, -1):
            (a, b), (c, d) = order[p], order[p - 1]
            buf[c, d] += t.move(buf[a, b][None], [order[p]], [order[p - 1]])[0]
    elif algo == "2d":
        row_reduce_chain(t, buf)
        for i in range(R - 1, 0, -1):
            buf[i - 1, 0] += t.move(buf[i, 0][None], [(i, 0)], [(i - 1, 0)])[0]
    elif algo == "tree":
        for s in _tree_levels(C):
            js = np.arange(s, C, 2 * s)
            src = [(i, j) for i in range(R) for j in js]
            dst = [(i, j - s) for i in range(R) for j in js]
            moved = t.move(buf[:, js].reshape(R * len(js), -1), src, dst).reshape(R, len(js), -1)
            buf[:, js - s] += moved
        for s in _tree_levels(R):
            is_ = np.arange(s, R, 2 * s)
            moved = t.move(buf[is_, 0], [(i, 0) for i in is_], [(i - s, 0) for i in is_])
            buf[is_ - s, 0] += moved
    else:  # "center": every row's tree into the root's column (all rows at once), then that column's tree
        row, col = row_reduce_parents("phases", C, fan_in), row_reduce_parents("phases", R, fan_in)
        c = row_root(row, C)
        for j in bottom_up(row, C)[:-1]:  # a PE sends once all its children have been added
            buf[:, row[j]] += t.move(buf[:, j], [(i, j) for i in range(R)], [(i, row[j]) for i in range(R)])
        for i in bottom_up(col, R)[:-1]:
            buf[col[i], c] += t.move(buf[i, c][None], [(i, c)], [(col[i], c)])[0]


def _place(mesh: Mesh, data: np.ndarray, rows: int | None, cols: int | None) -> tuple[Tiles, np.ndarray]:
    data = np.asarray(data, dtype=np.float32)
    if data.ndim != 3:
        raise ConfigError(f"collective input must be (rows, cols, n): one vector per PE, got shape {data.shape}")
    t = Tiles(mesh, data.shape[0] if rows is None else rows, data.shape[1] if cols is None else cols)
    if data.shape[:2] != (t.rows, t.cols) or data.shape[2] <= 0:
        raise ConfigError(f"collective input {data.shape} does not match the {t.rows}x{t.cols} region")
    buf = t.alloc("v", data.shape[2])
    buf[:] = data
    return t, buf


def broadcast(mesh: Mesh, v: np.ndarray, rows: int | None = None, cols: int | None = None) -> TileRun:
    """Copy vector `v` (n,) from PE (0, 0) to every PE of the region."""
    v = np.asarray(v, dtype=np.float32)
    if v.ndim != 1 or v.size == 0:
        raise ConfigError(f"broadcast needs a non-empty vector, got shape {v.shape}")
    t = Tiles(mesh, rows, cols)
    buf = t.alloc("v", v.size)
    buf[0, 0] = v
    row_broadcast(t, buf[:1])  # row 0 only
    col_broadcast(t, buf)
    return t.result(buf.copy())


def reduce(mesh: Mesh, data: np.ndarray, algo: str = "2d", rows: int | None = None,
           cols: int | None = None, fan_in: int = 1) -> TileRun:
    """Sum of the per-PE vectors data[i, j] (shape (rows, cols, n)), delivered at PE (0, 0) (the centre PE for
    "center", reached in `fan_in` phases per axis)."""
    t, buf = _place(mesh, data, rows, cols)
    _reduce_inplace(t, buf, algo, fan_in)
    return t.result(buf[reduce_root(algo, t.rows, t.cols, fan_in)].copy())


def allreduce(mesh: Mesh, data: np.ndarray, algo: str = "2d", rows: int | None = None,
              cols: int | None = None, fan_in: int = 1) -> TileRun:
    """Every PE ends with the sum of all per-PE vectors: reduce to the root, then broadcast from it."""
    t, buf = _place(mesh, data, rows, cols)
    _reduce_inplace(t, buf, algo, fan_in)
    if algo == "center":
        r, c = reduce_root(algo, t.rows, t.cols, fan_in)
        for i in list(range(r + 1, t.rows)) + list(range(r - 1, -1, -1)):  # along the middle column, both ways
            s = i - 1 if i > r else i + 1
            buf[i, c] = t.move(buf[s, c][None], [(s, c)], [(i, c)])[0]
        row_broadcast(t, buf, c)
    else:
        row_broadcast(t, buf[:1])
        col_broadcast(t, buf)
    return t.result(buf.copy())
