"""Analytic cycle models of the fabric kernels (the fast backend; `sim.py` is the slow reference that judges it).

The models live in three modules: this one (`Cycles`, the pieces every model shares, and the element-wise
kernel and row programs: norms, softmax, decode attention), `cost_matmul.py` (weight-stationary GEMV/GEMM/SpMV
and the GEMV of the in-layer model-parallel layout) and `cost_collectives.py` (reduce, broadcast, all-reduce,
all-to-all). Every model follows the schedule of its kernel in `kernels/` and charges:

* compute — FMAC/op cycles of the busiest PE at its SIMD width (Chip row: 4-wide fp16 FMAC on WSE-1/2, 8-wide
  on WSE-3, 1 fp32 FMAC) — and SRAM-port cycles (PE row: 16 B read + 8 B write per cycle), per task, through the
  micro-model in `pe.py`;
* fabric — wavelets (32 bits, 1 per cycle per link per direction, Fabric row) through the busiest link or ramp;
* latency — one cycle per hop, a ramp (~2 cycles) into and out of every PE on the way, one task per stage of a
  chain or tree (pipeline fill and drain), taken per PE along the schedule's critical path (the max over PEs
  of arrival + own work + trip to the root, with the real tile sizes: the last tile row/column is smaller);
* defects — with a defective `mesh`, the real detoured routes (regions up to 64x64 PEs) or per-link hop
  estimates (bigger regions), and the contention of detours that make two streams share a physical link
  (a first-come-first-served fluid queue over the windows in which each stream sends);
* routing — the colors a schedule needs against the colors a program may use (Fabric row: 24 colors, 6 reserved):
  a schedule needing more runs in several passes, each paying its fill again.

Omitted (and said so): finite router buffers/back-pressure, task-switch overhead, bank conflicts, load
imbalance other than SpMV's, routes-per-PE limits on detours, clock/power throttling.

The row programs (`row_program_cycles`) run phase lists from `schedules.py` on every row: local tasks,
East->West chain reductions into column 0 (`chain_latency`) and West->East multicasts back
(`multicast_latency`), as `sim.sim_row_program` executes them wavelet by wavelet.

`Cycles.total` is the critical path of the schedule. The parts are resource busy times on the busiest PE/link;
`fill_drain` is whatever of the total the busiest resource does not explain (latency, fill, drain).
`bottleneck` is "routing" when colors force extra passes, "fabric latency" when latency or link traffic
dominates, else "compute" or "SRAM"; "I/O" only when `io` dominates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric import pe as PE
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.schedules import attention_phases, norm_phases, softmax_phases, used
from waferscale.fabric.spec import FabricSpec

BOTTLENECKS = ("compute", "SRAM", "fabric latency", "routing", "I/O")


@dataclass(frozen=True, kw_only=True)
class Cycles:
    compute: float
    sram: float
    fabric: float
    fill_drain: float
    io: float = 0.0
    total: float
    bottleneck: str
    passes: int = 1  # > 1 when routing colors forced the schedule into several passes

    def seconds(self, spec: FabricSpec) -> float:
        return self.total / spec.clock_hz

    def as_dict(self) -> dict:
        return asdict(self)

    def __add__(self, other: "Cycles") -> "Cycles":
        """Two kernels run one after the other."""
        return make_cycles(compute=self.compute + other.compute, sram=self.sram + other.sram,
                           fabric=self.fabric + other.fabric, io=self.io + other.io,
                           total=self.total + other.total, passes=max(self.passes, other.passes))


def make_cycles(*, compute: float, sram: float, fabric: float, total: float, io: float = 0.0,
                passes: int = 1) -> Cycles:
    busiest = max(compute, sram, fabric)
    fill = max(0.0, total - busiest)
    if passes > 1:
        neck = "routing"
    elif io >= max(total - io, busiest, fill) and io > 0:
        neck = "I/O"
    else:
        neck = max((("compute", compute), ("SRAM", sram), ("fabric latency", max(fabric, fill))),
                   key=lambda kv: kv[1])[0]
    return Cycles(compute=float(compute), sram=float(sram), fabric=float(fabric), fill_drain=float(fill),
                  io=float(io), total=float(total), bottleneck=neck, passes=passes)


# ---- shared pieces --------------------------------------------------------------------------------------
def check_positive(**sizes: int) -> None:
    """Every keyword is a positive integer (a size); raises ConfigError naming the first that is not."""
    for name, v in sizes.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")


def check_region(spec: FabricSpec, rows: int, cols: int, mesh: Mesh | None) -> tuple[int, int]:
    check_positive(rows=rows, cols=cols)
    if mesh is not None:
        return mesh.check_region(rows, cols)
    if rows > spec.rows or cols > spec.cols:
        raise ConfigError(f"region {rows}x{cols} exceeds {spec.name}'s {spec.rows}x{spec.cols} PEs")
    return rows, cols


def longest_chain_hops(mesh: Mesh | None, rows: int, cols: int, axis: int) -> int:
    """Physical hops of the longest chain along rows (axis=1) or down columns (axis=0), detours included."""
    if mesh is None:
        return cols - 1 if axis == 1 else rows - 1
    return mesh.max_chain_hops(rows, cols, axis)


def exact_routes(mesh: Mesh | None, rows: int, cols: int) -> bool:
    """Charge a defective mesh's real (detoured) routes one by one? Up to 64x64 PEs (a wafer or a region of it);
    bigger meshes use the per-link hop estimates of `Mesh.chain_hops` (Manhattan + 2 per blocked segment)."""
    return mesh is not None and mesh.has_defects and mesh.usable_pes <= 4096


def detour_extra(mesh: Mesh, R: int, C: int) -> tuple[int, int, int]:
    """Hops beyond the defect-free ones that detours add: (worst row chain, all row chains, column-0 chain),
    from the region's routes (`Mesh.chain_hops`)."""
    row = (mesh.chain_hops(R, C, axis=1) - 1).sum(axis=1) if C > 1 else np.zeros(1, np.int64)
    col = int((mesh.chain_hops(R, 1, axis=0) - 1).sum()) if R > 1 else 0
    return int(row.max(initial=0)), int(row.sum()), col


def color_passes(spec: FabricSpec, colors_needed: int) -> int:
    return math.ceil(colors_needed / spec.colors)


def chain_latency(spec: FabricSpec, stages: int, hops: int, n_waves: int, add_c: int) -> int:
    """A pipelined chain of `stages` PEs forwarding n_waves wavelets, each combined by an add task of add_c:
    the first wavelet pays ramp out + hops + ramp in + add per stage, the rest follow one per max(1, add_c)."""
    return stages * (2 * spec.ramp_latency_cycles + add_c) + hops * spec.hop_latency_cycles \
        + (n_waves - 1) * max(1, add_c)


def multicast_latency(spec: FabricSpec, hops: int, n_waves: int) -> int:
    """One source multicasting n_waves wavelets to PEs up to `hops` away: ramp out, hops, ramp in, one per cycle."""
    return 2 * spec.ramp_latency_cycles + hops * spec.hop_latency_cycles + n_waves - 1


def fluid_finish(windows: list[tuple[float, float]], until: float, nw) -> float:
    """A link shared by streams each sending nw wavelets (an int, or one per stream) evenly over its window
    [first, last], serving one wavelet per cycle first come first served: when the wavelet arriving at `until`
    leaves. The queue holds the work that arrived since the busy period began: max over start points s of
    s + arrivals in [s, until]."""
    nws = nw if isinstance(nw, list) else [nw] * len(windows)

    def arrived(t: float) -> float:  # wavelets arrived at or before t
        return sum(n * min(1.0, max(0.0, (t - f + 1) / (l - f + 1))) for (f, l), n in zip(windows, nws))

    done = arrived(until)
    return max(s + done - arrived(s - 1) - 1 for s in {f for f, _ in windows if f <= until} | {until})


# ---- element-wise, norms, softmax, attention ------------------------------------------------------------
def elementwise_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, flops_per_elem: int = 1,
                       dtype: str = "fp16") -> Cycles:
    """z = f(x, y) on n_elems spread over the region: per PE, one SIMD op of `lanes` values at a time, reading
    two operands and writing one. No fabric traffic."""
    check_positive(n_elems=n_elems, flops_per_elem=flops_per_elem)
    R, C = check_region(spec, rows, cols, None)
    ne = -(-n_elems // (R * C))
    total = comp = sram = 0
    lanes = PE.lanes(spec, dtype)
    for e, count in ((lanes, ne // lanes), (ne % lanes, 1 if ne % lanes else 0)):  # full vector ops, then the rest
        kw = dict(ops=e * flops_per_elem, read_elems=2 * e, write_elems=e)
        total += count * PE.task_cycles(spec, dtype, **kw)
        c, s = PE.task_parts(spec, dtype, **kw)
        comp, sram = comp + count * c, sram + count * s
    return make_cycles(compute=comp, sram=sram, fabric=0, total=total)


def row_program_cycles(spec: FabricSpec, phases: list[tuple], rows: int, cols: int, dtype: str = "fp32",
                       mesh: Mesh | None = None, colors: int = 3) -> Cycles:
    """Phases run one after another on every row (the phase lists of `schedules.py`, which
    `sim.sim_row_program` executes wavelet by wavelet): local tasks, East->West chain reductions into column 0,
    and West->East multicasts back."""
    R, C = check_region(spec, rows, cols, mesh)
    epw = PE.elems_per_wavelet(spec, dtype)
    hops = longest_chain_hops(mesh, R, C, axis=1)
    total = comp = fabric = 0
    for ph in phases:
        kind = ph[0]
        if kind in ("local", "local0"):
            total += ph[1]
            comp += ph[1]
        elif C > 1 and kind == "reduce":
            nw, add_c = -(-ph[1] // epw), PE.add_task(spec, dtype, epw, ph[2])
            total += chain_latency(spec, C - 1, hops, nw, add_c)
            comp += nw * add_c
            fabric += nw
        elif C > 1 and kind == "bcast":
            nw = -(-ph[1] // epw)
            total += multicast_latency(spec, hops, nw)
            fabric += nw
    passes = color_passes(spec, colors)
    return make_cycles(compute=comp, sram=comp, fabric=fabric, total=total * passes, passes=passes)


def _rows_region(spec: FabricSpec, n_elems: int, width: int, rows: int, cols: int,
                 mesh: Mesh | None) -> tuple[int, int, int, int]:
    """Rows of `width` values: tokens over the region's rows, the width over its columns. Returns the PEs
    used (R, C), tokens per row and values per PE of a token."""
    check_positive(n_elems=n_elems, width=width)
    tokens = -(-n_elems // width)
    R, C = check_region(spec, rows, cols, mesh)
    R, C = used(tokens, R), used(width, C)
    return R, C, -(-tokens // R), -(-width // C)


def norm_cycles(spec: FabricSpec, n_elems: int, width: int, rows: int, cols: int, rms: bool = False,
                dtype: str = "fp32", *, mesh: Mesh | None = None) -> Cycles:
    """LayerNorm (or RMSNorm) of n_elems/width vectors of `width`: tokens over rows, width over columns; local
    statistics, a row all-reduce of them, then the normalisation (see `schedules.norm_phases`)."""
    R, C, tokens_per_row, width_per_pe = _rows_region(spec, n_elems, width, rows, cols, mesh)
    return row_program_cycles(spec, norm_phases(spec, tokens_per_row, width_per_pe, rms, dtype), R, C, dtype, mesh)


def softmax_cycles(spec: FabricSpec, n_elems: int, width: int, rows: int, cols: int, dtype: str = "fp32", *,
                   mesh: Mesh | None = None) -> Cycles:
    """Softmax over rows of `width`: a max all-reduce and a sum all-reduce along each mesh row; exp() is
    assumed to cost `spec.exp_ops` SIMD ops (not in WSE.md: an assumption, fabric/assumptions.py)."""
    R, C, tokens_per_row, width_per_pe = _rows_region(spec, n_elems, width, rows, cols, mesh)
    return row_program_cycles(spec, softmax_phases(spec, tokens_per_row, width_per_pe, dtype), R, C, dtype, mesh,
                              colors=5)


def attention_decode_cycles(spec: FabricSpec, n_heads: int, head_dim: int, context_len: int, rows: int, cols: int,
                            dtype: str = "fp16", *, n_kv_heads: int | None = None,
                            mesh: Mesh | None = None) -> Cycles:
    """One decode step of attention over a KV cache of context_len positions: KV heads over rows (each KV
    slice stored once), context over columns; q multicast along each row, local scores/exp/P.V for every
    query head of the row's KV heads (n_heads / n_kv_heads per KV head: grouped-query attention), a
    log-sum-exp merge chain into column 0. n_kv_heads defaults to n_heads (multi-head attention)."""
    n_kv = n_heads if n_kv_heads is None else n_kv_heads
    check_positive(n_heads=n_heads, head_dim=head_dim, context_len=context_len, n_kv_heads=n_kv)
    if n_heads % n_kv:
        raise ConfigError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv} (grouped-query attention)")
    R, C = check_region(spec, rows, cols, mesh)
    R, C = used(n_kv, R), used(context_len, C)
    kv_per_row, ctx_per_pe = -(-n_kv // R), -(-context_len // C)
    kv_bytes = 2 * kv_per_row * ctx_per_pe * head_dim * PE.dtype_bytes(dtype)
    if kv_bytes > spec.sram_bytes_per_pe:
        raise ConfigError(f"KV cache slice of {kv_bytes:,} B per PE exceeds {spec.sram_bytes_per_pe:,} B SRAM; "
                          f"use more PEs or a shorter context")
    phases = attention_phases(spec, kv_per_row * (n_heads // n_kv), ctx_per_pe, head_dim, dtype)
    return row_program_cycles(spec, phases, R, C, dtype, mesh)
