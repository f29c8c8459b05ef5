"""Benchmark: the serving engine's decode speed against Hugging Face `transformers` and against physics.

1. Single-stream greedy decode tokens/s, `ignore_eos`, same SmolLM2-135M-Instruct weights and dtype, same
   prompt, same thread count, same process: our `Engine` vs `LlamaForCausalLM.generate` built in-process from
   our weights (`models.hf.state_dict_to_hf` / `config_to_hf`). Decode rate = (N - 1) / (t(N) - t(1)) for
   both, so prefill and setup cancel out. Runs alternate (peer, ours, ...); medians are reported.
4. The memory-bandwidth bound: a decode token reads every weight once (the tied embedding / LM head once: the
   lookup reads one row, the head the whole matrix) plus the KV cache of every position so far, so
   tokens/s <= copy bandwidth / bytes read per token. Copy bandwidth is a large tensor copy with `--threads`
   threads on huge pages (like the engine's weights), counting bytes read + written (the STREAM convention).
   The bound is for the dtype we run (float32: 4 bytes a weight). The memory bandwidth a VM gets drifts (here
   ~35 GB/s with spikes to ~59 within seconds), so the fraction is printed three ways: the median run over
   the best copy of the whole run (the most conservative), each run over the copies just before and after
   it, and 16-token blocks each over a copy just before it (like with like; the headline when the host is
   noisy).
+. Aggregate tokens/s with 16 concurrent sequences (prefill included), one stage vs `--stages` pipelined.

    python bench/serve_decode.py [--threads 2] [--new-tokens 128] [--repeats 3] [--users 16] [--stages 2]
                                 [--isa x86-64-v3]   (our kernels' -march level: bench/isa_level.py)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import isa_level  # (bench/, beside this file)
import torch

from waferscale.data import load_tokenizer
from waferscale.models.hf import config_to_hf, state_dict_to_hf
from waferscale.models.pretrained import load_pretrained
from waferscale.serve.engine import Engine, SamplingParams
from waferscale.serve.kernels import hugepage_tensor

MODEL = "smollm2-135m-instruct"
QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


_COPY_BUFFERS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def copy_bandwidth(mb: int = 512, reps: int = 10) -> float:
    """Bytes read + written per second by a large tensor copy (best of `reps`), on huge pages like the
    engine's weights (serve/kernels.hugepage_tensor): with 4 KiB pages a copy on this VM is TLB-bound and
    reports ~25-35% less, which would flatter every fraction of the bound."""
    if mb not in _COPY_BUFFERS:
        a = hugepage_tensor(mb * 2**20 // 4)
        a.fill_(1.0)
        _COPY_BUFFERS[mb] = (a, hugepage_tensor(a.numel()))
    a, b = _COPY_BUFFERS[mb]
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


def paired_blocks(engine: Engine, prompt: list[int], n: int, block: int = 16) -> list[tuple[float, float]]:
    """Decode n tokens in blocks of `block` steps with a copy-bandwidth measurement before each block:
    [(tokens/s of the block, copy bytes/s beside it)]. On a shared host the memory bandwidth a VM gets
    drifts by tens of percent within seconds; pairing each block with its own copy compares like with like."""
    engine.add_request("paired", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    while engine.stats()["generation_tokens"] == 0 or engine.stats()["waiting"]:
        engine.step()  # prefill and the first token
    out = []
    while engine.has_unfinished():
        bw = copy_bandwidth(reps=3)
        t, k = time.perf_counter(), 0
        while k < block and engine.has_unfinished():
            engine.step()
            k += 1
        if k == block:
            out.append((k / (time.perf_counter() - t), bw))
    return out


def aggregate(engine: Engine, prompts: list[list[int]], n: int) -> float:
    engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return sum(len(o) for o in out) / (time.perf_counter() - t)


def kv_bytes_per_position(model: torch.nn.Module) -> int:
    """Bytes of K and V that one position adds to the cache (all layers)."""
    cfg = model.config
    return 2 * cfg.n_layer * cfg.kv_heads * cfg.head_dim * next(model.parameters()).element_size()


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
    isa_level.add_arguments(ap, peer=False)
    a = ap.parse_args()
    isa_level.apply(a)
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    loads = [os.getloadavg()[0]]
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {a.threads} threads, {a.dtype}; "
          f"load average at start {loads[0]:.2f} (other processes share these cores)")

    model = load_pretrained(MODEL).to(dtype)
    tok = load_tokenizer(MODEL)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied head counted once
    n = a.new_tokens
    # decode token i (i = 1 .. n-1 are timed) attends over len(prompt) + i positions
    kv_bytes = kv_bytes_per_position(model) * (len(prompt) + n / 2)
    engine = Engine(model, tok, kv_cache_mb=256)
    hf = None if a.skip_peer else hf_model(model)
    print(f"model: {MODEL}, {weight_bytes / 1e6:.1f} MB of weights + {kv_bytes / 1e6:.1f} MB of KV cache (mean) "
          f"read per token; prompt {len(prompt)} tokens, {n} new tokens, greedy, ignore_eos")
    print(f"engine: C kernels {engine.c_kernels}, decode threads {engine.decode_threads}, "
          f"fast_linear {engine.fast_linear}; {isa_level.level()}")

    # warm-up both
    ours_generate(engine, prompt, 8)
    if hf is not None:
        hf_generate(hf, prompt, 8)
    ours_rates, peer_rates, bws, paired = [], [], [], []
    ours_toks = peer_toks = None
    nbytes = weight_bytes + kv_bytes
    for _ in range(a.repeats):
        if hf is not None:
            r, peer_toks = decode_rate(lambda k: hf_generate(hf, prompt, k), n)
            peer_rates.append(r)
        before = copy_bandwidth(reps=5)
        r, ours_toks = decode_rate(lambda k: ours_generate(engine, prompt, k), n)
        after = copy_bandwidth(reps=5)
        ours_rates.append(r)
        bws += [before, after]
        paired.append(r / (max(before, after) / nbytes))
        loads.append(os.getloadavg()[0])
    blocks = paired_blocks(engine, prompt, n)
    ours = statistics.median(ours_rates)
    bw = max(bws)
    bound = bw / nbytes
    bound_w = bw / weight_bytes

    print("\n1. single-stream decode (median of %d; %s)" % (a.repeats, isa_level.level()))
    print(f"   ours (wsc Engine)          {ours:8.2f} tok/s   runs: {', '.join(f'{x:.2f}' for x in ours_rates)}")
    if hf is not None:
        peer = statistics.median(peer_rates)
        same = next((i for i, (x, y) in enumerate(zip(ours_toks, peer_toks)) if x != y), min(len(ours_toks),
                                                                                            len(peer_toks)))
        print(f"   transformers generate      {peer:8.2f} tok/s   runs: {', '.join(f'{x:.2f}' for x in peer_rates)}")
        print(f"   ratio ours / transformers  {ours / peer:8.2f}x   (target >= 1.5x); greedy tokens agree for the "
              f"first {same} of {n}")
    print("\n4. memory-bandwidth bound")
    print(f"   copy bandwidth (read + write, 512 MiB tensor copy on huge pages, {a.threads} threads), measured "
          f"before and after each of our runs: {', '.join(f'{x / 1e9:.1f}' for x in bws)} GB/s; best {bw / 1e9:.2f}")
    print(f"   bound = {bw / 1e9:.2f} GB/s / {nbytes / 1e6:.0f} MB per token   {bound:6.2f} tok/s   "
          f"(weights alone: {bound_w:.2f})")
    print(f"   ours / bound                                  {ours / bound:6.1%}   (target >= 80%; median run over "
          f"the best copy of the whole run; best run {max(ours_rates) / bound:.1%}; over the median copy "
          f"{ours / (statistics.median(bws) / nbytes):.1%})")
    print(f"   ours / bound, each run against the better copy beside it: "
          f"{', '.join(f'{x:.1%}' for x in paired)} (median {statistics.median(paired):.1%})")
    fr = sorted(r / (b / nbytes) for r, b in blocks)
    print(f"   ours / bound in blocks of 16 tokens, each against a copy just before it ({len(fr)} blocks): median "
          f"{statistics.median(fr):.1%}, quartiles {fr[len(fr) // 4]:.1%} .. {fr[3 * len(fr) // 4]:.1%}")
    print(f"   ours, effective read bandwidth                {ours * nbytes / 1e9:6.2f} GB/s")
    if hf is not None:
        print(f"   transformers / bound                          {peer / bound:6.1%}")
    print(f"   load average during the runs: {', '.join(f'{x:.1f}' for x in loads)} (this benchmark itself counts "
          "1-2; more means other processes share the cores, and every figure above is lower and noisier)")
    del hf

    if not a.skip_aggregate:
        users = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"{QUESTION} ({i})"}]))
                 for i in range(a.users)]
        print(f"\n+. aggregate throughput, {a.users} concurrent sequences x {a.user_tokens} new tokens "
              "(prefill included)")
        agg1 = aggregate(engine, users, a.user_tokens)
        print(f"   stages=1                   {agg1:8.2f} tok/s   ({agg1 / ours:.1f}x one stream; one process, the "
              f"kernels' pool of {engine.decode_threads} threads)")
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
