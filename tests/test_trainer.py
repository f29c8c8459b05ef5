"""The training loop: resume is exact, accumulation equals the full batch, mixed precision runs, outputs exist."""

import io
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import tiny_params
from waferscale.params import params_from_dict
from waferscale.zoo.runner import RunOptions, run


def _run(corpus: Path, model_dir: Path, mode: str = "train", *, params_over: dict | None = None,
         **opts: object) -> dict:
    d = tiny_params(corpus, model_dir)
    for section, values in (params_over or {}).items():
        d[section].update(values)
    return run(params_from_dict(d, source="test"),
               RunOptions(mode=mode, model_dir=model_dir, progress=False, **opts), out=io.StringIO())


def _metrics(model_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (model_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_metrics_summary_and_checkpoint(corpus: Path, tmp_path: Path) -> None:
    md = tmp_path / "run"
    s = _run(corpus, md, "train_and_eval")
    rows = _metrics(md)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert set(rows[0]) >= {"step", "loss", "lr", "tokens_per_s", "elapsed_s"}
    assert rows[0]["lr"] == 0.0 and rows[2]["lr"] == pytest.approx(3e-3)  # the warmup then cosine schedule
    assert rows[-1]["loss"] < rows[0]["loss"]
    summary = json.loads((md / "summary.json").read_text())
    for key in ("final_loss", "eval_loss", "eval_perplexity", "tokens_per_s", "mfu", "peak_memory_bytes"):
        assert key in summary, key
    assert summary["eval_perplexity"] == pytest.approx(math.exp(summary["eval_loss"]))
    assert (md / "checkpoint_6.safetensors").exists() and (md / "tokenizer").is_dir()
    assert s["final_step"] == 6


def test_resumed_run_matches_uninterrupted(corpus: Path, tmp_path: Path) -> None:
    full, split = tmp_path / "full", tmp_path / "split"
    _run(corpus, full, params_over={"model": {"dropout_rate": 0.1}})  # dropout: the RNG state must resume too
    _run(corpus, split, num_steps=3, params_over={"model": {"dropout_rate": 0.1}})
    assert [r["step"] for r in _metrics(split)] == [1, 2, 3]
    _run(corpus, split, params_over={"model": {"dropout_rate": 0.1}})  # resumes from checkpoint_3
    a, b = _metrics(full), _metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [(r["loss"], r["lr"]) for r in a] == [(r["loss"], r["lr"]) for r in b]


def test_checkpoint_steps_and_stale_metrics_truncated(corpus: Path, tmp_path: Path) -> None:
    md = tmp_path / "run"
    _run(corpus, md, params_over={"runconfig": {"checkpoint_steps": 2}})
    assert {p.name for p in md.glob("checkpoint_*")} == {f"checkpoint_{s}.safetensors" for s in (2, 4, 6)}
    for s in (6, 4):  # as if the run had died after step 3 with its last checkpoint at 2
        for p in md.glob(f"checkpoint_{s}.*"):
            p.unlink()
    _run(corpus, md)
    assert [r["step"] for r in _metrics(md)] == [1, 2, 3, 4, 5, 6]


def test_gradient_accumulation_equals_full_batch(corpus: Path, tmp_path: Path) -> None:
    a = _run(corpus, tmp_path / "a")
    b = _run(corpus, tmp_path / "b", params_over={"train_input": {"micro_batch_size": 2}})
    la, lb = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    for ra, rb in zip(la, lb):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
    assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-5)


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_mixed_precision_trains(corpus: Path, tmp_path: Path, half: str) -> None:
    over = {"model": {"mixed_precision": True, "fp16_type": half}, "optimizer": {"loss_scaling_factor": "dynamic"}}
    s = _run(corpus, tmp_path / half, params_over=over)
    rows = _metrics(tmp_path / half)
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert s["final_loss"] < rows[0]["loss"]


def test_eval_mode_needs_and_uses_a_checkpoint(corpus: Path, tmp_path: Path) -> None:
    from waferscale.errors import CheckpointError

    with pytest.raises(CheckpointError, match="needs a checkpoint"):
        _run(corpus, tmp_path / "none", "eval")
    md = tmp_path / "run"
    trained = _run(corpus, md, "train_and_eval")
    evaluated = _run(corpus, md, "eval")
    assert evaluated["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-6)


def test_llama_family_trains(corpus: Path, tmp_path: Path) -> None:
    s = _run(corpus, tmp_path / "llama", params_over={"model": {"name": "llama-tiny"}})
    assert math.isfinite(s["final_loss"])
    assert torch.get_num_threads() >= 1
