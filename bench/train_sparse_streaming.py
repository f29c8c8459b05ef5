"""Benchmark: sparse weight streaming against dense, through `wsc run`, at weight densities 1.0 / 0.5 / 0.25 / 0.1
(static sparsity on the blocks' matrices), with one system and with two (SwarmX).

Per step, from metrics.jsonl: `bytes_streamed` (what the link moved: for a sparse unit its kept values plus the
bitmask index, one bit per weight) against `bytes_in` (the dense payloads the device computed with), and
`bytes_reduced` (the gradients sent back: the kept values only) against `bytes_out`. The expected ratio is
density x (the blocks' share of the bytes) + the dense units' share, plus the index: 1 bit per block weight, 1/32
of an fp32 weight (1/16 under half precision). Step time is the median over the timed steps of every round;
the rounds run the densities in turn, forward then backward, so that a change of load on a shared machine falls
on all of them alike. The dense run (density 1.0, no sparsity section) is the peer, in the same job.

    python bench/train_sparse_streaming.py [--layers 4] [--hidden 512] [--seq_len 128] [--batch_size 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
from pathlib import Path

import torch

from waferscale.models import from_name
from waferscale.params import params_from_dict
from waferscale.zoo.runner import RunOptions, run

DENSITIES = (1.0, 0.5, 0.25, 0.1)


def params_dict(a: argparse.Namespace, model_dir: str, density: float) -> dict:
    d = {
        "train_input": {"data_dir": "shakespeare", "tokenizer": "char", "batch_size": a.batch_size,
                        "max_sequence_length": a.seq_len, "shuffle": True, "shuffle_seed": 0},
        "model": {"name": "gpt-mini", "vocab_size": 256, "max_position_embeddings": a.seq_len,
                  "hidden_size": a.hidden, "num_hidden_layers": a.layers, "num_heads": a.heads,
                  "mixed_precision": False},
        "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": 0.1},
        "runconfig": {"max_steps": a.warmup + a.steps, "seed": 0, "log_steps": 1, "model_dir": model_dir},
    }
    if density < 1.0:
        d["sparsity"] = {"algorithm": "static", "sparsity": round(1.0 - density, 6)}
    return d


def measure(a: argparse.Namespace, density: float, num_csx: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        run(params_from_dict(params_dict(a, d, density), source="bench"),
            RunOptions(model_dir=Path(d), progress=False, execution="streaming", num_csx=num_csx), out=io.StringIO())
        rows = [json.loads(ln) for ln in (Path(d) / "metrics.jsonl").read_text().splitlines()][a.warmup:]
    last = rows[-1]
    steps_s = [b["elapsed_s"] - a_["elapsed_s"] for a_, b in zip(rows, rows[1:])]
    return {"streamed": last["bytes_streamed"], "dense_in": last["bytes_in"], "reduced": last["bytes_reduced"],
            "dense_out": last["bytes_out"], "steps_s": steps_s, "loss": last["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--num_csx", default="1,2")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    model = from_name("gpt-mini", vocab_size=256, max_seq_len=a.seq_len, d_model=a.hidden, n_layer=a.layers,
                      n_head=a.heads, device="meta")
    n = model.config.num_params
    block = sum(p.numel() for k, p in model.named_parameters() if k.startswith("blocks.") and p.ndim == 2)
    share = block / n
    print(f"gpt-mini {a.layers}x{a.hidden} ({n / 1e6:.1f}M params; the blocks' matrices, which go sparse, are "
          f"{share:.0%} of them), batch {a.batch_size}x{a.seq_len}, fp32 streaming, {a.steps} timed steps, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'num_csx':>7} {'density':>7} {'streamed MB':>11} {'dense MB':>8} {'ratio':>6} {'expect':>6} "
          f"{'reduced MB':>10} {'ratio':>6} {'step s':>7} {'x dense':>7}")
    for num_csx in (int(x) for x in a.num_csx.split(",")):
        runs: dict[float, dict] = {}
        for k in range(a.rounds):
            for density in DENSITIES if k % 2 == 0 else DENSITIES[::-1]:
                r = measure(a, density, num_csx)
                r["steps_s"] = runs.get(density, {}).get("steps_s", []) + r["steps_s"]
                runs[density] = r
        for r in runs.values():
            r["step_s"] = statistics.median(r["steps_s"])
        base = runs[1.0]
        for density, r in runs.items():
            expect = 1.0 if density == 1.0 else 1 - share + share * (density + 1 / 32)
            print(f"{num_csx:>7} {density:>7.2f} {r['streamed'] / 1e6:>11.2f} {r['dense_in'] / 1e6:>8.2f} "
                  f"{r['streamed'] / r['dense_in']:>6.3f} {expect:>6.3f} {r['reduced'] / 1e6:>10.2f} "
                  f"{r['reduced'] / r['dense_out']:>6.3f} {r['step_s']:>7.3f} {base['step_s'] / r['step_s']:>6.2f}x")


if __name__ == "__main__":
    main()
