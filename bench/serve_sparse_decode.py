"""Benchmark: sparse decode against dense decode of the same pruned model, and against the bytes each reads.

SmolLM2-135M-Instruct with each block matrix (q, k, v, o, gate, up, down; not the embedding / tied head or the
norms) pruned by magnitude to 50, 75 and 90% sparsity (`waferscale.sparse.masks.mask_for_sparsity` per matrix).
For each, the serving engine holds the same model twice in this process: its matrices in sparse panels (the
default: serve/csrc/spanels.c) and dense with zeros (WSC_SPARSE_KERNELS=0). Single-stream greedy decode,
`ignore_eos`, same prompt; the two must produce the same tokens (asserted: the sparse kernels give the dense
ones' bits). The two engines decode in lockstep, one token each in turn (which goes first alternates), each
token timed alone: the cores are shared with other processes, and a pair of tokens a few milliseconds apart
sees the same machine, where runs seconds apart do not. Reported: tokens/s from the median token time of each
way, and the speedup as the median of the pairs' time ratios.

Decode reads every weight once a token, so its bound is bytes: the table gives the weight bytes a token reads
each way (the engine's own count: dense panels, or masks + non-zero values + window headers; the tied
embedding / LM head is dense in both) and their ratio. The issue's target: speedup >= 0.8 x (dense bytes /
sparse bytes).

    python bench/serve_sparse_decode.py [--threads 2] [--new-tokens 128] [--repeats 3] [--sparsity 0.5 0.75 0.9]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from waferscale.data import load_tokenizer
from waferscale.models.pretrained import load_pretrained
from waferscale.serve.engine import Engine, SamplingParams
from waferscale.sparse.masks import default_filter, mask_for_sparsity

MODEL = "smollm2-135m-instruct"
QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def pruned(model: torch.nn.Module, sparsity: float) -> torch.nn.Module:
    """A copy of `model` with each block matrix pruned by magnitude to `sparsity` (Cerebras' default filter;
    the embedding, which is also the tied head, stays dense)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if default_filter(name, p) and name.startswith("blocks."):
                p.mul_(mask_for_sparsity(p.abs(), sparsity))
    return m


def engine(model: torch.nn.Module, tok, sparse: bool) -> Engine:
    os.environ["WSC_SPARSE_KERNELS"] = "1" if sparse else "0"
    try:
        return Engine(model, tok, kv_cache_mb=64)
    finally:
        del os.environ["WSC_SPARSE_KERNELS"]


def lockstep(dense: Engine, sparse: Engine, prompt: list[int], n: int,
             rnd: int) -> tuple[list[float], list[float], list[int], list[int]]:
    """Both engines decode `prompt` for n tokens, a token each in turn: (dense token times, sparse token times,
    dense tokens, sparse tokens); the first token (prefill) is not timed."""
    engines = (dense, sparse)
    toks: tuple[list[int], list[int]] = ([], [])
    times: tuple[list[float], list[float]] = ([], [])
    for e in engines:
        e.add_request(f"r{rnd}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    step = 0
    while any(e.has_unfinished() for e in engines):
        for i in ((0, 1) if step % 2 == 0 else (1, 0)):
            if not engines[i].has_unfinished():
                continue
            t0 = time.perf_counter()
            out = engines[i].step()
            dt = time.perf_counter() - t0
            if toks[i]:  # (not the prefill step)
                times[i].append(dt)
            toks[i].extend(t for o in out for t in o.new_token_ids)
        step += 1
    return times[0], times[1], toks[0], toks[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.75, 0.9])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    loads = [os.getloadavg()[0]]
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {a.threads} threads, float32; load average at "
          f"start {loads[0]:.2f} (other processes share these cores)")
    base = load_pretrained(MODEL)
    tok = load_tokenizer(MODEL)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    n = a.new_tokens
    print(f"model: {MODEL}, block matrices pruned by magnitude per matrix; prompt {len(prompt)} tokens, {n} new "
          f"tokens, greedy, ignore_eos; {a.repeats} runs of the two engines in lockstep")
    rows = []
    for s in a.sparsity:
        model = pruned(base, s)
        dense, sparse = engine(model, tok, False), engine(model, tok, True)
        if not (dense.c_kernels and sparse.c_kernels):
            raise SystemExit("the C kernels are not available here (see serve/kernels.py): nothing to compare")
        lockstep(dense, sparse, prompt, 8, -1)  # warm-up both
        td, ts, ratios = [], [], []
        for k in range(a.repeats):
            d_t, s_t, d_tok, s_tok = lockstep(dense, sparse, prompt, n, k)
            assert s_tok == d_tok and len(d_tok) == n, f"sparsity {s}: sparse and dense decode disagree"
            td += d_t
            ts += s_t
            ratios += [x / y for x, y in zip(d_t, s_t)]
            loads.append(os.getloadavg()[0])
        bd, bs = dense.weight_bytes[1], sparse.weight_bytes[1]
        rows.append((s, 1 / statistics.median(td), 1 / statistics.median(ts), statistics.median(ratios), bd, bs,
                     sorted(ratios)))
        dense.close()
        sparse.close()
        del dense, sparse, model

    print("\nsingle-stream decode in lockstep: tokens/s (median token time) and weight bytes read per token; greedy "
          "tokens identical sparse vs dense in every run")
    print(f"{'sparsity':>8} {'dense tok/s':>11} {'sparse tok/s':>12} {'speedup':>8} {'dense MB':>9} {'sparse MB':>9} "
          f"{'bytes ratio':>11} {'speedup / bytes ratio':>22}")
    for s, d, sp, speedup, bd, bs, _ in rows:
        print(f"{s:8.0%} {d:11.2f} {sp:12.2f} {speedup:7.2f}x {bd / 1e6:9.1f} {bs / 1e6:9.1f} {bd / bs:10.2f}x "
              f"{speedup / (bd / bs):21.2f}   (target >= 0.80)")
    for s, _, _, _, _, _, r in rows:
        q = len(r) // 4
        print(f"   speedup at {s:.0%}: quartiles of the {len(r)} token pairs {r[q]:.2f} .. {r[3 * q]:.2f}x")
    print(f"load average during the runs: {', '.join(f'{x:.1f}' for x in loads)} (this benchmark itself counts 1-2; "
          "more means other processes share the cores, and every figure above is lower and noisier)")


if __name__ == "__main__":
    main()
