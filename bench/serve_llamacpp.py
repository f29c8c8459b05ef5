"""Benchmark: the serving engine against llama.cpp on the same GGUF files, each in the file's own precision.

Files: SmolLM2-135M-Instruct.Q4_1.gguf (llama.cpp's own: Q4_1 matrices, Q8_0 embedding and tied head) and a
Q8_0 file made from it by our `wsc export --format gguf --dtype q8_0` (serve/export_gguf.py; written once under
~/.cache/waferscale/gguf/). `--formats` adds fp32 / bf16 files made the same way.

Per file, in one process, same thread count (`--threads`: llama.cpp n_threads = n_threads_batch, our Engine's
C kernel pool and torch threads), llama.cpp's default F16 KV cache, ours float32:
- single-stream greedy decode, EOS ignored, the same prompt ids: (N - 1) / (t(N) - t(1)), so prefill, the first
  token and setup cancel (t(1) the median of 3 short runs);
- prefill of a `--prefill` token prompt (a held-out Shakespeare passage): prompt tokens / time to the first
  token (prefix caching off in ours, llama.cpp's KV cleared).
Rounds alternate llama.cpp, ours, for each file and measure; medians of `--repeats` rounds are reported.
llama.cpp also runs with 1 thread (`--peer-threads`): on a shared 2-core machine its 2-thread barriers can
collapse (single runs of ~2 tok/s), so the ratio against its best thread count is printed too.

Decode reads every weight once per token: the bound is the machine's copy bandwidth (read + write, huge pages,
as bench/serve_decode.py measures it, once per round, the median) over the file's tensor bytes (the tied embedding
once: it is the head); each decode figure is printed with its fraction of that bound (each round's rate over
its own round's bound, the median of those: the copy bandwidth of this shared VM moves by 2x between rounds).
Prefill reads the weights once per prompt and is compute-bound: no bytes bound is printed for it.

Ours runs the kernels' default products (serve/quant.py: Q8_0 / Q4_0 / Q4_1 round activations to int8 per
block of 32 as llama.cpp does), so greedy tokens may part from llama.cpp's after a while; the first divergence
is printed.

llama-cpp-python builds llama.cpp from source (CPU only, -march=native; ~20 min on 2 busy cores); the wheel is
cached outside the repository and installed without letting pip touch torch:

    pip wheel llama-cpp-python --no-deps -w ~/.cache/waferscale/wheels
    pip install --no-deps ~/.cache/waferscale/wheels/llama_cpp_python-*.whl
    pip install --no-deps diskcache   # its other deps (numpy, jinja2, typing-extensions) are already here

    python bench/serve_llamacpp.py [--threads 2] [--new-tokens 128] [--prefill 512] [--repeats 5]
                                   [--formats q4_1,q8_0] [--isa x86-64-v3 --llama-lib DIR]

`--isa` runs both engines at one instruction-set level (bench/isa_level.py: ours built for it, llama.cpp from a
library built for it), printed in every table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import isa_level  # noqa: E402
from serve_decode import MODEL, QUESTION, copy_bandwidth, ours_generate  # noqa: E402

from waferscale.data import load_tokenizer  # noqa: E402
from waferscale.data.corpus import held_out_shakespeare_passage  # noqa: E402
from waferscale.errors import AssetError  # noqa: E402
from waferscale.models.pretrained import load_pretrained  # noqa: E402
from waferscale.serve.engine import Engine  # noqa: E402
from waferscale.serve.export_gguf import export_gguf  # noqa: E402
from waferscale.serve.sampling import SamplingParams  # noqa: E402
from waferscale.util.assets import asset_path  # noqa: E402
from waferscale.util.paths import cache_dir  # noqa: E402

WHEELS = "~/.cache/waferscale/wheels"
INSTALL = (f"pip wheel llama-cpp-python --no-deps -w {WHEELS} && pip install --no-deps "
           f"{WHEELS}/llama_cpp_python-*.whl && pip install --no-deps diskcache")
CACHE = Path(os.environ.get("WAFERSCALE_GGUF_CACHE") or cache_dir() / "gguf").expanduser()


def source_gguf() -> Path:
    try:
        return asset_path(MODEL, "model")  # located, not imported: the package's __init__ imports `llm`
    except AssetError as e:
        raise SystemExit(str(e)) from None


def format_file(src: Path, fmt: str) -> Path:
    """`src` itself for its own format (q4_1), else `wsc export --format gguf --dtype fmt` of it in CACHE
    (rewritten when older than the source)."""
    if fmt == "q4_1":
        return src
    out = CACHE / f"{src.name.removesuffix('.Q4_1.gguf')}.{fmt.upper()}.from-Q4_1.gguf"
    if not out.is_file() or out.stat().st_mtime < src.stat().st_mtime:
        CACHE.mkdir(parents=True, exist_ok=True)
        print(f"writing {out} (wsc export --format gguf --dtype {fmt} of {src.name}) ...", flush=True)
        export_gguf(src, out, fmt)
    return out


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of all tensors in the file: what a decode step reads (the tied embedding once, as the head)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


class LlamaCpp:
    """Greedy decode with llama.cpp: `Llama.eval` over the prompt, then one token at a time, next token =
    argmax of the last logits read in place (EOS never stops it: the same work as our engine's ignore_eos)."""

    def __init__(self, path: Path, n_ctx: int, threads: int) -> None:
        import llama_cpp

        self._lc = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                   n_batch=n_ctx, n_gpu_layers=0, verbose=False, seed=0)
        self.n_vocab = self.llm.n_vocab()
        self.threads = threads

    def set_threads(self, n: int) -> None:
        if n != self.threads:
            self._lc.llama_set_n_threads(self.llm.ctx, n, n)
            self.threads = n

    def _next(self) -> int:
        # Llama.eval (logits_all=False) leaves the logits in the context, not in `scores`: read them in place
        logits = np.ctypeslib.as_array(self._lc.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def generate(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        llm = self.llm
        t = time.perf_counter()
        llm.reset()
        llm.eval(prompt)  # drops the previous run's KV (seq_rm from position 0) and prefills
        out = [self._next()]
        while len(out) < n:
            llm.eval([out[-1]])
            out.append(self._next())
        return time.perf_counter() - t, out


def decode_rate(fn, n: int, short_runs: int = 3) -> tuple[float, list[int]]:
    """(n - 1) / (t(n) - t(1)); t(1) (prefill + first token, a short run that one scheduler hiccup on a shared
    machine can double) is the median of `short_runs` runs."""
    t1 = statistics.median(fn(1)[0] for _ in range(short_runs))
    tn, toks = fn(n)
    return ((n - 1) / (tn - t1) if tn > t1 else float("nan")), toks


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="threads of both (llama.cpp n_threads and "
                                                           "n_threads_batch; our kernels' pool and torch)")
    ap.add_argument("--peer-threads", default=None,
                    help="comma-separated llama.cpp thread counts (default: --threads, and 1 as well)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill comparison")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--formats", default="q4_1,q8_0", help="comma-separated: q4_1 (the file), q8_0, q4_0, bf16, "
                                                           "fp32 (made from it by wsc export)")
    ap.add_argument("--show-tokens", type=int, default=24, help="greedy tokens of each system to print")
    isa_level.add_arguments(ap, peer=True)
    a = ap.parse_args()
    isa_level.apply(a)
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError):
        print(f"llama_cpp is not importable; build and install llama-cpp-python (CPU) with: {INSTALL}")
        sys.exit(2)

    torch.set_num_threads(a.threads)
    peer_threads = ([int(x) for x in a.peer_threads.split(",")] if a.peer_threads
                    else list(dict.fromkeys([a.threads, 1])))
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, llama-cpp-python "
          f"{getattr(llama_cpp, '__version__', '?')}, {a.threads} threads; load average at start "
          f"{os.getloadavg()[0]:.2f} (other processes share these cores)")
    src = source_gguf()
    tok = load_tokenizer(MODEL)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    long_prompt = tok.encode(held_out_shakespeare_passage(6 * a.prefill))[:a.prefill]
    if len(long_prompt) < a.prefill:
        raise SystemExit(f"the held-out passage gives only {len(long_prompt)} tokens; lower --prefill")
    n = a.new_tokens
    n_ctx = max(1024, -(-(a.prefill + n + 8) // 256) * 256)
    formats = a.formats.split(",")
    files = {f: format_file(src, f) for f in formats}
    nbytes = {f: gguf_weight_bytes(p) for f, p in files.items()}
    ours, peers = {}, {}
    for f, path in files.items():
        model = load_pretrained(path, keep_quantized=True)
        ours[f] = Engine(model, tok, kv_cache_mb=256, threads=a.threads, decode_threads=a.threads,
                         enable_prefix_caching=False)
        peers[f] = LlamaCpp(path, n_ctx, a.threads)
        print(f"{f}: {path} ({nbytes[f] / 1e6:.1f} MB of tensors read per decode token); ours: C kernels "
              f"{ours[f].c_kernels}, one-call layer stack {ours[f]._runner.stack is not None}")
    level = isa_level.level(peer=True)
    print(level)
    print(f"decode: prompt {len(prompt)} tokens, {n} new tokens, greedy, EOS ignored; prefill: {len(long_prompt)} "
          f"tokens; {a.repeats} alternating rounds")

    def prefill_time(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for f in formats:  # warm-up
        ours_generate(ours[f], prompt, 8)
        for t in peer_threads:
            peers[f].set_threads(t)
            peers[f].generate(prompt, 8)
    runs: dict[tuple[str, str, str], list[float]] = {}
    toks: dict[tuple[str, str], list[int]] = {}
    bws = []
    for _ in range(a.repeats):
        bws.append(copy_bandwidth())  # measured every round: a shared host's bandwidth drifts
        for f in formats:
            systems = [(f"llama.cpp/{t}", t) for t in peer_threads] + [("ours", None)]
            for who, t in systems:
                if t is not None:
                    peers[f].set_threads(t)
                fn = (lambda m, f=f: peers[f].generate(prompt, m)) if t else (
                    lambda m, f=f: ours_generate(ours[f], prompt, m))
                r, toks[f, who] = decode_rate(fn, n)
                runs.setdefault((f, who, "decode"), []).append(r)
            for who, t in systems:
                if t is not None:
                    peers[f].set_threads(t)
                fn = (lambda f=f: peers[f].generate(long_prompt, 1)) if t else (
                    lambda f=f: ours[f].generate([long_prompt], one))
                runs.setdefault((f, who, "prefill"), []).append(len(long_prompt) / prefill_time(fn))
    bw = statistics.median(bws)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"\nmedians of {a.repeats} rounds, tokens/s; decode bound = copy bandwidth {bw / 1e9:.2f} GB/s (read + "
          "write, huge pages, as serve_decode.py; the median of one measurement per round: "
          f"{', '.join(f'{b / 1e9:.1f}' for b in bws)}) / tensor bytes per token")
    for f in formats:
        print(f"\n{f} ({nbytes[f] / 1e6:.1f} MB per token, bound {bw / nbytes[f]:.1f} tok/s; {level}):")
        for what in ("decode", "prefill"):
            for who in [f"llama.cpp/{t}" for t in peer_threads] + ["ours"]:
                r = med[f, who, what]
                # each round's rate against the bandwidth measured in that round, the median of those
                frac = statistics.median(x * nbytes[f] / b for x, b in zip(runs[f, who, what], bws))
                bound = f"   {frac:6.1%} of the bound" if what == "decode" else " " * 22
                label = f"llama.cpp n_threads={who.split('/')[1]}" if "/" in who else f"ours threads={a.threads}"
                print(f"   {what:8s} {label:22s} {r:9.1f}{bound}   runs: "
                      + ", ".join(f"{x:.1f}" for x in runs[f, who, what]))
            best = max(peer_threads, key=lambda t: med[f, f"llama.cpp/{t}", what])
            ours_r = med[f, "ours", what]
            line = f"   {what:8s} ours / llama.cpp"
            if a.threads in peer_threads:
                line += f" at the same {a.threads} threads = {ours_r / med[f, f'llama.cpp/{a.threads}', what]:.2f}x"
            print(line + f"; against its best here (n_threads={best}) = "
                  f"{ours_r / med[f, f'llama.cpp/{best}', what]:.2f}x")
        d = first_divergence(toks[f, "ours"], toks[f, f"llama.cpp/{peer_threads[0]}"])
        k = min(a.show_tokens, n)
        print(f"   greedy tokens agree for {d} of {n}; first {k}: ours {tok.decode(toks[f, 'ours'][:k])!r}")
        if d < k:
            print(f"   {'':33s}llama.cpp {tok.decode(toks[f, f'llama.cpp/{peer_threads[0]}'][:k])!r}")
    for e in ours.values():
        e.close()
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
