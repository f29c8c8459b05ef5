"""GEMM on 2D-distributed operands, tile by tile: SUMMA and Cannon (the schedules of `schedules_gemm2d.py`,
whose cycles `cost_gemm2d.py` models and `sim_gemm2d.py` simulates).

Y (m, n) = W (m, k) X (k, n); W, X and Y each in rows x cols blocks, block (i, j) on PE (i, j) (Cannon folded:
on PE (slot(i), slot(j)), the interleaved placement). Every PE holds its blocks and the panel/block buffers in
its own SRAM (`Tiles.alloc` refuses an overflow); blocks reach other PEs only through `Tiles.move`/`shift`,
hop by hop along the mesh routes, and every PE multiplies only what it holds.
"""

from __future__ import annotations

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric.kernels.tiles import TileRun, Tiles
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.schedules import tile_sizes
from waferscale.fabric.schedules_gemm2d import BUFFERS, cannon_block, region, ring_slot, summa_panels


def _blocks(a: np.ndarray, row_parts: int, col_parts: int) -> tuple[np.ndarray, list[int], list[int]]:
    """(row_parts, col_parts, rt, ct) zero-padded blocks of `a` and the real block sizes along each axis."""
    rs, cs = tile_sizes(a.shape[0], row_parts), tile_sizes(a.shape[1], col_parts)
    out = np.zeros((row_parts, col_parts, rs[0], cs[0]), np.float32)
    for i in range(row_parts):
        for j in range(col_parts):
            out[i, j, :rs[i], :cs[j]] = a[i * rs[0]:i * rs[0] + rs[i], j * cs[0]:j * cs[0] + cs[j]]
    return out, rs, cs


def _unblock(b: np.ndarray, rs: list[int], cs: list[int]) -> np.ndarray:
    return np.concatenate([np.concatenate([b[i, j, :rs[i], :cs[j]] for j in range(len(cs))], axis=1)
                           for i in range(len(rs))], axis=0)


def gemm2d(mesh: Mesh, W: np.ndarray, X: np.ndarray, algo: str = "summa", rows: int | None = None,
           cols: int | None = None) -> TileRun:
    """Y = W @ X by SUMMA or Cannon on a rows x cols region of `mesh` (default: the whole logical mesh)."""
    W, X = np.asarray(W, np.float32), np.asarray(X, np.float32)
    if W.ndim != 2 or X.ndim != 2 or W.size == 0 or X.size == 0 or W.shape[1] != X.shape[0]:
        raise ConfigError(f"gemm2d needs W (m, k) and X (k, n), got shapes {W.shape} and {X.shape}")
    rows, cols = mesh.check_region(rows, cols)
    (m, k), n = W.shape, X.shape[1]
    R, C = region(algo, m, k, n, rows, cols)
    if algo == "summa":
        return _summa(Tiles(mesh, R, C), W, X)
    return _cannon(Tiles(mesh, R, C), W, X, algo == "cannon_folded")


def _summa(t: Tiles, W: np.ndarray, X: np.ndarray) -> TileRun:
    R, C = t.rows, t.cols
    Wb, ms, kws = _blocks(W, R, C)
    Xb, kxs, ns = _blocks(X, R, C)
    panels = summa_panels(W.shape[1], R, C)
    kb = max(w for _, w, _, _ in panels)
    w_own, x_own = t.alloc("W", *Wb.shape[2:]), t.alloc("X", *Xb.shape[2:])
    w_own[:], x_own[:] = Wb, Xb
    y = t.alloc("Y", ms[0], ns[0])
    w_buf, x_buf = t.alloc("W panels", BUFFERS, ms[0], kb), t.alloc("X panels", BUFFERS, kb, ns[0])
    for p, (a, w, cw, rx) in enumerate(panels):
        wp, xp = w_buf[:, :, p % BUFFERS, :, :w], x_buf[:, :, p % BUFFERS, :w, :]
        wp[:, cw] = w_own[:, cw, :, a - cw * kws[0]:a - cw * kws[0] + w]  # the owners' slices of the panel
        xp[rx] = x_own[rx, :, a - rx * kxs[0]:a - rx * kxs[0] + w, :]
        for j in range(cw + 1, C):  # multicast along every row, East then West of the owner column
            wp[:, j] = t.shift(wp, axis=1, step=1, index=j - 1)
        for j in range(cw - 1, -1, -1):
            wp[:, j] = t.shift(wp, axis=1, step=-1, index=j + 1)
        for i in range(rx + 1, R):  # and down every column, South then North of the owner row
            xp[i] = t.shift(xp, axis=0, step=1, index=i - 1)
        for i in range(rx - 1, -1, -1):
            xp[i] = t.shift(xp, axis=0, step=-1, index=i + 1)
        y += np.einsum("ijab,ijbc->ijac", wp, xp)  # every PE: its panel product into its own Y block
    return t.result(_unblock(y, ms, ns))


def _cannon(t: Tiles, W: np.ndarray, X: np.ndarray, folded: bool) -> TileRun:
    P = t.rows
    Wb, ms, ks = _blocks(W, P, P)
    Xb, _, ns = _blocks(X, P, P)
    slot = [ring_slot(q, P, folded) for q in range(P)]
    pe = {(i, j): (slot[i], slot[j]) for i in range(P) for j in range(P)}  # ring position -> PE
    w_buf, x_buf = t.alloc("W blocks", BUFFERS, ms[0], ks[0]), t.alloc("X blocks", BUFFERS, ks[0], ns[0])
    y = t.alloc("Y", ms[0], ns[0])
    for (i, j), (a, b) in pe.items():
        w_buf[a, b, 0], x_buf[a, b, 0] = Wb[i, j], Xb[i, j]

    def move(buf: np.ndarray, cur: int, dst) -> None:
        """Every ring position (i, j) sends its block in buffer `cur` to ring position dst(i, j)'s other one."""
        src = [q for q in pe if dst(*q) != q]
        got = t.move(np.stack([buf[pe[q]][cur] for q in src]), [pe[q] for q in src], [pe[dst(*q)] for q in src])
        for q, block in zip(src, got):
            buf[pe[dst(*q)]][1 - cur] = block
        for q in pe:
            if dst(*q) == q:
                buf[pe[q]][1 - cur] = buf[pe[q]][cur]  # stays: a local copy between its buffers

    move(w_buf, 0, lambda i, j: (i, (j - i) % P))  # the skew: row i West by i, column j North by j
    move(x_buf, 0, lambda i, j: ((i - j) % P, j))
    cur = 1
    for s in range(P):
        for (i, j), (a, b) in pe.items():  # every PE multiplies the blocks it holds (k block l, real width)
            kl = ks[cannon_block(i, j, s, P)]
            y[a, b] += w_buf[a, b, cur, :, :kl] @ x_buf[a, b, cur, :kl, :]
        if s + 1 < P:
            move(w_buf, cur, lambda i, j: (i, (j - 1) % P))
            move(x_buf, cur, lambda i, j: ((i - 1) % P, j))
            cur = 1 - cur
    out = np.zeros((P, P) + y.shape[2:], np.float32)
    for (i, j), (a, b) in pe.items():
        out[i, j] = y[a, b]
    return t.result(_unblock(out, ms, ns))
