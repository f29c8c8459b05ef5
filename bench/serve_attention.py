"""Benchmark: one sequence's decode attention (the C kernel, `kernels.decode_attention`) on 1 and 2 threads,
against torch's `scaled_dot_product_attention` (GQA) over the same cache, at SmolLM2-135M's shapes (9 query
heads, 3 KV heads of 64) and several context lengths.

Each figure is the per-layer time over 30 caches used in turn (a decode token visits 30 layers' caches, so a
cache is cold when it comes round again once they exceed the L3), the best of `--repeats` passes. With 2
threads the C kernel gives each thread the query heads of one KV head at a time (csrc/attention.c); torch
runs with the same thread count. Rope and the KV write are included on our side (the kernel does them).

    python bench/serve_attention.py [--positions 100,500,2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from waferscale.serve import kernels

NH, NKV, HD, LAYERS = 9, 3, 64, 30


def per_layer(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(LAYERS):
            fn(i)
        best = min(best, (time.perf_counter() - t) / LAYERS)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", default="100,500,2000")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if not kernels.available():
        raise SystemExit(f"the C kernels are not available: {kernels.unavailable_reason()}")
    print(f"decode attention, {NH} query heads, {NKV} KV heads of {HD}, {LAYERS} caches in turn; us per layer "
          f"(best of {a.repeats})")
    print(f"{'positions':>10s}{'KV MB':>8s}{'ours 1 thr':>12s}{'ours 2 thr':>12s}{'2 / 1':>8s}{'torch 2 thr':>13s}"
          f"{'torch / ours':>14s}")
    for S in (int(s) for s in a.positions.split(",")):
        caches = [torch.randn(2 * NKV, S, HD) for _ in range(LAYERS)]
        qkv = torch.randn(1, (NH + 2 * NKV) * HD)
        ours = {}
        for threads in (1, 2, 1, 2):  # alternating, the best of each
            kernels.set_threads(threads)
            t = per_layer(lambda i: kernels.decode_attention(qkv.clone(), None, None, caches[i], 0, S, NH, NKV),
                          a.repeats)
            ours[threads] = min(ours.get(threads, t), t)
        torch.set_num_threads(2)
        q = qkv[:, :NH * HD].view(1, NH, 1, HD)
        with torch.inference_mode():
            peer = per_layer(lambda i: F.scaled_dot_product_attention(q, caches[i][None, :NKV], caches[i][None, NKV:],
                                                                      enable_gqa=True), a.repeats)
        mb = 2 * NKV * S * HD * 4 / 1e6
        print(f"{S:10d}{mb:8.2f}{ours[1] * 1e6:12.1f}{ours[2] * 1e6:12.1f}{ours[1] / ours[2]:7.2f}x"
              f"{peer * 1e6:13.1f}{peer / ours[2]:13.2f}x")


if __name__ == "__main__":
    main()
