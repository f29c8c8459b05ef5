"""The micro-model of one PE, shared by the analytic cost model (`cost*.py`) and the event simulation (`sim.py`).

One *task* (a dataflow task fired by arriving wavelets) costs

    cycles = task_overhead + max(ceil(ops / lanes) + vector_ops * vector_op,
                                 ceil(read_bytes / sram_read_bytes_per_cycle),
                                 ceil(write_bytes / sram_write_bytes_per_cycle), 1)

i.e. the SIMD datapath and the SRAM ports overlap and the slowest of them sets the task's length (PE row of
WSE.md: "per cycle 2x64-bit reads + 1x64-bit write"). `lanes` counts FMACs (or simple ops) per cycle:
FLOP/cycle / 2 (Chip row "fp16 SIMD per PE": 4-wide FMAC on WSE-1/2, 8-wide on WSE-3; "fp32 per PE 1 FMAC").
Two constants no source publishes are the PE's own fixed costs, calibrated on kernel-level measurements
(`bench/calibrate.py`; their values, ranges and rows in `fabric/assumptions.py`): `task_overhead_cycles`, what
activating a task and ending it costs whatever it does, and `vector_op_cycles`, what each vector (DSD)
instruction a task issues costs beyond its elements (issue, address setup, the pipeline filling); a third,
`fp32_fmac_sustained_fraction`, is the share of the Chip row's "1 FMAC" a cycle that an fp32 multiply-add
sustains (fp32 `lanes` = 1 x that fraction; the SDK's SIMD table gives no width for @fmacs). A task's
vector instructions: one per x value of an AXPY (y[:rows] += W[:, j] x_j), one per op of an element-wise
stream, none for the scalar adds that combine an arriving wavelet's partial values in a reduction.

Omitted: microthread switching, the 256 B cache, bank conflicts (beyond what the constants absorb).
The event simulation only shares these per-task costs; *when* tasks run (arrival order, queueing behind other
tasks, link contention) it works out wavelet by wavelet on its own.
"""

from __future__ import annotations

import math

from waferscale.errors import ConfigError
from waferscale.fabric.spec import FabricSpec

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
WAVELET_BYTES = 4  # Fabric row: "32-bit wavelet" (A)


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def lanes(spec: FabricSpec, dtype: str, fmac: bool = False) -> float:
    """FMACs (or simple element ops) per cycle per PE for `dtype`; an fp32 multiply-add (`fmac`) at the calibrated
    share of its peak."""
    flops = spec.fp32_flops_per_cycle_per_pe if dtype_bytes(dtype) == 4 else spec.fp16_flops_per_cycle_per_pe
    n = max(1, flops // 2)
    return n * spec.fp32_fmac_sustained_fraction if fmac and dtype_bytes(dtype) == 4 else n


def elems_per_wavelet(spec: FabricSpec, dtype: str) -> int:
    """Values carried by one 32-bit wavelet: 2 fp16 or 1 fp32 (Fabric row: "32 bits per cycle per link")."""
    return max(1, min(spec.link_bytes_per_cycle, WAVELET_BYTES) // dtype_bytes(dtype))


def wavelets(n_elems: int, spec: FabricSpec, dtype: str) -> int:
    return -(-n_elems // elems_per_wavelet(spec, dtype))


def task_cycles(spec: FabricSpec, dtype: str, *, ops: float, read_elems: float, write_elems: float,
                vector_ops: float = 1, fmac: bool = False) -> int:
    """Cycles of one task doing `ops` FMACs/ops (`fmac`: multiply-adds) in `vector_ops` vector instructions and
    touching SRAM for `read_elems`/`write_elems` values."""
    return max(1, *task_parts(spec, dtype, ops=ops, read_elems=read_elems, write_elems=write_elems,
                              vector_ops=vector_ops, fmac=fmac))


def task_parts(spec: FabricSpec, dtype: str, *, ops: float, read_elems: float, write_elems: float,
               vector_ops: float = 1, fmac: bool = False) -> tuple[int, int]:
    """(compute cycles, SRAM cycles) of one task, for breakdowns; each includes the task's activation."""
    b = dtype_bytes(dtype)
    sram = max(math.ceil(read_elems * b / spec.sram_read_bytes_per_cycle),
               math.ceil(write_elems * b / spec.sram_write_bytes_per_cycle))
    compute = math.ceil(ops / lanes(spec, dtype, fmac)) + math.ceil(vector_ops * spec.vector_op_cycles)
    return spec.task_overhead_cycles + compute, spec.task_overhead_cycles + sram


# ---- the per-wavelet tasks every kernel uses --------------------------------------------------------------
def axpy_parts(spec: FabricSpec, dtype: str, n_x: int, tile_rows: int) -> tuple[int, int]:
    """(compute, SRAM) cycles of `axpy_task`, for breakdowns."""
    return task_parts(spec, dtype, ops=n_x * tile_rows, read_elems=2 * n_x * tile_rows, write_elems=n_x * tile_rows,
                      vector_ops=n_x, fmac=True)


def axpy_task(spec: FabricSpec, dtype: str, n_x: int, tile_rows: int) -> int:
    """A wavelet carrying `n_x` input values arrives: y[:tile_rows] += W[:, j] * x_j for each of them (one vector
    instruction each)."""
    return max(1, *axpy_parts(spec, dtype, n_x, tile_rows))


def add_task(spec: FabricSpec, dtype: str, n: int, ops_per_elem: int = 1) -> int:
    """A wavelet of `n` partial values arrives and is combined into the local partial (read own, write sum): scalar
    operations on the wavelet's values, no vector instruction to set up."""
    return task_cycles(spec, dtype, ops=n * ops_per_elem, read_elems=n, write_elems=n, vector_ops=0)
