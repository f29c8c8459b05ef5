"""Weight streaming equals resident training; the device budget holds; observability; bad input exits 2.

Tolerances: fp32 streaming is the resident arithmetic (same kernels, same order), compared at rel 1e-5. Under
bf16 the streamed matrices are the same bf16 values autocast would make, but the embedding table is looked up in
bf16 (resident: fp32) and gradients accumulate in a different order, so bf16 runs agree to rel 2e-3 in loss and
2e-2 in weights (norm of the difference / norm of the weight) over 10 steps.
"""

import io
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import tiny_params, wsc
from train_helpers import checkpoint_weights
from waferscale.params import params_from_dict
from waferscale.zoo.runner import RunOptions, run


def _run(corpus: Path, model_dir: Path, *, over: dict | None = None, **opts: object) -> dict:
    d = tiny_params(corpus, model_dir)
    d["runconfig"]["max_steps"] = 10
    for section, values in (over or {}).items():
        d[section].update(values)
    return run(params_from_dict(d, source="test"), RunOptions(model_dir=model_dir, progress=False, **opts),
               out=io.StringIO())


def _metrics(model_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (model_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    step = _metrics(model_dir)[-1]["step"]
    return checkpoint_weights(model_dir / f"checkpoint_{step}.safetensors")


def _assert_same_run(a: Path, b: Path, rel: float, wrel: float) -> None:
    la, lb = _metrics(a), _metrics(b)
    assert len(la) == len(lb)
    for ra, rb in zip(la, lb):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=rel), (ra["step"], ra["loss"], rb["loss"])
        assert rb["lr"] == ra["lr"]
        if "grad_norm" in ra:
            assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=max(rel, 1e-5))
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        if k.endswith("k_proj.bias"):  # softmax ignores a key bias: its gradient is 0 plus rounding noise, which
            continue  # Adam scales to full-size steps in any two implementations that round differently
        diff = float((wa[k] - wb[k]).norm() / wa[k].norm().clamp_min(1e-2))
        assert diff <= wrel, (k, diff)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_streaming_equals_resident_fp32(corpus: Path, tmp_path: Path, model: str) -> None:
    over = {"model": {"name": model}}
    _run(corpus, tmp_path / "r", over=over, execution="resident")
    s = _run(corpus, tmp_path / "s", over=over, execution="streaming")
    assert s["executor"] == "streaming"
    _assert_same_run(tmp_path / "r", tmp_path / "s", rel=1e-5, wrel=1e-5)


@pytest.mark.parametrize("recompute", ["always", "never"])
def test_accumulation_clipping_schedule_identical(corpus: Path, tmp_path: Path, recompute: str) -> None:
    """micro-batches (accumulation), clipping at a norm that bites, the warmup + cosine schedule."""
    over = {"train_input": {"micro_batch_size": 2}, "optimizer": {"max_gradient_norm": 0.5}}
    _run(corpus, tmp_path / "r", over=over, execution="resident")
    _run(corpus, tmp_path / "s", over=over, execution="streaming", recompute=recompute)
    rows = _metrics(tmp_path / "s")
    assert any(r["grad_norm"] > 0.5 for r in rows)  # clipping was active
    assert rows[0]["recompute"] is (recompute == "always")
    _assert_same_run(tmp_path / "r", tmp_path / "s", rel=1e-5, wrel=1e-4)


def test_no_clipping_updates_eagerly_and_matches(corpus: Path, tmp_path: Path) -> None:
    over = {"optimizer": {"max_gradient_norm": None}, "model": {"name": "llama-tiny"}}
    _run(corpus, tmp_path / "r", over=over, execution="resident")
    s = _run(corpus, tmp_path / "s", over=over, execution="streaming")
    assert s["update_policy"] == "eager"
    _assert_same_run(tmp_path / "r", tmp_path / "s", rel=1e-5, wrel=1e-5)


def test_bf16_within_tolerance(corpus: Path, tmp_path: Path) -> None:
    over = {"model": {"mixed_precision": True, "fp16_type": "bfloat16"}}
    _run(corpus, tmp_path / "r", over=over, execution="resident")
    _run(corpus, tmp_path / "s", over=over, execution="streaming")
    assert _metrics(tmp_path / "s")[0]["bytes_in"] < _metrics(tmp_path / "s")[0]["bytes_out"]  # bf16 in, fp32 out
    _assert_same_run(tmp_path / "r", tmp_path / "s", rel=2e-3, wrel=2e-2)


def test_fp16_dynamic_loss_scaling_matches_grad_scaler() -> None:
    """Executors driven directly (the trainer's fp16 matmul-peak probe takes minutes on a CPU)."""
    from waferscale.params import OptimizerParams
    from waferscale.models import build
    from waferscale.models.registry import config_from_name
    from waferscale.runtime.executor import ResidentExecutor
    from waferscale.runtime.loss_scale import LossScaler
    from waferscale.runtime.memoryx import MemoryX
    from waferscale.runtime.optim import build_optimizer
    from waferscale.runtime.streaming import StreamingExecutor, build_skeleton

    cfg = config_from_name("gpt-tiny", vocab_size=64, max_seq_len=16)
    opt = OptimizerParams(optimizer_type="AdamW", learning_rate=1e-3, max_gradient_norm=1.0,
                          loss_scaling_factor="dynamic")
    torch.manual_seed(0)
    model = build(cfg, device="cpu")
    mx = MemoryX(model, opt, stream_dtype=torch.float16, max_gradient_norm=1.0,
                 loss_scaler=LossScaler.from_config("dynamic"))
    st = StreamingExecutor(build_skeleton(cfg), mx, device=torch.device("cpu"), half_dtype="float16")
    res = ResidentExecutor(model, build_optimizer(model.parameters(), opt), device=torch.device("cpu"),
                           half_dtype="float16", max_gradient_norm=1.0, loss_scaling_factor="dynamic")
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
        a, b = res.train_step(x, y, 1e-3), st.train_step(x, y, 1e-3)
        assert b.loss == pytest.approx(a.loss, rel=2e-3) and b.skipped == a.skipped
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=2e-2)
    assert mx.scaler.scale == res.scaler.get_scale()
    assert mx.optimizer_state_dict()["grad_scaler"]["scale"] == res.optimizer_state()["grad_scaler"]["scale"]
    st.close()


def test_checkpoints_interchange_with_resident(corpus: Path, tmp_path: Path) -> None:
    """streaming for 4 steps, then resident resumes from its checkpoint: the same run as resident throughout."""
    _run(corpus, tmp_path / "r", execution="resident")
    mixed = tmp_path / "mixed"
    _run(corpus, mixed, execution="streaming", num_steps=4)
    _run(corpus, mixed, execution="resident")
    _assert_same_run(tmp_path / "r", mixed, rel=1e-5, wrel=1e-5)


# muP's scalings and three learning-rate scales that split a block's matrices into runs (attention, the MLP's input,
# its output) and the embeddings from the head: MemoryX steps each run with its resident group's rate and decay
MUP = {"model": {"embeddings_scale": 10.0, "output_logits_scale": 0.25, "scale_qk_dot_by_d": True},
       "optimizer": {"adjust_learning_rate": {"decoder_attention": 0.5, "decoder_output_ffn": 0.25,
                                              "embedding": 2.0}}}


@pytest.mark.slow
def test_mup_streams_and_runs_on_two_systems_as_resident(corpus: Path, tmp_path: Path) -> None:
    """A muP config: streaming and --num_csx 2 give the resident run; checkpoints interchange both ways (4 steps on
    two systems then resident resumes; 4 resident steps then streaming resumes)."""
    _run(corpus, tmp_path / "r", over=MUP, execution="resident")
    _run(corpus, tmp_path / "s", over=MUP, execution="streaming")
    _assert_same_run(tmp_path / "r", tmp_path / "s", rel=1e-5, wrel=1e-5)
    two = tmp_path / "two"
    assert _run(corpus, two, over=MUP, execution="streaming", num_csx=2, num_steps=4)["executor"] == "swarmx"
    _run(corpus, two, over=MUP, execution="resident")
    _assert_same_run(tmp_path / "r", two, rel=1e-5, wrel=1e-5)
    back = tmp_path / "back"
    _run(corpus, back, over=MUP, execution="resident", num_steps=4)
    _run(corpus, back, over=MUP, execution="streaming")
    _assert_same_run(tmp_path / "r", back, rel=1e-5, wrel=1e-5)


def test_mup_groups_are_the_resident_ones_and_a_checkpoint_must_have_them() -> None:
    from waferscale.errors import CheckpointError
    from waferscale.models import build
    from waferscale.models.mup import lr_adjustment
    from waferscale.models.registry import config_from_name
    from waferscale.runtime.memoryx import MemoryX
    from waferscale.runtime.optim import OptimizerSpec, build_optimizer
    from waferscale.zoo.lm import adjust_learning_rates

    scales = MUP["optimizer"]["adjust_learning_rate"]
    model = build(config_from_name("gpt-tiny", vocab_size=64, max_seq_len=16))
    spec = OptimizerSpec("AdamW", learning_rate=1e-3, weight_decay=0.1)
    resident = build_optimizer(model.parameters(), spec)
    adjust_learning_rates(resident, model.named_parameters(), scales)
    mup, plain = MemoryX(model, spec, lr_scale=lambda n: lr_adjustment(n, scales)), MemoryX(model, spec)
    want = resident.state_dict()["param_groups"]
    got = mup.optimizer_state_dict()["param_groups"]
    assert [(g["params"], g["weight_decay"], g.get("adjust_learning_rate")) for g in got] == \
        [(g["params"], g["weight_decay"], g.get("adjust_learning_rate")) for g in want]
    with pytest.raises(CheckpointError, match="adjust_learning_rate"):  # indices would name other parameters
        mup.load_optimizer_state_dict(plain.optimizer_state_dict())
    mup.close()
    plain.close()


def test_device_budget_a_tenth_of_the_state(corpus: Path, tmp_path: Path) -> None:
    """weights + optimizer state are 10x --device_memory_mb; the reported peak working set stays within it."""
    over = {"model": {"name": "gpt-tiny", "hidden_size": 64, "num_hidden_layers": 24, "num_heads": 4},
            "train_input": {"batch_size": 2, "max_sequence_length": 16}, "runconfig": {"max_steps": 3}}
    d = tiny_params(corpus, tmp_path / "m")
    for k, v in over.items():
        d[k].update(v)
    params = params_from_dict(d, source="test")
    n = params.model.to_model_config().num_params
    state_bytes = n * 12  # fp32 weights + AdamW's two moments
    budget_mb = state_bytes / 10 / 2**20
    s = run(params, RunOptions(model_dir=tmp_path / "m", progress=False, device_memory_mb=budget_mb),
            out=io.StringIO())
    assert s["executor"] == "streaming" and "exceed" in s["execution_reason"]  # auto chose streaming
    assert 0 < s["peak_memory_bytes"] <= budget_mb * 2**20
    rows = _metrics(tmp_path / "m")
    assert all(r["peak_device_bytes"] <= budget_mb * 2**20 for r in rows)
    assert math.isfinite(s["final_loss"])


def test_observability_fields_and_trace(corpus: Path, tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    s = _run(corpus, tmp_path / "s", execution="streaming", trace=str(trace))
    row = _metrics(tmp_path / "s")[1]
    for key in ("wait_weights_s", "compute_s", "grad_writeback_s", "optimizer_s", "bytes_in", "bytes_out",
                "stream_bandwidth_Bps", "no_stall", "no_stall_tokens_needed", "peak_device_bytes"):
        assert key in row, key
    assert s["streaming"]["bytes_in"] == sum(r["bytes_in"] for r in _metrics(tmp_path / "s"))
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"main", "prefetch"} <= lanes
    assert any(e["name"].startswith("backward unit") for e in events)


def _cli_error(tmp_path: Path, *extra: str, over: dict | None = None) -> str:
    import yaml

    d = tiny_params(tmp_path / "corpus", tmp_path / "md")
    for k, v in (over or {}).items():
        d[k].update(v)
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(d))
    r = wsc("run", "-p", str(p), "--no_progress", *extra)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert not list((tmp_path / "md").glob("checkpoint_*"))  # nothing half-written
    return lines[0]


@pytest.mark.parametrize("case", ["num_csx0", "split", "budget", "flash"])
@pytest.mark.slow
def test_bad_input_exits_2_with_one_line(corpus: Path, tmp_path: Path, case: str) -> None:
    if case == "num_csx0":
        assert "--num_csx" in _cli_error(tmp_path, "--num_csx", "0")
    elif case == "split":
        assert "does not split evenly" in _cli_error(tmp_path, "--num_csx", "3")
    elif case == "budget":
        assert "smaller than one unit" in _cli_error(tmp_path, "--execution", "streaming",
                                                     "--device_memory_mb", "0.01")
    else:
        blocker = tmp_path / "a_file"
        blocker.write_text("not a directory")
        msg = _cli_error(tmp_path, "--execution", "streaming", "--memoryx_ram_mb", "0.05",
                         "--flash_dir", str(blocker / "flash"))
        assert "not writable" in msg
