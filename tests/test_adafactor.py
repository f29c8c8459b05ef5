"""Adafactor: equal to transformers' Adafactor step for step (which Cerebras' cstorch.optim.Adafactor ports), Model
Zoo's t5_base optimizer (AdaFactor under an InverseSquareRootDecay schedule) trained by `wsc run` resident, streamed
and on two systems alike, resumed exactly from a checkpoint, and the places that cannot hold factored state refused."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from conftest import wsc_main
from train_helpers import assert_same_training
from waferscale.errors import ConfigError
from waferscale.params import params_from_dict
from waferscale.runtime import optim as rt
from waferscale.runtime.memoryx import MemoryX
from waferscale.zoo.runner import RunOptions, run

transformers = pytest.importorskip("transformers")

MODELZOO = Path(__file__).parent / "data" / "modelzoo"


@pytest.mark.parametrize("options", [
    {},  # transformers' defaults: relative_step, scale_parameter
    {"relative_step": False, "lr": 0.05},  # cstorch's (Model Zoo's) use: the scheduled rate times the RMS
    {"relative_step": False, "lr": 0.05, "scale_parameter": False, "beta1": 0.9, "weight_decay": 0.1},
    {"warmup_init": True, "beta1": 0.5, "clip_threshold": 0.3},
])
def test_equals_transformers_step_for_step(options: dict) -> None:
    torch.manual_seed(0)
    shapes = [(6, 5), (5,), (2, 3, 4)]  # a matrix (factored), a vector, a 3-d tensor (factored over its last two)
    start = [torch.randn(s) for s in shapes]
    ours = [nn.Parameter(t.clone()) for t in start]
    theirs = [nn.Parameter(t.clone()) for t in start]
    a, b = rt.Adafactor(ours, **options), transformers.optimization.Adafactor(theirs, **options)
    for step in range(8):
        for i, (p, q) in enumerate(zip(ours, theirs)):
            if step == 3 and i == 1:  # a parameter without a gradient is skipped (its step count stays)
                p.grad = q.grad = None
                continue
            g = torch.randn(p.shape)
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
        for p, q in zip(ours, theirs):
            assert torch.allclose(p, q, rtol=0, atol=1e-6), (step, options)
    assert not torch.allclose(ours[0], start[0])
    st = a.state[ours[0]]
    assert (tuple(st["exp_avg_sq_row"].shape), tuple(st["exp_avg_sq_col"].shape)) == ((6,), (5,))
    assert a.state[ours[1]]["step"] == 7 and a.state[ours[0]]["step"] == 8


def test_spec_and_params_take_model_zoo_keys() -> None:
    spec = rt.OptimizerSpec(optimizer_type="Adafactor", learning_rate=0.01)
    assert (spec.eps, spec.relative_step, spec.scale_parameter, spec.beta1) == ((1e-30, 1e-3), False, True, None)
    opt = rt.build_optimizer([nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(2))], spec)
    assert isinstance(opt, rt.Adafactor) and opt.defaults["lr"] == 0.01 and not opt.defaults["relative_step"]
    assert rt.OptimizerSpec(optimizer_type="AdamW").eps == 1e-6  # (the others' default is unchanged)
    with pytest.raises(ConfigError, match="Adafactor takes two numbers"):
        rt.OptimizerSpec(optimizer_type="Adafactor", eps=1e-6)
    d = yaml.safe_load((MODELZOO / "params_t5_base.yaml").read_text())
    assert params_from_dict(d, "t").optimizer.optimizer_type == "Adafactor"  # (Model Zoo's 'AdaFactor')
    for change, message in [({"relative_step": True}, "optimizer.relative_step: true is not supported"),
                            ({"eps": 1e-3}, "optimizer.eps: Adafactor takes two numbers"),
                            ({"optimizer_type": "AdamW", "beta1": 0.9}, "optimizer.beta1: applies to Adafactor only"),
                            ({"clip_threshold": 0.0}, "optimizer.clip_threshold: must be > 0")]:
        bad = {**d, "optimizer": {**d["optimizer"], **change}}
        with pytest.raises(ConfigError, match=message):
            params_from_dict(bad, "t")


def test_wsc_validate_accepts_model_zoo_t5_base(capsys) -> None:
    r = wsc_main(capsys, "validate", str(MODELZOO / "params_t5_base.yaml"))
    assert r.returncode == 0 and "valid (222.9M-parameter model)" in r.stdout, r.stderr[-2000:]


# ---- wsc run of a tiny t5_base: resident = streamed = two systems, resumed exactly --------------------------------

def _tiny_t5_base(corpus: Path, model_dir: Path, **optimizer: object) -> dict:
    """Model Zoo's t5_base shrunk; its optimizer section as published (AdaFactor, InverseSquareRootDecay, dynamic
    loss scaling) but for a warmup short enough (and a rate small enough) that the rate changes within the run."""
    d = yaml.safe_load((MODELZOO / "params_t5_base.yaml").read_text())
    d.pop("eval_input")
    d["train_input"].update(src_data_dir=str(corpus), src_max_sequence_length=32, tgt_max_sequence_length=8,
                            batch_size=4, num_workers=0)
    d["train_input"].pop("src_vocab_file")  # (a SentencePiece vocab.txt: the run reads 'char' instead)
    d["model"].update(src_vocab_size=156, encoder_num_hidden_layers=2, decoder_num_hidden_layers=2, num_heads=4,
                      d_kv=8, d_ff=64, d_model=32, src_max_position_embeddings=32, mixed_precision=False,
                      dropout_rate=0.0)
    d["optimizer"]["learning_rate"][0].update(warmup_steps=2, scale=0.05)
    d["optimizer"].update(optimizer)
    d["runconfig"].update(max_steps=4, checkpoint_steps=4, log_steps=1, model_dir=str(model_dir))
    return d


def _run(d: dict, model_dir: Path, **opts: object) -> dict:
    return run(params_from_dict(d, "t"), RunOptions(model_dir=model_dir, progress=False, **opts), out=io.StringIO())


def _same_training(a: Path, b: Path) -> None:
    ra, _ = assert_same_training(a, b, grad_norm=False)
    # the schedule's rate, 0.05/sqrt(max(t, warmup 2)) at t = 0, 1, 2, 3 updates made
    assert [r["lr"] for r in ra] == pytest.approx([0.05 * t ** -0.5 for t in (2, 2, 2, 3)])


@pytest.mark.parametrize("beta1", [None, 0.9])
def test_tiny_t5_base_trains_resident_and_streamed_alike(corpus: Path, tmp_path: Path, beta1: float | None) -> None:
    extra = {} if beta1 is None else {"beta1": beta1}
    r = _run(_tiny_t5_base(corpus, tmp_path / "r", **extra), tmp_path / "r", execution="resident")
    s = _run(_tiny_t5_base(corpus, tmp_path / "s", **extra), tmp_path / "s", execution="streaming")
    assert (r["executor"], s["executor"]) == ("resident", "streaming")
    _same_training(tmp_path / "r", tmp_path / "s")
    ra = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert ra[-1]["loss"] < ra[0]["loss"]


def test_tiny_t5_base_resumes_exactly_resident_and_streamed(corpus: Path, tmp_path: Path) -> None:
    _run(_tiny_t5_base(corpus, tmp_path / "once"), tmp_path / "once", execution="resident")
    for execution in ("resident", "streaming"):
        d = _tiny_t5_base(corpus, tmp_path / execution)
        d["runconfig"]["checkpoint_steps"] = 2
        for _ in range(2):
            _run(d, tmp_path / execution, execution=execution, num_steps=2)
        _same_training(tmp_path / "once", tmp_path / execution)
    # a resident checkpoint resumes streamed (the same state, keyed alike), with MemoryX's units in RAM or in
    # files (a flash tier: the slots are files, the factored averages stay in RAM)
    for name, ram_mb in (("ram", None), ("flash", 0.001)):
        d = _tiny_t5_base(corpus, tmp_path / name)
        d["runconfig"]["checkpoint_steps"] = 2
        _run(d, tmp_path / name, execution="resident", num_steps=2)
        s = _run(d, tmp_path / name, execution="streaming", num_steps=2, memoryx_ram_mb=ram_mb,
                 flash_dir=str(tmp_path / "flash_dir"))
        assert s["executor"] == "streaming"
        if ram_mb is not None:
            assert s["memoryx_units_on_flash"] >= 1 and s["memoryx_flash_bytes"] > 0
        _same_training(tmp_path / "once", tmp_path / name)
    assert not any((tmp_path / "flash_dir").iterdir())  # each run's flash files went with it


@pytest.mark.slow
def test_tiny_t5_base_on_two_systems_equals_one(corpus: Path, tmp_path: Path, capsys) -> None:
    _run(_tiny_t5_base(corpus, tmp_path / "one"), tmp_path / "one", execution="resident")
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(_tiny_t5_base(corpus, tmp_path / "unused")))
    # `wsc run` by its main in this process: rank 0 here, the two systems' ranks processes of their own
    r = wsc_main(capsys, "run", "-p", str(p), "-o", str(tmp_path / "two"), "--no_progress", "--num_csx", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["executor"] == "swarmx"
    _same_training(tmp_path / "one", tmp_path / "two")


def test_memoryx_refuses_masks_and_foreign_state() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    mx = MemoryX(model, rt.OptimizerSpec(optimizer_type="Adafactor", learning_rate=0.1), units=[model[0], model[1]])
    try:
        with pytest.raises(ConfigError, match="weight sparsity with Adafactor is not supported"):
            mx.set_mask("0.weight", torch.ones(3, 4, dtype=torch.bool))
        adamw = torch.optim.AdamW(rt.param_groups(model.parameters(), 0.01))  # the run's groups, AdamW's state
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        adamw.step()
        from waferscale.errors import CheckpointError
        with pytest.raises(CheckpointError, match="Adafactor keeps exp_avg_sq_row"):
            mx.load_optimizer_state_dict(adamw.state_dict())
    finally:
        mx.close()


def test_resident_sparsity_refuses_adafactor() -> None:
    """The resident path (optimizer.apply(sparsity)) refuses Adafactor as MemoryX does: a mask cannot prune its
    factored averages."""
    from waferscale.sparse.algorithms import sparsify_optimizer

    model = nn.Linear(4, 3)
    opt = rt.build_optimizer(model.parameters(), rt.OptimizerSpec(optimizer_type="Adafactor", learning_rate=0.1))
    with pytest.raises(ConfigError, match="weight sparsity with Adafactor is not supported"):
        sparsify_optimizer(None, opt)
