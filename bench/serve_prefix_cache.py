"""Benchmark: prefix caching and the time to first token (TTFT) of a request that shares a 1,000-token prefix.

vLLM, whose automatic prefix caching the engine follows, does not install on this CPU-only machine, so the peer
is our own engine with caching off (`enable_prefix_caching=False`), in the same process, on the same model,
weights and threads. Each round times three requests, in an order that rotates from round to round:

- off:  caching off: the whole prompt is prefilled, as every request is without the cache;
- cold: caching on, a prefix never seen before (another 1,000 tokens of the same text): the first request of a
        prefix, which pays for hashing and registering its blocks and gains nothing;
- warm: caching on, the prefix cached by an earlier request: only the prefix's last partial block and the
        question are prefilled.

A request is the prefix followed by a question of its own round (so that the end of the prompt is never found in
the cache), greedy, max_tokens=1. TTFT is add_request -> the first token out of `Engine.step` (queue, prefill,
sampling; no HTTP). Reported: the medians over rounds, off / warm (the speed-up) and cold / off (the cost), and
whether warm and off give the same first token for the same prompt. On a shared machine the prefill times swing
with the other processes' load (the alternation keeps the comparison fair; the spread is printed).

    python bench/serve_prefix_cache.py [--prefix-tokens 1000] [--rounds 15] [--threads 2] [--block-size 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from waferscale.data import held_out_shakespeare_passage, load_tokenizer
from waferscale.models.pretrained import load_pretrained
from waferscale.serve.engine import Engine, SamplingParams

MODEL = "smollm2-135m-instruct"


def ttft(engine: Engine, rid: str, prompt: list[int]) -> tuple[float, int, int]:
    """Seconds from add_request to the first token, the prompt tokens the prefix cache supplied, the token."""
    t = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while True:
        for o in engine.step():
            if o.request_id == rid and o.new_token_ids:
                dt = time.perf_counter() - t
                while engine.has_unfinished():
                    engine.step()
                return dt, o.cached_tokens, o.new_token_ids[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {a.threads} threads; load average at start "
          f"{os.getloadavg()[0]:.2f} (other processes share these cores)")
    model = load_pretrained(MODEL)
    tok = load_tokenizer(MODEL)
    n = a.prefix_tokens
    # one text (~3.5 characters a token): the shared prefix, then the cold ones
    text = tok.encode(held_out_shakespeare_passage(5 * (a.rounds + 2) * n))
    if len(text) < (a.rounds + 2) * n:
        raise SystemExit(f"the held-out passage has {len(text)} tokens, fewer than {(a.rounds + 2) * n} needed")
    prefix = text[:n]
    cold_prefixes = [text[(r + 1) * n:(r + 2) * n] for r in range(a.rounds + 1)]
    questions = [tok.encode(f"\n\nQuestion {r}: who speaks next, and why?") for r in range(a.rounds + 1)]
    kw = dict(block_size=a.block_size, kv_cache_mb=512, threads=a.threads)
    off, on = Engine(model, tok, enable_prefix_caching=False, **kw), Engine(model, tok, **kw)
    print(f"model: {MODEL}; engine: C kernels {on.c_kernels}, decode threads {on.decode_threads}, "
          f"max_num_batched_tokens {on.max_num_batched_tokens}, KV blocks of {on.block_size} positions")
    print(f"prefix {n} tokens (held-out Shakespeare passage), question {len(questions[0])} tokens, max_tokens 1")

    # warm-up: each engine once, and the shared prefix into the cache (round 0's question)
    ttft(off, "warmup", prefix + questions[0])
    ttft(on, "warmup-cold", cold_prefixes[0] + questions[0])
    ttft(on, "warmup", prefix + questions[0])
    times: dict[str, list[float]] = {"off": [], "cold": [], "warm": []}
    cached: dict[str, set[int]] = {k: set() for k in times}
    first: dict[str, list[int]] = {k: [] for k in times}
    for r in range(1, a.rounds + 1):
        runs = {"off": (off, prefix), "cold": (on, cold_prefixes[r]), "warm": (on, prefix)}
        order = list(runs)[r % 3:] + list(runs)[:r % 3]
        for k in order:
            engine, pre = runs[k]
            dt, c, t = ttft(engine, f"{k}-{r}", pre + questions[r])
            times[k].append(dt)
            cached[k].add(c)
            first[k].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nTTFT, medians of {a.rounds} rounds (min .. max):")
    for k, label in (("off", "caching off (the peer)"), ("cold", "caching on, prefix not cached"),
                     ("warm", "caching on, prefix cached")):
        print(f"  {label:<32} {med[k] * 1e3:8.1f} ms  ({min(times[k]) * 1e3:.1f} .. {max(times[k]) * 1e3:.1f})  "
              f"cached prompt tokens {sorted(cached[k])}")
    print(f"warm vs off: {med['off'] / med['warm']:.1f}x faster to the first token; cold / off: "
          f"{med['cold'] / med['off']:.3f} (what caching costs a prefix it has not seen)")
    same = sum(x == y for x, y in zip(first["warm"], first["off"]))
    print(f"the same first token warm and off (same prompt): {same} of {a.rounds} rounds")
    st = on.stats()
    print(f"engine with caching: prefix cache hit rate {st['prefix_cache_hits'] / st['prefix_cache_queries']:.3f} "
          f"({st['prefix_cache_hits']} of {st['prefix_cache_queries']} prompt tokens), {st['kv_blocks_cached']} "
          f"of {st['kv_blocks_total']} blocks cached; load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
