"""Checks shared by the tests that train a model twice (resident vs streamed vs `--num_csx 2`, or once vs resumed)
through `wsc run` and compare the runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from waferscale.runtime.checkpoint import load_checkpoint


def read_metrics(model_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (model_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_training(a: Path, b: Path, *, steps: int = 4, grad_norm: bool = True,
                         skip: tuple[str, ...] = ()) -> tuple[list[dict], list[dict]]:
    """Runs `a` and `b` logged steps 1..steps with the same losses (and gradient norms) within 1e-5, and their
    checkpoints at the last step hold the same weights (relative difference of each tensor <= 1e-5; names ending
    in one of `skip` are not compared). Returns both runs' metrics for further checks."""
    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, steps + 1))
    for x, y in zip(ra, rb):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        if grad_norm:
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
    wa, wb = (load_checkpoint(d / f"checkpoint_{steps}.safetensors", with_optimizer=False).model for d in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        if skip and k.endswith(skip):
            continue
        assert float((wa[k] - wb[k]).norm() / wa[k].norm().clamp_min(1e-2)) <= 1e-5, k
    return ra, rb


def checkpoint_weights(path: Path) -> dict:
    """The model weights of a checkpoint file (runtime/checkpoint.py's format, any version)."""
    return load_checkpoint(path, with_optimizer=False).model
