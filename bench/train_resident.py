"""Benchmark: `wsc run` (resident execution) against a plain hand-written PyTorch loop (nanoGPT style).

Same model class and size, same batch, same data, same machine, same process, same thread count. Both
figures are wall-clock tokens/s over the timed steps (after warm-up), including data loading and the
loop's own bookkeeping; `wsc run` also writes metrics.jsonl every step and a checkpoint at the end
(the checkpoint is outside the timed window). Runs alternate (peer, ours, peer, ours, ...) and the median
of each side is reported.

    python bench/train_resident.py [--steps 60] [--warmup 10] [--repeats 2] [--model gpt-mini] ...
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from waferscale.params import params_from_dict
from waferscale.data import CharTokenizer, build_token_splits, read_documents
from waferscale.models import from_name, lm_loss
from waferscale.zoo.runner import RunOptions, run
from waferscale.util.paths import cache_dir


def params_dict(a: argparse.Namespace, model_dir: str) -> dict:
    return {
        "train_input": {"data_dir": "shakespeare", "tokenizer": "char", "batch_size": a.batch_size,
                        "max_sequence_length": a.seq_len, "shuffle": True, "shuffle_seed": 0},
        "model": {"name": a.model, "vocab_size": 256, "max_position_embeddings": a.seq_len,
                  "hidden_size": a.hidden, "num_hidden_layers": a.layers, "num_heads": a.heads,
                  "mixed_precision": False},
        "optimizer": {"optimizer_type": "AdamW", "learning_rate": a.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": 0.1, "max_gradient_norm": 1.0},
        "runconfig": {"max_steps": a.warmup + a.steps, "seed": 0, "log_steps": 1, "model_dir": model_dir},
    }


def ours(a: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as d:
        params = params_from_dict(params_dict(a, d), source="bench")
        run(params, RunOptions(mode="train", model_dir=Path(d), progress=False), out=io.StringIO())
        rows = [json.loads(ln) for ln in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    timed = rows[a.warmup:]  # steps warmup+1 .. end
    span = timed[-1]["elapsed_s"] - rows[a.warmup - 1]["elapsed_s"]
    return len(timed) * a.batch_size * a.seq_len / span


def peer(a: argparse.Namespace, train: np.ndarray) -> float:
    """The nanoGPT training loop, written out by hand."""
    torch.manual_seed(0)
    model = from_name(a.model, vocab_size=256, max_seq_len=a.seq_len, d_model=a.hidden, n_layer=a.layers,
                      n_head=a.heads)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(0)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = rng.integers(0, len(train) - a.seq_len - 1, a.batch_size)
        x = torch.from_numpy(np.stack([train[i:i + a.seq_len].astype(np.int64) for i in ix]))
        y = torch.from_numpy(np.stack([train[i + 1:i + 1 + a.seq_len].astype(np.int64) for i in ix]))
        return x, y

    model.train()
    t0 = 0.0
    for it in range(a.warmup + a.steps):
        if it == a.warmup:
            t0 = time.perf_counter()
        x, y = get_batch()
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # what a loop that logs every step does
    return a.steps * a.batch_size * a.seq_len / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()

    docs = read_documents("shakespeare")
    tok = CharTokenizer.from_text("".join(docs))
    train = build_token_splits(docs, tok, cache_dir() / "tokens", val_fraction=0.05, progress=False).train
    n = from_name(a.model, vocab_size=256, max_seq_len=a.seq_len, d_model=a.hidden, n_layer=a.layers,
                  n_head=a.heads, device="meta").config.num_params
    print(f"model {a.model} {a.layers}x{a.hidden} ({n / 1e6:.1f}M params), batch {a.batch_size}x{a.seq_len}, "
          f"{a.steps} timed steps after {a.warmup} warm-up, {torch.get_num_threads()} threads, torch {torch.__version__}")
    peer_runs, our_runs = [], []
    for r in range(a.repeats):
        peer_runs.append(peer(a, train))
        our_runs.append(ours(a))
        print(f"  repeat {r + 1}: plain loop {peer_runs[-1]:,.0f} tok/s | wsc run {our_runs[-1]:,.0f} tok/s")
    p, o = statistics.median(peer_runs), statistics.median(our_runs)
    print(f"plain PyTorch loop : {p:,.0f} tokens/s")
    print(f"wsc run (resident) : {o:,.0f} tokens/s")
    print(f"ratio wsc/plain    : {o / p:.3f}  (target >= 0.95)")


if __name__ == "__main__":
    main()
