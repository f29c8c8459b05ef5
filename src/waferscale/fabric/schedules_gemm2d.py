"""The schedules of GEMM on 2D-distributed operands (SUMMA and Cannon), as data shared by the three views:
the tile-by-tile execution (`kernels/gemm2d.py`), the cycle model (`cost_gemm2d.py`) and the wavelet-level
event simulation that judges it (`sim_gemm2d.py`).

Y (m, n) = W (m, k) X (k, n) on a rows x cols region. W, X and Y are each cut into rows x cols blocks (block
splits as `schedules.tile_sizes`: ceil tiles, the last ones smaller): m over the mesh rows, n over the mesh
columns, and k over the mesh columns for W and over the mesh rows for X. Block (i, j) of each lives on PE (i, j).

* SUMMA (van de Geijn & Watts): k is cut into panels, the common refinement of W's and X's k splits (one PE's
  block width when rows == cols). For panel p, the PEs of W's owner column multicast their W panel along their
  rows, those of X's owner row their X panel down their columns, and every PE adds the panel product into its
  Y block. Two panel buffers: an owner sends panel p + 1 when it starts computing panel p (its receivers have
  then finished panel p - 1 and freed that buffer), so the next multicast overlaps the current compute.
* Cannon (P x P mesh): an initial skew (row i's W blocks move i places West, column j's X blocks j places
  North, with wrap-around), then P steps: multiply the blocks held, pass W one place West and X one place North
  (wrap-around). Two buffers per operand: a PE sends its blocks on when it starts computing with them. Without
  a torus the wrap-around is a real route across the row (P - 1 hops). "cannon_folded" places ring position l
  at mesh slot `ring_slot(l)` (0, P-1, 1, P-2, ... interleaved, as WaferLLM's MeshGEMM does) so that every ring
  neighbour, the wrap-around included, is at most 2 hops away; W, X and Y then live in that interleaved layout
  (a placement the compiler chooses once, like the weight tiles themselves). The wrap-around's latency is paid
  once per trip around the ring, not once per step: each PE waits only for its own neighbour, so the PEs drift
  apart by their distance from the wrap and stay there (the event simulation shows folding gaining at most a few
  percent, tests/test_fabric_gemm2d.py). When a step computes longer than a block takes to arrive, that drift
  stays within one step and two buffers suffice; with smaller blocks a real PE would stall its sender for a
  buffer (back-pressure, omitted by the simulation and the model alike).

A local block product is one AXPY task per X wavelet (`pe.axpy_task`: y[:, c] += W[:, l] * X[l, c] for the
values it carries); nothing else runs on the core while it computes.
"""

from __future__ import annotations

from waferscale.errors import ConfigError
from waferscale.fabric import pe as PE
from waferscale.fabric.schedules import tile_sizes, used
from waferscale.fabric.spec import FabricSpec

ALGOS = ("summa", "cannon", "cannon_folded")
BUFFERS = 2  # panel/block buffers per operand (double buffering: receive the next while computing this one)


def check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise ConfigError(f"unknown 2D GEMM algorithm {algo!r}; use one of {', '.join(ALGOS)}")


def region(algo: str, m: int, k: int, n: int, rows: int, cols: int) -> tuple[int, int]:
    """The PEs (R, C) the schedule really uses (no PE with an empty Y block; Cannon: P x P, every k block
    non-empty). Cannon needs a square region."""
    check_algo(algo)
    if algo == "summa":
        return used(m, rows), used(n, cols)
    if rows != cols:
        raise ConfigError(f"{algo} needs a square mesh (rows == cols), got {rows}x{cols}; use algo 'summa' "
                          f"or a square --pes")
    P = rows
    while min(used(m, P), used(k, P), used(n, P)) < P:  # fewer values than PEs along some axis
        P = min(used(m, P), used(k, P), used(n, P))
    return P, P


def summa_panels(k: int, R: int, C: int) -> list[tuple[int, int, int, int]]:
    """(first k index, width, W's owner column, X's owner row) of every k-panel, in order."""
    kw, kx = -(-k // C), -(-k // R)
    cuts = sorted({min(k, c * kw) for c in range(C + 1)} | {min(k, r * kx) for r in range(R + 1)})
    return [(a, b - a, a // kw, a // kx) for a, b in zip(cuts, cuts[1:]) if b > a]


def ring_slot(pos: int, P: int, folded: bool) -> int:
    """Mesh row/column of ring position `pos` (0..P-1): itself, or folded: 0, P-1, 1, P-2, ... interleaved so
    ring neighbours are <= 2 apart."""
    if not folded:
        return pos
    return 2 * pos if pos < (P + 1) // 2 else 2 * (P - 1 - pos) + 1


def cannon_block(i: int, j: int, step: int, P: int) -> int:
    """The k block ring position (i, j) multiplies at `step` (after the skew): W (i, l) and X (l, j)."""
    return (i + j + step) % P


def block_wavelets(spec: FabricSpec, dtype: str, rows: int, cols: int) -> int:
    """Wavelets of a rows x cols block sent packed (`pe.elems_per_wavelet` values each)."""
    return PE.wavelets(rows * cols, spec, dtype)


def block_product(spec: FabricSpec, dtype: str, mt: int, kb: int, nt: int) -> tuple[int, int, int]:
    """(cycles, compute cycles, SRAM cycles) of Y (mt, nt) += W (mt, kb) X (kb, nt) on one PE: for each of the
    kb rows of X, one AXPY task per wavelet of that row (its e values each update a column of Y with a column
    of W: e * mt FMACs, reading W and Y, writing Y)."""
    epw = PE.elems_per_wavelet(spec, dtype)
    cyc = comp = sram = 0
    full, rem = divmod(nt, epw)
    for e, count in ((epw, full), (rem, 1 if rem else 0)):
        if count:
            kw = dict(ops=e * mt, read_elems=2 * e * mt, write_elems=e * mt, vector_ops=e, fmac=True)
            c, s = PE.task_parts(spec, dtype, **kw)
            cyc += count * PE.task_cycles(spec, dtype, **kw)
            comp, sram = comp + count * c, sram + count * s
    return kb * cyc, kb * comp, kb * sram


def sram_bytes(algo: str, m: int, k: int, n: int, R: int, C: int, value_bytes: int) -> int:
    """Bytes on the busiest PE: its W, X and Y blocks plus the panel (SUMMA) or block (Cannon) buffers."""
    mt, nt = tile_sizes(m, R)[0], tile_sizes(n, C)[0]
    if algo == "summa":
        kw, kx = tile_sizes(k, C)[0], tile_sizes(k, R)[0]
        kb = max(w for _, w, _, _ in summa_panels(k, R, C))
        vals = mt * kw + kx * nt + mt * nt + BUFFERS * (mt * kb + kb * nt)
    else:  # the held blocks are the buffers: BUFFERS of each operand
        kt = tile_sizes(k, R)[0]
        vals = BUFFERS * (mt * kt + kt * nt) + mt * nt
    return vals * value_bytes


def check_sram(spec: FabricSpec, algo: str, m: int, k: int, n: int, R: int, C: int, dtype: str) -> None:
    """Refuse blocks and buffers that overflow a PE's SRAM less the program reserve (code, routing tables)."""
    need = sram_bytes(algo, m, k, n, R, C, PE.dtype_bytes(dtype))
    have = spec.sram_bytes_per_pe - spec.program_reserve_bytes_per_pe
    if need > have:
        raise ConfigError(f"{algo} GEMM {m}x{k}x{n} ({dtype}) on {R}x{C} PEs needs {need:,} B per PE (W, X, Y "
                          f"blocks and {BUFFERS} buffers each), over the {have:,} B a PE has for data "
                          f"({spec.sram_bytes_per_pe:,} B SRAM less {spec.program_reserve_bytes_per_pe:,} B for its "
                          f"program); use more PEs (a larger --pes) or a smaller problem")
