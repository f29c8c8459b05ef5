"""Benchmark: what sparsity costs in quality. The demo's small GPT on Shakespeare (configs/gpt2_tiny_shakespeare.yaml:
same data order, seed and steps), trained dense and 75% sparse with each algorithm, then sparse pre-training
followed by dense fine-tuning (SPDF) against dense-only at equal total steps. Validation loss (nats/char) from
`wsc run --mode train_and_eval`, resident execution (the streamed runs compute the same numbers).

    static   one random mask, kept
    gmp      magnitude pruning from dense up to 75% (linear schedule, masks every 10 steps until 3/4 of the run)
    set      75%; every 25 steps until 3/4 of the run, drop the smallest of a cosine-decaying fraction (0.3 at
             first) of the kept weights and regrow as many at random
    rigl     the same, regrowing where the dense gradient is largest
    rigl_in  RigL with each input column keeping the same share (balance_in_groups = hidden size)
    spdf     static 75% for 3/4 of the steps, then the same weights dense (the masks dropped) to the end

    python bench/sparse_quality.py [--steps 300]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import yaml

from waferscale.params import params_from_dict
from waferscale.runtime.checkpoint import load_checkpoint
from waferscale.zoo.runner import RunOptions, run

ROOT = Path(__file__).resolve().parents[1]


def sparsity_sections(steps: int, hidden: int) -> dict[str, dict | None]:
    stop = steps * 3 // 4
    drop = {"type": "cosine", "init": 0.3, "half_period": stop}
    return {
        "dense": None,
        "static": {"algorithm": "static", "sparsity": 0.75},
        "gmp": {"algorithm": "gmp", "sparsity": {"type": "linear", "init": 0.0, "slope": 0.75 / stop},
                "update": {"freq": 10, "stop": stop}},
        "set": {"algorithm": "set", "sparsity": 0.75, "update": {"freq": 25, "stop": stop}, "drop_fraction": drop},
        "rigl": {"algorithm": "rigl", "sparsity": 0.75, "update": {"freq": 25, "stop": stop},
                 "drop_fraction": drop},
        "rigl_in": {"algorithm": "rigl", "sparsity": 0.75, "update": {"freq": 25, "stop": stop},
                    "drop_fraction": drop, "balance_in_groups": hidden},
    }


def train(base: dict, steps: int, model_dir: Path, sparsity: dict | None) -> dict:
    d = json.loads(json.dumps(base))
    d["runconfig"].update(max_steps=steps, checkpoint_steps=steps, model_dir=str(model_dir))
    d["sparsity"] = sparsity
    if sparsity is None:
        d.pop("sparsity")
    return run(params_from_dict(d, source="bench"),
               RunOptions(mode="train_and_eval", model_dir=model_dir, progress=False, execution="resident"),
               out=io.StringIO())


def column_balance(model_dir: Path, step: int) -> float | None:
    """How unevenly the kept weights spread over input columns: the coefficient of variation of kept weights per
    column, averaged over the masked matrices of the final checkpoint (None for a dense run). Gradient regrowth
    (RigL) piles weights where the inputs are large: dL/dW[i, j] sums the output error times input j."""
    sd = load_checkpoint(model_dir / f"checkpoint_{step}.safetensors", with_optimizer=False).model
    cvs = [(c.std() / c.mean()).item() for k, m in sd.items() if k.endswith("_mask") for c in [m.float().sum(0)]]
    return sum(cvs) / len(cvs) if cvs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--runs", nargs="+", choices=["dense", "static", "gmp", "set", "rigl", "rigl_in", "spdf"],
                    default=["dense", "static", "gmp", "set", "rigl", "rigl_in", "spdf"],
                    help="which runs (default: all)")
    a = ap.parse_args()
    base = yaml.safe_load((ROOT / "configs" / "gpt2_tiny_shakespeare.yaml").read_text())
    sections = sparsity_sections(a.steps, base["model"]["hidden_size"])
    print(f"gpt-mini on Shakespeare, {a.steps} steps of {base['train_input']['batch_size']}x"
          f"{base['train_input']['max_sequence_length']} characters, validation loss over "
          f"{base['runconfig']['eval_steps']} batches")
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, section in sections.items():
            if name not in a.runs:
                continue
            t0 = time.perf_counter()
            s = train(base, a.steps, Path(tmp) / name, section)
            results[name] = s["eval_loss"]
            cv = column_balance(Path(tmp) / name, a.steps)
            print(f"  {name:<7} val loss {s['eval_loss']:.4f}   train loss {s['final_loss']:.4f}   "
                  + (f"kept weights per input column: CV {cv:.3f}   " if cv is not None else "")
                  + f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if "spdf" in a.runs:
            spdf = Path(tmp) / "spdf"
            train(base, a.steps * 3 // 4, spdf, sections["static"])  # sparse pre-training
            s = train(base, a.steps, spdf, None)  # resumes dense from the sparse checkpoint (its masks dropped)
            results["spdf"] = s["eval_loss"]
    ref, ref_name = (results["dense"], "dense") if "dense" in results else (results[a.runs[0]], a.runs[0])
    print(f"\n{'run':<22} {'val loss':>8} {'vs ' + ref_name:>9}")
    for name, label in (("dense", "dense"), ("static", "static 75%"), ("gmp", "GMP -> 75%"), ("set", "SET 75%"),
                        ("rigl", "RigL 75%"), ("rigl_in", "RigL 75%, per column"),
                        ("spdf", "SPDF (75% then dense)")):
        if name in results:
            print(f"{label:<22} {results[name]:>8.4f} {results[name] - ref:>+9.4f}")


if __name__ == "__main__":
    main()
