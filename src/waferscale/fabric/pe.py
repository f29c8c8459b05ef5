"""The micro-model of one PE, shared by the analytic cost model (`cost*.py`) and the event simulation (`sim.py`).

One *task* (a dataflow task fired by arriving wavelets) costs

    cycles = max(ceil(ops / lanes), ceil(read_bytes / sram_read_bytes_per_cycle),
                 ceil(write_bytes / sram_write_bytes_per_cycle), 1)

i.e. the SIMD datapath and the SRAM ports overlap and the slowest of them sets the task length (PE row of
WSE.md: "per cycle 2x64-bit reads + 1x64-bit write"). `lanes` counts FMACs (or simple ops) per cycle:
FLOP/cycle / 2 (Chip row "fp16 SIMD per PE": 4-wide FMAC on WSE-1/2, 8-wide on WSE-3; "fp32 per PE 1 FMAC").

Omitted: task-activation overhead, microthread switching, the 256 B cache, bank conflicts.
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


def lanes(spec: FabricSpec, dtype: str) -> int:
    """FMACs (or simple element ops) per cycle per PE for `dtype`."""
    flops = spec.fp32_flops_per_cycle_per_pe if dtype_bytes(dtype) == 4 else spec.fp16_flops_per_cycle_per_pe
    return max(1, flops // 2)


def elems_per_wavelet(spec: FabricSpec, dtype: str) -> int:
    """Values carried by one 32-bit wavelet: 2 fp16 or 1 fp32 (Fabric row: "32 bits per cycle per link")."""
    return max(1, min(spec.link_bytes_per_cycle, WAVELET_BYTES) // dtype_bytes(dtype))


def wavelets(n_elems: int, spec: FabricSpec, dtype: str) -> int:
    return -(-n_elems // elems_per_wavelet(spec, dtype))


def task_cycles(spec: FabricSpec, dtype: str, *, ops: float, read_elems: float, write_elems: float) -> int:
    """Cycles of one task doing `ops` FMACs/ops and touching SRAM for `read_elems`/`write_elems` values."""
    return max(1, *task_parts(spec, dtype, ops=ops, read_elems=read_elems, write_elems=write_elems))


def task_parts(spec: FabricSpec, dtype: str, *, ops: float, read_elems: float, write_elems: float) -> tuple[int, int]:
    """(compute cycles, SRAM cycles) of one task, for breakdowns."""
    b = dtype_bytes(dtype)
    sram = max(math.ceil(read_elems * b / spec.sram_read_bytes_per_cycle),
               math.ceil(write_elems * b / spec.sram_write_bytes_per_cycle))
    return math.ceil(ops / lanes(spec, dtype)), sram


# ---- the per-wavelet tasks every kernel uses --------------------------------------------------------------
def axpy_task(spec: FabricSpec, dtype: str, n_x: int, tile_rows: int) -> int:
    """A wavelet carrying `n_x` input values arrives: y[:tile_rows] += W[:, j] * x_j for each of them."""
    return task_cycles(spec, dtype, ops=n_x * tile_rows, read_elems=2 * n_x * tile_rows, write_elems=n_x * tile_rows)


def add_task(spec: FabricSpec, dtype: str, n: int, ops_per_elem: int = 1) -> int:
    """A wavelet of `n` partial values arrives and is combined into the local partial (read own, write sum)."""
    return task_cycles(spec, dtype, ops=n * ops_per_elem, read_elems=n, write_elems=n)
