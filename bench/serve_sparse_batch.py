"""Benchmark: the sparse panel kernels against the dense ones, one product at a time, for 1 to 64 rows.

SmolLM2-135M-Instruct's block matrices, each pruned by magnitude to 50, 75 and 90% sparsity
(`waferscale.sparse.masks.mask_for_sparsity` per matrix) and fused as the serving engine fuses them (q|k|v 960 x
576, o 576 x 576, gate|up 3072 x 576, down 576 x 1536), are packed both ways: dense panels with their zeros
(`kernels.pack`) and sparse panels (`kernels.pack_sparse`). For each number of rows (decode batches: one row
per stream) every layer's four products run dense then sparse or sparse then dense (alternating), each timed
alone; the layers follow each other, so the weights stream from memory as in a decode step (30 layers, far more
than the caches). The two must agree bit for bit (asserted). Reported per row count: the median time of a
layer's four products each way and the median of the layers' time ratios (dense / sparse: above 1, sparse is
faster), and the bytes ratio (what a bound by memory alone would give). Each product is one `kernels.linear`
call from Python (a few microseconds of overhead each way, which flattens the ratio at 1 row; the single-stream
figures of bench/serve_sparse_decode.py run the whole stack in C).

    python bench/serve_sparse_batch.py [--threads 2] [--rows 1 4 8 16 24 32 64] [--sparsity 0.5 0.75 0.9] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from waferscale.models.pretrained import load_pretrained
from waferscale.serve import kernels
from waferscale.sparse.masks import mask_for_sparsity

MODEL = "smollm2-135m-instruct"


def fused_layers(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """Per block, its matrices as the serving engine fuses them: [q|k|v, o, gate|up, down]."""
    out = []
    for b in model.blocks:
        a, m = b.attn, b.mlp
        out.append([torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight])
    return [[w.detach().float().contiguous() for w in ws] for ws in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 64])
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.75, 0.9])
    ap.add_argument("--repeats", type=int, default=5, help="passes over the layers per row count")
    a = ap.parse_args()
    if not kernels.available():
        raise SystemExit(f"the C kernels are not available here: {kernels.unavailable_reason()}")
    torch.set_num_threads(a.threads)
    kernels.set_threads(a.threads)
    loads = [os.getloadavg()[0]]
    print(f"machine: {os.cpu_count()} CPUs, {a.threads} threads, float32; load average at start {loads[0]:.2f} (other "
          "processes share these cores)")
    layers = fused_layers(load_pretrained(MODEL))
    print(f"model: {MODEL}, {len(layers)} layers x 4 fused matrices, pruned by magnitude per matrix; {a.repeats} "
          "passes over the layers per row count, dense and sparse alternating")
    print(f"{'sparsity':>8} {'rows':>4} {'S (per matrix)':>14} {'dense us':>9} {'sparse us':>9} {'speedup':>8} "
          f"{'bytes ratio':>11}")
    for s in a.sparsity:
        packed = []
        dense_b = sparse_b = 0
        for ws in layers:
            row = []
            for w in ws:
                w = w * mask_for_sparsity(w.abs(), s)
                plan = kernels.sparse_plan(w)
                row.append((kernels.pack(w), kernels.pack_sparse(w, plan), w.shape[0], plan.S))
                dense_b += 4 * kernels.packed_numel(tuple(w.shape))
                sparse_b += 4 * plan.numel
            packed.append(row)
        S = ",".join(str(v) for v in sorted({p[3] for row in packed for p in row}))
        for R in a.rows:
            xs = {n: torch.randn(R, n) for n in (576, 1536)}
            td, ts, ratios = [], [], []
            for rep in range(a.repeats + 1):  # (the first pass warms up, untimed)
                for i, row in enumerate(packed):
                    t = [0.0, 0.0]
                    for way in ((1, 0) if (rep + i) % 2 == 0 else (0, 1)):  # which goes first alternates
                        for wp, sp, out, _ in row:
                            x = xs[wp.shape[1]]
                            t0 = time.perf_counter()
                            y = kernels.linear(x, sp if way else wp, out)
                            t[way] += time.perf_counter() - t0
                            if way == 1 and rep == 0:
                                assert torch.equal(y.view(torch.int32), kernels.linear(x, wp, out).view(torch.int32)), \
                                    "sparse and dense bits differ"
                    if rep:
                        td.append(t[0])
                        ts.append(t[1])
                        ratios.append(t[0] / t[1])
            loads.append(os.getloadavg()[0])
            print(f"{s:8.0%} {R:4d} {S:>14} {statistics.median(td) * 1e6:9.1f} {statistics.median(ts) * 1e6:9.1f} "
                  f"{statistics.median(ratios):7.2f}x {dense_b / sparse_b:10.2f}x")
    print(f"load average during the runs: {', '.join(f'{x:.1f}' for x in loads)} (this benchmark counts "
          f"{a.threads}; more means other processes share the cores, and every figure above is noisier)")


if __name__ == "__main__":
    main()
