"""Benchmark: one sequence's decode attention (the C kernel, `kernels.decode_attention`) on 1 and 2 threads,
against torch's `scaled_dot_product_attention` (GQA) over the same cache, at SmolLM2-135M's shapes (9 query
heads, 3 KV heads of 64) and several context lengths.

Each figure is the per-layer time over 30 caches used in turn (a decode token visits 30 layers' caches, so a
cache is cold when it comes round again once they exceed the L3), the best of `--repeats` passes. With 2
threads the C kernel gives each thread the query heads of one KV head at a time (csrc/attention.c); torch
runs with the same thread count. Rope and the KV write are included on our side (the kernel does them).

A second table is a decode step of `--batch` sequences (default 16) over a block-paged cache (blocks of 16
positions, scattered), `kernels.decode_attention_batch` with a float32 and a float16 cache (`--kv-cache-dtype`;
float16 halves the bytes), against torch SDPA over each sequence's gathered float32 keys and values (the runner's
torch path), 2 threads each, per layer over 30 layers' caches.

A third table is one prefill chunk of `--prefill` tokens (default 128,512) attending causally: the C stack's
`kernels.decode_attention_batch` over the chunk's tokens (csrc/attention.c: a run of 65 or more goes in blocks
of 16 tokens; rope and the KV write included), against torch SDPA (is_causal, GQA) over the same keys and
values, 2 threads each, per layer over 30 layers' caches; the multiply-adds of both products over the time.

    python bench/serve_attention.py [--positions 100,500,2000] [--batch 16] [--prefill 128,512] [--repeats 5]
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
    ap.add_argument("--batch", type=int, default=16, help="sequences of the batched table (0: skip it)")
    ap.add_argument("--prefill", default="128,512", help="chunk lengths of the prefill table ('': skip it)")
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
    if a.batch > 0:
        batched(a)
    if a.prefill:
        prefill_table([int(t) for t in a.prefill.split(",")], a.repeats)


def batched(a) -> None:
    B, bs = a.batch, 16
    kernels.set_threads(2)
    torch.set_num_threads(2)
    print(f"\na decode step of {B} sequences over a paged cache (blocks of {bs}), 2 threads; us per layer (best of "
          f"{a.repeats})")
    print(f"{'positions':>10s}{'KV MB fp32':>12s}{'ours fp32':>11s}{'ours fp16':>11s}{'fp32 / fp16':>13s}"
          f"{'torch fp32':>12s}{'torch / ours fp16':>19s}")
    for S in (int(s) for s in a.positions.split(",")):
        nblk = -(-S // bs)
        slots = 2 * B * nblk * bs
        g = torch.Generator().manual_seed(0)
        tables = torch.randperm(slots // bs, generator=g)[:B * nblk].view(B, nblk)
        pos, rows = torch.full((B,), S - 1), torch.arange(B)
        qkv, y = torch.randn(B, (NH + 2 * NKV) * HD), torch.empty(B, NH * HD)
        caches32 = [torch.randn(2 * NKV, slots, HD) for _ in range(LAYERS)]
        caches = {torch.float32: caches32, torch.float16: [c.half() for c in caches32]}
        ours = {}
        for dt in (torch.float32, torch.float16) * 2:  # alternating, the best of each
            t = per_layer(lambda i: kernels.decode_attention_batch(qkv, rows, pos, None, None, caches[dt][i], tables,
                                                                   bs, NH, NKV, y), a.repeats)
            ours[dt] = min(ours.get(dt, t), t)
        idx = (tables[:, :, None] * bs + torch.arange(bs)).view(B, -1)[:, :S].reshape(-1)
        q = qkv[:, :NH * HD].view(B, NH, 1, HD)
        with torch.inference_mode():
            def peer_layer(i: int) -> torch.Tensor:
                kv = caches32[i].index_select(1, idx).view(2 * NKV, B, S, HD).transpose(0, 1)
                return F.scaled_dot_product_attention(q, kv[:, :NKV], kv[:, NKV:], enable_gqa=True)
            peer = per_layer(peer_layer, a.repeats)
        mb = B * 2 * NKV * S * HD * 4 / 1e6
        f32, f16 = ours[torch.float32], ours[torch.float16]
        print(f"{S:10d}{mb:12.2f}{f32 * 1e6:11.1f}{f16 * 1e6:11.1f}{f32 / f16:12.2f}x{peer * 1e6:12.1f}"
              f"{peer / f16:18.2f}x")


def prefill_table(lengths: list[int], repeats: int) -> None:
    kernels.set_threads(2)
    torch.set_num_threads(2)
    print(f"\none prefill chunk attending causally (float32 cache, blocks of 16), 2 threads each; us per layer over "
          f"{LAYERS} layers, GMAC/s of q.k and p.v")
    print(f"{'tokens':>8s}{'ours':>10s}{'GMAC/s':>9s}{'torch SDPA':>12s}{'GMAC/s':>9s}{'ours / torch':>14s}")
    bs = 16
    for T in lengths:
        nblk = -(-T // bs)
        g = torch.Generator().manual_seed(0)
        tables = torch.randperm(2 * nblk, generator=g)[:nblk].repeat(T, 1)  # one sequence's scattered blocks
        pos, rows = torch.arange(T), torch.arange(T)
        qkv0 = torch.randn(T, (NH + 2 * NKV) * HD, generator=g)
        y = torch.empty(T, NH * HD)
        caches = [torch.zeros(2 * NKV, 2 * nblk * bs, HD) for _ in range(LAYERS)]
        qkvs = [qkv0.clone() for _ in range(LAYERS)]
        ours = per_layer(lambda i: kernels.decode_attention_batch(qkvs[i], rows, pos, None, None, caches[i], tables,
                                                                  bs, NH, NKV, y), repeats)
        q = qkv0[:, :NH * HD].view(T, NH, HD).transpose(0, 1)[None]
        k = qkv0[:, NH * HD:(NH + NKV) * HD].view(T, NKV, HD).transpose(0, 1)[None]
        v = qkv0[:, (NH + NKV) * HD:].view(T, NKV, HD).transpose(0, 1)[None]
        with torch.inference_mode():
            peer = per_layer(lambda i: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                             repeats)
        macs = 2 * NH * HD * T * (T + 1) / 2
        print(f"{T:8d}{ours * 1e6:10.1f}{macs / ours / 1e9:9.1f}{peer * 1e6:12.1f}{macs / peer / 1e9:9.1f}"
              f"{peer / ours:13.2f}x")


if __name__ == "__main__":
    main()
