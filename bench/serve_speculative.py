"""Benchmark: prompt-lookup speculative decoding on an input-grounded task, with and without, same engine code.

The task: SmolLM2-135M-Instruct, chat template, "Rewrite this passage, fixing the typos" and a ~150-word passage
with typos; greedy, up to --new-tokens, EOS ends it. Two engines over the same weights in one process, one
with `speculative=NgramSpeculation(K, --lookup-max, --lookup-min)` (`wsc serve --speculative ngram
--num_speculative_tokens K`), one without; prefix caching off in both (each round prefills the prompt again).
Rounds alternate (plain, speculative, ...); medians are reported of

- decode tokens/s: (N - 1) / (time of the last token - time of the first), so the prefill and the first token
  (which speculation does not change) cancel out;
- end to end tokens/s: N / the request's whole time, prefill included;

and their ratio, speculative / plain, the acceptance (accepted / drafted tokens) and the tokens emitted per
verification step. The generated token ids must be identical with and without speculation (greedy); the bench
says so, or prints where they part.

    python bench/serve_speculative.py [--threads 2] [--k 6] [--lookup-max 5] [--lookup-min 3] [--repeats 5]
                                      [--new-tokens 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from waferscale.data import load_tokenizer
from waferscale.models.pretrained import load_pretrained
from waferscale.serve.engine import Engine, SamplingParams
from waferscale.serve.speculative import NgramSpeculation

MODEL = "smollm2-135m-instruct"
PASSAGE = (
    "The lighthouse stood at the edge of the cliff for more then two hundred years. Every night the keeper "
    "climbed the narow stairs to light the lamp, and every morning he wrote the wether in a small leather "
    "book. Ships pased the rocks safely becuase of his work, and the sailors who never met him still "
    "trusted his light. One winter a storm broke the big window at the top of the tower, and the keeper "
    "spent three days repairing it with wood and glas from the village. When the lamp shone again, the "
    "fishermen rang the church bell to thank him, and the keeper smiled, because he knew that the sea was "
    "a litle safer that night.")
TASK = "Rewrite this passage, fixing the typos. Answer with the corrected passage only.\n\n" + PASSAGE


def run_once(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], float, float, dict]:
    """One greedy request: (token ids, decode tokens/s, end-to-end tokens/s, speculation counts of the run)."""
    before = engine.stats()
    t0 = time.perf_counter()
    engine.add_request("bench", prompt, SamplingParams(temperature=0, max_tokens=n))
    toks: list[int] = []
    t_first = t_last = t0
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids:
                if not toks:
                    t_first = time.perf_counter()
                toks.extend(o.new_token_ids)
                t_last = time.perf_counter()
    after = engine.stats()
    spec = {k: after[k] - before[k] for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens",
                                              "steps") if k in after}
    decode = (len(toks) - 1) / (t_last - t_first) if len(toks) > 1 and t_last > t_first else float("nan")
    return toks, decode, len(toks) / (t_last - t0), spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=6, help="--num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=5, help="--prompt_lookup_max")
    ap.add_argument("--lookup-min", type=int, default=3, help="--prompt_lookup_min")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=256)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    spec = NgramSpeculation(a.k, a.lookup_max, a.lookup_min)
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {a.threads} threads; load average at start "
          f"{os.getloadavg()[0]:.2f} (other processes share these cores)")
    model = load_pretrained(MODEL)
    tok = load_tokenizer(MODEL)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": TASK}], add_generation_prompt=True))
    kw = dict(kv_cache_mb=256, enable_prefix_caching=False)
    engines = {"plain": Engine(model, tok, **kw), "speculative": Engine(model, tok, speculative=spec, **kw)}
    print(f"model: {MODEL}, float32, fast_linear={engines['plain'].fast_linear}; prompt {len(prompt)} tokens; "
          f"greedy, at most {a.new_tokens} new tokens; speculation: ngram, K={spec.k}, n-grams {spec.min_n}.."
          f"{spec.max_n}")
    for e in engines.values():  # warm-up: kernels, packing, first-touch of the KV cache
        run_once(e, prompt, 8)
    res: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    toks: dict[str, list[int]] = {}
    counts: list[dict] = []
    for r in range(a.repeats):
        for name, e in engines.items():
            ids, dec, e2e, c = run_once(e, prompt, a.new_tokens)
            res[name].append((dec, e2e))
            if name == "speculative":
                counts.append(c)
            if name in toks and toks[name] != ids:
                print(f"  note: {name} round {r} gave different tokens from its first round")
            toks.setdefault(name, ids)
            print(f"  round {r} {name:>11}: {len(ids)} tokens, decode {dec:6.1f} tok/s, end to end {e2e:6.1f} tok/s"
                  + (f", {c['spec_accepted_tokens']}/{c['spec_draft_tokens']} drafted tokens accepted in "
                     f"{c['steps']} steps" if "spec_drafts" in c else ""))
    med = {name: (statistics.median(d for d, _ in v), statistics.median(e for _, e in v)) for name, v in res.items()}
    same = toks["plain"] == toks["speculative"]
    c = counts[0]
    print(f"\ntext: {tok.decode(toks['speculative'])!r}")
    print(f"identical tokens with and without speculation: {'yes' if same else 'NO'} "
          f"({len(toks['plain'])} vs {len(toks['speculative'])} tokens)")
    if not same:
        k = next((i for i, (x, y) in enumerate(zip(toks["plain"], toks["speculative"])) if x != y),
                 min(len(toks["plain"]), len(toks["speculative"])))
        print(f"  they part at token {k}: plain {toks['plain'][k:k + 5]}, speculative {toks['speculative'][k:k + 5]}")
    print(f"acceptance: {c['spec_accepted_tokens']}/{c['spec_draft_tokens']} drafted tokens "
          f"({c['spec_accepted_tokens'] / max(1, c['spec_draft_tokens']):.0%}); "
          f"{(len(toks['speculative']) - 1) / max(1, c['steps'] - 1):.2f} tokens per decode step (the prefill step "
          "and its token excluded)")
    print(f"{'':>12} {'decode tok/s':>13} {'end to end tok/s':>17}   (medians of {a.repeats} alternating rounds)")
    for name, (d, e) in med.items():
        print(f"{name:>12} {d:13.1f} {e:17.1f}")
    print(f"{'ratio':>12} {med['speculative'][0] / med['plain'][0]:12.2f}x "
          f"{med['speculative'][1] / med['plain'][1]:16.2f}x   (target >= 1.5x)")


if __name__ == "__main__":
    main()
