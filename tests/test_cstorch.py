"""The cstorch-style API (`waferscale.pytorch`): weight streaming under a user's own training loop."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import waferscale.pytorch as cstorch
from waferscale.errors import CheckpointError, ConfigError
from waferscale.models import ModelConfig, build
from waferscale.runtime import optim as sched

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = ModelConfig(name="t-gpt", family="gpt", vocab_size=37, d_model=32, n_layer=3, n_head=4, max_seq_len=16)
TINY_LLAMA = ModelConfig(name="t-llama", family="llama", vocab_size=37, d_model=32, n_layer=2, n_head=4, n_kv_head=2,
                         max_seq_len=16, norm="rmsnorm", activation="swiglu", position="rotary", tie_embeddings=False,
                         attn_bias=False, mlp_bias=False)


def batches(n: int, b: int = 4, t: int = 16, vocab: int = 37) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (b, t + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def train(backend_type: str, make_model, steps: int = 6, *, opt: str = "AdamW", clip: float | None = None,
          half: str | None = None, scaler: bool = False, scaler_clip: float | None = None, tmp: Path | None = None,
          **backend_kw):
    torch.manual_seed(0)
    model = make_model()
    cstorch.amp.set_half_dtype(half)
    try:
        # on the host, where a GPU is present too: these compare arithmetic with the CPU backend's (dropout's random
        # masks included); tests/test_gpu.py runs the GPU
        backend_kw.setdefault("device", "cpu")
        backend = cstorch.backend(backend_type, artifact_dir=str(tmp or "artifacts"), **backend_kw)
        compiled = cstorch.compile(model, backend)
        optimizer = cstorch.optim.configure_optimizer(opt, model.parameters(), lr=1e-2, weight_decay=0.1)
        schedule = cstorch.optim.lr_scheduler.CosineDecayLR(optimizer, initial_learning_rate=1e-2,
                                                            end_learning_rate=1e-3, total_iters=steps)
        grad_scaler = cstorch.amp.GradScaler(loss_scale="dynamic", max_gradient_norm=scaler_clip) if scaler else None
        loss_fn = nn.CrossEntropyLoss()
        losses: list[float] = []

        @cstorch.trace
        def step(x, y):
            logits = compiled(x)
            loss = loss_fn(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
            if clip or grad_scaler:
                cstorch.amp.optimizer_step(loss, optimizer, grad_scaler, clip)
            else:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            schedule.step()
            return loss

        @cstorch.step_closure
        def record(loss):
            losses.append(loss.item())

        executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: batches(2)),
                                                   num_steps=steps)
        for x, y in executor:
            record(step(x, y))
        weights = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
        return losses, weights, optimizer
    finally:
        cstorch.amp.set_half_dtype(None)


def assert_close_weights(a: dict, b: dict, rtol: float) -> None:
    """Relative error of all weights together (a key-projection bias has a zero gradient in exact arithmetic,
    so per tensor it is pure rounding noise, which Adam scales up to the learning rate)."""
    assert a.keys() == b.keys()
    fa = torch.cat([a[k].float().reshape(-1) for k in sorted(a)])
    fb = torch.cat([b[k].float().reshape(-1) for k in sorted(b)])
    err = (fa - fb).norm() / fb.norm()
    assert err < rtol, f"relative error {err:.2e}"


@pytest.mark.parametrize("cfg", [TINY_GPT, TINY_LLAMA], ids=["gpt", "llama"])
def test_streaming_equals_resident_fp32(cfg, tmp_path):
    lr, wr, _ = train("CPU", lambda: build(cfg), tmp=tmp_path)
    ls, ws, opt = train("CSX", lambda: build(cfg), tmp=tmp_path)
    assert opt._stream is not None and opt._stream.mx is not None  # really streamed through MemoryX
    assert len(lr) == 6 and lr[-1] < lr[0]
    for a, b in zip(ls, lr):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert_close_weights(ws, wr, 1e-5)


def test_streaming_clipping_and_lion_equal_resident(tmp_path):
    lr, wr, _ = train("CPU", lambda: build(TINY_GPT), opt="Lion", clip=0.05, tmp=tmp_path)
    ls, ws, opt = train("CSX", lambda: build(TINY_GPT), opt="Lion", clip=0.05, tmp=tmp_path)
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.05  # the clip was active
    for a, b in zip(ls, lr):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert_close_weights(ws, wr, 1e-5)


def test_the_grad_scalers_own_clip_streams_as_it_clips_resident(tmp_path):
    ref, wr, _ = train("CPU", lambda: build(TINY_GPT), opt="Lion", clip=0.05, scaler=True, tmp=tmp_path)
    lr, w1, _ = train("CPU", lambda: build(TINY_GPT), opt="Lion", scaler=True, scaler_clip=0.05, tmp=tmp_path)
    ls, ws, opt = train("CSX", lambda: build(TINY_GPT), opt="Lion", scaler=True, scaler_clip=0.05, tmp=tmp_path)
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.05  # MemoryX clipped
    for a, b, c in zip(ls, lr, ref):
        assert abs(a - b) <= 1e-5 * abs(b) and abs(b - c) <= 1e-6 * abs(c)
    assert_close_weights(ws, wr, 1e-5)


def test_adafactor_configured_by_name_streams_as_it_trains_resident(tmp_path):
    """Model Zoo's spelling, Cerebras' defaults (relative_step False: the scheduler's rate, scaled by each
    parameter's RMS); MemoryX steps each parameter whole and keeps the factored state, in torch's format."""
    lr, wr, _ = train("CPU", lambda: build(TINY_GPT), opt="AdaFactor", tmp=tmp_path)
    ls, ws, opt = train("CSX", lambda: build(TINY_GPT), opt="AdaFactor", tmp=tmp_path)
    assert isinstance(opt, cstorch.optim.Adafactor) and not opt.defaults["relative_step"]
    assert ls == pytest.approx(lr, rel=1e-5) and lr[-1] < lr[0]
    assert max(float((wr[k] - ws[k]).abs().max()) for k in wr) < 1e-5
    state = opt.state_dict()["state"]
    assert any("exp_avg_sq_row" in st for st in state.values()) and not any("exp_avg" in st for st in state.values())


def test_streaming_bf16_with_loss_scaling_tracks_resident(tmp_path):
    lr, _, _ = train("CPU", lambda: build(TINY_GPT), half="bfloat16", scaler=True, tmp=tmp_path)
    ls, _, opt = train("CSX", lambda: build(TINY_GPT), half="bfloat16", scaler=True, tmp=tmp_path)
    assert opt._stream.mx.stream_dtype == torch.bfloat16
    for a, b in zip(ls, lr):  # bf16 weights and matmuls: documented tolerance 2%
        assert abs(a - b) <= 2e-2 * abs(b)


def test_a_plain_sequential_model_streams_layer_by_layer(tmp_path):
    def mlp():
        return nn.Sequential(nn.Embedding(37, 16), nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 37))

    lr, wr, _ = train("CPU", mlp, tmp=tmp_path)
    ls, ws, opt = train("CSX", mlp, tmp=tmp_path)
    assert opt._stream.n == 5  # one unit per child; dropout masks are replayed in the recomputation
    for a, b in zip(ls, lr):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert_close_weights(ws, wr, 1e-5)


def test_device_budget_smaller_than_two_units_is_refused(tmp_path):
    torch.manual_seed(0)
    model = build(TINY_GPT)
    compiled = cstorch.compile(model, cstorch.backend("CSX", artifact_dir=str(tmp_path), device_memory_mb=0.001))
    cstorch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match="budget smaller than two units"):
        compiled(torch.zeros(1, 4, dtype=torch.long))


def test_lamb_trains_resident_and_is_refused_with_streaming(tmp_path):
    losses, _, _ = train("CPU", lambda: build(TINY_GPT), opt="Lamb", tmp=tmp_path)
    assert losses[-1] < losses[0]
    with pytest.raises(ConfigError, match="trust ratio"):
        train("CSX", lambda: build(TINY_GPT), opt="Lamb", tmp=tmp_path)


def test_lr_schedulers_follow_cerebras_formulas():
    p = [nn.Parameter(torch.zeros(2))]
    opt = cstorch.optim.SGD(p, lr=0.0)
    lin = cstorch.optim.lr_scheduler.LinearLR(opt, initial_learning_rate=1.0, end_learning_rate=0.0, total_iters=4)
    cos = cstorch.optim.lr_scheduler.CosineDecayLR(opt, initial_learning_rate=0.5, end_learning_rate=0.1,
                                                   total_iters=10)
    seq = cstorch.optim.lr_scheduler.SequentialLR(opt, [lin, cos], milestones=[4])
    want = sched.Sequential((sched.Polynomial(1.0, 0.0, 4), sched.CosineDecay(0.5, 0.1, 10)), (0, 4))
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        seq.step()
    assert seen == pytest.approx([want(s) for s in range(12)])
    state = seq.state_dict()
    again = cstorch.optim.lr_scheduler.SequentialLR(opt, [lin, cos], milestones=[4])
    again.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == pytest.approx(want(12))
    with pytest.raises(ConfigError, match="milestones"):
        cstorch.optim.lr_scheduler.SequentialLR(opt, [lin, cos], milestones=[])
    assert cstorch.optim.AdamW(p).defaults["eps"] == 1e-6


def test_closures_run_after_the_step_and_on_checkpoint_steps_only():
    events: list[str] = []

    @cstorch.step_closure
    def log(v):
        events.append(f"log{v}")

    @cstorch.checkpoint_closure
    def ckpt(step):
        events.append(f"ckpt{step}")

    @cstorch.trace
    def step(v):
        log(v)
        events.append(f"body{v}")
        return v

    ex = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: [1, 2, 3]), num_steps=5,
                                         checkpoint_steps=2)
    finals = []
    for batch in ex:
        step(batch)
        ckpt(ex.user_iteration)
        finals.append(ex.on_final_iteration)
    assert events == ["body1", "log1", "body2", "log2", "ckpt2", "body3", "log3", "body1", "log1", "ckpt4",
                      "body2", "log2", "ckpt5"]
    assert finals == [False, False, False, False, True]
    assert ex.iteration == 5 and ex.profiler.rate_tracker.total_samples == 5


@pytest.mark.parametrize("suffix", [".mdl", ".safetensors"])
def test_save_load_round_trip_and_partial_files_are_refused(tmp_path, suffix):
    """The name picks the format (a .mdl path: Cerebras' HDF5, as a Cerebras script saves it; else ours)."""
    model = build(TINY_GPT)  # tied embeddings: two names, one tensor
    state = {"model": model.state_dict(), "global_step": 7, "schedulers": [{"last_epoch": 7}], "name": "x",
             "pair": (1, 2.5), "none": None}
    path = tmp_path / f"checkpoint_7{suffix}"
    cstorch.save(state, path)
    assert (path.read_bytes()[:8] == b"\x89HDF\r\n\x1a\n") == (suffix == ".mdl")
    back = cstorch.load(path)
    assert back["global_step"] == 7 and back["schedulers"] == [{"last_epoch": 7}] and back["pair"] == (1, 2.5)
    assert back["none"] is None and back["name"] == "x"
    for k, v in state["model"].items():
        assert torch.equal(back["model"][k], v)
    data = path.read_bytes()
    (tmp_path / "cut.mdl").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a complete checkpoint|partially written"):
        cstorch.load(tmp_path / "cut.mdl")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        cstorch.load(tmp_path / "missing.mdl")
    assert not list(tmp_path.glob(".*tmp*"))


def test_streamed_checkpoint_resumes_exactly(tmp_path):
    """Train 6 steps; or train 3, save model + optimizer + scheduler with cstorch.save, rebuild everything in
    a fresh model, load, train 3 more: the same weights."""
    def run(steps, start=None, save_to=None):
        torch.manual_seed(0)
        model = build(TINY_GPT)
        compiled = cstorch.compile(model, cstorch.backend("CSX", artifact_dir=str(tmp_path), device="cpu"))
        opt = cstorch.optim.AdamW(model.parameters(), lr=1e-2)
        sch = cstorch.optim.lr_scheduler.LinearLR(opt, initial_learning_rate=1e-2, end_learning_rate=0.0,
                                                  total_iters=6)
        data = batches(6)
        first = 0
        compiled(data[0][0])  # binds MemoryX (a forward without backward changes nothing)
        if start is not None:
            s = cstorch.load(start)
            model.load_state_dict(s["model"])
            opt.load_state_dict(s["optimizer"])
            sch.load_state_dict(s["schedulers"][0])
            first = s["global_step"]
        for x, y in data[first:steps]:
            loss = nn.functional.cross_entropy(compiled(x).view(-1, 37), y.reshape(-1))
            loss.backward()
            opt.step()
            sch.step()
        if save_to:
            cstorch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                          "schedulers": [sch.state_dict()], "global_step": steps}, save_to)
        return {k: v.clone() for k, v in model.state_dict().items()}

    full = run(6)
    run(3, save_to=tmp_path / "c3.mdl")
    resumed = run(6, start=tmp_path / "c3.mdl")
    assert_close_weights(resumed, full, 1e-6)


def test_bad_input_is_named():
    with pytest.raises(ConfigError, match="not one of CSX, CPU, GPU"):
        cstorch.backend("TPU")
    with pytest.raises(ConfigError, match="num_csx"):
        cstorch.distributed.ClusterConfig(num_csx=0)
    with pytest.raises(ConfigError, match="needs the \"CSX\" backend"):
        cstorch.backend("CPU", cluster_config=cstorch.distributed.ClusterConfig(num_csx=2))
    from waferscale.pytorch.utils.data import _shard

    with pytest.raises(ConfigError, match="does not split evenly over num_csx 2"):
        _shard(torch.zeros(3, 4), 0, 2)
    with pytest.raises(ConfigError, match="function that returns"):
        cstorch.utils.data.DataLoader([1, 2])
    with pytest.raises(ConfigError, match="optimizer_type"):
        cstorch.optim.configure_optimizer("Adafactr", [nn.Parameter(torch.zeros(1))])
    with pytest.raises(ConfigError, match="relative_step=True exclude"):  # (Cerebras' Adafactor takes its rate)
        cstorch.optim.configure_optimizer("AdaFactor", [nn.Parameter(torch.zeros(1))], lr=0.1, relative_step=True)


def _example(tmp: Path, *args: str) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "cstorch_train.py"), "--steps", "4",
                          "--checkpoint_steps", "2", "--artifact_dir", str(tmp), *args],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp / "checkpoint_2.mdl").exists() and (tmp / "checkpoint_4.mdl").exists()
    return [float(line.split()[3]) for line in out.stdout.splitlines() if line.startswith("step")]


@pytest.mark.slow
def test_the_example_script_with_two_systems_equals_one(tmp_path):
    one = _example(tmp_path / "one")
    two = _example(tmp_path / "two", "--num_csx", "2")
    resident = _example(tmp_path / "cpu", "--backend", "CPU")
    assert len(one) == 4 and all(math.isfinite(v) for v in one)
    assert one == pytest.approx(two, rel=1e-4) and one == pytest.approx(resident, rel=1e-4)
    w1 = cstorch.load(tmp_path / "one" / "checkpoint_4.mdl")["model"]
    w2 = cstorch.load(tmp_path / "two" / "checkpoint_4.mdl")["model"]
    assert_close_weights(w2, w1, 1e-5)


@pytest.mark.slow
def test_a_system_that_dies_is_named_and_checkpoints_stay_loadable(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "WSC_SWARMX_FAULT": "1:3:die"}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "cstorch_train.py"), "--steps", "6",
                          "--checkpoint_steps", "2", "--num_csx", "2", "--artifact_dir", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0
    assert "SwarmX: system 1 (rank 1) died (exit code 17)" in out.stderr
    assert cstorch.load(tmp_path / "checkpoint_2.mdl")["global_step"] == 2
    assert not (tmp_path / "checkpoint_4.mdl").exists()


def test_compile_only_places_the_model_on_a_wafer_and_runs_no_steps(tmp_path):
    import json

    model = build(TINY_GPT)
    compiled = cstorch.compile(model, cstorch.backend("CSX", artifact_dir=str(tmp_path), compile_only=True))
    plan = json.loads((tmp_path / "compile" / "plan.json").read_text())
    assert plan and (tmp_path / "compile" / "wafer.png").exists()
    assert list(cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: [1]), num_steps=3)) == []
    with pytest.raises(ConfigError, match="compile_only"):
        compiled(torch.zeros(1, 4, dtype=torch.long))


def test_grad_scaler_clips_to_its_max_gradient_norm_and_refuses_unknown_arguments():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = cstorch.amp.GradScaler(loss_scale=64.0, max_gradient_norm=0.01)  # as Model Zoo passes it
    loss = (model(torch.randn(4, 8)) ** 2).sum() * 100
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert float(norm) == pytest.approx(0.01, rel=1e-4)  # unscaled, then clipped
    with pytest.raises(TypeError, match="overflow_tolerance"):
        cstorch.amp.GradScaler(overflow_tolerance=0.1)  # not one of its arguments: not silently ignored
    with pytest.raises(ConfigError, match="max_gradient_norm must be positive"):
        cstorch.amp.GradScaler(max_gradient_norm=0)


def test_backend_and_executor_name_cerebras_arguments_and_refuse_unknown_ones(tmp_path):
    with pytest.warns(UserWarning, match="retrace_every_iteration accepted as Cerebras' cstorch.backend takes them"):
        cstorch.backend("CPU", artifact_dir=str(tmp_path), retrace_every_iteration=False)  # Model Zoo passes it
    with pytest.raises(TypeError, match="unexpected keyword argument.*artifact_dri"):
        cstorch.backend("CPU", artifact_dri=str(tmp_path))  # a typo is not swallowed
    loader = cstorch.utils.data.DataLoader(lambda: batches(2))
    with pytest.warns(UserWarning, match="listeners accepted"):
        cstorch.utils.data.DataExecutor(loader, num_steps=1, listeners=[])
    with pytest.raises(TypeError, match="num_step"):
        cstorch.utils.data.DataExecutor(loader, num_step=1)


def test_importing_cstorch_changes_nothing_in_torch() -> None:
    """A library changes nothing global on import: `model.apply(sparsity)` works through torch's own
    `Module.apply` (the algorithm is the function it calls), which stays torch's."""
    code = ("import torch; apply = torch.nn.Module.apply; import waferscale.pytorch as cstorch; "
            "assert torch.nn.Module.apply is apply; m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), "
            "torch.nn.Sequential(torch.nn.Linear(8, 4))); "
            "s = cstorch.sparse.configure({'algorithm': 'static', 'sparsity': 0.5}); m.apply(s); "
            "names = sorted(n for n, _ in m.named_buffers()); assert names == ['0.weight_mask', '2.0.weight_mask'], "
            "names; assert abs(float(m[0].weight_mask.float().mean()) - 0.5) < 0.02")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_two_runs_in_one_process_share_no_state(tmp_path):
    """A run's backend, half dtype, optimizers (what MemoryX binds) and traced steps are its own
    (pytorch/context.py): a second run in the same process, scoped by run_context() or after reset(), starts from
    none of them, and the first is current again after the block."""
    from waferscale.pytorch.optim import find_optimizer

    def train(half):
        cstorch.amp.set_half_dtype(half)
        torch.manual_seed(0)
        model = build(TINY_GPT)
        compiled = cstorch.compile(model, cstorch.backend("CSX", artifact_dir=str(tmp_path), device="cpu"))
        opt = cstorch.optim.SGD(model.parameters(), lr=1e-2)
        x, y = batches(1)[0]
        nn.functional.cross_entropy(compiled(x).float().view(-1, 37), y.reshape(-1)).backward()
        opt.step()
        compiled.close()
        return model, cstorch.current_backend()

    with cstorch.run_context():
        first, b1 = train("bfloat16")
        with cstorch.run_context():
            assert cstorch.amp.half_dtype() is None and cstorch.current_backend() is None
            assert find_optimizer(first) is None  # the other run's optimizer is not this run's to bind
            second, b2 = train(None)
        assert cstorch.amp.half_dtype() is torch.bfloat16 and cstorch.current_backend() is b1 is not b2
        assert find_optimizer(first) is not None
        cstorch.reset()
        assert cstorch.amp.half_dtype() is None and find_optimizer(first) is None


def test_compiled_models_close_and_leave_no_threads(tmp_path):
    """Twenty weight-streamed models, each compiled, stepped and closed (ten by `with`): every thread they
    started ends, and a closed model says so instead of stepping."""
    import threading

    before = {t.ident for t in threading.enumerate()}
    for i in range(20):
        torch.manual_seed(i)
        model = build(TINY_GPT)
        compiled = cstorch.compile(model, cstorch.backend("CSX", artifact_dir=str(tmp_path), device="cpu"))
        with compiled if i % 2 else contextlib.nullcontext(compiled):
            opt = cstorch.optim.SGD(model.parameters(), lr=1e-2)
            x, y = batches(1)[0]
            nn.functional.cross_entropy(compiled(x).view(-1, 37), y.reshape(-1)).backward()
            opt.step()
        if not i % 2:
            compiled.close()
        compiled.close()  # (idempotent)
        with pytest.raises(ConfigError, match="was closed"):
            compiled(x)
    left = [t.name for t in threading.enumerate() if t.ident not in before]
    assert not left, left


def test_cluster_config_takes_the_appliance_jobs_number_of_systems(monkeypatch):
    """A script submitted to the appliance (`wsc submit --script S.py --num_csx N`) gets N in $WSC_NUM_CSX:
    ClusterConfig() defaults to it; an explicit num_csx wins; a bad value is named."""
    monkeypatch.delenv("WSC_NUM_CSX", raising=False)
    assert cstorch.distributed.ClusterConfig().num_csx == 1
    monkeypatch.setenv("WSC_NUM_CSX", "3")
    assert cstorch.distributed.ClusterConfig().num_csx == 3
    assert cstorch.distributed.ClusterConfig(num_csx=2).num_csx == 2
    monkeypatch.setenv("WSC_NUM_CSX", "two")
    with pytest.raises(ConfigError, match="WSC_NUM_CSX='two'"):
        cstorch.distributed.ClusterConfig()


@pytest.mark.slow
def test_two_systems_from_python_m_and_a_clear_refusal_from_python_c(tmp_path):
    """num_csx=2 runs the script once more per system: started as `python -m MODULE` its copy runs the same module
    (sys.argv[0] alone would be the bare file, outside its package); from `python -c` there is no script to run
    again, which is said instead of starting a copy that does something else."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("WHO = 'helper'\n")
    (pkg / "job.py").write_text(
        "from .helper import WHO  # a relative import: fails if the copy runs the bare file\n"
        "import sys\n"
        "import waferscale.pytorch as cstorch\n"
        f"b = cstorch.backend('CSX', artifact_dir={str(tmp_path / 'art')!r}, device='cpu',\n"
        "                     cluster_config=cstorch.distributed.ClusterConfig(num_csx=2))\n"
        "print(WHO, cstorch.distributed.rank(), cstorch.distributed.world_size(), sys.argv[1:], flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "mypkg.job", "--x", "1"], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "helper 0 2 ['--x', '1']" in r.stdout
    assert "helper 1 2 ['--x', '1']" in (tmp_path / "art" / "swarmx_rank1.log").read_text()
    r = subprocess.run([sys.executable, "-c", "import waferscale.pytorch as c; c.backend('CSX', "
                        "cluster_config=c.distributed.ClusterConfig(num_csx=2))"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "no script to run again (python -c" in r.stderr
