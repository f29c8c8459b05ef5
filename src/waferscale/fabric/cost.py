"""Analytic cycle models of the fabric kernels (the fast backend; `sim.py` is the slow reference that judges it).

Every model follows the schedule of its kernel in `kernels/` and charges:

* compute — FMAC/op cycles of the busiest PE at its SIMD width (Chip row: 4-wide fp16 FMAC on WSE-1/2, 8-wide
  on WSE-3, 1 fp32 FMAC) — and SRAM-port cycles (PE row: 16 B read + 8 B write per cycle), per task, through the
  micro-model in `pe.py`;
* fabric — wavelets (32 bits, 1 per cycle per link per direction, Fabric row) through the busiest link or ramp;
* latency — one cycle per hop, a ramp (~2 cycles) into and out of every PE on the way, one task per stage of a
  chain or tree (pipeline fill and drain), extra hops of detours when a `mesh` with defects is given;
* routing — the colors a schedule needs against the colors a program may use (Fabric row: 24 colors, 6 reserved):
  a schedule needing more runs in several passes, each paying its fill again.

Omitted (and said so): finite router buffers/back-pressure, task-switch overhead, bank conflicts, load
imbalance other than SpMV's (modelled statistically), routes-per-PE limits on detours, clock/power throttling.

`Cycles.total` is the critical path of the schedule. The parts are resource busy times on the busiest PE/link;
`fill_drain` is whatever of the total the busiest resource does not explain (latency, fill, drain).
`bottleneck` is "routing" when colors force extra passes, "fabric latency" when latency or link traffic
dominates, else "compute" or "SRAM"; "I/O" only when `io` dominates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric import pe as PE
from waferscale.fabric.kernels.tiles import used
from waferscale.fabric.mesh import Mesh
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
def _positive(**sizes: int) -> None:
    for name, v in sizes.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")


def _region(spec: FabricSpec, rows: int, cols: int, mesh: Mesh | None) -> tuple[int, int]:
    _positive(rows=rows, cols=cols)
    if mesh is not None:
        return mesh.check_region(rows, cols)
    if rows > spec.rows or cols > spec.cols:
        raise ConfigError(f"region {rows}x{cols} exceeds {spec.name}'s {spec.rows}x{spec.cols} PEs")
    return rows, cols


def _chunks(n: int, per: int) -> list[int]:
    full, last = divmod(n, per)
    return [per] * full + ([last] if last else [])


def _hops(mesh: Mesh | None, rows: int, cols: int, axis: int) -> int:
    """Physical hops of the longest chain along rows (axis=1) or down columns (axis=0), detours included."""
    if mesh is None:
        return cols - 1 if axis == 1 else rows - 1
    return mesh.max_chain_hops(rows, cols, axis)


def _exact(mesh: Mesh | None, rows: int, cols: int) -> bool:
    """Use the real (detoured) routes of a defective mesh? Up to 64x64 PEs; bigger regions use the
    vectorized Manhattan distances of `Mesh.max_chain_hops` (detours around dead links not counted)."""
    return mesh is not None and mesh.has_defects and rows * cols <= 4096


def _passes(spec: FabricSpec, colors_needed: int) -> int:
    return math.ceil(colors_needed / spec.colors)


def _chain(spec: FabricSpec, stages: int, hops: int, n_waves: int, add_c: int) -> int:
    """A pipelined chain of `stages` PEs forwarding n_waves wavelets, each combined by an add task of add_c:
    the first wavelet pays ramp out + hops + ramp in + add per stage, the rest follow one per max(1, add_c)."""
    if stages == 0:
        return 0
    return stages * (2 * spec.ramp_latency_cycles + add_c) + hops * spec.hop_latency_cycles \
        + (n_waves - 1) * max(1, add_c)


def _multicast(spec: FabricSpec, hops: int, n_waves: int) -> int:
    """One source multicasting n_waves wavelets to PEs up to `hops` away: ramp out, hops, ramp in, one per cycle."""
    return 2 * spec.ramp_latency_cycles + hops * spec.hop_latency_cycles + n_waves - 1


# ---- GEMV / GEMM / SpMV ---------------------------------------------------------------------------------
def _weight_stationary(spec: FabricSpec, m: int, k: int, n: int, rows: int, cols: int, dtype: str,
                       mesh: Mesh | None, density: float | None = None) -> Cycles:
    """x segments multicast down the columns (1 color), one AXPY task per arriving x wavelet, partial sums
    chained East->West along the rows (2 alternating colors); n vectors stream back to back."""
    R, C = _region(spec, rows, cols, mesh)
    R, C = used(m, R), used(k, C)
    mt, kt = -(-m // R), -(-k // C)
    epw = PE.elems_per_wavelet(spec, dtype)
    pe_x = comp = sram = 0
    for e in _chunks(kt, epw):
        if density is None:
            ops, rd, wr = e * mt, 2 * e * mt, e * mt
        else:  # sparse: value + index + y read, y write per non-zero; the busiest PE (statistical, see spmv)
            ops = _worst_nnz(e * mt, density, R * C, kt // max(1, e))
            rd, wr = 3 * ops, ops
        pe_x += PE.task_cycles(spec, dtype, ops=ops, read_elems=rd, write_elems=wr)
        c, s = PE.task_parts(spec, dtype, ops=ops, read_elems=rd, write_elems=wr)
        comp, sram = comp + c, sram + s
    ny = -(-mt // epw)
    add_c = PE.add_task(spec, dtype, epw)
    adds = ny * add_c if C > 1 else 0
    down = _hops(mesh, R, C, axis=0)
    if _exact(mesh, R, C):  # the real multicast tree of each column
        down = max(mesh.tree_depth(mesh.multicast_tree([(i, j) for i in range(R)]), mesh.physical(0, j))
                   for j in range(C))
    fill = _multicast(spec, down, 1)  # first x wavelet reaches the farthest row
    chain = _chain(spec, C - 1, _hops(mesh, R, C, axis=1), ny, add_c)
    # steady state: every chain PE spends pe_x + adds per vector; the last vector then drains like a GEMV
    body = (n - 1) * (pe_x + adds) + pe_x + chain
    passes = _passes(spec, 1 + (2 if C > 1 else 0))
    total = passes * fill + body
    fabric = n * max(-(-kt // epw), ny if C > 1 else 0)
    return make_cycles(compute=n * (comp + (adds if C > 1 else 0)), sram=n * sram, fabric=fabric,
                       total=total, passes=passes)


def _worst_nnz(cells: int, density: float, n_pe: int, n_tasks: int) -> float:
    """Expected non-zeros of one task on the busiest PE: the mean plus the expected maximum deviation of the
    PEs' totals (binomial ~ Gaussian; E[max of P] ~ sigma * Phi^-1((P - 0.375) / (P + 0.25)), Blom's
    approximation), spread over its tasks."""
    mean = cells * density
    sigma = math.sqrt(cells * density * (1 - density) * max(1, n_tasks))
    z = NormalDist().inv_cdf((n_pe - 0.375) / (n_pe + 0.25)) if n_pe > 1 else 0.0
    return mean + sigma * z / max(1, n_tasks)


def gemv_cycles(spec: FabricSpec, m: int, k: int, rows: int, cols: int, dtype: str = "fp16", *,
                mesh: Mesh | None = None) -> Cycles:
    """y(m) = W(m, k) x(k) on a rows x cols region (W stationary in tiles; at most one PE per row/column)."""
    _positive(m=m, k=k)
    return _weight_stationary(spec, m, k, 1, rows, cols, dtype, mesh)


def gemm_cycles(spec: FabricSpec, m: int, k: int, n: int, rows: int, cols: int, dtype: str = "fp16", *,
                mesh: Mesh | None = None) -> Cycles:
    """Y(m, n) = W(m, k) X(k, n): the n columns of X stream through the stationary W one after another."""
    _positive(m=m, k=k, n=n)
    return _weight_stationary(spec, m, k, n, rows, cols, dtype, mesh)


def spmv_cycles(spec: FabricSpec, m: int, k: int, nnz: int, rows: int, cols: int, dtype: str = "fp16", *,
                mesh: Mesh | None = None) -> Cycles:
    """Sparse y = W x with `nnz` non-zeros spread uniformly at random: one multiply-add per non-zero weight per
    arriving x value. The busiest PE carries the mean plus the expected maximum deviation over PEs."""
    _positive(m=m, k=k, nnz=nnz)
    if nnz > m * k:
        raise ConfigError(f"nnz={nnz} exceeds m*k={m * k}")
    return _weight_stationary(spec, m, k, 1, rows, cols, dtype, mesh, density=nnz / (m * k))


# ---- collectives ----------------------------------------------------------------------------------------
def _node_times(arrivals: list[tuple[float, float]], nw: int, add_c: int) -> tuple[float, float]:
    """(first, last) send time of a PE given its children's (first, last) wavelet arrival times: it adds every
    child's wavelet (add_c cycles each, at most one wavelet per cycle through its ramp). Its first wavelet waits
    for the slowest child's first; its last for the slowest child's last, or for all fan_in * nw adds counted
    from the first arrival, whichever is later. A leaf sends its nw wavelets one per cycle from t = 0."""
    if not arrivals:
        return 0.0, float(nw - 1)
    r = max(1, add_c)
    first = max(f for f, _ in arrivals) + add_c
    last = max(max(l for _, l in arrivals) + add_c, min(f for f, _ in arrivals) + len(arrivals) * nw * r)
    return first, last


def _edge(times: tuple[float, float], hops: int, spec: FabricSpec) -> tuple[float, float]:
    d = 2 * spec.ramp_latency_cycles + hops * spec.hop_latency_cycles  # ramp out, hops, ramp in
    return times[0] + d, times[1] + d


def _tree_finish(parents: dict, root, mesh: Mesh, nw: int, add_c: int, spec: FabricSpec) -> float:
    """Critical path of a reduction tree given as child -> parent: `last` of the root (all wavelets summed).
    Detoured routes may share a physical link; an edge whose busiest link carries k edges gets 1/k of it."""
    kids: dict = {}
    for c, p in parents.items():
        kids.setdefault(p, []).append(c)
    load: dict = {}
    for c, p in parents.items():
        path = mesh.route(c, p)
        for link in zip(path, path[1:]):
            load[link] = load.get(link, 0) + 1
    share = {c: max((load[link] for link in zip(mesh.route(c, p), mesh.route(c, p)[1:])), default=1)
             for c, p in parents.items()}

    def edge(c, v):
        f, last = _edge(times[c], mesh.hops(c, v), spec)
        return f, max(last, f + share[c] * nw - 1)

    order, stack = [], [root]
    while stack:  # iterative post-order
        v = stack.pop()
        order.append(v)
        stack.extend(kids.get(v, ()))
    times: dict = {}
    for v in reversed(order):
        times[v] = _node_times([edge(c, v) for c in kids.get(v, ())], nw, add_c)
    return times[root][1]


def _regular_finish(algo: str, R: int, C: int, nw: int, add_c: int, spec: FabricSpec) -> float:
    """`_tree_finish` for a defect-free region in O(R + C): every row's tree is the same, then column 0."""
    from waferscale.fabric.sim import reduce_parents
    if algo == "chain":
        return nw - 1 + (R * C - 1) * (2 * spec.ramp_latency_cycles + spec.hop_latency_cycles + add_c)
    row = {(0, j): p for (i, j), p in reduce_parents(algo, 1, C).items()}
    col = {(i, 0): p for (i, j), p in reduce_parents(algo, R, 1).items()}
    kids_row: dict = {}
    for c, p in row.items():
        kids_row.setdefault(p, []).append(c)
    row_times: dict = {}
    for j in range(C - 1, -1, -1):  # children in a row are always East of their parent
        if j > 0:
            row_times[j] = _node_times([_edge(row_times[c[1]], c[1] - j, spec) for c in kids_row.get((0, j), ())],
                                       nw, add_c)
    row_in = [_edge(row_times[c[1]], c[1], spec) for c in kids_row.get((0, 0), ())]
    kids_col: dict = {}
    for c, p in col.items():
        kids_col.setdefault(p[0], []).append(c[0])
    col_times: dict = {}
    for i in range(R - 1, -1, -1):  # children in column 0 are always South of their parent
        col_times[i] = _node_times(row_in + [_edge(col_times[c], c - i, spec) for c in kids_col.get(i, ())],
                                   nw, add_c)
    return col_times[0][1]


def reduce_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, algo: str = "2d", dtype: str = "fp32", *,
                  mesh: Mesh | None = None) -> Cycles:
    """Reduce (sum) of one n_elems vector per PE into PE (0, 0). The HPDC'24 form (Fabric row of WSE.md),

        T = max(C, E/N) + L + (2 T_R + 1) D,

    is evaluated node by node up the tree: a PE's last wavelet leaves after its slowest child's last one arrives
    (L + (2 T_R + 1) D along the path: hops, ramp out and in, one add per stage) or after its fan-in times nw
    adds counted from its first arrival (the contention C), whichever is later. E/N (= nw per active link) never
    exceeds C here. With a defective `mesh`, hops are the real detoured routes."""
    from waferscale.fabric.sim import reduce_parents
    _positive(n_elems=n_elems)
    R, C = _region(spec, rows, cols, mesh)
    nw = PE.wavelets(n_elems, spec, dtype)
    add_c = PE.add_task(spec, dtype, PE.elems_per_wavelet(spec, dtype))
    if algo not in ("chain", "2d", "tree"):
        raise ConfigError(f"unknown all-reduce algorithm {algo!r}; use chain, tree or 2d")
    if R * C == 1:
        return make_cycles(compute=0, sram=0, fabric=0, total=0)
    fan_in = {"chain": 1, "2d": 2 if R > 1 and C > 1 else 1,
              "tree": (C - 1).bit_length() + (R - 1).bit_length()}[algo]
    colors = {"chain": 2, "2d": 4, "tree": fan_in}[algo]  # chains alternate 2 colors; a tree uses one per level
    if _exact(mesh, R, C):
        total = _tree_finish(reduce_parents(algo, R, C), (0, 0), mesh, nw, add_c, spec)
    else:
        total = _regular_finish(algo, R, C, nw, add_c, spec)
    passes = _passes(spec, colors)
    if passes > 1:  # levels beyond the available colors wait for the previous group: pay the fill again
        total += (passes - 1) * (total - (nw - 1) * fan_in * max(1, add_c))
    return make_cycles(compute=fan_in * nw * add_c, sram=fan_in * nw * add_c, fabric=fan_in * nw,
                       total=total, passes=passes)


def broadcast_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, dtype: str = "fp32", *,
                     mesh: Mesh | None = None) -> Cycles:
    """PE (0, 0) multicasts n_elems along row 0 and down every column (1 color): fill + one wavelet per cycle."""
    _positive(n_elems=n_elems)
    R, C = _region(spec, rows, cols, mesh)
    nw = PE.wavelets(n_elems, spec, dtype)
    if R * C == 1:
        return make_cycles(compute=0, sram=0, fabric=0, total=0)
    hops = (C - 1) + (R - 1)
    if _exact(mesh, R, C):  # the real multicast tree: row 0, then every column
        tree = mesh.multicast_tree([(0, j) for j in range(C)], [[(i, j) for i in range(R)] for j in range(C)])
        hops = mesh.tree_depth(tree, mesh.physical(0, 0))
    return make_cycles(compute=0, sram=0, fabric=nw, total=_multicast(spec, hops, nw))


def allreduce_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, algo: str = "2d", dtype: str = "fp32",
                     *, mesh: Mesh | None = None) -> Cycles:
    """Reduce into (0, 0) (`reduce_cycles`, HPDC'24 form), then broadcast the sum (`broadcast_cycles`);
    algo in {"chain", "tree", "2d"}. The broadcast starts when the root holds the whole sum."""
    r = reduce_cycles(spec, n_elems, rows, cols, algo, dtype, mesh=mesh)
    b = broadcast_cycles(spec, n_elems, rows, cols, dtype, mesh=mesh)
    return r + b


# ---- element-wise, norms, softmax, attention ------------------------------------------------------------
def elementwise_cycles(spec: FabricSpec, n_elems: int, rows: int, cols: int, flops_per_elem: int = 1,
                       dtype: str = "fp16") -> Cycles:
    """z = f(x, y) on n_elems spread over the region: per PE, one SIMD op of `lanes` values at a time, reading
    two operands and writing one. No fabric traffic."""
    _positive(n_elems=n_elems, flops_per_elem=flops_per_elem)
    R, C = _region(spec, rows, cols, None)
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
    """Phases run one after another on every row (see `sim.sim_row_program`): local tasks, East->West chain
    reductions into column 0, and West->East multicasts back."""
    R, C = _region(spec, rows, cols, mesh)
    epw = PE.elems_per_wavelet(spec, dtype)
    hops = _hops(mesh, R, C, axis=1)
    total = comp = fabric = 0
    for ph in phases:
        kind = ph[0]
        if kind in ("local", "local0"):
            total += ph[1]
            comp += ph[1]
        elif C > 1 and kind == "reduce":
            nw, add_c = -(-ph[1] // epw), PE.add_task(spec, dtype, epw, ph[2])
            total += _chain(spec, C - 1, hops, nw, add_c)
            comp += nw * add_c
            fabric += nw
        elif C > 1 and kind == "bcast":
            nw = -(-ph[1] // epw)
            total += _multicast(spec, hops, nw)
            fabric += nw
    passes = _passes(spec, colors)
    return make_cycles(compute=comp, sram=comp, fabric=fabric, total=total * passes, passes=passes)


def norm_cycles(spec: FabricSpec, n_elems: int, width: int, rows: int, cols: int, rms: bool = False,
                dtype: str = "fp32", *, mesh: Mesh | None = None) -> Cycles:
    """LayerNorm (or RMSNorm) of n_elems/width vectors of `width`: tokens over rows, width over columns; local
    statistics, a row all-reduce of them, then the normalisation (see `sim.norm_phases`)."""
    from waferscale.fabric.sim import norm_phases
    _positive(n_elems=n_elems, width=width)
    tokens = -(-n_elems // width)
    R, C = _region(spec, rows, cols, mesh)
    R, C = used(tokens, R), used(width, C)
    return row_program_cycles(spec, norm_phases(spec, -(-tokens // R), -(-width // C), rms, dtype), R, C, dtype, mesh)


def softmax_cycles(spec: FabricSpec, n_elems: int, width: int, rows: int, cols: int, dtype: str = "fp32", *,
                   mesh: Mesh | None = None) -> Cycles:
    """Softmax over rows of `width`: a max all-reduce and a sum all-reduce along each mesh row; exp() is
    assumed to cost `sim.EXP_OPS` SIMD ops (not in WSE.md: an assumption)."""
    from waferscale.fabric.sim import softmax_phases
    _positive(n_elems=n_elems, width=width)
    tokens = -(-n_elems // width)
    R, C = _region(spec, rows, cols, mesh)
    R, C = used(tokens, R), used(width, C)
    return row_program_cycles(spec, softmax_phases(spec, -(-tokens // R), -(-width // C), dtype), R, C, dtype,
                              mesh, colors=5)


def attention_decode_cycles(spec: FabricSpec, n_heads: int, head_dim: int, context_len: int, rows: int, cols: int,
                            dtype: str = "fp16", *, mesh: Mesh | None = None) -> Cycles:
    """One decode step of attention over a KV cache of context_len positions: heads over rows, context over
    columns; q multicast along each row, local scores/exp/P.V, a log-sum-exp merge chain into column 0."""
    from waferscale.fabric.sim import attention_phases
    _positive(n_heads=n_heads, head_dim=head_dim, context_len=context_len)
    R, C = _region(spec, rows, cols, mesh)
    R, C = used(n_heads, R), used(context_len, C)
    kv_bytes = 2 * -(-n_heads // R) * -(-context_len // C) * head_dim * PE.dtype_bytes(dtype)
    if kv_bytes > spec.sram_bytes_per_pe:
        raise ConfigError(f"KV cache slice of {kv_bytes:,} B per PE exceeds {spec.sram_bytes_per_pe:,} B SRAM; "
                          f"use more PEs or a shorter context")
    phases = attention_phases(spec, -(-n_heads // R), -(-context_len // C), head_dim, dtype)
    return row_program_cycles(spec, phases, R, C, dtype, mesh)


# ---- the `wsc kernel` entry point -----------------------------------------------------------------------
KERNELS = ("gemv", "gemm", "spmv", "allreduce")
VERIFY_MAX_PES = 64 * 64  # functional verification runs on at most this many PEs (numpy, tile by tile)


def run_kernel(kind: str, *, m: int, k: int, n: int | None, target: str, pes: tuple[int, int] | None,
               defects: float = 0.0, seed: int = 0, verify: bool = False, sparsity: float = 0.9,
               clock_hz: float | None = None, algo: str = "2d") -> dict:
    """Project (and optionally verify) one kernel on a target. Sizes: gemv/spmv y(m) = W(m, k) x(k); gemm with
    n streamed vectors; allreduce of an m-element fp32 vector per PE (k, n unused). Without `pes` the whole
    (logical, defect-free part of the) wafer is used. `verify` runs the functional tile-level execution on the
    same mesh and compares it with numpy."""
    from waferscale.fabric.presets import fabric_from_name

    if kind not in KERNELS:
        raise ConfigError(f"unknown kernel {kind!r}; use one of {', '.join(KERNELS)}")
    _positive(m=m, k=k)
    if n is not None:
        _positive(n=n)
    if kind == "gemm" and n is None:
        raise ConfigError("gemm needs --n (the number of streamed input vectors)")
    if not 0.0 <= sparsity < 1.0:
        raise ConfigError(f"--sparsity must be in [0, 1), got {sparsity}")
    spec = fabric_from_name(target, pes=pes, clock_hz=clock_hz)
    mesh = Mesh.build(spec, defect_rate=defects, seed=seed)
    R, C = mesh.logical_rows, mesh.logical_cols
    dtype = "fp32" if kind == "allreduce" else "fp16"
    rng = np.random.default_rng(seed)
    W = None
    if kind == "gemv":
        cyc, flops, used_pes = gemv_cycles(spec, m, k, R, C, dtype, mesh=mesh), 2 * m * k, used(m, R) * used(k, C)
    elif kind == "gemm":
        cyc, flops = gemm_cycles(spec, m, k, n, R, C, dtype, mesh=mesh), 2 * m * k * n
        used_pes = used(m, R) * used(k, C)
    elif kind == "spmv":
        if verify:
            from waferscale.fabric.kernels import random_sparse
            W = random_sparse(m, k, sparsity, rng)
            nnz = int((W != 0).sum())
        else:
            nnz = max(1, round(m * k * (1 - sparsity)))
        cyc, flops, used_pes = spmv_cycles(spec, m, k, nnz, R, C, dtype, mesh=mesh), 2 * nnz, used(m, R) * used(k, C)
    else:
        cyc, flops, used_pes = allreduce_cycles(spec, m, R, C, algo, mesh=mesh), m * (R * C - 1), R * C
    ws_bytes = -(-m // used(m, R)) * -(-k // used(k, C)) * PE.dtype_bytes(dtype) if kind != "allreduce" else 0
    if kind in ("gemv", "gemm") and ws_bytes > spec.sram_bytes_per_pe:
        need = -(-m * k * PE.dtype_bytes(dtype) // spec.sram_bytes_per_pe)
        raise ConfigError(f"mesh too small: a {m}x{k} {dtype} W needs {ws_bytes:,} B per PE on {R}x{C} PEs, over "
                          f"the {spec.sram_bytes_per_pe:,} B SRAM; use at least {need:,} PEs (a larger --pes)")
    out = {
        "kernel": kind, "target": spec.name,
        "region": f"{R}x{C}" if kind == "allreduce" else f"{used(m, R)}x{used(k, C)}", "pes": int(used_pes),
        "usable_pes": mesh.usable_pes, "cycles": cyc.total, "time_s": cyc.seconds(spec), "flops": int(flops),
        "flops_per_s": flops / cyc.seconds(spec) if cyc.total else 0.0,
        "bottleneck": cyc.bottleneck, "breakdown": cyc.as_dict(),
        "assumptions": {
            "clock_hz": spec.clock_hz, "dtype": dtype,
            "flops_per_cycle_per_pe": spec.fp16_flops_per_cycle_per_pe if dtype == "fp16"
            else spec.fp32_flops_per_cycle_per_pe,
            "sram_read_bytes_per_cycle": spec.sram_read_bytes_per_cycle,
            "sram_write_bytes_per_cycle": spec.sram_write_bytes_per_cycle,
            "link_bytes_per_cycle": spec.link_bytes_per_cycle, "hop_latency_cycles": spec.hop_latency_cycles,
            "ramp_latency_cycles": spec.ramp_latency_cycles, "colors": spec.colors,
            "defects": mesh.summary(), "defect_rate": defects, "seed": seed,
            **({"algo": algo} if kind == "allreduce" else {}),
            **({"sparsity": sparsity} if kind == "spmv" else {}),
            "model": "analytic (fabric/cost.py), validated against the wavelet-level event simulation (sim.py)",
        },
    }
    if verify:
        out.update(_verify(kind, mesh, m, k, n, W, algo, rng, used_pes))
    return out


def _verify(kind: str, mesh: Mesh, m: int, k: int, n: int | None, W, algo: str, rng, used_pes: int) -> dict:
    from waferscale.fabric import kernels as KN

    if used_pes > VERIFY_MAX_PES:
        raise ConfigError(f"--verify runs the tile-by-tile numpy execution; {used_pes:,} PEs is too many "
                          f"(limit {VERIFY_MAX_PES:,}); add --pes 8x8 (or another small mesh)")
    R, C = mesh.logical_rows, mesh.logical_cols
    if kind == "allreduce":
        R0, C0 = min(R, 64), min(C, 64)
        data = rng.standard_normal((R0, C0, m)).astype(np.float32)
        got, ref = KN.allreduce(mesh, data, algo, R0, C0).out, np.broadcast_to(data.sum((0, 1)), (R0, C0, m))
    else:
        W = rng.standard_normal((m, k)).astype(np.float32) if W is None else W
        if kind == "gemm":
            X = rng.standard_normal((k, n)).astype(np.float32)
            got, ref = KN.gemm(mesh, W, X).out, W.astype(np.float64) @ X
        else:
            x = rng.standard_normal(k).astype(np.float32)
            got = (KN.gemv if kind == "gemv" else KN.spmv)(mesh, W, x).out
            ref = W.astype(np.float64) @ x
    err = float(np.max(np.abs(got - ref)))
    tol = 1e-4 * max(1.0, float(np.max(np.abs(ref)))) * max(1.0, np.sqrt(max(k, R * C)) / 8)
    return {"verified": bool(err <= tol), "max_abs_err": err}


def format_kernel_report(d: dict) -> str:
    """A short human summary of `run_kernel`'s result, with its assumptions."""
    b, a = d["breakdown"], d["assumptions"]
    lines = [
        f"{d['kernel']} on {d['target']}: {d['pes']:,} PEs used of {d['usable_pes']:,} usable (region {d['region']})",
        f"  {d['cycles']:,.0f} cycles = {d['time_s'] * 1e6:,.3f} us at {a['clock_hz'] / 1e9:g} GHz;  "
        f"{d['flops']:,} FLOP -> {d['flops_per_s'] / 1e12:,.3f} TFLOP/s",
        f"  bottleneck: {d['bottleneck']}  (compute {b['compute']:,.0f}, SRAM {b['sram']:,.0f}, "
        f"fabric {b['fabric']:,.0f}, fill/drain {b['fill_drain']:,.0f}, I/O {b['io']:,.0f} cycles"
        + (f", {b['passes']} routing passes" if b["passes"] > 1 else "") + ")",
        f"  assumed: {a['dtype']} at {a['flops_per_cycle_per_pe']} FLOP/cycle/PE, SRAM "
        f"{a['sram_read_bytes_per_cycle']}+{a['sram_write_bytes_per_cycle']} B/cycle, links "
        f"{a['link_bytes_per_cycle']} B/cycle/direction, {a['hop_latency_cycles']} cycle/hop, ramp "
        f"{a['ramp_latency_cycles']} cycles, {a['colors']} colors",
        f"  mesh: {a['defects']}",
    ]
    if "verified" in d:
        lines.append(f"  verified vs numpy: {'OK' if d['verified'] else 'FAILED'} (max abs err {d['max_abs_err']:.2e})")
    return "\n".join(lines)
