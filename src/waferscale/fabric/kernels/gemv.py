"""Weight-stationary GEMV, GEMM (streamed vectors) and sparse GEMV on a rows x cols region.

Mapping (the WSE-1 compiler deck in WSE.md: "each PE holds a tile of the weight matrix, inputs stream in along
one axis, partial sums accumulate along the other"):

    W (m, k) is cut into rows x cols tiles of (mt, kt) = (ceil(m/rows), ceil(k/cols)); PE (i, j) holds
    W[i*mt:(i+1)*mt, j*kt:(j+1)*kt] (edge tiles zero-padded; the padding counts against SRAM).
    x segment j starts on PE (0, j) and is multicast down column j, hop by hop.
    PE (i, j) computes its partial y_ij = W_ij x_j (one AXPY per arriving x value).
    Partials reduce along each row East -> West (a chain: each PE adds its East neighbour's partial and
    forwards the sum); y segment i ends on PE (i, 0).

`gemv_allreduce` is the GEMV of the in-layer model-parallel layout (`schedules_gemv.py`): x_j already on
every PE of column j, the partials summed by a row all-reduce (a chain or a K-ary tree into column 0, or K
phases of two chains into group centres ending at the row's centre; then a multicast back from that root), so
y_i ends on every PE of row i.

Sparse GEMV keeps only the non-zeros of each tile (value, local row, local column) and does one multiply-add
per non-zero weight for each arriving x value — the "one AXPY per non-zero" of sparsity harvesting.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric.kernels.collectives import col_broadcast, row_broadcast, row_reduce_chain
from waferscale.fabric.kernels.tiles import TileRun, Tiles, region_for, to_tiles
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.schedules_gemv import bottom_up, row_reduce_parents, row_root


def _tile_w(W: np.ndarray, R: int, C: int) -> tuple[np.ndarray, int, int]:
    m, k = W.shape
    mt, kt = -(-m // R), -(-k // C)
    Wp = np.zeros((R * mt, C * kt), dtype=np.float32)  # zero-padded to whole tiles
    Wp[:m, :k] = W
    return Wp.reshape(R, mt, C, kt).transpose(0, 2, 1, 3), mt, kt  # (R, C, mt, kt)


def _stationary(mesh: Mesh, W: np.ndarray, rows: int | None, cols: int | None) -> tuple[Tiles, np.ndarray]:
    """The region W (m, k) takes and its tiles placed on it: (the Tiles, the (R, C, mt, kt) W buffer)."""
    m, k = W.shape
    R, C = region_for(mesh, rows, cols, m, k)
    t = Tiles(mesh, R, C)
    tiles, mt, kt = _tile_w(W, R, C)
    Wt = t.alloc("W", mt, kt)
    Wt[:] = tiles
    return t, Wt


def _check(W: np.ndarray, x: np.ndarray, x_axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    W = np.asarray(W, dtype=np.float32)
    x = np.asarray(x, dtype=np.float32)
    if W.ndim != 2 or W.size == 0:
        raise ConfigError(f"W must be a non-empty (m, k) matrix, got shape {W.shape}")
    if x.shape[x_axis] != W.shape[1]:
        raise ConfigError(f"x has {x.shape[x_axis]} values along k, W has k={W.shape[1]}")
    return W, x


def _stream_x(t: Tiles, xb: np.ndarray, xseg: np.ndarray) -> None:
    """Place x segments on row 0 of `xb` (R, C, kt) and multicast them down the columns."""
    xb[0] = to_tiles(xseg, t.cols, xb.shape[2])
    col_broadcast(t, xb)


def gemv(mesh: Mesh, W: np.ndarray, x: np.ndarray, rows: int | None = None, cols: int | None = None) -> TileRun:
    """y = W @ x with W (m, k) stationary in per-PE tiles; returns y (m,): `gemm` of one streamed vector."""
    run = gemm(mesh, W, np.asarray(x, dtype=np.float32)[:, None], rows, cols)
    return dataclasses.replace(run, out=run.out[:, 0].copy())


def gemm(mesh: Mesh, W: np.ndarray, X: np.ndarray, rows: int | None = None, cols: int | None = None) -> TileRun:
    """Y = W @ X with X (k, n): the n columns of X stream through the same stationary W one after another."""
    W, X = _check(W, X)
    if X.ndim != 2:
        raise ConfigError(f"X must be (k, n), got shape {X.shape}")
    t, Wt = _stationary(mesh, W, rows, cols)
    xb = t.alloc("x", Wt.shape[3])
    yp = t.alloc("y", Wt.shape[2])
    m = W.shape[0]
    Y = np.empty((m, X.shape[1]), dtype=np.float32)
    for v in range(X.shape[1]):  # one streamed vector at a time: the buffers are reused
        _stream_x(t, xb, X[:, v])
        yp[:] = np.einsum("ijab,ijb->ija", Wt, xb)  # every PE: its own tile times its own x segment
        row_reduce_chain(t, yp)
        Y[:, v] = yp[:, 0].reshape(-1)[:m]
    return t.result(Y)


def spmv(mesh: Mesh, W: np.ndarray, x: np.ndarray, rows: int | None = None, cols: int | None = None) -> TileRun:
    """y = W @ x storing only W's non-zeros: each PE does one multiply-add per non-zero of its tile."""
    W, x = _check(W, x)
    m, k = W.shape
    R, C = region_for(mesh, rows, cols, m, k)
    t = Tiles(mesh, R, C)
    dense, mt, kt = _tile_w(W, R, C)  # (R, C, mt, kt) — used only to extract each tile's non-zeros
    nz = dense != 0
    nnz_max = max(1, int(nz.sum(axis=(2, 3)).max()))
    val = t.alloc("w_val", nnz_max)
    row = t.alloc("w_row", nnz_max, dtype=np.int32)  # 16-bit indices on hardware; 4 B here
    col = t.alloc("w_col", nnz_max, dtype=np.int32)
    # pack each PE's non-zeros to the front of its arrays (padding: value 0 at index 0)
    flat = nz.reshape(R, C, -1)
    order = np.argsort(~flat, axis=2, kind="stable")[..., :nnz_max]
    keep = np.take_along_axis(flat, order, axis=2)
    val[:] = np.where(keep, np.take_along_axis(dense.reshape(R, C, -1), order, axis=2), 0)
    row[:], col[:] = np.where(keep, order // kt, 0), np.where(keep, order % kt, 0)
    xb = t.alloc("x", kt)
    _stream_x(t, xb, x)
    yp = t.alloc("y", mt)
    contrib = val * np.take_along_axis(xb, col, axis=2)  # one multiply per stored non-zero, every PE at once
    ii, jj = np.indices((R, C))
    np.add.at(yp, (ii[..., None], jj[..., None], row), contrib)
    row_reduce_chain(t, yp)
    return t.result(yp[:, 0].reshape(-1)[:m].copy())


def gemv_allreduce(mesh: Mesh, W: np.ndarray, x: np.ndarray, rows: int | None = None, cols: int | None = None,
                   algo: str = "ktree", fan_in: int = 2) -> TileRun:
    """y = W @ x in the in-layer model-parallel layout (`schedules_gemv.py`): x segment j already on every PE
    of column j, W (m, k) in tiles; every PE its partial, then the row all-reduce ("chain" or "ktree" of
    `fan_in` into column 0; "phases", fan_in = the number of phases, into the row's centre) and the multicast
    back along the row from its root (both ways from a centre). Returns (cols, m): y as every column of PEs
    holds it (row i's PEs hold y's segment i)."""
    W, x = _check(W, x)
    if x.ndim != 1:
        raise ConfigError(f"x must be a vector (k,), got shape {x.shape}")
    m = W.shape[0]
    t, Wt = _stationary(mesh, W, rows, cols)
    R, C, mt, kt = Wt.shape
    parents = row_reduce_parents(algo, C, fan_in)
    xb = t.alloc("x", kt)
    xb[:] = to_tiles(x, C, kt)[None]  # the previous GEMV's all-reduce left segment j on all of column j
    yp = t.alloc("y", mt)
    yp[:] = np.einsum("ijab,ijb->ija", Wt, xb)
    for c in bottom_up(parents, C)[:-1]:  # a PE sends once all its children have been added
        p = parents[c]
        yp[:, p] += t.move(yp[:, c], [(i, c) for i in range(R)], [(i, p) for i in range(R)])
    row_broadcast(t, yp, row_root(parents, C))
    return t.result(yp.transpose(1, 0, 2).reshape(C, R * mt)[:, :m].copy())


def random_sparse(m: int, k: int, sparsity: float, rng: np.random.Generator) -> np.ndarray:
    """A dense (m, k) fp32 matrix with a `sparsity` fraction of exact zeros (at least one non-zero)."""
    if not 0.0 <= sparsity < 1.0:
        raise ConfigError(f"--sparsity must be in [0, 1), got {sparsity}")
    W = rng.standard_normal((m, k)).astype(np.float32)
    W[rng.random((m, k)) < sparsity] = 0.0
    if not W.any():
        W[0, 0] = 1.0
    return W
