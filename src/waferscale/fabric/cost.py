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
East->West chain reductions into column 0 (`chain_latency`), South->North chains up column 0 over groups of
rows (decode attention: a KV head's rows) and multicasts from column 0 (`multicast_latency`), a link that
detours make several of a phase's streams share passing their wavelets in turn, as `sim.sim_row_program`
executes them wavelet by wavelet.

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
    """z = f(x, y) on n_elems spread over the region: per PE, one task streaming its slice through the SIMD unit
    (one vector instruction per op of f), reading two operands and writing one. No fabric traffic."""
    check_positive(n_elems=n_elems, flops_per_elem=flops_per_elem)
    R, C = check_region(spec, rows, cols, None)
    ne = -(-n_elems // (R * C))
    kw = dict(ops=ne * flops_per_elem, read_elems=2 * ne, write_elems=ne, vector_ops=flops_per_elem)
    comp, sram = PE.task_parts(spec, dtype, **kw)
    return make_cycles(compute=comp, sram=sram, fabric=0, total=PE.task_cycles(spec, dtype, **kw))


def row_program_cycles(spec: FabricSpec, phases: list[tuple], rows: int, cols: int, dtype: str = "fp32",
                       mesh: Mesh | None = None, colors: int = 3, group: int = 1) -> Cycles:
    """Phases run one after another on every row (the phase lists of `schedules.py`, which
    `sim.sim_row_program` executes wavelet by wavelet): local tasks, East->West chain reductions into column 0,
    South->North chains up column 0 over each group of `group` rows, and multicasts from column 0 of a group's
    first row down column 0 and along its rows."""
    R, C = check_region(spec, rows, cols, mesh)
    epw = PE.elems_per_wavelet(spec, dtype)
    hops = longest_chain_hops(mesh, R, C, axis=1)
    col_hops = _group_column_hops(mesh, R, group)
    total = comp = fabric = 0
    for ph in phases:
        kind = ph[0]
        if kind in ("local", "local0"):
            total += ph[1]
            comp += ph[1]
        elif (C > 1 and kind == "reduce") or (group > 1 and kind == "creduce"):
            nw, add_c = -(-ph[1] // epw), PE.add_task(spec, dtype, epw, ph[2])
            share = _shared_link_streams(spec, mesh, R, C, group, kind, nw, add_c)
            total += chain_latency(spec, C - 1, hops, nw, add_c) if kind == "reduce" else \
                chain_latency(spec, group - 1, col_hops, nw, add_c)
            total += max(0, (share - max(1, add_c)) * nw)  # the busiest shared link takes turns
            comp += nw * add_c
            fabric += share * nw
        elif C * group > 1 and kind == "bcast":
            nw = -(-ph[1] // epw)
            share = _shared_link_streams(spec, mesh, R, C, group, kind, nw)
            total += multicast_latency(spec, hops + col_hops, nw) + (share - 1) * nw
            fabric += share * nw
    passes = color_passes(spec, colors)
    return make_cycles(compute=comp, sram=comp, fabric=fabric, total=total * passes, passes=passes)


def _shared_link_streams(spec: FabricSpec, mesh: Mesh | None, R: int, C: int, group: int, kind: str,
                         nw: int, add_c: int = 1) -> int:
    """The most streams of one phase that a physical link carries at once: detours can make the chains of
    different rows ("reduce": every (i, j) -> (i, j - 1)), of column 0 ("creduce") or the groups' multicast
    trees ("bcast") share a link, which then passes their wavelets in turn. A stream of nw wavelets holds a
    link for nw cycles (a chain's: nw adds of add_c) from when its first wavelet gets there (a chain's k-th
    edge: k stages of ramps, add and hop after the phase starts; a tree link: its depth in hops), so streams
    far apart in time do not collide. 1 on a perfect mesh, and on meshes too big for exact routes."""
    if not exact_routes(mesh, R, C):
        return 1
    busy = nw * max(1, add_c)
    key = ("row_program_share", R, C, group, kind, nw, add_c)
    if key not in mesh._routes:
        windows: dict = {}  # physical link -> first cycles of the streams on it
        if kind == "bcast":
            for g in range(0, R, group):
                tree = mesh.multicast_tree([(g + r, 0) for r in range(group)],
                                           [[(g + r, j) for j in range(C)] for r in range(group)])
                depth = Mesh.tree_depths(tree, mesh.physical(g, 0))
                for a, bs in tree[0].items():
                    for b in bs:
                        windows.setdefault((a, b), []).append(depth[a] * spec.hop_latency_cycles)
        else:
            stage = 2 * spec.ramp_latency_cycles + spec.hop_latency_cycles + add_c
            edges = [((i, j), (i, j - 1), C - 1 - j) for i in range(R) for j in range(1, C)] if kind == "reduce" \
                else [((i, 0), (i - 1, 0), group - 1 - i % group) for i in range(R) if i % group]
            for a, b, k in edges:  # the k-th stage of its chain
                p = mesh.route(a, b)
                for link in zip(p, p[1:]):
                    windows.setdefault(link, []).append(k * stage)
        mesh._routes[key] = max((max(sum(1 for t in ts if s <= t < s + busy) for s in ts)
                                 for ts in windows.values()), default=1)
    return mesh._routes[key]


def _group_column_hops(mesh: Mesh | None, R: int, group: int) -> int:
    """Physical hops down column 0 through the longest group of `group` consecutive rows (detours included)."""
    if mesh is None or group == 1 or not mesh.has_defects:
        return group - 1
    links = mesh.chain_hops(R, 1, axis=0)[:, 0]  # (i, 0) -> (i + 1, 0)
    return int(max(links[g:g + group - 1].sum() for g in range(0, R, group)))


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


def attention_decode_schedule(spec: FabricSpec, n_heads: int, head_dim: int, context_len: int, rows: int,
                              cols: int, dtype: str = "fp16", *, n_kv_heads: int | None = None,
                              mesh: Mesh | None = None) -> tuple[list, int, int, int]:
    """The layout `attention_decode_cycles` charges: (phases, rows, cols, rows_per_head) for
    `row_program_cycles` / `sim.sim_row_program`.

    KV heads over groups of rows, each head's context over its rows_per_head x cols PEs (row-major, the same
    number of positions per PE, the last PEs possibly padding), so every row of the region holds cache when it
    has more rows than KV heads; with fewer rows than KV heads, several KV heads share a row. A head's rows
    cost a longer q multicast and a chain merge up column 0; a position less per PE saves a scores/P.V pass
    over all of the head's query heads, so from 1 to rows // n_kv rows per head the fastest layout is taken
    (fewest rows on ties; rows == n_kv is one row per head). Raises ConfigError when even the smallest KV
    slice exceeds a PE's SRAM."""
    n_kv = n_heads if n_kv_heads is None else n_kv_heads
    check_positive(n_heads=n_heads, head_dim=head_dim, context_len=context_len, n_kv_heads=n_kv)
    if n_heads % n_kv:
        raise ConfigError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv} (grouped-query attention)")
    R0, C0 = check_region(spec, rows, cols, mesh)
    best, smallest = None, None
    for group in range(1, max(1, R0 // n_kv) + 1):
        heads_rows = used(n_kv, R0 // group)  # groups of rows, kv_per_group KV heads each
        kv_per_group, ctx_per_pe = -(-n_kv // heads_rows), -(-context_len // (group * C0))
        pes = -(-context_len // ctx_per_pe)  # PEs of one head holding real positions
        if -(-pes // C0) < group:  # fewer rows hold the same positions per PE: a smaller group's layout
            continue
        kv_bytes = 2 * kv_per_group * ctx_per_pe * head_dim * PE.dtype_bytes(dtype)
        smallest = kv_bytes if smallest is None else min(smallest, kv_bytes)
        if kv_bytes > spec.sram_bytes_per_pe:
            continue
        phases = attention_phases(spec, kv_per_group * (n_heads // n_kv), ctx_per_pe, head_dim, dtype)
        layout = (phases, heads_rows * group, min(C0, pes), group)
        total = row_program_cycles(spec, *layout[:3], dtype, mesh, _attention_colors(group), group).total
        if best is None or total < best[0]:
            best = (total, layout)
    if best is None:
        raise ConfigError(f"KV cache slice of {smallest:,} B per PE exceeds {spec.sram_bytes_per_pe:,} B SRAM; "
                          f"use more PEs or a shorter context")
    return best[1]


def _attention_colors(group: int) -> int:
    """Colors of the attention row program: the q multicast (1) and the row chain (2, alternating), plus a
    column chain like the row chain's when a head has several rows."""
    return 3 if group == 1 else 5


def attention_decode_cycles(spec: FabricSpec, n_heads: int, head_dim: int, context_len: int, rows: int, cols: int,
                            dtype: str = "fp16", *, n_kv_heads: int | None = None,
                            mesh: Mesh | None = None) -> Cycles:
    """One decode step of attention over a KV cache of context_len positions, laid out as
    `attention_decode_schedule` says (KV heads over groups of rows, each head's context over its rows and all
    columns; each KV slice stored once): q multicast from column 0 of the head's first row down column 0 and
    along the rows, local scores/exp/P.V for every query head of the PE's KV heads (n_heads / n_kv_heads per
    KV head: grouped-query attention), a log-sum-exp merge chain along every row into column 0, then one up
    column 0 into the head's first row. n_kv_heads defaults to n_heads (multi-head attention)."""
    phases, R, C, group = attention_decode_schedule(spec, n_heads, head_dim, context_len, rows, cols, dtype,
                                                    n_kv_heads=n_kv_heads, mesh=mesh)
    return row_program_cycles(spec, phases, R, C, dtype, mesh, _attention_colors(group), group)
