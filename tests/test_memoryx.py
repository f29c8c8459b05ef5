"""MemoryX: the flash tier keeps RSS within its RAM budget, trains like the RAM tier, masks, state-dict keys.

RSS margin (documented): peak RSS <= RSS before MemoryX is built (torch and the executor's code paths loaded)
+ RAM budget + 64 MiB. The 64 MiB covers what is not MemoryX's resident state; measured for the model below
(d=192, 30 blocks, 7.1 MiB of state per block): the streaming working set (<= 2 units' weights and gradients,
activations, ~8 MiB), the flash units mapped while fetched or updated (master, gradient, two moments: ~9 MiB) and
heap slack of small tensors and threads (~30 MiB). Growth measured here: ~80-90 MiB over a 48 MiB budget, against
~200 MiB of state; all in RAM it would be ~250 MiB.
"""

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import tiny_params
from waferscale.params import OptimizerParams, params_from_dict
from waferscale.errors import ConfigError
from waferscale.models import build
from waferscale.models.registry import config_from_name
from waferscale.runtime.memoryx import MemoryX
from waferscale.runtime.optim import build_optimizer
from waferscale.zoo.runner import RunOptions, run

MARGIN_MB = 64

_RSS_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from waferscale.params import OptimizerParams
    from waferscale.models.registry import config_from_name
    from waferscale.runtime.memoryx import MemoryX
    from waferscale.runtime.streaming import StreamingExecutor, build_skeleton

    def rss(field):
        for ln in open("/proc/self/status"):
            if ln.startswith(field):
                return int(ln.split()[1]) * 1024

    ram_mb, flash = float(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    cfg = config_from_name("gpt-tiny", vocab_size=256, d_model=192, n_layer=30, n_head=4, max_seq_len=32)
    opt = OptimizerParams(optimizer_type="AdamW", learning_rate=1e-3, max_gradient_norm=1.0)
    def tiny_step():  # warm-up: load the code paths (torch.func, meta registrations, SDPA) before measuring
        c = config_from_name("gpt-tiny", vocab_size=64, max_seq_len=16)
        ex = StreamingExecutor(build_skeleton(c), MemoryX(build_skeleton(c), opt, max_gradient_norm=1.0),
                               device=torch.device("cpu"))
        ex.train_step(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long), 1e-3)
        ex.close()

    tiny_step()
    torch.manual_seed(0)
    skeleton = build_skeleton(cfg)  # parameters on meta: MemoryX initialises unit by unit
    base = rss("VmRSS")
    mx = MemoryX(skeleton, opt, ram_budget_bytes=int(ram_mb * 2**20), flash_dir=flash, max_gradient_norm=1.0)
    ex = StreamingExecutor(build_skeleton(cfg), mx, device=torch.device("cpu"), recompute=True)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(3):
        x, y = torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)
        losses.append(ex.train_step(x, y, 1e-3).loss)
    mx.synchronize()
    print(json.dumps({"base": base, "peak": rss("VmHWM"), "state": mx.total_state_bytes, "ram": mx.ram_bytes(),
                      "flash": mx.flash_bytes(), "units_on_flash": mx.units_on_flash(), "losses": losses}))
    ex.close()
""")


@pytest.mark.slow
def test_flash_tier_keeps_rss_within_budget(tmp_path: Path) -> None:
    """A model whose state is 4x MemoryX's RAM budget trains; peak RSS <= base + budget + margin."""
    ram_mb = 48.0
    script = tmp_path / "rss.py"
    script.write_text(_RSS_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(ram_mb), str(tmp_path / "flash")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["state"] >= 4 * ram_mb * 2**20  # the state really is 4x the budget
    assert d["ram"] <= ram_mb * 2**20 and d["units_on_flash"] >= 10
    assert all(v == v for v in d["losses"])
    grown = (d["peak"] - d["base"]) / 2**20
    assert grown <= ram_mb + MARGIN_MB, f"RSS grew {grown:.0f} MiB for a {ram_mb:.0f} MiB budget"


def _run(corpus: Path, model_dir: Path, **opts: object) -> list[dict]:
    d = tiny_params(corpus, model_dir)
    run(params_from_dict(d, source="test"), RunOptions(model_dir=model_dir, progress=False, execution="streaming",
                                                       **opts), out=io.StringIO())
    return [json.loads(ln) for ln in (model_dir / "metrics.jsonl").read_text().splitlines()]


def test_flash_tier_trains_exactly_like_ram(tmp_path: Path) -> None:
    from waferscale.runtime.streaming import StreamingExecutor, build_skeleton

    cfg = config_from_name("llama-tiny", vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    model = build(cfg, device="cpu")
    opt = OptimizerParams(optimizer_type="AdamW", learning_rate=1e-3, max_gradient_norm=1.0)
    runs = []
    for budget, flash in ((None, None), (60_000, tmp_path / "flash")):
        mx = MemoryX(model, opt, ram_budget_bytes=budget, flash_dir=flash, max_gradient_norm=1.0)
        ex = StreamingExecutor(build_skeleton(cfg), mx, device=torch.device("cpu"))
        g = torch.Generator().manual_seed(1)
        losses = [ex.train_step(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g),
                                1e-3).loss for _ in range(4)]
        runs.append((losses, {k: v.clone() for k, v in ex.model_for_checkpoint().items()},
                     mx.optimizer_state_dict(), mx.units_on_flash(),
                     len(list((tmp_path / "flash").glob("run-*/unit*.exp_avg.bin")))))
        ex.close()
    (la, wa, sa, fa, _), (lb, wb, sb, fb, files) = runs
    assert fa == 0 and fb >= 2 and files >= 2  # in the run's own directory, while it runs
    assert not list((tmp_path / "flash").iterdir())  # and removed when it closes
    assert la == lb
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(torch.equal(sa["state"][i]["exp_avg_sq"], sb["state"][i]["exp_avg_sq"]) for i in sa["state"])


def test_flash_tier_from_the_cli_options(corpus: Path, tmp_path: Path) -> None:
    rows = _run(corpus, tmp_path / "flash", memoryx_ram_mb=0.1)  # flash dir defaults to model_dir/memoryx_flash
    assert rows[-1]["loss"] < rows[0]["loss"]
    summary = json.loads((tmp_path / "flash" / "summary.json").read_text())
    assert summary["memoryx_units_on_flash"] >= 2 and summary["memoryx_flash_bytes"] > 0
    assert not list((tmp_path / "flash" / "memoryx_flash").iterdir())  # the run's flash files went with it


def test_runs_sharing_a_flash_directory_keep_their_own_files(tmp_path: Path) -> None:
    """Two MemoryX at once over one flash directory each write their own `run-*` directory; one that closes
    removes only its own, and a run that died without closing is cleaned by the next one to start."""
    import os
    import subprocess
    import sys

    cfg = config_from_name("gpt-tiny", vocab_size=64, max_seq_len=16)
    flash = tmp_path / "flash"
    a = MemoryX(build(cfg, device="cpu"), _opt(), ram_budget_bytes=1000, flash_dir=flash)
    b = MemoryX(build(cfg, device="cpu"), _opt(), ram_budget_bytes=1000, flash_dir=flash)
    dirs = sorted(flash.glob("run-*"))
    assert len(dirs) == 2 and all(list(d.glob("unit*.param.bin")) for d in dirs)
    a.close()
    assert [d for d in flash.glob("run-*")] == [b._flash.path]
    code = ("import sys, os; from waferscale.runtime.tiers import FlashDir; d = FlashDir(__import__('pathlib')"
            ".Path(sys.argv[1])); (d.path / 'unit0000.param.bin').write_bytes(b'x'); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(flash)], check=True, timeout=120)  # dies without closing
    assert len(list(flash.glob("run-*"))) == 2
    c = MemoryX(build(cfg, device="cpu"), _opt(), ram_budget_bytes=1000, flash_dir=flash)
    assert sorted(flash.glob("run-*")) == sorted([b._flash.path, c._flash.path])  # the dead run's is gone
    b.close()
    c.close()
    assert not list(flash.iterdir()) and os.path.isdir(flash)


def _opt() -> OptimizerParams:
    return OptimizerParams(optimizer_type="AdamW", learning_rate=1e-3, weight_decay=0.1)


def test_optimizer_state_is_keyed_like_the_resident_optimizer() -> None:
    cfg = config_from_name("gpt-tiny", vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    model = build(cfg, device="cpu")
    resident = build_optimizer(model.parameters(), _opt())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    resident.step()
    sd = resident.state_dict()
    mx = MemoryX(model, _opt())
    mx.load_optimizer_state_dict(sd)
    back = mx.optimizer_state_dict()
    assert [g["params"] for g in back["param_groups"]] == [g["params"] for g in sd["param_groups"]]
    assert [g["weight_decay"] for g in back["param_groups"]] == [g["weight_decay"] for g in sd["param_groups"]]
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(back["state"][i][k], v), (i, k)
    mx.close()


def test_masks_hold_through_updates_and_are_saved() -> None:
    cfg = config_from_name("gpt-tiny", vocab_size=64, max_seq_len=16)
    model = build(cfg, device="cpu")
    mx = MemoryX(model, _opt())
    name = "blocks.0.mlp.up_proj.weight"
    mask = torch.rand(model.get_parameter(name).shape) > 0.5
    mx.set_mask(name, mask)
    u = next(lay.index for lay in mx.layouts if any(e.name == name for e in lay.owned))
    mx.begin_step(1e-2)
    for v in range(mx.n_units - 1, -1, -1):
        lay = mx.layouts[v]
        mx.push_grads(v, torch.randn(lay.n_matrices), torch.randn(lay.n_vectors))
    mx.end_backward()
    w = mx.checkpoint_state()
    assert torch.all(w[name][~mask] == 0) and torch.all(w[name][mask] != 0)
    assert torch.equal(w[f"{name}_mask"], mask)
    big, _ = mx.fetch(u)
    assert (big == 0).sum() >= (~mask).sum()
    mx.close()


def test_unwritable_flash_dir_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = config_from_name("gpt-tiny", vocab_size=64, max_seq_len=16)
    with pytest.raises(ConfigError, match="not writable"):
        MemoryX(build(cfg, device="cpu"), _opt(), ram_budget_bytes=1000, flash_dir=blocker / "flash")
    with pytest.raises(ConfigError, match="RAM budget"):
        MemoryX(build(cfg, device="cpu"), _opt(), ram_budget_bytes=1000)
