"""Decode attention (one query token) over a KV cache spread across a rows x cols region.

Layout (`cost.attention_decode_schedule` charges the same): KV heads over groups of `rows_per_head`
consecutive rows (several KV heads per row when the region has fewer rows than KV heads), each head's context
positions over its rows_per_head x cols PEs, row-major, the same number per PE (the last PEs padded). PE (i, j)
holds K and V for its KV heads and its slice of the context, (kv_heads per group, positions per PE, head_dim)
each, and computes every query head that reads them (grouped-query attention: heads/kv_heads query heads per
KV head). A head's first row is the group's first row.

1. q for a head's query heads starts on PE (first row, 0), is forwarded down column 0 over the head's rows and
   then multicast West -> East along every row.
2. Every PE computes its scores s = K q / sqrt(d), a local max m, p = exp(s - m), l = sum p and o = p V
   (a PE with padding only holds m = -inf, l = 0, o = 0, which every merge leaves out).
3. The (m, l, o) partials reduce along every row East -> West, hop by hop, with the log-sum-exp merge
   m' = max(m1, m2), l' = l1 e^(m1-m') + l2 e^(m2-m'), o' = o1 e^(m1-m') + o2 e^(m2-m'),
   then up column 0, South -> North, into the head's first row with the same merge.
4. PE (first row, 0) writes out = o / l for its heads.
"""

from __future__ import annotations

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric.kernels.collectives import row_broadcast
from waferscale.fabric.kernels.tiles import TileRun, Tiles
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.schedules import used


def attention_decode(mesh: Mesh, q: np.ndarray, K: np.ndarray, V: np.ndarray, rows: int | None = None,
                     cols: int | None = None, rows_per_head: int | None = None) -> TileRun:
    """q (heads, d), K and V (ctx, kv_heads, d) -> out (heads, d) = softmax(q K^T / sqrt(d)) V per head.

    Grouped-query attention when kv_heads < heads (heads % kv_heads == 0): query head h reads KV head
    h // (heads / kv_heads). Each KV slice is stored once; a row computes every query head of its KV heads.
    rows_per_head: rows of a KV head's context (default: every row the region has for it, rows // kv_heads,
    but no more than one position per PE needs)."""
    q, K, V = (np.asarray(a, dtype=np.float32) for a in (q, K, V))
    if q.ndim != 2 or K.ndim != 3 or K.shape != V.shape or K.shape[2] != q.shape[1] or K.shape[0] == 0 \
            or K.shape[1] == 0 or q.shape[0] % K.shape[1]:
        raise ConfigError(f"attention needs q (heads, d) and K, V (ctx, kv_heads, d) with heads a multiple of "
                          f"kv_heads; got {q.shape}, {K.shape}, {V.shape}")
    T, Hk, d = K.shape
    H = q.shape[0]
    g = H // Hk  # query heads per KV head
    R0, C0 = mesh.check_region(rows, cols)
    G = max(1, R0 // Hk) if rows_per_head is None else rows_per_head
    if not 1 <= G <= max(1, R0 // Hk):
        raise ConfigError(f"rows_per_head={rows_per_head} must be between 1 and {max(1, R0 // Hk)} "
                          f"(the region's {R0} rows over {Hk} KV heads)")
    ct = -(-T // (G * C0))  # positions per PE
    C = min(C0, -(-T // ct))
    G = -(-T // (ct * C))  # rows a head's positions really need
    groups = used(Hk, R0 // G)
    hr = -(-Hk // groups)  # KV heads per group
    R = groups * G
    t = Tiles(mesh, R, C)

    def tile_kv(A: np.ndarray) -> np.ndarray:  # (T, Hk, d) -> (R, C, hr, ct, d), zero padded
        P = np.zeros((G * C * ct, groups * hr, d), dtype=np.float32)
        P[:T, :Hk] = A
        return P.reshape(G, C, ct, groups, hr, d).transpose(3, 0, 1, 4, 2, 5).reshape(R, C, hr, ct, d)

    Kb, Vb = t.alloc("K", hr, ct, d), t.alloc("V", hr, ct, d)
    Kb[:], Vb[:] = tile_kv(K), tile_kv(V)
    qb = t.alloc("q", hr, g, d)
    qp = np.zeros((groups * hr * g, d), dtype=np.float32)
    qp[:H] = q
    first = [n * G for n in range(groups)]  # each head's first row
    qb[first, 0] = qp.reshape(groups, hr, g, d)
    for r in range(1, G):  # down column 0 over the head's rows, hop by hop
        qb[[f + r for f in first], 0] = t.move(qb[[f + r - 1 for f in first], 0], [(f + r - 1, 0) for f in first],
                                               [(f + r, 0) for f in first])
    row_broadcast(t, qb)

    pos = (np.arange(G)[:, None, None] * C + np.arange(C)[None, :, None]) * ct + np.arange(ct)  # (G, C, ct)
    valid = np.tile(pos < T, (groups, 1, 1))  # (R, C, ct) real context positions
    s = np.einsum("ijktd,ijkgd->ijkgt", Kb, qb) / np.float32(np.sqrt(d))
    s = np.where(valid[:, :, None, None, :], s, -np.inf)
    part = t.alloc("part", hr, g, d + 2)  # [m, l, o_0..o_{d-1}] per query head
    part[..., 0] = s.max(-1)
    p = np.exp(s - _finite(part[..., 0])[..., None])
    part[..., 1] = p.sum(-1)
    part[..., 2:] = np.einsum("ijkgt,ijktd->ijkgd", p, Vb)
    for j in range(C - 1, 0, -1):  # log-sum-exp merge, East -> West, hop by hop
        part[:, j - 1] = _merge(part[:, j - 1], t.shift(part, axis=1, step=-1, index=j))
    for r in range(G - 1, 0, -1):  # then South -> North up column 0 into each head's first row
        up = t.move(part[[f + r for f in first], 0], [(f + r, 0) for f in first], [(f + r - 1, 0) for f in first])
        part[[f + r - 1 for f in first], 0] = _merge(part[[f + r - 1 for f in first], 0], up)
    out = part[first, 0, ..., 2:] / part[first, 0, ..., 1:2]  # (groups, hr, g, d)
    return t.result(out.reshape(groups * hr * g, d)[:H].copy())


def _finite(m: np.ndarray) -> np.ndarray:
    """A max that is -inf (a PE or partial holding padding only) rescales by 0 instead of 0 * inf."""
    return np.where(np.isfinite(m), m, 0)


def _merge(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Log-sum-exp merge of two [m, l, o...] partials (last axis)."""
    m = np.maximum(a[..., 0], b[..., 0])
    ea, eb = (np.exp(x[..., 0] - _finite(m))[..., None] for x in (a, b))
    return np.concatenate([m[..., None], a[..., 1:] * ea + b[..., 1:] * eb], axis=-1)


def attention_reference(q: np.ndarray, K: np.ndarray, V: np.ndarray) -> np.ndarray:
    """Plain softmax attention of one query per head; K, V with fewer (KV) heads are shared by groups."""
    g = q.shape[0] // K.shape[1]
    K, V = np.repeat(K, g, axis=1), np.repeat(V, g, axis=1)
    s = np.einsum("thd,hd->ht", K, q) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), V)
