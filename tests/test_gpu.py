"""The execution core on a CUDA device: weight streaming (H2D/D2H link streams, pinned MemoryX buffers) computes the
run that resident training computes on the CPU, keeps its device budget as the GPU allocator counts it, and SwarmX
workers train on the GPU. Skipped where no CUDA device is present (CI has none)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_params, wsc
from test_streaming import _assert_same_run, _metrics, _run
from waferscale.params import params_from_dict
from waferscale.zoo.runner import RunOptions, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")]


@pytest.fixture(autouse=True)
def _exact_float32():
    """float32 products on the GPU without TF32, so the parity bounds below compare arithmetic, not rounding mode."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_streaming_on_cuda_equals_resident_on_cpu(corpus: Path, tmp_path: Path, model: str) -> None:
    over = {"model": {"name": model}}
    _run(corpus, tmp_path / "cpu", over=over, execution="resident", device="cpu")
    s = _run(corpus, tmp_path / "gpu", over=over, execution="streaming", device="cuda")
    assert s["executor"] == "streaming"
    # the same float32 arithmetic, summed in another order by the GPU's kernels
    _assert_same_run(tmp_path / "cpu", tmp_path / "gpu", rel=1e-4, wrel=1e-3)


def test_bf16_streaming_on_cuda_within_tolerance(corpus: Path, tmp_path: Path) -> None:
    over = {"model": {"mixed_precision": True, "fp16_type": "bfloat16"}}
    _run(corpus, tmp_path / "r", over=over, execution="resident", device="cuda")
    _run(corpus, tmp_path / "s", over=over, execution="streaming", device="cuda")
    rows = _metrics(tmp_path / "s")
    assert rows[0]["bytes_in"] < rows[0]["bytes_out"]  # bf16 weights in, fp32 gradients out
    _assert_same_run(tmp_path / "r", tmp_path / "s", rel=2e-3, wrel=2e-2)


def test_device_budget_holds_on_the_gpu_allocator(corpus: Path, tmp_path: Path) -> None:
    """weights + optimizer state are 10x --device_memory_mb; torch.cuda.max_memory_allocated stays within it. The
    allocator also holds cuBLAS's workspaces (tens of MB on Hopper), so the model is big enough (300M parameters,
    a 350 MB budget) for the budget to be a real one rather than the libraries' fixed share."""
    d = tiny_params(corpus, tmp_path / "m")
    d["model"].update({"name": "gpt-tiny", "hidden_size": 1024, "num_hidden_layers": 24, "num_heads": 8})
    d["train_input"].update({"batch_size": 2, "max_sequence_length": 16})
    d["runconfig"]["max_steps"] = 3
    params = params_from_dict(d, source="test")
    budget_mb = params.model.to_model_config().num_params * 12 / 10 / 2**20  # fp32 weights + AdamW's moments
    s = run(params, RunOptions(model_dir=tmp_path / "m", progress=False, device="cuda", device_memory_mb=budget_mb),
            out=io.StringIO())
    assert s["executor"] == "streaming"
    assert 0 < s["peak_memory_bytes"] <= budget_mb * 2**20
    assert all(0 < r["peak_device_bytes"] <= budget_mb * 2**20 for r in _metrics(tmp_path / "m"))


def test_two_swarmx_workers_on_the_gpu_equal_one_cpu_system(corpus: Path, tmp_path: Path) -> None:
    """--num_csx 2 with CUDA workers (both on the visible GPU; gloo carries host tensors between them and MemoryX)
    trains the run one CPU system trains on the same global batch."""
    params = tmp_path / "p.yaml"
    params.write_text(json.dumps(tiny_params(corpus, tmp_path / "unused")))  # JSON is YAML
    one, two = tmp_path / "one", tmp_path / "two"
    for md, extra in ((one, ("--device", "cpu")), (two, ("--device", "cuda", "--num_csx", "2"))):
        r = wsc("run", "--params", str(params), "--mode", "train", "--model_dir", str(md), "--execution",
                "streaming", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
    assert _metrics(two)[0]["num_csx"] == 2
    _assert_same_run(one, two, rel=1e-4, wrel=1e-3)


def test_cstorch_script_streams_to_the_gpu_as_it_trains_on_the_cpu(tmp_path: Path) -> None:
    """A cstorch script whose batches are CPU tensors (it never moves them): on "CSX" the executor hands them to
    the GPU the weights stream to, and on "GPU" to the GPU the model lives on; both train the CPU's run."""
    from test_cstorch import TINY_GPT, assert_close_weights, build, train

    lc, wc, _ = train("CPU", lambda: build(TINY_GPT), tmp=tmp_path)
    for kind in ("CSX", "GPU"):
        lg, wg, _ = train(kind, lambda: build(TINY_GPT), tmp=tmp_path)
        assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(lg, lc)), (kind, lg, lc)
        assert_close_weights({k: v.cpu() for k, v in wg.items()}, wc, 1e-4)
