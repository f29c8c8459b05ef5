"""Benchmark: weight streaming against resident training, both through `wsc run`, on a compute-heavy CPU config.

Same params YAML, model, batch, data, process and thread count; only `--execution` differs. Figures are wall-clock
tokens/s over the timed steps (after warm-up) from metrics.jsonl. Streaming runs twice: `recompute auto` (no
device budget, so each unit's autograd state is kept and only the weights leave the device) and `recompute always`
(only unit-boundary activations kept; each unit's forward runs again in backward: 8 instead of 6 FLOP per
parameter per token, so its ceiling is ~0.75 of resident). Runs alternate; medians are reported.

    python bench/train_streaming.py [--layers 6] [--hidden 384] [--seq_len 256] [--batch_size 16] [--repeats 2]
                                    [--device cuda] [--bf16]

On CUDA the device is the GPU and MemoryX is host RAM: streaming moves each unit's weights over PCIe and its
gradients back, while resident keeps the whole state on the GPU.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
from pathlib import Path

import torch

from waferscale.params import params_from_dict
from waferscale.models import from_name
from waferscale.zoo.runner import RunOptions, run


def params_dict(a: argparse.Namespace, model_dir: str) -> dict:
    return {
        "train_input": {"data_dir": "shakespeare", "tokenizer": "char", "batch_size": a.batch_size,
                        "max_sequence_length": a.seq_len, "shuffle": True, "shuffle_seed": 0},
        "model": {"name": a.model, "vocab_size": 256, "max_position_embeddings": a.seq_len,
                  "hidden_size": a.hidden, "num_hidden_layers": a.layers, "num_heads": a.heads,
                  "mixed_precision": a.bf16, **({"fp16_type": "bfloat16"} if a.bf16 else {})},
        "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": 0.1, "max_gradient_norm": 1.0},
        "runconfig": {"max_steps": a.warmup + a.steps, "seed": 0, "log_steps": 1, "model_dir": model_dir},
    }


def tokens_per_s(a: argparse.Namespace, execution: str, recompute: str = "auto") -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as d:
        params = params_from_dict(params_dict(a, d), source="bench")
        run(params, RunOptions(model_dir=Path(d), progress=False, execution=execution, recompute=recompute,
                                  device=a.device),
            out=io.StringIO())
        rows = [json.loads(ln) for ln in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    timed = rows[a.warmup:]
    span = timed[-1]["elapsed_s"] - rows[a.warmup - 1]["elapsed_s"]
    return len(timed) * a.batch_size * a.seq_len / span, timed[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision (fp32 masters in MemoryX)")
    a = ap.parse_args()
    n = from_name(a.model, vocab_size=256, max_seq_len=a.seq_len, d_model=a.hidden, n_layer=a.layers,
                  n_head=a.heads, device="meta").config.num_params
    print(f"model {a.model} {a.layers}x{a.hidden} ({n / 1e6:.1f}M params), batch {a.batch_size}x{a.seq_len}, "
          f"{a.steps} timed steps after {a.warmup} warm-up, {torch.get_num_threads()} threads, torch {torch.__version__}, device {a.device}"
          + (f" ({torch.cuda.get_device_name(a.device)})" if a.device.startswith("cuda") else "")
          + (", bf16 mixed precision" if a.bf16 else ""))
    res, keep, rec = [], [], []
    last: dict = {}
    for r in range(a.repeats):
        t, last = tokens_per_s(a, "streaming")
        keep.append(t)
        res.append(tokens_per_s(a, "resident")[0])
        rec.append(tokens_per_s(a, "streaming", "always")[0])
        print(f"  repeat {r + 1}: resident {res[-1]:,.0f} | streaming {keep[-1]:,.0f} | streaming+recompute "
              f"{rec[-1]:,.0f} tok/s")
    r, k, c = statistics.median(res), statistics.median(keep), statistics.median(rec)
    print(f"resident                        : {r:,.0f} tokens/s")
    print(f"streaming (recompute auto: off) : {k:,.0f} tokens/s   ratio {k / r:.3f}  (target >= 0.85)")
    print(f"streaming (recompute always)    : {c:,.0f} tokens/s   ratio {c / r:.3f}  (ceiling ~0.75: 8 vs 6 FLOP/param/token)")
    print(f"last streaming step: wait for weights {last['wait_weights_s'] * 1e3:.1f} ms, compute "
          f"{last['compute_s'] * 1e3:.1f} ms, stream {last['stream_bandwidth_Bps'] / 1e9:.2f} GB/s, "
          f"no-stall {last['no_stall']} (needs >= {last['no_stall_tokens_needed']:,} tokens/step)")


if __name__ == "__main__":
    main()
