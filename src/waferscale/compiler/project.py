"""Projections: cycles of every stage from the fabric cost model, composed into latency and throughput.

Nothing here is fitted to a published throughput. Every time is the fabric cost model's cycles for the
kernels a unit runs on its region (GEMV/GEMM per matrix, attention over the KV cache, norms, element-wise)
divided by the clock, plus hops between regions and the system I/O between wafers, all from FabricSpec.
Each kernel's time is booked under the bottleneck the cost model names for it, so the plan can say what
limits it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache

from waferscale.compiler.ir import Unit
from waferscale.errors import ConfigError
from waferscale.fabric import cost, cost_collectives, cost_gemm2d, cost_matmul
from waferscale.fabric.spec import FabricSpec


@dataclass
class Time:
    """Seconds, by bottleneck label (`fabric.cost.BOTTLENECKS`)."""

    parts: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def s(self) -> float:
        return sum(self.parts.values())

    def add(self, label: str, seconds: float) -> "Time":
        self.parts[label] += seconds
        return self

    def add_cycles(self, cyc: cost.Cycles, clock_hz: float) -> "Time":
        self.parts[cyc.bottleneck] += cyc.total / clock_hz
        return self

    def __iadd__(self, o: "Time") -> "Time":
        for k, v in o.parts.items():
            self.parts[k] += v
        return self

    def scaled(self, f: float) -> "Time":
        return Time(defaultdict(float, {k: v * f for k, v in self.parts.items()}))

    def bottleneck(self) -> str:
        return max(self.parts, key=self.parts.get) if self.parts else "compute"

    def shares(self) -> dict[str, float]:
        tot = self.s or 1.0
        return {k: round(v / tot, 4) for k, v in sorted(self.parts.items(), key=lambda kv: -kv[1]) if v > 0}


# ---- one unit on one region ------------------------------------------------------------------------------

def _key(u: Unit) -> tuple:
    key = (u.kind, u.matmuls, u.n_heads, u.head_dim, u.kv_heads or u.n_heads, u.norm_width, u.n_norms,
           u.elementwise_flops_per_token, u.d_out)
    return key + ((u.cross_heads, u.cross_ctx),) if u.cross_heads else key


@lru_cache(maxsize=65536)
def _unit_cycles(spec: FabricSpec, ukey: tuple, rows: int, cols: int, n_tokens: int, attn_ctx: int,
                 dtype: str, decode: bool, gemm2d: bool = False) -> tuple[tuple[str, float], ...] | None:
    """`_unit_parts` on a defect-free region (memoized: placement asks for the same shapes many times)."""
    return _unit_parts(spec, ukey, rows, cols, n_tokens, attn_ctx, dtype, decode, None, gemm2d)


# the 2D schedule a large mesh's prefill may use instead (Cannon's model is slower to evaluate: `wsc kernel gemm
# --algo cannon|cannon_folded` projects it)
GEMM2D_ALGOS = ("summa",)


def _gemm(spec: FabricSpec, m: int, k: int, n: int, rows: int, cols: int, dtype: str, mesh, gemm2d: bool):
    """Y = W X of n tokens: the weight-stationary streamed GEMM, or (gemm2d) the fastest of it and the 2D
    schedules with X and Y cut into blocks too (`cost_gemm2d`; a schedule whose blocks overflow SRAM is out)."""
    c = cost_matmul.gemm_cycles(spec, m, k, n, rows, cols, dtype, mesh=mesh)
    for algo in GEMM2D_ALGOS if gemm2d else ():
        try:
            c = min(c, cost_gemm2d.gemm2d_cycles(spec, m, k, n, rows, cols, dtype, algo=algo, mesh=mesh),
                    key=lambda x: x.total)
        except ConfigError:
            continue
    return c


def _unit_parts(spec: FabricSpec, ukey: tuple, rows: int, cols: int, n_tokens: int, attn_ctx: int,
                dtype: str, decode: bool, mesh, gemm2d: bool = False) -> tuple[tuple[str, float], ...] | None:
    """(label, cycles) of every kernel a unit runs; None if the fabric cost model refuses the region
    (e.g. a KV-cache slice larger than a PE's SRAM). `mesh`: the region as a `fabric.mesh.Mesh` of its own
    (`Mesh.subregion`), so detours around its defects are charged; None = a perfect region. `gemm2d`: the
    matrices of several tokens may also run as 2D-blocked GEMMs (`_gemm`)."""
    kind, matmuls, n_heads, head_dim, kv_heads, norm_width, n_norms, ew, d_out = ukey[:9]
    attns = [(n_heads, kv_heads, attn_ctx)] + [(h, h, ctx) for h, ctx in ukey[9:]]  # self, then cross-attention
    out: list = []
    m = dict(mesh=mesh)
    try:
        for mm in matmuls:
            c = cost_matmul.gemv_cycles(spec, mm.m, mm.k, rows, cols, dtype, **m) if n_tokens == 1 \
                else _gemm(spec, mm.m, mm.k, n_tokens, rows, cols, dtype, mesh, gemm2d)
            if mm.sparse:  # the sparse kernel where it is faster (a barely sparse matrix on tiny tiles is not)
                c = min(c, cost_matmul.sparse_gemm_cycles(spec, mm.m, mm.k, n_tokens, rows, cols, dtype,
                                                          density=mm.density, act_density=mm.act_density, **m),
                        key=lambda x: x.total)
            out.append(c)
        for heads, kvh, actx in attns:
            if not heads or actx <= 0:
                continue
            if n_tokens == 1:  # decode: one query over the KV cache spread across the region
                out.append(cost.attention_decode_cycles(spec, heads, head_dim, actx, rows, cols, dtype,
                                                        n_kv_heads=kvh, **m))
            else:  # prefill / training: QK^T and PV as GEMMs with K (then V) stationary, softmax between
                q = n_tokens * heads
                out.append(_gemm(spec, actx, head_dim, q, rows, cols, dtype, mesh, gemm2d))
                out.append(cost.softmax_cycles(spec, q * actx, actx, rows, cols, **m))
                out.append(_gemm(spec, head_dim, actx, q, rows, cols, dtype, mesh, gemm2d))
        if norm_width and n_norms:
            out += [cost.norm_cycles(spec, norm_width * n_tokens, norm_width, rows, cols, **m)] * n_norms
        if ew:
            out.append(cost.elementwise_cycles(spec, ew * n_tokens, rows, cols, 1, dtype))
        if kind == "embed":  # the looked-up row fans out over the region to the next stage's edge
            out.append(cost_collectives.broadcast_cycles(spec, d_out * n_tokens, rows, cols, dtype, **m))
        if kind == "head" and decode:  # sampling: a max-reduce over the vocabulary spread across the region
            out.append(cost_collectives.allreduce_cycles(spec, n_tokens, rows, cols, **m))
    except ConfigError:
        return None
    return tuple((c.bottleneck, float(c.total)) for c in out)


def unit_time(spec: FabricSpec, u: Unit, rows: int, cols: int, *, n_tokens: int, attn_ctx: int,
              dtype: str = "fp16", decode: bool = True, mesh=None, gemm2d: bool = False) -> Time:
    """One forward pass of `n_tokens` tokens through unit `u` on a rows x cols region; infinite when the
    region cannot hold the unit's working set (the cost model refuses it).

    attn_ctx: keys each query attends to (decode: the context; prefill/training: the average window).
    mesh: the placed region's own defect map (`Mesh.subregion`), to charge its detours; None = perfect.
    gemm2d: several tokens' matrices may also run as 2D-blocked GEMMs (a large mesh's prefill)."""
    t = Time()
    if mesh is not None and mesh.has_defects:  # memoized on the region's own Mesh (a region is asked again)
        key = ("unit_parts", spec, _key(u), rows, cols, n_tokens, attn_ctx, dtype, decode, gemm2d)
        if key not in mesh._routes:
            mesh._routes[key] = _unit_parts(spec, key[2], rows, cols, n_tokens, attn_ctx, dtype, decode, mesh,
                                            gemm2d)
        parts = mesh._routes[key]
    else:
        parts = _unit_cycles(spec, _key(u), rows, cols, n_tokens, attn_ctx, dtype, decode, gemm2d)
    if parts is None:
        return Time().add("SRAM", math.inf)
    for label, cyc in parts:
        t.add(label, cyc / spec.clock_hz)
    return t


def backward_time(spec: FabricSpec, u: Unit, rows: int, cols: int, fwd: Time, recompute: bool = False,
                  **kw) -> Time:
    """The backward of unit `u` whose forward took `fwd` (plus that forward again when it is recomputed): two
    forward-equivalents, the weight gradient dW = dy x^T, which skips zero inputs as the forward does, and the
    input gradient W^T dy, which cannot (dy is dense). `kw`: `unit_time`'s, for that dense-input product."""
    if not u.act_sparse:
        return fwd.scaled(2 + recompute)
    dense_x = dataclasses.replace(u, matmuls=tuple(dataclasses.replace(m, act_density=1.0) for m in u.matmuls))
    t = fwd.scaled(1 + recompute)
    t += unit_time(spec, dense_x, rows, cols, **kw)
    return t


def handoff_time(spec: FabricSpec, elems: int, dtype_bytes: int, edge_pes: int, hops: int = 1) -> Time:
    """Activations of one token (or chunk) crossing from one region into the next over `edge_pes` links."""
    cyc = hops * spec.hop_latency_cycles + 2 * spec.ramp_latency_cycles + \
        math.ceil(elems * dtype_bytes / (spec.link_bytes_per_cycle * max(1, edge_pes)))
    return Time().add("fabric latency", cyc / spec.clock_hz)


def io_time(spec: FabricSpec, nbytes: float) -> Time:
    """Across systems (or host <-> wafer): one hop's latency plus the bytes at the system I/O bandwidth."""
    return Time().add("I/O", spec.io_latency_s + nbytes / spec.io_bytes_per_s)


_SPEC_FACTS = ("clock_hz", "fp16_flops_per_cycle_per_pe", "fp32_flops_per_cycle_per_pe", "sram_bytes_per_pe",
               "sram_read_bytes_per_cycle", "link_bytes_per_cycle", "hop_latency_cycles", "ramp_latency_cycles",
               "io_bytes_per_s", "io_latency_s")


def assumptions(spec: FabricSpec, systems: int, dtype: str) -> dict:
    return {**{name: getattr(spec, name) for name in _SPEC_FACTS}, "peak_fp16_flops_per_wafer": spec.peak_flops("fp16"),
            "systems": systems, "dtype": dtype, "cost_model": cost.__name__}
