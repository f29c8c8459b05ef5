"""Benchmark: data-parallel scaling through SwarmX, tokens/s for --num_csx 1, 2 (and 4 where cores allow).

Every configuration runs the same execution model (MemoryX on rank 0, N worker processes over gloo on
127.0.0.1) on the same global batch. Each worker is one "system" with a fixed share of the host: `--threads`
intra-op threads (default 1), so N systems use N times the cores, as N CS-2s would; efficiency is
tokens/s(N) / (N x tokens/s(1)). On a host with fewer cores than N x threads + 1 (MemoryX's optimizer also runs),
the systems share cores and the efficiency says so.

    python bench/scaling_num_csx.py [--layers 4] [--hidden 256] [--batch_size 16] [--seq_len 128] [--max_csx 2]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from waferscale.params import OptimizerParams
from waferscale.models import build
from waferscale.models.registry import config_from_name
from waferscale.runtime.memoryx import MemoryX
from waferscale.runtime.streaming import build_skeleton
from waferscale.runtime.swarmx import SwarmXExecutor


def tokens_per_s(a: argparse.Namespace, n: int) -> float:
    cfg = config_from_name(a.model, vocab_size=256, max_seq_len=a.seq_len, d_model=a.hidden, n_layer=a.layers,
                           n_head=a.heads)
    opt = OptimizerParams(optimizer_type="AdamW", learning_rate=1e-3, max_gradient_norm=1.0)
    torch.manual_seed(0)
    mx = MemoryX(build(cfg, device="cpu"), opt, max_gradient_norm=1.0)
    ex = SwarmXExecutor(build_skeleton(cfg), mx, num_csx=n, device=torch.device("cpu"), timeout_s=120,
                        worker_threads=a.threads)
    g = torch.Generator().manual_seed(0)
    batch = lambda: (torch.randint(0, 256, (a.batch_size, a.seq_len), generator=g),  # noqa: E731
                     torch.randint(0, 256, (a.batch_size, a.seq_len), generator=g))
    try:
        for _ in range(a.warmup):
            ex.train_step(*batch(), 1e-3)
        t = time.perf_counter()
        for _ in range(a.steps):
            ex.train_step(*batch(), 1e-3)
        return a.steps * a.batch_size * a.seq_len / (time.perf_counter() - t)
    finally:
        ex.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per system")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max_csx", type=int, default=None, help="default: 4 if the host has >= 5 cores, else 2")
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    sizes = [1, 2] + ([4] if (a.max_csx or (4 if cores >= 5 else 2)) >= 4 else [])
    print(f"model {a.model} {a.layers}x{a.hidden}, global batch {a.batch_size}x{a.seq_len}, {a.threads} thread(s) "
          f"per system, host cores {cores}")
    base = None
    for n in sizes:
        tps = tokens_per_s(a, n)
        base = base or tps
        print(f"--num_csx {n}: {tps:10,.0f} tokens/s   speed-up {tps / base:5.2f}x   efficiency {tps / (n * base):6.1%}")


if __name__ == "__main__":
    main()
