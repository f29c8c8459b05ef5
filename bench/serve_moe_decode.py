"""Benchmark: mixture-of-experts decode in the serving engine. A Mixtral-style tiny MoE (8 SwiGLU experts, top 2)
against the dense model of equal total parameters (one SwiGLU MLP as wide as the 8 experts together) and the
dense model of equal active parameters (as wide as 2 experts: what one token computes with, less the router).
Same shapes otherwise (GQA attention, RMSNorm, rotary), random weights, float32, the same engine, C kernels and
threads.

For each: the weight bytes decode reads per token (the engine's counters: a step reads every matrix once and,
in the MoE, only the experts its tokens were routed to) and decode tokens/s, single-stream and with --batch
sequences decoding together (a batch reads each chosen expert once for all the rows routed to it, so the MoE's
bytes per token grow towards the dense-total model's as the batch covers more experts). Decode rate =
(N - 1) / (t(N) - t(1)) generated tokens per sequence, so prefill cancels out. Rounds alternate between the three
models; medians of --repeats rounds.

    python bench/serve_moe_decode.py [--threads 2] [--new-tokens 64] [--repeats 5] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from waferscale.data.tokenizer import CharTokenizer
from waferscale.models import ModelConfig, build
from waferscale.serve.engine import Engine, SamplingParams


def configs(d: int, layers: int, expert_ff: int, experts: int, top_k: int, vocab: int) -> dict[str, ModelConfig]:
    base = dict(family="mixtral", vocab_size=vocab, n_layer=layers, n_head=d // 64, n_kv_head=max(1, d // 256),
                d_model=d, max_seq_len=1024, norm="rmsnorm", activation="swiglu", position="rotary",
                tie_embeddings=False, attn_bias=False, mlp_bias=False)
    return {
        "moe": ModelConfig(name=f"moe-{experts}x-top{top_k}", **base, d_ff=expert_ff, n_experts=experts,
                           experts_per_token=top_k),
        "dense-total": ModelConfig(name="dense-total", **{**base, "family": "llama"}, d_ff=experts * expert_ff),
        "dense-active": ModelConfig(name="dense-active", **{**base, "family": "llama"}, d_ff=top_k * expert_ff),
    }


def decode(engine: Engine, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """(decode tokens/s over all sequences, weight bytes read per decode token) for greedy decode of n tokens
    per prompt, all prompts together."""
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in (1, n)]
    t = time.perf_counter()
    engine.generate(prompts, params[0])
    t1 = time.perf_counter() - t
    s0 = engine.stats()
    t = time.perf_counter()
    engine.generate(prompts, params[1])
    tn = time.perf_counter() - t
    s1 = engine.stats()
    read = (s1["decode_weight_bytes"] - s0["decode_weight_bytes"]) / (s1["decode_tokens"] - s0["decode_tokens"])
    return len(prompts) * (n - 1) / (tn - t1), read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--expert-ff", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {a.threads} threads, float32; load average "
          f"at start {os.getloadavg()[0]:.2f} (other processes share these cores)")
    tok = CharTokenizer([chr(0x100 + i) for i in range(a.vocab)])
    engines: dict[str, Engine] = {}
    for key, cfg in configs(a.d_model, a.layers, a.expert_ff, a.experts, a.top_k, a.vocab).items():
        torch.manual_seed(0)
        engines[key] = Engine(build(cfg, device="cpu"), tok, kv_cache_mb=64, fast_linear=True,
                              decode_threads=a.threads)
        st = engines[key].stats()
        print(f"{key:12s} {cfg.name}: {cfg.num_params / 1e6:.1f}M parameters, {cfg.num_active_params / 1e6:.1f}M "
              f"active; weight matrices {st['total_weight_bytes'] / 1e6:.1f} MB, of which one token's "
              f"{st['active_weight_bytes'] / 1e6:.1f} MB; C kernels {engines[key].c_kernels}, one-call layer "
              f"stack {engines[key]._runner.stack is not None}")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, a.vocab, (16,), generator=gen).tolist() for _ in range(a.batch)]
    for e in engines.values():  # warm-up
        decode(e, prompts[:1], 4)
        decode(e, prompts, 4)
    rates: dict[tuple[str, int], list[float]] = {}
    reads: dict[tuple[str, int], list[float]] = {}
    for _ in range(a.repeats):
        for batch in (1, a.batch):
            for key, e in engines.items():
                r, b = decode(e, prompts[:batch], a.new_tokens)
                rates.setdefault((key, batch), []).append(r)
                reads.setdefault((key, batch), []).append(b)
    print(f"\ngreedy decode, {a.new_tokens} new tokens per sequence after a 16-token prompt; median of {a.repeats} "
          f"alternating rounds (load average now {os.getloadavg()[0]:.2f})")
    print(f"{'model':14s} {'batch':>5s} {'MB read/token':>14s} {'tokens/s':>9s}   runs")
    for batch in (1, a.batch):
        for key in engines:
            r, b = statistics.median(rates[key, batch]), statistics.median(reads[key, batch])
            print(f"{key:14s} {batch:5d} {b / 1e6:14.2f} {r:9.1f}   "
                  f"{', '.join(f'{x:.1f}' for x in rates[key, batch])}")
    for batch in (1, a.batch):
        moe_r, moe_b = statistics.median(rates["moe", batch]), statistics.median(reads["moe", batch])
        for key in ("dense-total", "dense-active"):
            r, b = statistics.median(rates[key, batch]), statistics.median(reads[key, batch])
            print(f"batch {batch}: MoE / {key}: bytes per token {moe_b / b:.2f}x, tokens/s {moe_r / r:.2f}x")


if __name__ == "__main__":
    main()
