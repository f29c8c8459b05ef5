"""Decode attention (one query token) over a KV cache spread across a rows x cols region.

Layout: KV heads are block-split over the region's rows, context positions over its columns; PE (i, j) holds
K and V for its KV heads and its slice of the context, (kv_heads/rows, ctx/cols, head_dim) each, and computes
every query head that reads them (grouped-query attention: heads/kv_heads query heads per KV head).

1. q for row i's query heads starts on PE (i, 0) and is multicast West -> East along the row.
2. Every PE computes its scores s = K q / sqrt(d), a local max m, p = exp(s - m), l = sum p and o = p V.
3. The (m, l, o) partials reduce along the row East -> West, hop by hop, with the log-sum-exp merge
   m' = max(m1, m2), l' = l1 e^(m1-m') + l2 e^(m2-m'), o' = o1 e^(m1-m') + o2 e^(m2-m').
4. PE (i, 0) writes out = o / l for its heads.
"""

from __future__ import annotations

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric.kernels.collectives import row_broadcast
from waferscale.fabric.kernels.tiles import TileRun, Tiles, region_for
from waferscale.fabric.mesh import Mesh


def attention_decode(mesh: Mesh, q: np.ndarray, K: np.ndarray, V: np.ndarray, rows: int | None = None,
                     cols: int | None = None) -> TileRun:
    """q (heads, d), K and V (ctx, kv_heads, d) -> out (heads, d) = softmax(q K^T / sqrt(d)) V per head.

    Grouped-query attention when kv_heads < heads (heads % kv_heads == 0): query head h reads KV head
    h // (heads / kv_heads). KV heads are split over the rows, so each KV slice is stored once; a row computes
    every query head of its KV heads."""
    q, K, V = (np.asarray(a, dtype=np.float32) for a in (q, K, V))
    if q.ndim != 2 or K.ndim != 3 or K.shape != V.shape or K.shape[2] != q.shape[1] or K.shape[0] == 0 \
            or K.shape[1] == 0 or q.shape[0] % K.shape[1]:
        raise ConfigError(f"attention needs q (heads, d) and K, V (ctx, kv_heads, d) with heads a multiple of "
                          f"kv_heads; got {q.shape}, {K.shape}, {V.shape}")
    T, Hk, d = K.shape
    H = q.shape[0]
    g = H // Hk  # query heads per KV head
    R, C = region_for(mesh, rows, cols, Hk, T)
    t = Tiles(mesh, R, C)
    hr, ct = -(-Hk // R), -(-T // C)

    def tile_kv(A: np.ndarray) -> np.ndarray:  # (T, Hk, d) -> (R, C, hr, ct, d), zero padded
        P = np.zeros((C * ct, R * hr, d), dtype=np.float32)
        P[:T, :Hk] = A
        return P.reshape(C, ct, R, hr, d).transpose(2, 0, 3, 1, 4)

    Kb, Vb = t.alloc("K", hr, ct, d), t.alloc("V", hr, ct, d)
    Kb[:], Vb[:] = tile_kv(K), tile_kv(V)
    qb = t.alloc("q", hr, g, d)
    qp = np.zeros((R * hr * g, d), dtype=np.float32)
    qp[:H] = q
    qb[:, 0] = qp.reshape(R, hr, g, d)
    row_broadcast(t, qb)

    valid = (np.arange(C)[:, None] * ct + np.arange(ct)[None, :]) < T  # (C, ct) real context positions
    s = np.einsum("ijktd,ijkgd->ijkgt", Kb, qb) / np.float32(np.sqrt(d))
    s = np.where(valid[None, :, None, None, :], s, -np.inf)
    part = t.alloc("part", hr, g, d + 2)  # [m, l, o_0..o_{d-1}] per query head
    part[..., 0] = s.max(-1)  # every PE has >= 1 real position (no empty tiles), so m is finite
    p = np.exp(s - part[..., 0:1])
    part[..., 1] = p.sum(-1)
    part[..., 2:] = np.einsum("ijkgt,ijktd->ijkgd", p, Vb)
    for j in range(C - 1, 0, -1):  # log-sum-exp merge, East -> West, hop by hop
        a, b = part[:, j - 1], t.shift(part, axis=1, step=-1, index=j)
        m = np.maximum(a[..., 0], b[..., 0])
        ea, eb = np.exp(a[..., 0] - m)[..., None], np.exp(b[..., 0] - m)[..., None]
        part[:, j - 1, ..., 0] = m
        part[:, j - 1, ..., 1:] = a[..., 1:] * ea + b[..., 1:] * eb
    out = part[:, 0, ..., 2:] / part[:, 0, ..., 1:2]  # (R, hr, g, d)
    return t.result(out.reshape(R * hr * g, d)[:H].copy())


def attention_reference(q: np.ndarray, K: np.ndarray, V: np.ndarray) -> np.ndarray:
    """Plain softmax attention of one query per head; K, V with fewer (KV) heads are shared by groups."""
    g = q.shape[0] // K.shape[1]
    K, V = np.repeat(K, g, axis=1), np.repeat(V, g, axis=1)
    s = np.einsum("thd,hd->ht", K, q) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), V)
