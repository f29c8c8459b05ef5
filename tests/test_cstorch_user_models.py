"""A user's own language model (no `units()`) on the "CSX" backend: split into units automatically, streamed
block by block, the same losses and weights as on "CPU", with one system and with two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from user_models import TutorialLM, train
from waferscale.runtime.units import model_units

ROOT = Path(__file__).resolve().parents[1]


def assert_same_run(a, b, rtol: float = 1e-5) -> None:
    (la, wa), (lb, wb) = a, b
    assert len(la) == len(lb) and la[-1] < la[0]
    for x, y in zip(la, lb):
        assert abs(x - y) <= rtol * abs(y), (la, lb)
    assert wa.keys() == wb.keys()
    fa = torch.cat([wa[k].float().reshape(-1) for k in sorted(wa)])
    fb = torch.cat([wb[k].float().reshape(-1) for k in sorted(wb)])
    assert (fa - fb).norm() / fb.norm() < rtol


def test_a_tutorial_lm_is_split_into_a_chain_of_units():
    torch.manual_seed(0)
    model = TutorialLM().eval()  # (no dropout: one pass each way draws different masks)
    split = model_units(model)
    assert split.report.how == "traced" and split.takes_input
    assert len(split) == 1 + 3 + 2  # embedding (+ positions), each block, the final norm, the head
    x = torch.randint(0, 41, (2, 16))
    h = x
    for unit in split.modules:
        h = unit(h, x)
    assert torch.equal(h, model(x))


@pytest.mark.parametrize("name,units", [("tutorial", 6), ("tied", 6), ("batchnorm", 5)])
def test_a_users_lm_streams_block_by_block_with_the_cpu_losses(name, units, tmp_path):
    """Dropout inside nn.MultiheadAttention and nn.Dropout (replayed when a unit is recomputed), tied weights,
    batch-norm running statistics (counted once per step): losses and every state tensor as on "CPU"."""
    cpu_losses, cpu_w, _ = train(name, "CPU", artifact_dir=str(tmp_path))
    csx_losses, csx_w, opt = train(name, "CSX", artifact_dir=str(tmp_path))
    stream = opt._stream
    assert stream is not None and stream.mx is not None and stream.n == units  # streamed, unit by unit
    assert stream.stats["bytes_in"] > 0
    assert_same_run((csx_losses, csx_w), (cpu_losses, cpu_w))


class _Glue(TutorialLM):
    """Variants of the tutorial forward that a split cannot reproduce exactly."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant

    def forward(self, idx: torch.Tensor):
        T = idx.size(1)
        x = self.embedding(idx)
        if self.variant == "in_place":
            x.mul_(2.0)
        x = x + self.pos[:, :T]
        if self.variant == "training_flag":
            x = torch.nn.functional.dropout(x, 0.1, self.training)
        if self.variant == "noise_from_input":
            x = x + torch.randn_like(self.pos[:, :T]) * idx.size(0)
        for blk in self.blocks:
            x = blk(x, self.causal[:T, :T])
        if self.variant == "unused_unit":
            self.ln_f(x)
            return self.head(x)
        out = self.head(self.ln_f(x))
        return (out,) if self.variant == "tuple_output" else out


@pytest.mark.parametrize("variant,reason", [
    ("in_place", "changes tensors in place"),
    ("training_flag", "reads `self.training`"),
    ("tuple_output", "its output is not one tensor"),
    ("unused_unit", "not of the unit before it"),
])
def test_a_forward_a_split_cannot_reproduce_streams_whole(variant, reason):
    split = model_units(_Glue(variant))
    assert split.report.how == "whole" and reason in split.report.reason, split.report


@pytest.mark.parametrize("training", [True, False])
def test_split_units_chained_equal_the_model_in_both_modes(training):
    """Same seed, same draws: the units run the model's own ops in its own order (dropout in attention too)."""
    torch.manual_seed(0)
    model = TutorialLM().train(training)
    split = model_units(model)
    assert split.report.how == "traced"
    x = torch.randint(0, 41, (2, 16))
    torch.manual_seed(1)
    want = model(x)
    torch.manual_seed(1)
    h = x
    for unit in split.modules:
        h = unit(h, x)
    assert torch.equal(h, want)


def test_a_forward_that_cannot_be_split_streams_whole_and_says_why(tmp_path, capsys):
    cpu_losses, cpu_w, _ = train("branchy", "CPU", artifact_dir=str(tmp_path))
    csx_losses, csx_w, opt = train("branchy", "CSX", artifact_dir=str(tmp_path))
    assert opt._stream.n == 1
    assert "streams as one unit: its forward could not be traced" in capsys.readouterr().err
    assert_same_run((csx_losses, csx_w), (cpu_losses, cpu_w))


def _script(tmp: Path, *args: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "losses.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "user_models.py"), "--out", str(out),
                        "--artifact_dir", str(tmp), *args], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text()), load_file(str(out) + ".safetensors")


@pytest.mark.slow
def test_a_users_lm_on_two_systems_equals_cpu(tmp_path):
    # no dropout: two systems draw their masks for half a batch each, never the single run's masks
    cpu = _script(tmp_path / "cpu", "--backend", "CPU", "--dropout", "0")
    two = _script(tmp_path / "two", "--backend", "CSX", "--num_csx", "2", "--dropout", "0")
    assert_same_run(two, cpu)
