"""Training data-parallel over N systems through SwarmX: the gradient all-reduce and the weak-scaling table.

SwarmX is a tree of 1:4 broadcast-reduce nodes between MemoryX and the systems (`fabric.spec.SystemSpec`:
its per-system bandwidth and its depth ceil(log4 N)). Times in seconds.
"""

from __future__ import annotations

import math
from typing import Callable

from waferscale.compiler import project as pj
from waferscale.compiler.context import CompileContext
from waferscale.fabric.spec import SystemSpec


def swarmx_allreduce(ctx: CompileContext, nbytes: float, n: int) -> pj.Time:
    """Resident training's gradient all-reduce over n systems through SwarmX: every system streams its
    gradients out, the tree sums them at line rate, the sum is broadcast back; each way costs the bytes at the
    per-system bandwidth plus one I/O latency per hop (tree levels + 1). Nothing to do for one system."""
    if n <= 1:
        return pj.Time()
    sx = SystemSpec(ctx.spec, n)
    return pj.Time().add("I/O", 2 * (nbytes / sx.swarmx_bytes_per_s + sx.swarmx_hops * ctx.spec.io_latency_s))


def weak_scaling(ctx: CompileContext, per_sys: int, seq: int, step_at: Callable[[int], float],
                 exposed_at: Callable[[int], float]) -> list[dict]:
    """Data-parallel scaling over N and the powers of two up to max(N, 16) systems at a fixed per-system batch
    (weak scaling, as Cerebras' --num_csx does: the global batch grows with N, every system runs the same
    step). `step_at(n)` is the step time on n systems; `exposed_at(n)` the part of it SwarmX adds that compute
    does not hide. Efficiency = tokens/s(n) / (n x tokens/s(1)) <= 1, and the table says what it loses to."""
    rows = []
    for n in sorted({2 ** i for i in range(int(math.log2(max(ctx.systems, 16))) + 1)} | {ctx.systems}):
        st = step_at(n)
        rows.append({"systems": n, "global_batch": n * per_sys, "per_system_batch": per_sys, "step_time_s": st,
                     "tokens_per_s": n * per_sys * seq / st, "swarmx_levels": SystemSpec(ctx.spec, n).swarmx_levels,
                     "swarmx_exposed_s": exposed_at(n)})
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        r["efficiency"] = r["speedup"] / r["systems"]
    return rows

