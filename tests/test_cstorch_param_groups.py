"""A user's own param groups (different rates, weight decay and tags, each group's rate set by its own scheduler)
stream through MemoryX as they are: the same losses, weights and optimizer state dict as on the "CPU" backend.
Also a script (the two-system run relaunches it):

    python tests/test_cstorch_param_groups.py --num_csx 2 --out weights.safetensors
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch
import pytest
from safetensors.torch import load_file, save_file
from torch import nn

import waferscale.pytorch as cstorch
from waferscale.errors import ConfigError
from user_models import TutorialLM, batches

STEPS = 6


ROOT = Path(__file__).resolve().parents[1]


def run(backend: str, tmp: Path, steps: int = STEPS, start: Path | None = None, save_to: Path | None = None,
        num_csx: int = 1, decay_rate: float = 0.1, bind_first: bool = False):
    torch.manual_seed(0)
    model = TutorialLM(dropout=0.0)
    cluster = cstorch.distributed.ClusterConfig(num_csx=num_csx)
    compiled = cstorch.compile(model, cstorch.backend(backend, artifact_dir=str(tmp), cluster_config=cluster))
    named = list(model.named_parameters())
    # the head's weight joins the vectors: the groups cut across MemoryX's matrices-then-vectors runs of a unit
    decay = [p for n, p in named if p.ndim >= 2 and n != "head.weight"]
    rest = [p for n, p in named if p.ndim < 2 or n == "head.weight"]
    opt = cstorch.optim.AdamW([{"params": decay, "weight_decay": decay_rate, "tags": "decay"},
                               {"params": rest, "weight_decay": 0.0, "lr": 1e-3, "tags": "rest",
                                "adjust_learning_rate": 0.5}], lr=3e-3, betas=(0.8, 0.95))
    schedulers = [cstorch.optim.lr_scheduler.LinearLR(opt, initial_learning_rate=3e-2, end_learning_rate=1e-3,
                                                      total_iters=STEPS, param_group_tags="decay"),
                  cstorch.optim.lr_scheduler.LinearLR(opt, initial_learning_rate=1e-2, end_learning_rate=5e-2,
                                                      total_iters=STEPS, param_group_tags="rest")]
    data = batches(STEPS)
    first, losses = 0, []
    if bind_first:
        compiled(data[0][0])  # binds the optimizer to MemoryX before the load (a forward alone changes nothing)
    if start is not None:
        s = cstorch.load(start)
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["optimizer"])
        for sch, st in zip(schedulers, s["schedulers"]):
            sch.load_state_dict(st)
        first = s["global_step"]
    for x, y in data[first:steps]:
        logits = compiled(x)
        loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1).to(logits.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        for sch in schedulers:
            sch.step()
        losses.append(loss.item())
    if save_to is not None:
        cstorch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                      "schedulers": [s.state_dict() for s in schedulers], "global_step": steps}, save_to)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, weights, opt


def rel(a: dict, b: dict) -> float:
    fa = torch.cat([a[k].float().reshape(-1) for k in sorted(a)])
    fb = torch.cat([b[k].float().reshape(-1) for k in sorted(b)])
    return float((fa - fb).norm() / fb.norm())


def test_param_groups_stream_as_they_train_on_cpu(tmp_path):
    cpu_l, cpu_w, cpu_opt = run("CPU", tmp_path)
    csx_l, csx_w, csx_opt = run("CSX", tmp_path)
    assert csx_opt._stream is not None and csx_opt._stream.mx is not None  # really streamed through MemoryX
    assert len(csx_l) == STEPS and csx_l[-1] < csx_l[0]
    for a, b in zip(csx_l, cpu_l):
        assert abs(a - b) <= 1e-5 * abs(b), (csx_l, cpu_l)
    assert rel(csx_w, cpu_w) < 1e-5
    # MemoryX's state dict is the user's optimizer's: its groups' settings and numbering, its state per index
    cpu_sd, csx_sd = cpu_opt.state_dict(), csx_opt.state_dict()
    assert csx_sd["param_groups"] == cpu_sd["param_groups"]
    assert cpu_sd["param_groups"][1]["lr"] != cpu_sd["param_groups"][0]["lr"]
    assert csx_sd["state"].keys() == cpu_sd["state"].keys()
    for i, st in cpu_sd["state"].items():
        assert csx_sd["state"][i].keys() == st.keys()
        for k, v in st.items():
            torch.testing.assert_close(torch.as_tensor(csx_sd["state"][i][k]).float(), torch.as_tensor(v).float(),
                                       rtol=1e-4, atol=1e-6)


def test_param_groups_checkpoint_round_trips_both_ways(tmp_path):
    """3 steps, cstorch.save, a fresh run loads and trains 3 more: the 6-step weights, streamed from a streamed
    checkpoint (also into an optimizer built with other settings) and from one the CPU backend wrote (the same
    numbering)."""
    _, full, _ = run("CSX", tmp_path)
    run("CSX", tmp_path, steps=3, save_to=tmp_path / "csx3.mdl")
    _, resumed, _ = run("CSX", tmp_path, start=tmp_path / "csx3.mdl")
    assert rel(resumed, full) < 1e-6
    # built with another weight decay, the optimizer takes the checkpoint's (as torch's load_state_dict does)
    _, other_decay, opt = run("CSX", tmp_path, start=tmp_path / "csx3.mdl", decay_rate=0.5, bind_first=True)
    assert opt.param_groups[0]["weight_decay"] == 0.1 and rel(other_decay, full) < 1e-6
    run("CPU", tmp_path, steps=3, save_to=tmp_path / "cpu3.mdl")
    _, from_cpu, _ = run("CSX", tmp_path, start=tmp_path / "cpu3.mdl")
    assert rel(from_cpu, full) < 1e-5


def test_groups_that_leave_out_a_parameter_are_named(tmp_path):
    model = TutorialLM(dropout=0.0)
    compiled = cstorch.compile(model, cstorch.backend("CSX", artifact_dir=str(tmp_path)))
    opt = cstorch.optim.AdamW([p for n, p in model.named_parameters() if n != "ln_f.bias"], lr=1e-3)
    with pytest.raises(ConfigError, match=r"leaves out parameters of the model \(ln_f.bias\)"):
        compiled(batches(1)[0][0])
    assert opt._stream is None


@pytest.mark.slow
def test_param_groups_on_two_systems_equal_cpu(tmp_path):
    _, cpu_w, _ = run("CPU", tmp_path)
    out = tmp_path / "two.safetensors"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, __file__, "--num_csx", "2", "--artifact_dir", str(tmp_path), "--out",
                        str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert rel(load_file(str(out)), cpu_w) < 1e-5


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--num_csx", type=int, default=1)
    ap.add_argument("--artifact_dir", default="artifacts")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    _, weights, _ = run("CSX", Path(a.artifact_dir), num_csx=a.num_csx)
    if cstorch.distributed.is_master():
        save_file({k: v.contiguous() for k, v in weights.items()}, a.out)
