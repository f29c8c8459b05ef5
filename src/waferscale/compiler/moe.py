"""Mixture of experts on the wafer: what routing costs.

An MoE block's router sends each token's activations to the k of its E experts it picks; each expert is a unit
of its own, in a region of its own (`capture`), and computes only the tokens routed to it. All E experts'
weights are resident (or streamed) whether a token uses them or not. Routing adds two costs:

- traffic: each token's activations go from the block's region to each chosen expert's region and the expert's
  output comes back to the next block's region (`route_time`: hops between the rectangles and the bytes over
  the links facing each other, through the fabric cost model's hand-off);
- load imbalance: the experts of a layer work in parallel, so a batch of B tokens takes as long as the most
  loaded expert needs. Assumption: routing is uniform and independent per token (each token picks k distinct
  experts, every k-subset equally likely), what the load-balancing loss trains the router towards.
  `expected_max_load(B, E, k)` is E[max_e load_e] under it, computed from the exact distribution of the
  k-subsets' counts (multinomial over the C(E, k) subsets) by seeded sampling.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Sequence

import numpy as np

from waferscale.compiler import project as pj
from waferscale.compiler.plan import Region
from waferscale.fabric.spec import FabricSpec

LOAD_SAMPLES = 4096  # draws of a batch's routing: the estimate's relative standard error is well under 1%
MAX_SUBSETS = 1 << 14  # beyond this many k-subsets, draw each token's experts instead


@lru_cache(maxsize=4096)
def expected_max_load(tokens: int, n_experts: int, k: int) -> float:
    """E[tokens the most loaded expert gets] when each of `tokens` tokens picks k distinct of `n_experts`
    experts uniformly at random (mean load tokens*k/E; the excess is the load imbalance). Seeded: the same
    arguments give the same figure."""
    if tokens <= 0:
        return 0.0
    if k == n_experts:
        return float(tokens)
    rng = np.random.default_rng(0)
    subsets = list(itertools.combinations(range(n_experts), k))
    if len(subsets) <= MAX_SUBSETS:  # counts per k-subset are multinomial; an expert's load sums its subsets'
        incidence = np.zeros((len(subsets), n_experts), dtype=np.int64)
        for row, sub in enumerate(subsets):
            incidence[row, list(sub)] = 1
        counts = rng.multinomial(tokens, np.full(len(subsets), 1 / len(subsets)), size=LOAD_SAMPLES)
        loads = counts @ incidence
    else:  # each token's k experts: the k smallest of E uniform keys
        loads = np.zeros((LOAD_SAMPLES, n_experts), dtype=np.int64)
        for start in range(0, tokens, 256):
            n = min(256, tokens - start)
            picks = np.argpartition(rng.random((LOAD_SAMPLES, n, n_experts)), k - 1, axis=-1)[..., :k]
            for j in range(k):
                loads += np.eye(n_experts, dtype=np.int64)[picks[..., j]].sum(1)
    return float(loads.max(1).mean())


def imbalance(tokens: int, n_experts: int, k: int) -> float:
    """Expected max load over the mean load (>= 1): how much longer a layer's experts take than if every expert
    got exactly tokens*k/E."""
    return expected_max_load(tokens, n_experts, k) / (tokens * k / n_experts) if tokens else 1.0


def expected_max_of_k(values: Sequence[float], k: int) -> float:
    """E[max of k values drawn without replacement] from `values`, every k-subset equally likely (exact: the
    i-th smallest of n is the maximum with probability C(i-1, k-1) / C(n, k))."""
    v = sorted(values)
    n = len(v)
    return sum(x * math.comb(i, k - 1) for i, x in enumerate(v)) / math.comb(n, k)


def gap_hops(a: Region, b: Region) -> int:
    """Hops between two rectangles on one wafer: the Manhattan gap between their nearest PEs (1 when they
    share an edge or overlap)."""
    dr = max(0, max(a.row, b.row) - min(a.row + a.rows, b.row + b.rows) + 1)
    dc = max(0, max(a.col, b.col) - min(a.col + a.cols, b.col + b.cols) + 1)
    return max(1, dr + dc)


def route_time(spec: FabricSpec, a: Region, b: Region, elems: int, nbytes: int) -> pj.Time:
    """`elems` values of `nbytes` bytes from region a to region b: through the systems' I/O between wafers; on
    one wafer over as many parallel routes as the narrower rectangle is wide (the region spreads the vector
    over its PEs), `gap_hops` hops long (`project.handoff_time`)."""
    if a.system != b.system:
        return pj.io_time(spec, elems * nbytes)
    lanes = min(a.rows, a.cols, b.rows, b.cols)
    return pj.handoff_time(spec, elems, nbytes, lanes, gap_hops(a, b))


def layer_latency(spec: FabricSpec, block: Region, experts: Sequence[Region], after: Region | None,
                  expert_times: Sequence[pj.Time], d: int, nbytes: int, k: int) -> pj.Time:
    """One token from an MoE block's region through its k routed experts (in parallel) to `after` (the next
    stage's region; None: back to the block): the expected slowest of the k paths (activations in, the
    expert's compute, its output out), each path equally likely to be chosen. Booked by the parts of the
    expected path in proportion."""
    paths = []
    for r, t in zip(experts, expert_times):
        p = pj.Time()
        p += route_time(spec, block, r, d, nbytes)
        p += t
        p += route_time(spec, r, after or block, d, nbytes)
        paths.append(p)
    want = expected_max_of_k([p.s for p in paths], k)
    mean = sum(p.s for p in paths) / len(paths)
    out = pj.Time()
    for p in paths:
        out += p
    return out.scaled(want / mean / len(paths)) if mean else out


def traffic(spec: FabricSpec, block: Region, experts: Sequence[Region], after: Region | None, d: int,
            nbytes: int, k: int) -> dict:
    """A token's routing traffic through one MoE layer: bytes sent (k activations out, k outputs back) and the
    mean hops of a routed path (uniform routing)."""
    hops = [gap_hops(block, r) + (gap_hops(r, after) if after is not None and after.system == r.system else 0)
            for r in experts]
    return {"bytes_per_token": 2 * k * d * nbytes, "mean_hops": sum(hops) / len(hops),
            "max_hops": max(hops), "crosses_systems": any(after is not None and after.system != r.system
                                                          for r in experts)}
