"""Benchmark: the wafer's projected speed against weight density, each sparse plan beside the dense plan of the
same request compiled in the same run (the peer), and the ratio.

    python bench/wafer_sparsity.py [--out wafer_sparsity.png] [--densities 1,0.5,0.25,0.1,0.05,0.01]

GPT-3 XL (1.3B) on a WSE-2 and Llama-3.1-8B on a WSE-3, each compiled for training (the training step: weight
streaming from MemoryX, sequences of 2,048 tokens, the default no-stall batch) and for inference (decode speed:
per user, and aggregate over the users the plan keeps in flight), at every density of the blocks' matrices
(Cerebras' default filter; embedding and LM head dense). Every figure is the compiler's projection
(`wsc compile --sparsity 1-d`), from the fabric cost model: one multiply-add per non-zero weight, the fixed
costs that do not shrink, the busiest PE of a random pattern. Then activation sparsity side by side: a ReLU
FFN at 60% exact zeros (the seed's 50-70%) against the exact-zero fraction measured on a trained SwiGLU model
(SmolLM2-135M, `wsc sparsity-report`'s measurement, when its weights are installed). Writes a PNG of speedup
against density with the ideal 1/d.
"""

from __future__ import annotations

import argparse
import time

from waferscale.compiler import compile_model

MODELS = (("gpt3-1.3b", "wse2"), ("llama3.1-8b", "wse3"))
SEQ_LEN = 2048  # training sequences (GPT-3's; Llama-3.1's 128k context would not fit one sequence's checkpoints)


def project(model: str, target: str, mode: str, density: float, act=None) -> dict:
    p = compile_model(model=model, target=target, mode=mode, sparsity=None if density >= 1 else 1 - density,
                      activation_sparsity=act, seq_len=SEQ_LEN if mode == "train" else None)
    q = p.projection
    out = {"plan": p, "step_s": q.get("step_time_s"), "tokens_per_s": q.get("tokens_per_s"),
           "user_tps": q.get("decode_tokens_per_s_per_user"), "agg_tps": q.get("aggregate_decode_tokens_per_s")}
    w = p.extra.get("sparsity", {}).get("weight")
    out["knee"] = w and w["knee_density"]
    out["max"] = w and w["max_speedup"]
    out["floor"] = w and max(w["floor_parts_s"].items(), key=lambda kv: kv[1])[0]
    return out


def measured_swiglu_zeros() -> tuple[float, str] | None:
    """Mean exact-zero fraction entering the FFN down-projections of SmolLM2-135M on a sample of text."""
    import torch

    from waferscale.compiler.capture import measure_sparsity
    from waferscale.errors import UserError
    from waferscale.runtime.generation import load_for_generation

    try:
        model, tok, _ = load_for_generation("smollm2-135m", tokenizer=None, device="cpu",
                                            need_tokenizer=False)
    except UserError as e:
        print(f"(SmolLM2-135M not available: {e}; the SwiGLU row uses 0 exact zeros)")
        return None
    text = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
            "arrows of outrageous fortune, or to take arms against a sea of troubles. ") * 8
    ids = torch.tensor(tok.encode(text)[:256]).reshape(2, 128) if tok else torch.randint(0, 1000, (2, 128))
    rows = [r for r in measure_sparsity(model, ids, 1e-2) if r["activation_exact_zero"] is not None]
    exact = sum(r["activation_exact_zero"] for r in rows) / len(rows)
    near = sum(r["activation_near_zero"] for r in rows) / len(rows)
    return exact, f"SmolLM2-135M (SwiGLU, trained), 2 x 128 tokens: exact zeros {exact:.2%}, |a| < 0.01 {near:.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="wafer_sparsity.png")
    ap.add_argument("--densities", default="1,0.5,0.25,0.1,0.05,0.01")
    a = ap.parse_args()
    densities = [float(d) for d in a.densities.split(",")]
    if densities[0] != 1.0:
        densities.insert(0, 1.0)
    t0 = time.perf_counter()
    res: dict = {}
    for model, target in MODELS:
        for mode in ("train", "inference"):
            res[model, mode] = {d: project(model, target, mode, d) for d in densities}
    spec = res[MODELS[0][0], "train"][1.0]["plan"].assumptions
    print(f"projected by the fabric cost model (clock {spec['clock_hz'] / 1e9:g} GHz, fp16; WSE-2 8 and WSE-3 16 "
          f"FLOP/cycle/PE, 48 KiB SRAM/PE, links 4 B/cycle, I/O 150 GB/s); peer = the dense plan, same run\n")
    print(f"{'model':<12} {'target':<6} {'density':>7} {'step ms':>9} {'train tok/s':>12} {'x dense':>8} "
          f"{'decode tok/s/user':>18} {'x dense':>8} {'aggregate tok/s':>16} {'x dense':>8} {'ideal':>6}")
    for model, target in MODELS:
        tr, inf = res[model, "train"], res[model, "inference"]
        for d in densities:
            print(f"{model:<12} {target:<6} {d:>7g} {tr[d]['step_s'] * 1e3:>9.1f} {tr[d]['tokens_per_s']:>12,.0f} "
                  f"{tr[1.0]['step_s'] / tr[d]['step_s']:>7.2f}x {inf[d]['user_tps']:>18,.0f} "
                  f"{inf[d]['user_tps'] / inf[1.0]['user_tps']:>7.2f}x {inf[d]['agg_tps']:>16,.0f} "
                  f"{inf[d]['agg_tps'] / inf[1.0]['agg_tps']:>7.2f}x {1 / d:>5.0f}x")
    print("\nwhere the speedup stops being near-linear (the plan's sweep on its own placement):")
    for (model, mode), r in res.items():
        d = min(densities)
        knee = r[d]["knee"]
        print(f"  {model:<12} {mode:<9} " + (f"near-linear down to d ~{knee:.2g}" if knee else "never near-linear")
              + f"; at most {r[d]['max']:.2f}x; largest fixed cost: {r[d]['floor']}")
    measured = measured_swiglu_zeros()
    swiglu = measured[0] if measured else 0.0
    print("\nactivation sparsity (dense weights; the cores skip exact zeros entering the FFN down-projections):")
    if measured:
        print(f"  measured: {measured[1]}")
    print(f"{'model':<12} {'FFN':<22} {'zeros':>6} {'train x dense':>14} {'decode/user x dense':>20}")
    for model, target in MODELS:
        for label, z in (("ReLU (seed: 50-70%)", 0.6), ("GELU/SwiGLU (measured)", swiglu)):
            tr, inf = project(model, target, "train", 1.0, z), project(model, target, "inference", 1.0, z)
            print(f"{model:<12} {label:<22} {z:>6.1%} {res[model, 'train'][1.0]['step_s'] / tr['step_s']:>13.2f}x "
                  f"{inf['user_tps'] / res[model, 'inference'][1.0]['user_tps']:>19.2f}x")
    _plot(res, densities, a.out)
    print(f"\nwrote {a.out} ({time.perf_counter() - t0:.0f} s in all)")


def _plot(res: dict, densities: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, mode, title in ((axes[0], "train", "training step"), (axes[1], "inference", "decode")):
        ax.plot(densities, [1 / d for d in densities], "k--", lw=0.8, label="ideal 1/d")
        for (model, target), color in zip(MODELS, ("#3182bd", "#e6550d")):
            r = res[model, mode]
            key = "step_s" if mode == "train" else "user_tps"
            sp = [r[1.0][key] / r[d][key] if mode == "train" else r[d][key] / r[1.0][key] for d in densities]
            ax.plot(densities, sp, "o-", color=color, label=f"{model} on {target}")
            if mode == "inference":
                ax.plot(densities, [r[d]["agg_tps"] / r[1.0]["agg_tps"] for d in densities], "s:", color=color,
                        label=f"{model}: aggregate")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.invert_xaxis()
        ax.set_xlabel("weight density of the blocks' matrices")
        ax.set_title(f"projected {title} speedup vs dense", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("speedup (x dense)")
    fig.tight_layout()
    fig.savefig(path, dpi=140)


if __name__ == "__main__":
    main()
