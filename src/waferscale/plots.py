"""Pictures a person would rather look at than read: the loss curve of a run."""

from __future__ import annotations

import json
from pathlib import Path

from waferscale.errors import DataError
from waferscale.util.files import atomic_path


def plot_loss(model_dir: Path, out: Path | None = None) -> Path:
    """Draw train loss (and the learning rate) from model_dir/metrics.jsonl to a PNG; returns its path."""
    metrics = model_dir / "metrics.jsonl"
    if not metrics.exists():
        raise DataError(f"{metrics} not found: plot a model_dir written by `wsc run`")
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    if not rows:
        raise DataError(f"{metrics} is empty: train at least one step first")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(steps, [r["loss"] for r in rows], lw=1.2, label="train loss")
    summary = model_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        if "eval_loss" in s and "final_step" in s:
            ax.scatter([s["final_step"]], [s["eval_loss"]], color="C3", zorder=3, label=f"eval loss {s['eval_loss']:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(steps, [r["lr"] for r in rows], color="C2", lw=0.8, alpha=0.6, label="learning rate")
    ax2.set_ylabel("learning rate")
    (handles, labels), (handles2, labels2) = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(handles + handles2, labels + labels2, loc="upper right")
    ax.set_title(f"{model_dir.name}: {len(rows)} steps")
    fig.tight_layout()
    out = out or model_dir / "loss.png"
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return out
