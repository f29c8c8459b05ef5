"""Benchmark: aggregate decode throughput of 16 concurrent streaming users through the HTTP server (`wsc serve`,
continuous batching) against Hugging Face `transformers` batched `generate` on the same machine.

Same model (SmolLM2-135M-Instruct, the GGUF asset; `wsc serve` runs it in the file's own precision, Q4_1 with a
Q8_0 embedding, as a user gets it by default; transformers runs it dequantized to float32, exported once as a HF
directory, since it has no Q4_1 CPU kernels), same 16 prompts as token ids, greedy, `ignore_eos`, the same number of
new tokens per user, the same torch thread count. The two sides run one after the other, never at once,
alternating for `--repeats` rounds (default 3): this VM's speed drifts by +-10% over minutes, so each side's
figures are the median round, and the ratio is of the medians.

Ours: a real server process on loopback; 16 asyncio clients stream /v1/completions (SSE) at the same
moment, on aiohttp as vLLM's serving benchmark does (the clients share the VM's two cores with the server: httpx
measured 0.24 core-seconds per 2,048 streamed tokens, aiohttp 0.10). Aggregate tokens/s = all completion tokens
/ wall time from the first request to the last [DONE]; time to first token (TTFT) and inter-token latency
(ITL) are measured by the clients, p50/p99 over users / over every gap. Peer: one left-padded batch of 16
through `model.generate(max_new_tokens=N, min_new_tokens=N, do_sample=False)`; tokens/s = 16 N / wall time (its
TTFT is the whole batch's prefill + first step, its ITL the mean decode step, as it streams nothing).

    python bench/serve_http.py [--users 16] [--new-tokens 128] [--threads 2] [--repeats 3] [--isa x86-64-v3]
                               [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import isa_level  # (bench/, beside this file)
import torch

TOPICS = ["the ocean", "a lighthouse keeper", "quantum computers", "bread baking", "the moon landing",
          "honeybees", "a chess tournament", "volcanoes", "the printing press", "a jazz club", "glaciers",
          "an old library", "electric cars", "the Silk Road", "a mountain village", "desert plants"]


def prompts(tok, users: int) -> list[list[int]]:
    out = []
    for i in range(users):
        msgs = [{"role": "user", "content": f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}."}]
        out.append(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True)))
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


# ---- ours: the HTTP server -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_user(session, base: str, ids: list[int], n: int, model: str) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with session.post(base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:  # one SSE line at a time
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    return {"t0": t0, "times": times, "tokens": tokens, "end": time.perf_counter()}


async def run_clients(base: str, ps: list[list[int]], n: int, model: str) -> list[dict]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)  # every user its own connection, at once
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await one_user(session, base, ps[0], 4, model)  # warm-up (first-call overheads)
        return await asyncio.gather(*(one_user(session, base, p, n, model) for p in ps))


def bench_server(a, ps: list[list[int]], rounds: int) -> list[dict]:
    """One server process; `rounds` measured rounds of all users (after a one-user warm-up)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)}
    log = open(Path(tempfile.gettempdir()) / f"wsc-bench-serve-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "waferscale.serve.server", "--model", a.model, "--port",
                             str(port), "--max-num-seqs", str(max(64, a.users))], stdout=log, stderr=subprocess.STDOUT,
                            env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited ({proc.returncode}); see {log.name}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("server did not start in 300 s")
            time.sleep(0.3)
        return [summarize(a, asyncio.run(run_clients(base, ps, a.new_tokens, a.model))) for _ in range(rounds)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def summarize(a, res: list[dict]) -> dict:
    t_start = min(r["t0"] for r in res)
    t_end = max(r["end"] for r in res)
    tokens = sum(r["tokens"] for r in res)
    assert all(r["tokens"] == a.new_tokens for r in res), [r["tokens"] for r in res]
    ttft = [r["times"][0] - r["t0"] for r in res]
    itl = [b - x for r in res for x, b in zip(r["times"], r["times"][1:])]
    return {"tokens_per_s": tokens / (t_end - t_start), "wall_s": t_end - t_start, "tokens": tokens,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99)}


# ---- peer: transformers batched generate ---------------------------------------------------------------------
def load_transformers(a, tok):
    import transformers

    from waferscale.models.hf import save_hf_dir
    from waferscale.models.pretrained import load_pretrained

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as d:
        save_hf_dir(load_pretrained(a.model, dtype=torch.float32), d, tokenizer=tok)
        return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def bench_transformers(a, ps: list[list[int]], tok, model) -> dict:
    torch.set_num_threads(a.threads)
    pad = tok.eos_id if tok.eos_id is not None else 0
    width = max(len(p) for p in ps)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=pad, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False, pad_token_id=pad)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        first = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, **kw)
        wall = time.perf_counter() - t
    n = (out.shape[1] - width) * len(ps)
    return {"tokens_per_s": n / wall, "wall_s": wall, "tokens": n, "ttft_p50": first, "ttft_p99": first,
            "itl_p50": (wall - first) / max(1, a.new_tokens - 1), "itl_p99": float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds of each side (median reported)")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    isa_level.add_arguments(ap, peer=False)
    a = ap.parse_args()
    isa_level.apply(a)  # (the server process inherits WSC_KERNEL_MARCH)

    from waferscale.data import load_tokenizer

    tok = load_tokenizer(a.model)
    ps = prompts(tok, a.users)
    print(f"serve_http: {a.model} (ours: the file's precision; transformers: float32), {a.users} users x {a.new_tokens} new tokens (greedy, ignore_eos), "
          f"prompts {min(map(len, ps))}-{max(map(len, ps))} tokens, {a.threads} threads", flush=True)
    if a.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    hf = load_transformers(a, tok)
    ours_all, peer_all = [], []
    for i in range(a.repeats):  # alternate: one server round, one transformers round
        ours_all += bench_server(a, ps, 1)
        peer_all.append(bench_transformers(a, ps, tok, hf))
        print(f"round {i + 1}: ours {ours_all[-1]['tokens_per_s']:.1f} tokens/s, transformers "
              f"{peer_all[-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    median = lambda rs: sorted(rs, key=lambda r: r["tokens_per_s"])[(len(rs) - 1) // 2]  # noqa: E731
    ours, peer = median(ours_all), median(peer_all)
    ms = lambda s: f"{s * 1e3:8.1f} ms"  # noqa: E731
    print(isa_level.level() + " (the server's; transformers: torch's own kernels)")
    print(f"{'':34s}{'tokens/s':>10s}{'wall':>9s}{'TTFT p50':>12s}{'TTFT p99':>12s}{'ITL p50':>12s}{'ITL p99':>12s}")
    for name, r in (("wsc serve (HTTP, 16 streams)", ours), ("transformers generate (batch 16)", peer)):
        print(f"{name:34s}{r['tokens_per_s']:10.1f}{r['wall_s']:8.1f}s{ms(r['ttft_p50'])}{ms(r['ttft_p99'])}"
              f"{ms(r['itl_p50'])}{ms(r['itl_p99']) if r['itl_p99'] == r['itl_p99'] else '         n/a'}")
    ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
    print(f"ratio (ours / transformers), aggregate tokens/s: {ratio:.2f}x  (targets: >= 4x at x86-64-v3; on AVX-512 "
          "VNNI no slower than b19465c's 5.8x)")
    if a.json:
        print(json.dumps({"ours": ours, "transformers": peer, "ratio": ratio, "rounds_ours": ours_all,
                          "rounds_transformers": peer_all}))


if __name__ == "__main__":
    main()
