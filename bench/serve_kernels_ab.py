"""A/B of two versions of the C kernels' source on the real single-stream decode, in one process.

This VM's memory bandwidth moves by up to 1.7x between runs, so two kernel versions measured in separate runs
cannot be told apart at the few-percent level. Here both versions are built (serve/kernels.py's build, from
each csrc directory) and loaded side by side; one engine (the same packed weights, KV cache and prompt)
decodes `--new-tokens` greedy tokens with A's kernels, then with B's, alternating which goes first, for
`--rounds` rounds. It prints each side's tokens/s per round and the median of the per-round ratios B / A.
Run it with A and B the same directory first: that ratio's distance from 1.00 is the noise (measured here:
1.009 and 1.018 over 40 and 10 rounds).

    python bench/serve_kernels_ab.py --a src/waferscale/serve/csrc --b /tmp/variant/csrc [--format q4_1]
                                     [--rounds 40] [--new-tokens 128]

The prompt, model file and engine settings are bench/serve_llamacpp.py's (its Q4_1 file, or the Q8_0 file it
makes). Both directories must hold the whole csrc (serve_kernels.c and what it includes) and share the
packed weights' layout (an A/B of a change to the packing is not meaningful here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_decode import MODEL, QUESTION, ours_generate  # noqa: E402
from serve_llamacpp import format_file, source_gguf  # noqa: E402

from waferscale.data import load_tokenizer  # noqa: E402
from waferscale.models.pretrained import load_pretrained  # noqa: E402
from waferscale.serve import kernels  # noqa: E402
from waferscale.serve.engine import Engine  # noqa: E402


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="csrc directory of version A")
    ap.add_argument("--b", required=True, help="csrc directory of version B")
    ap.add_argument("--format", default="q4_1", choices=["q4_1", "q8_0"])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for d in (a.a, a.b):
        if not (Path(d) / "serve_kernels.c").is_file():
            fail(f"{d}: no serve_kernels.c there; give a csrc directory (e.g. src/waferscale/serve/csrc)")
    if a.rounds < 1 or a.new_tokens < 2:
        fail("--rounds must be at least 1 and --new-tokens at least 2")
    torch.set_num_threads(a.threads)
    default_csrc = kernels._CSRC
    libs = []
    for d in (a.a, a.b):
        kernels._CSRC = Path(d).resolve()
        libs.append(kernels._build())
    kernels._CSRC = default_csrc
    kernels._lib = libs[0]
    tok = load_tokenizer(MODEL)
    eng = Engine(load_pretrained(format_file(source_gguf(), a.format), keep_quantized=True), tok, kv_cache_mb=256,
                 threads=a.threads, decode_threads=a.threads, enable_prefix_caching=False)
    for lib in libs:
        lib.wsc_set_threads(a.threads)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    n = a.new_tokens + 1
    rates: list[list[float]] = [[], []]
    for r in range(a.rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            kernels._lib = libs[i]
            ours_generate(eng, prompt, 4)  # (the other pool's workers have gone to sleep: wake this one's)
            t1 = ours_generate(eng, prompt, 1)[0]
            tn, _ = ours_generate(eng, prompt, n)
            rates[i].append((n - 1) / (tn - t1))
    for name, rs in zip("AB", rates):
        print(f"{name} ({a.a if name == 'A' else a.b}): median {statistics.median(rs):.1f} tok/s; rounds "
              + " ".join(f"{x:.0f}" for x in rs))
    ratio = statistics.median(b / x for x, b in zip(*rates))
    print(f"{a.format}, {a.rounds} rounds of {a.new_tokens} tokens: B / A per round, median {ratio:.3f}")


if __name__ == "__main__":
    main()
