"""Benchmark: the HDF5 loader's delivery (tokens/s of training batches) against what training consumes, on the demo
model (configs/gpt2_tiny_shakespeare.yaml) and on a 125M model (gpt3-125m, sequences of 2048).

For each model: Shakespeare is preprocessed (`waferscale.data.preprocess`) to its sequence length twice, stored as
`wsc data_preprocess` stores it (contiguous, memory-mapped) and as Model Zoo stores it (gzip, one example per
chunk). Loader: `HDF5Batches` as `wsc run` builds it (shuffled, the config's batch), timed over `--loader_batches`
batches after two, with no training beside it. Consumption: `wsc run` on the same files (the runner's loop with
this loader inside), tokens/s over the steps after the warm-up, from metrics.jsonl. The loader keeps up when the
ratio delivered / consumed is above 1 (it runs while the step computes only with num_workers > 0; with 0 its time
is part of each step).

    python bench/hdf5_loader.py [--device cpu] [--big_batch 1] [--big_steps 3] [--demo_steps 40]
    python bench/hdf5_loader.py --device cuda --big_batch 8 --big_steps 20   (the 125M model in bfloat16)
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

from waferscale.data.hdf5 import HDF5Batches, HDF5Examples
from waferscale.data.preprocess import preprocess
from waferscale.params import params_from_dict
from waferscale.zoo.runner import RunOptions, run

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def loader_rate(data_dir: Path, batch: int, n_batches: int, num_workers: int) -> float:
    """Tokens/s the loader delivers (x and y tensors ready), over n_batches after 2."""
    loader = HDF5Batches(HDF5Examples(data_dir), batch, shuffle=True, seed=0, num_workers=num_workers)
    for _ in range(2):
        next(loader)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        x, _ = next(loader)
    dt = time.perf_counter() - t0
    loader.close()
    return n_batches * x.numel() / dt


def train_rate(d: dict, model_dir: Path, warmup: int, device: str) -> float:
    """Tokens/s of `wsc run` over the steps after `warmup`."""
    run(params_from_dict(d, "bench"), RunOptions(model_dir=model_dir, device=device, execution="resident",
                                                 progress=False), out=io.StringIO())
    rows = [json.loads(ln) for ln in (model_dir / "metrics.jsonl").read_text().splitlines()]
    span = rows[-1]["elapsed_s"] - rows[warmup - 1]["elapsed_s"]
    batch, seq = d["train_input"]["batch_size"], d["train_input"]["max_sequence_length"]
    return (len(rows) - warmup) * batch * seq / span


def case(name: str, d: dict, tmp: Path, steps: int, warmup: int, a: argparse.Namespace) -> None:
    msl, batch = d["train_input"]["max_sequence_length"], d["train_input"]["batch_size"]
    rates = {}
    for storage, compression in (("contiguous", None), ("gzip", "gzip")):
        out = tmp / f"{name}-{storage}"
        preprocess([a.corpus], out, max_seq_length=msl, compression=compression, progress=False)
        rates[storage] = loader_rate(out, batch, a.loader_batches, d["train_input"].get("num_workers", 0))
    d["train_input"].update(data_dir=[str(tmp / f"{name}-contiguous")], data_processor="GptHDF5MapDataProcessor")
    d["runconfig"].update(max_steps=warmup + steps, checkpoint_steps=0)
    eaten = train_rate(d, tmp / f"{name}-run", warmup, a.device)
    print(f"{name}: batch {batch} x {msl} tokens on {a.device}")
    print(f"  training consumes     {eaten:14,.0f} tokens/s  ({steps} steps after {warmup})")
    for storage, r in rates.items():
        print(f"  loader delivers       {r:14,.0f} tokens/s  ({storage} files)  ratio {r / eaten:,.1f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--corpus", default="shakespeare", help="the text to preprocess (default: the builtin "
                    "Shakespeare corpus; or a directory of its .txt files)")
    ap.add_argument("--demo_steps", type=int, default=40)
    ap.add_argument("--big_steps", type=int, default=3)
    ap.add_argument("--big_batch", type=int, default=1)
    ap.add_argument("--loader_batches", type=int, default=200)
    ap.add_argument("--skip_big", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        demo = yaml.safe_load((CONFIGS / "gpt2_tiny_shakespeare.yaml").read_text())
        demo.pop("eval_input")
        case("demo (gpt2_tiny_shakespeare.yaml)", demo, tmp, a.demo_steps, 5, a)
        if not a.skip_big:
            big = {"train_input": {"data_dir": ["shakespeare"], "batch_size": a.big_batch, "max_sequence_length": 2048,
                                   "shuffle": True, "shuffle_seed": 0},
                   "model": {"name": "gpt3-125m", "vocab_size": 50257, "mixed_precision": a.device == "cuda",
                             "fp16_type": "bfloat16"},
                   "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-4},
                   "runconfig": {"seed": 0, "log_steps": 1}}
            case("125M (gpt3-125m)", big, tmp, a.big_steps, 1, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
