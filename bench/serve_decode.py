"""Benchmark: the serving engine's decode speed against Hugging Face `transformers` and against physics.

1. Single-stream greedy decode tokens/s, `ignore_eos`, same SmolLM2-135M-Instruct weights and dtype, same
   prompt, same thread count, same process: our `Engine` vs `LlamaForCausalLM.generate` built in-process from
   our weights (`models.hf.state_dict_to_hf` / `config_to_hf`). Decode rate = (N - 1) / (t(N) - t(1)) for
   both, so prefill and setup cancel out. Runs alternate (peer, ours, ...); medians are reported.
4. The memory-bandwidth bound: every decode token reads every weight once, so tokens/s <= copy bandwidth /
   weight bytes. Copy bandwidth is measured here with a large tensor copy, counting bytes read + written
   (the STREAM convention); the fraction of that bound we reach is printed.
+. Aggregate tokens/s with 16 concurrent sequences (prefill included), one stage vs `--stages` pipelined.

    python bench/serve_decode.py [--threads 2] [--new-tokens 128] [--repeats 3] [--users 16] [--stages 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from waferscale.models.hf import config_to_hf, state_dict_to_hf
from waferscale.models.pretrained import load_pretrained, pretrained_tokenizer
from waferscale.serve.engine import Engine, SamplingParams

MODEL = "smollm2-135m-instruct"
QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def copy_bandwidth(mb: int = 512, reps: int = 10) -> float:
    """Bytes read + written per second by a large tensor copy (best of `reps`)."""
    a = torch.ones(mb * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in config_to_hf(model.config).items() if k != "architectures"})
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg)
    sd = state_dict_to_hf(model.state_dict(), model.config)
    hf.load_state_dict(sd, strict=False, assign=True)
    hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)  # rebuild its inv_freq buffer off meta
    return hf.to(next(model.parameters()).dtype).eval()


def hf_generate(hf: torch.nn.Module, prompt: list[int], n: int) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt])
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - t, out[0, len(prompt):].tolist()


def ours_generate(engine: Engine, prompt: list[int], n: int) -> tuple[float, list[int]]:
    t = time.perf_counter()
    [toks] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - t, toks


def decode_rate(fn, n: int) -> tuple[float, list[int]]:
    t1, _ = fn(1)
    tn, toks = fn(n)
    return (n - 1) / (tn - t1), toks


def aggregate(engine: Engine, prompts: list[list[int]], n: int) -> float:
    engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return sum(len(o) for o in out) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-aggregate", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {a.threads} threads, {a.dtype}; "
          f"load average at start {os.getloadavg()[0]:.2f} (other processes share these cores)")

    model = load_pretrained(MODEL).to(dtype)
    tok = pretrained_tokenizer(MODEL)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied head counted once
    engine = Engine(model, tok, kv_cache_mb=256)
    hf = None if a.skip_peer else hf_model(model)
    n = a.new_tokens
    print(f"model: {MODEL}, {weight_bytes / 1e6:.0f} MB of weights read per token; prompt {len(prompt)} tokens, "
          f"{n} new tokens, greedy, ignore_eos; engine fast_linear={engine.fast_linear}")

    # warm-up both
    ours_generate(engine, prompt, 8)
    if hf is not None:
        hf_generate(hf, prompt, 8)
    ours_rates, peer_rates = [], []
    ours_toks = peer_toks = None
    for _ in range(a.repeats):
        if hf is not None:
            r, peer_toks = decode_rate(lambda k: hf_generate(hf, prompt, k), n)
            peer_rates.append(r)
        r, ours_toks = decode_rate(lambda k: ours_generate(engine, prompt, k), n)
        ours_rates.append(r)
    ours = statistics.median(ours_rates)
    bw = copy_bandwidth()
    bound = bw / weight_bytes

    print("\n1. single-stream decode (median of %d)" % a.repeats)
    print(f"   ours (wsc Engine)          {ours:8.2f} tok/s   runs: {', '.join(f'{x:.2f}' for x in ours_rates)}")
    if hf is not None:
        peer = statistics.median(peer_rates)
        same = next((i for i, (x, y) in enumerate(zip(ours_toks, peer_toks)) if x != y), min(len(ours_toks),
                                                                                            len(peer_toks)))
        print(f"   transformers generate      {peer:8.2f} tok/s   runs: {', '.join(f'{x:.2f}' for x in peer_rates)}")
        print(f"   ratio ours / transformers  {ours / peer:8.2f}x   (target >= 1.5x); greedy tokens agree for the "
              f"first {same} of {n}")
    print("\n4. memory-bandwidth bound")
    print(f"   copy bandwidth (read + write, 512 MiB tensor copy)  {bw / 1e9:6.2f} GB/s")
    print(f"   bound = {bw / 1e9:.2f} GB/s / {weight_bytes / 1e6:.0f} MB per token      {bound:6.2f} tok/s")
    print(f"   ours / bound                                        {ours / bound:6.1%}   (target >= 80%)")
    print(f"   (counting the copied bytes once, {bw / 2e9:.2f} GB/s: bound {bound / 2:.2f} tok/s, ours "
          f"{2 * ours / bound:.1%} of it)")
    if hf is not None:
        print(f"   transformers / bound                                {peer / bound:6.1%}")
    del hf

    if not a.skip_aggregate:
        users = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"{QUESTION} ({i})"}]))
                 for i in range(a.users)]
        print(f"\n+. aggregate throughput, {a.users} concurrent sequences x {a.user_tokens} new tokens "
              "(prefill included)")
        agg1 = aggregate(engine, users, a.user_tokens)
        print(f"   stages=1                   {agg1:8.2f} tok/s   ({agg1 / ours:.1f}x one stream; one process, "
              "single-threaded runner)")
        engine.close()
        del engine
        if a.stages > 1:
            with Engine(model, tok, kv_cache_mb=256, stages=a.stages) as e2:
                aggk = aggregate(e2, users, a.user_tokens)
            print(f"   stages={a.stages}                   {aggk:8.2f} tok/s   ({aggk / agg1:.2f}x stages=1; "
                  f"{a.stages} stage processes x {max(1, a.threads // a.stages)} thread)")
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
