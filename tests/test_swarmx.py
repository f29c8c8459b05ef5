"""SwarmX: --num_csx 2 equals --num_csx 1 (same global batch), checkpoints resume on another world size, a dead or
hung worker stops the run with its name and the last checkpoint resumes. Worker processes rendezvous over TCP on
127.0.0.1 (a free port), spawned by the real CLI."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_params
from train_helpers import checkpoint_weights
from waferscale.params import params_from_dict
from waferscale.runtime import checkpoint as ckpt
from waferscale.zoo.runner import RunOptions, run

pytestmark = pytest.mark.slow  # each test starts MemoryX and worker processes


def _params(corpus: Path, tmp_path: Path, **run_over: object) -> Path:
    d = tiny_params(corpus, tmp_path / "unused", **run_over)
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def _cli(params: Path, model_dir: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if fault:
        env["WSC_SWARMX_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "waferscale", "run", "-p", str(params), "-o", str(model_dir),
                           "--no_progress", *extra], capture_output=True, text=True, env=env, timeout=300)


def _metrics(model_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (model_dir / "metrics.jsonl").read_text().splitlines()]


def _library_run(corpus: Path, model_dir: Path, **opts: object) -> dict:
    return run(params_from_dict(tiny_params(corpus, model_dir), source="test"),
               RunOptions(model_dir=model_dir, progress=False, execution="streaming", **opts), out=io.StringIO())


def test_two_systems_equal_one_and_resume_on_one(corpus: Path, tmp_path: Path) -> None:
    """3 steps on --num_csx 2, then resumed on 1 system: the same 6 steps as one system throughout."""
    one = tmp_path / "one"
    _library_run(corpus, one)
    two = tmp_path / "two"
    r = _cli(_params(corpus, tmp_path), two, "--num_csx", "2", "--num_steps", "3", "--mode", "train_and_eval")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _metrics(two)
    assert rows[0]["num_csx"] == 2 and "bytes_in" in rows[0]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["executor"] == "swarmx" and summary["eval_loss"] > 0  # rank 0 evaluates from MemoryX
    _library_run(corpus, two)  # resumes checkpoint_3 with one system
    a, b = _metrics(one), _metrics(two)
    assert [x["step"] for x in b] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
    wa, wb = (checkpoint_weights(d / "checkpoint_6.safetensors") for d in (one, two))
    for k in wa:
        if not k.endswith("k_proj.bias"):  # zero-gradient parameter: rounding noise only (see test_streaming)
            assert float((wa[k] - wb[k]).norm() / wa[k].norm().clamp_min(1e-2)) <= 1e-5, k


def test_dead_worker_is_named_and_the_rerun_resumes(corpus: Path, tmp_path: Path) -> None:
    params = _params(corpus, tmp_path, checkpoint_steps=2)
    md = tmp_path / "run"
    r = _cli(params, md, "--num_csx", "2", "--swarmx_timeout_s", "30", fault="2:3:die")
    assert r.returncode == 1, r.stderr[-3000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "worker 2" in err[0] and "died" in err[0], r.stderr[-2000:]
    c = ckpt.load_checkpoint(md)  # the last complete checkpoint loads
    assert c.step == 2
    r = _cli(params, md, "--num_csx", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "(step 2)" in r.stdout
    assert [x["step"] for x in _metrics(md)] == [1, 2, 3, 4, 5, 6]


def test_hung_worker_times_out_with_its_name(corpus: Path, tmp_path: Path) -> None:
    r = _cli(_params(corpus, tmp_path), tmp_path / "run", "--num_csx", "2", "--swarmx_timeout_s", "5",
             fault="1:2:hang")
    assert r.returncode == 1, r.stderr[-3000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "worker 1" in err[0] and "hung" in err[0], r.stderr[-2000:]
