"""Element-wise ops, layer norm / RMS norm and softmax on a rows x cols region.

* element-wise: a flat vector block-split over the region's PEs (row-major); no fabric traffic.
* norms and softmax work on X (tokens, width): tokens are block-split over the region's rows, the width over its
  columns, so each PE holds a (tokens/rows, width/cols) tile. Per-token statistics (sum, sum of squares, max)
  are computed locally, reduced along the row East -> West into column 0 hop by hop, and sent back along the row
  (multicast West -> East) before each PE finishes its tile locally.
"""

from __future__ import annotations

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric.kernels.collectives import row_broadcast, row_reduce_chain
from waferscale.fabric.kernels.tiles import TileRun, Tiles, region_for, to_tiles
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.schedules import used

_GELU_C = np.float32(np.sqrt(2.0 / np.pi))
ELEMENTWISE_OPS = {
    "add": lambda x, y: x + y,
    "mul": lambda x, y: x * y,
    "relu": lambda x, y: np.maximum(x, 0),
    "silu": lambda x, y: x / (1 + np.exp(-x)),
    "gelu": lambda x, y: 0.5 * x * (1 + np.tanh(_GELU_C * (x + 0.044715 * x ** 3))),
}


def elementwise(mesh: Mesh, op: str, x: np.ndarray, y: np.ndarray | None = None, rows: int | None = None,
                cols: int | None = None) -> TileRun:
    """op(x[, y]) on a flat vector spread over the region; returns the (n,) result."""
    if op not in ELEMENTWISE_OPS:
        raise ConfigError(f"unknown element-wise op {op!r}; use one of {', '.join(ELEMENTWISE_OPS)}")
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    y = np.zeros_like(x) if y is None else np.asarray(y, dtype=np.float32).reshape(-1)
    if x.size == 0 or y.shape != x.shape:
        raise ConfigError(f"element-wise inputs must be non-empty and the same size, got {x.shape} and {y.shape}")
    rows, cols = mesh.check_region(rows, cols)
    P = used(x.size, rows * cols)
    R = min(rows, P)
    C = -(-P // R)
    t = Tiles(mesh, R, C)
    ne = -(-x.size // (R * C))
    xb, yb = t.alloc("x", ne), t.alloc("y", ne)
    xb[:] = to_tiles(x, R * C, ne).reshape(R, C, ne)
    yb[:] = to_tiles(y, R * C, ne).reshape(R, C, ne)
    zb = t.alloc("z", ne)
    zb[:] = ELEMENTWISE_OPS[op](xb, yb)
    return t.result(zb.reshape(-1)[:x.size].copy())


def _place_rows(mesh: Mesh, X: np.ndarray, rows: int | None, cols: int | None, pad: float = 0.0
                ) -> tuple[Tiles, np.ndarray, int, int]:
    X = np.asarray(X, dtype=np.float32)
    if X.ndim != 2 or X.size == 0:
        raise ConfigError(f"input must be a non-empty (tokens, width) matrix, got shape {X.shape}")
    n, w = X.shape
    R, C = region_for(mesh, rows, cols, n, w)
    t = Tiles(mesh, R, C)
    tt, wt = -(-n // R), -(-w // C)
    Xp = np.full((R * tt, C * wt), pad, dtype=np.float32)
    Xp[:n, :w] = X
    Xp[n:] = 0.0  # padded tokens: finite, discarded
    xb = t.alloc("x", tt, wt)
    xb[:] = Xp.reshape(R, tt, C, wt).transpose(0, 2, 1, 3)
    return t, xb, tt, wt


def _row_allreduce(t: Tiles, stats: np.ndarray, combine=np.add) -> None:
    row_reduce_chain(t, stats, combine)
    row_broadcast(t, stats)


def _param(t: Tiles, name: str, v: np.ndarray | None, w: int, wt: int, default: float) -> np.ndarray:
    v = np.full(w, default, np.float32) if v is None else np.asarray(v, dtype=np.float32)
    if v.shape != (w,):
        raise ConfigError(f"{name} must have shape ({w},), got {v.shape}")
    b = t.alloc(name, wt)
    b[:] = to_tiles(v, t.cols, wt)[None]  # column j's slice of the parameter, on every row of column j
    return b


def _unplace(t: Tiles, out: np.ndarray, n: int, w: int) -> np.ndarray:
    R, C, tt, wt = out.shape
    return out.transpose(0, 2, 1, 3).reshape(R * tt, C * wt)[:n, :w].copy()


def layernorm(mesh: Mesh, X: np.ndarray, gamma: np.ndarray | None = None, beta: np.ndarray | None = None,
              eps: float = 1e-5, rows: int | None = None, cols: int | None = None) -> TileRun:
    """LayerNorm over the last axis of X (tokens, width)."""
    n, w = np.shape(X)
    t, xb, tt, wt = _place_rows(mesh, X, rows, cols)
    g, b = _param(t, "gamma", gamma, w, wt, 1.0), _param(t, "beta", beta, w, wt, 0.0)
    stats = t.alloc("stats", tt, 2)
    stats[..., 0], stats[..., 1] = xb.sum(-1), (xb * xb).sum(-1)  # padding is 0: adds nothing
    _row_allreduce(t, stats)
    mean = stats[..., 0] / w
    var = np.maximum(stats[..., 1] / w - mean * mean, 0)
    out = (xb - mean[..., None]) / np.sqrt(var[..., None] + eps) * g[:, :, None, :] + b[:, :, None, :]
    return t.result(_unplace(t, out, n, w))


def rmsnorm(mesh: Mesh, X: np.ndarray, gamma: np.ndarray | None = None, eps: float = 1e-6,
            rows: int | None = None, cols: int | None = None) -> TileRun:
    """RMSNorm over the last axis of X (tokens, width)."""
    n, w = np.shape(X)
    t, xb, tt, wt = _place_rows(mesh, X, rows, cols)
    g = _param(t, "gamma", gamma, w, wt, 1.0)
    stats = t.alloc("stats", tt, 1)
    stats[..., 0] = (xb * xb).sum(-1)
    _row_allreduce(t, stats)
    out = xb / np.sqrt(stats / w + eps) * g[:, :, None, :]
    return t.result(_unplace(t, out, n, w))


def softmax(mesh: Mesh, X: np.ndarray, rows: int | None = None, cols: int | None = None) -> TileRun:
    """Softmax over the last axis of X (tokens, width): a row max all-reduce, exp, a row sum all-reduce."""
    n, w = np.shape(X)
    t, xb, tt, wt = _place_rows(mesh, X, rows, cols, pad=-np.inf)
    mx = t.alloc("max", tt)
    mx[:] = xb.max(-1)
    _row_allreduce(t, mx, np.maximum)
    e = np.exp(xb - mx[..., None])  # padding: exp(-inf) = 0
    s = t.alloc("sum", tt)
    s[:] = e.sum(-1)
    _row_allreduce(t, s)
    return t.result(_unplace(t, e / s[..., None], n, w))
