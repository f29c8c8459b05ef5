"""Benchmark: the serving engine's single-stream decode speed against llama.cpp on the same GGUF.

Single-stream greedy decode tokens/s, EOS ignored, same prompt token ids, same thread count, in one process:
our `Engine` (weights of SmolLM2-135M-Instruct.Q4_1.gguf dequantized to `--dtype`, `threads=--threads`) vs
llama.cpp through `llama-cpp-python` (`n_threads = n_threads_batch = --threads`; llama.cpp is also run with 1
thread, since our engine spends most of a decode step single-threaded and on a shared 2-core machine llama.cpp's
2-thread barriers can collapse; both ratios are printed). Both decode rates are (N - 1) / (t(N) - t(1)), so
prefill, the first token and setup cancel out (t(1) is the median of 3 short runs). Each repeat runs
llama.cpp float (each thread count), ours, llama.cpp Q4_1 (each thread count), ours; medians are reported.

a. Matching precision (the comparison): our engine computes with the dequantized weights in float32 (default;
   its MKL-packed fast path) or bfloat16. The same dequantized weights are written, once, as an F32 or BF16
   GGUF (metadata and tokenizer copied; Q/K rows kept in llama.cpp's own rotary layout, as stored) under
   ~/.cache/waferscale/gguf/, checked to be bit-identical to our model's weights (by loading it back with
   `load_gguf`), and llama.cpp runs on it with its KV cache in the same dtype.
b. Reference: llama.cpp on the original file (Q4_1 matrices + Q8_0 embedding, F16 KV cache, llama.cpp's
   defaults): about 5.6x fewer weight bytes per token, so a different problem, printed for context.

For each: llama.cpp tok/s, ours tok/s, ratio ours / llama.cpp, and each system's fraction of the
memory-bandwidth bound (copy bandwidth, read + write as in serve_decode.py, / weight bytes read per token).
The greedy tokens of both systems are compared (float rounding may make them part after many tokens).

llama-cpp-python builds llama.cpp from source (CPU only, -march=native, so the wheel fits this CPU only; ~20 min
on 2 busy cores); the wheel is cached outside the repository and installed without letting pip touch torch:

    pip wheel llama-cpp-python --no-deps -w ~/.cache/waferscale/wheels
    pip install --no-deps ~/.cache/waferscale/wheels/llama_cpp_python-*.whl
    pip install --no-deps diskcache   # its other deps (numpy, jinja2, typing-extensions) are already here

    python bench/serve_llamacpp.py [--threads 2] [--new-tokens 128] [--repeats 3] [--dtype float32|bfloat16]
                                   [--peer-threads 2,1] [--skip-q4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_decode import MODEL, QUESTION, copy_bandwidth, ours_generate  # noqa: E402

from waferscale.data import load_tokenizer  # noqa: E402
from waferscale.errors import AssetError  # noqa: E402
from waferscale.models.gguf import load_gguf  # noqa: E402
from waferscale.models.pretrained import load_pretrained  # noqa: E402
from waferscale.serve.engine import Engine  # noqa: E402
from waferscale.util.assets import asset_path  # noqa: E402
from waferscale.util.files import atomic_path, atomic_write_json  # noqa: E402
from waferscale.util.gguf import read_gguf  # noqa: E402
from waferscale.util.paths import cache_dir  # noqa: E402

WHEELS = "~/.cache/waferscale/wheels"
INSTALL = (f"pip wheel llama-cpp-python --no-deps -w {WHEELS} && pip install --no-deps "
           f"{WHEELS}/llama_cpp_python-*.whl && pip install --no-deps diskcache")
CACHE = Path(os.environ.get("WAFERSCALE_GGUF_CACHE") or cache_dir() / "gguf").expanduser()
# GGML tensor types (ggml.h) and llama file types (llama.h) used below
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
FTYPE = {"float32": 0, "bfloat16": 32}  # LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_BF16
TAG = {"float32": "F32", "bfloat16": "BF16"}
CONVERTER_VERSION = 1


def source_gguf() -> Path:
    try:
        return asset_path(MODEL, "model")  # located, not imported: the package's __init__ imports `llm`
    except AssetError as e:
        raise SystemExit(str(e)) from None


def float_gguf(src: Path, dtype: str) -> Path:
    """The dequantized weights of `src` as an F32 / BF16 GGUF in CACHE (written once; rewritten when the source
    file changes). 2-D weights become `dtype` exactly as our loader makes them (dequantize -> float32 ->
    torch .to(dtype), round-to-nearest-even), 1-D ones (norms) stay F32 as llama.cpp's converter writes them;
    Q/K rows keep the file's (llama.cpp) layout. Metadata and tokenizer are copied unchanged."""
    import gguf
    from gguf.quants import dequantize

    out = CACHE / f"{src.name.removesuffix('.gguf')}.dequant-{TAG[dtype]}.gguf"
    st = src.stat()
    stamp = {"source": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": dtype,
             "converter": CONVERTER_VERSION}
    side = out.with_suffix(".json")
    if out.is_file() and side.is_file():
        try:
            if json.loads(side.read_text()) == stamp:
                return out
        except ValueError:
            pass
    CACHE.mkdir(parents=True, exist_ok=True)
    print(f"writing {out} (dequantized {src.name}, {TAG[dtype]}) ...", flush=True)
    reader = read_gguf(src)
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch=str(reader.fields["general.architecture"].contents()))
        for f in reader.fields.values():
            if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
                continue
            vtype = gguf.GGUFValueType(f.types[0])
            sub = gguf.GGUFValueType(f.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
        w.add_file_type(FTYPE[dtype])
        for t in reader.tensors:
            a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            a = a.reshape(tuple(int(s) for s in reversed(t.shape)))  # (out, in) row-major, as our loader reads it
            if dtype == "bfloat16" and a.ndim >= 2:
                b = torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16).view(torch.uint8).numpy()
                w.add_tensor(t.name, b, raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                w.add_tensor(t.name, np.ascontiguousarray(a))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    atomic_write_json(side, stamp)
    return out


def check_same_weights(path: Path, model: torch.nn.Module) -> None:
    """The converted file, read back through our own GGUF loader (which undoes llama.cpp's Q/K layout), must
    give bit-for-bit the parameters our engine runs with."""
    dtype = next(model.parameters()).dtype
    other, _ = load_gguf(path, dtype=dtype)
    mine, theirs = model.state_dict(), other.state_dict()
    bad = [k for k in mine if k not in theirs or not torch.equal(mine[k], theirs[k])]
    if bad or mine.keys() != theirs.keys():
        raise SystemExit(f"{path}: weights differ from our model's ({bad[:4]}); delete it and rerun")


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of all tensors in the file: what a decode step reads (the tied embedding once, as the head)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


class LlamaCpp:
    """Greedy decode with llama.cpp: `Llama.eval` over the prompt, then one token at a time, next token =
    argmax of the last logits read in place (EOS never stops it: the same work as our engine's ignore_eos).
    Thread count switchable between runs (llama_set_n_threads)."""

    def __init__(self, path: Path, n_ctx: int, kv_type: int | None) -> None:
        import llama_cpp

        self._lc = llama_cpp
        kw = dict(model_path=str(path), n_threads=1, n_threads_batch=1, n_ctx=n_ctx, n_batch=n_ctx,
                  n_gpu_layers=0, verbose=False, seed=0)
        self.kv = "F16 (llama.cpp's default)"
        if kv_type is not None:
            try:
                self.llm = llama_cpp.Llama(**kw, type_k=kv_type, type_v=kv_type)
                self.kv = {GGML_F32: "F32", GGML_F16: "F16", GGML_BF16: "BF16"}[kv_type]
            except (ValueError, RuntimeError) as e:
                print(f"   (llama.cpp refused KV cache type {kv_type}: {e}; using its default)")
                self.llm = llama_cpp.Llama(**kw)
        else:
            self.llm = llama_cpp.Llama(**kw)
        self.n_vocab = self.llm.n_vocab()
        self.threads = 1

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

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)


def decode_rate(fn, n: int, short_runs: int = 3) -> tuple[float, list[int]]:
    """(n - 1) / (t(n) - t(1)), as serve_decode.decode_rate, but t(1) (prefill + first token, a short run that
    one scheduler hiccup on a shared machine can double) is the median of `short_runs` runs."""
    t1 = statistics.median(fn(1)[0] for _ in range(short_runs))
    tn, toks = fn(n)
    return ((n - 1) / (tn - t1) if tn > t1 else float("nan")), toks


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2,
                    help="thread count of both: llama.cpp n_threads / n_threads_batch, our Engine's `threads`")
    ap.add_argument("--engine-threads", type=int, default=None, help="override our Engine's `threads`")
    ap.add_argument("--peer-threads", default=None,
                    help="comma-separated llama.cpp thread counts to run (default: --threads, and 1 as well)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="our compute dtype, and the float GGUF written for llama.cpp to match it")
    ap.add_argument("--show-tokens", type=int, default=24, help="greedy tokens of each system to print")
    ap.add_argument("--skip-q4", action="store_true", help="skip the llama.cpp-on-Q4_1 reference")
    a = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print(f"llama_cpp is not importable; build and install llama-cpp-python (CPU) with: {INSTALL}")
        sys.exit(2)

    torch.set_num_threads(a.threads)
    engine_threads = a.engine_threads or a.threads
    peer_threads = ([int(x) for x in a.peer_threads.split(",")] if a.peer_threads
                    else list(dict.fromkeys([a.threads, 1])))
    dtype = getattr(torch, a.dtype)
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, llama-cpp-python "
          f"{getattr(llama_cpp, '__version__', '?')}, {a.threads} threads; load average at start "
          f"{os.getloadavg()[0]:.2f} (other processes share these cores)")

    src = source_gguf()
    model = load_pretrained(MODEL).to(dtype)
    tok = load_tokenizer(MODEL)
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    prompt = tok.encode(text)
    n = a.new_tokens
    ours_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied head counted once
    fpath = float_gguf(src, a.dtype)
    check_same_weights(fpath, model)
    nbytes = {"float": gguf_weight_bytes(fpath), "q4_1": gguf_weight_bytes(src)}

    engine = Engine(model, tok, kv_cache_mb=256, threads=engine_threads)
    n_ctx = max(512, -(-(len(prompt) + n + 8) // 256) * 256)
    peers = {"float": LlamaCpp(fpath, n_ctx, GGML_F32 if a.dtype == "float32" else GGML_BF16)}
    if not a.skip_q4:
        peers["q4_1"] = LlamaCpp(src, n_ctx, None)
    name = {"float": f"llama.cpp {TAG[a.dtype]}", "q4_1": "llama.cpp Q4_1"}
    peer_tok = peers["float"].tokenize(text)
    print(f"model: {MODEL}; prompt {len(prompt)} tokens (llama.cpp's own tokenizer "
          f"{'agrees' if peer_tok == prompt else 'DIFFERS: ' + str(peer_tok[:12])}; both are fed our ids), "
          f"{n} new tokens, greedy, EOS ignored")
    print(f"ours:      wsc Engine, {a.dtype}, fast_linear={engine.fast_linear}, threads={engine_threads}; "
          f"{ours_bytes / 1e6:.0f} MB of weights per token")
    print(f"matching:  llama.cpp on {fpath}: {nbytes['float'] / 1e6:.0f} MB per token, the same weights bit for "
          f"bit; KV cache {peers['float'].kv}")
    if "q4_1" in peers:
        print(f"reference: llama.cpp on {src.name}: {nbytes['q4_1'] / 1e6:.0f} MB per token; KV cache "
              f"{peers['q4_1'].kv}")
    print(f"llama.cpp n_threads (= n_threads_batch) runs: {', '.join(map(str, peer_threads))}")

    # warm-up all
    ours_generate(engine, prompt, 8)
    for p in peers.values():
        for t in peer_threads:
            p.set_threads(t)
            p.generate(prompt, 8)
    rates: dict[tuple[str, int], list[float]] = {}
    ours_rates: list[float] = []
    toks: dict[tuple[str, int], list[int]] = {}
    ours_toks: list[int] = []
    for _ in range(a.repeats):
        for k, p in peers.items():  # per repeat: llama.cpp float (each thread count), ours, llama.cpp Q4_1, ours
            for t in peer_threads:
                p.set_threads(t)
                r, toks[k, t] = decode_rate(lambda m, p=p: p.generate(prompt, m), n)
                rates.setdefault((k, t), []).append(r)
            r, ours_toks = decode_rate(lambda m: ours_generate(engine, prompt, m), n)
            ours_rates.append(r)
    med = {key: statistics.median(v) for key, v in rates.items()}
    ours = statistics.median(ours_rates)
    bw = copy_bandwidth()
    engine.close()

    def row(label: str, r: float, nb: int, runs: list[float]) -> str:
        return (f"   {label:34s} {r:8.2f} tok/s   {r * nb / bw:6.1%} of its bound ({bw / nb:6.1f} tok/s)   runs: "
                f"{', '.join(f'{x:.2f}' for x in runs)}")

    print(f"\nsingle-stream decode tok/s, medians of {a.repeats} (ours: {len(ours_rates)}) runs; bound = copy "
          f"bandwidth {bw / 1e9:.2f} GB/s (read + write, as serve_decode.py) / weight bytes per token")
    print(row(f"ours ({a.dtype}, threads={engine_threads})", ours, ours_bytes, ours_rates))
    for (k, t), r in med.items():
        print(row(f"{name[k]} GGUF, n_threads={t}", r, nbytes[k], rates[k, t]))
    for k, what in (("float", f"a. matching precision ({TAG[a.dtype]} weights in both, bit-identical)"),
                    ("q4_1", f"b. reference only: llama.cpp on Q4_1 ({nbytes['q4_1'] / 1e6:.0f} vs "
                             f"{ours_bytes / 1e6:.0f} MB per token)")):
        if k not in peers:
            continue
        best = max(peer_threads, key=lambda t: med[k, t])
        line = f"\n   {what}:\n      ours / llama.cpp"
        if a.threads in peer_threads:
            line += f" at the same {a.threads} threads = {ours / med[k, a.threads]:.2f}x"
        if best != a.threads:
            line += f"; against llama.cpp's best here (n_threads={best}) = {ours / med[k, best]:.2f}x"
        elif len(peer_threads) > 1:
            line += " (its best thread count here)"
        print(line + ("   (goal: >= 1.00x)" if k == "float" else "   (not like for like)"))

    k_show = min(a.show_tokens, n)
    print(f"\ngreedy tokens, first {k_show} of {n}:")
    print(f"   {'ours':28s} {tok.decode(ours_toks[:k_show])!r}")
    for (k, t), ids in toks.items():
        if t == peer_threads[0]:
            print(f"   {name[k] + f' n_threads={t}':28s} {tok.decode(ids[:k_show])!r}")
    for (k, t), ids in toks.items():
        d = first_divergence(ours_toks, ids)
        print(f"   ours vs {name[k]} n_threads={t}: "
              + ("all agree" if d == n else f"agree for the first {d}, then diverge") + f" ({d} of {n})")
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
