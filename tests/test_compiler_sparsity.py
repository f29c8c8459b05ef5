"""Sparsity on the wafer: sparse kernels' speedup against density, weight and activation sparsity in plans, a
params file's sparsity section, dense plans left byte for byte as they were, `wsc sparsity-report`, CLI errors."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from waferscale.cli.main import main
from waferscale.compiler import compile_model, plan_json, plan_summary, write_outputs
from waferscale.compiler import sparsity as sp
from waferscale.compiler.capture import capture_zoo, measure_sparsity, section_sparsity
from waferscale.compiler.ir import MatMul
from waferscale.errors import ConfigError
from waferscale.fabric import cost_matmul
from waferscale.fabric.assumptions import UNCALIBRATED
from waferscale.fabric.kernel_run import run_kernel
from waferscale.fabric.presets import fabric_from_name
from waferscale.models import build, config_from_name

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DENSITIES = (1.0, 0.5, 0.25, 0.1, 0.05, 0.02, 0.01)

# sha256 of dense plans (inference, resident training, weight streaming, defects), recompiled when the PE's
# calibrated constants came in (fabric/pe.py): a plan without zeros stays these bytes
DENSE_FINGERPRINTS = {
    (("model", "gpt-tiny"), ("pes", (8, 8))): "4323c25bc58504247db6c685dc7c8e6d30838e07caeaee0172380d8d9087f35d",
    (("model", "llama-tiny"), ("pes", (16, 16)), ("mode", "train")):
        "f2b11ea78dbf9449183e24b0b1e67e1cfa92333c57fa90bf1c9d07f5eee4038c",
    (("model", "gpt-tiny"), ("pes", (4, 4)), ("mode", "train")):
        "beb9ed3d18da24fa49065b9a7cb6977019a419b17970c422a71f319519c4e2bf",
    (("model", "gpt-tiny"), ("pes", (16, 16)), ("defects", 0.02), ("seed", 1), ("mode", "train")):
        "0fba14105e63b8f839e0b842397be14dc620a456859c2a43b3de8d9632e414e1",
}


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU(), nn.Linear(512, 512, bias=False))


# ---- the kernel ----------------------------------------------------------------------------------------------

def test_sparse_gemm_speedup_near_linear_then_saturating():
    """A compute-bound GEMM: one multiply-add per non-zero makes the speedup proportional to 1/d (times the
    index read's overhead) at moderate density, then the fixed costs flatten it. The micro-model without the PE's
    calibrated fixed costs (each x value's vector instruction costs its setup whatever the density: with them
    the speedup saturates sooner, test_calibrated_setup_saturates_sparsity_sooner)."""
    spec = fabric_from_name("wse3", pes=(8, 8)).uncalibrated()
    dense = cost_matmul.gemm_cycles(spec, 1024, 1024, 256, 8, 8).total
    s = {d: dense / cost_matmul.sparse_gemm_cycles(spec, 1024, 1024, 256, 8, 8, density=d).total
         for d in (*DENSITIES, 0.001)}
    assert s[1.0] == 1.0
    assert all(s[a] < s[b] for a, b in zip(DENSITIES, DENSITIES[1:]))  # monotone
    for d in (0.5, 0.25, 0.1):  # near-linear: about 2/3 of 1/d (3 reads per non-zero against 2 per weight)
        assert 0.5 < s[d] * d < 0.8
    assert s[0.001] / s[0.01] < 2  # a 10x lower density buys less than 2x: saturated
    assert cost_matmul.sparse_gemm_cycles(spec, 1024, 1024, 256, 8, 8).total == dense


def test_calibrated_setup_saturates_sparsity_sooner():
    spec = fabric_from_name("wse3", pes=(8, 8))
    dense = cost_matmul.gemm_cycles(spec, 1024, 1024, 256, 8, 8).total
    s = {d: dense / cost_matmul.sparse_gemm_cycles(spec, 1024, 1024, 256, 8, 8, density=d).total for d in DENSITIES}
    bare = spec.uncalibrated()
    s0 = {d: cost_matmul.gemm_cycles(bare, 1024, 1024, 256, 8, 8).total /
          cost_matmul.sparse_gemm_cycles(bare, 1024, 1024, 256, 8, 8, density=d).total for d in DENSITIES}
    assert all(s[a] < s[b] for a, b in zip(DENSITIES, DENSITIES[1:]))  # still monotone
    assert all(1 < s[d] < s0[d] for d in DENSITIES[1:])  # but the setups are not skipped with the zeros


def test_imbalance_and_activation_skipping():
    # the micro-model without the calibrated fixed costs: the work that varies from PE to PE alone
    spec = fabric_from_name("wse2").uncalibrated()
    assert cost_matmul.sparse_imbalance(spec, 2048, 8192, 994, 750, 0.1) > 1.3  # tiny tiles: the busiest PE lags
    assert 1.0 <= cost_matmul.sparse_imbalance(spec, 2048, 8192, 62, 46, 0.1) < 1.3  # big tiles: binomials concentrate
    small = fabric_from_name("wse3", pes=(8, 8)).uncalibrated()
    dense = cost_matmul.gemm_cycles(small, 512, 512, 64, 8, 8).total
    act = [cost_matmul.sparse_gemm_cycles(small, 512, 512, 64, 8, 8, act_density=a).total for a in (1.0, 0.5, 0.3)]
    assert act[0] == dense and dense > act[1] > act[2]
    assert dense / act[2] < 1 / 0.3  # the wavelets' tasks and the partial sums are not skipped
    with pytest.raises(ConfigError, match="density"):
        cost_matmul.sparse_gemm_cycles(small, 64, 64, 1, 8, 8, density=0.0)


def test_spmv_stays_exact_tile_by_tile():
    d = run_kernel("spmv", m=64, k=96, n=None, target="wse2", pes=(8, 8), sparsity=0.9, verify=True)
    assert d["verified"] and d["max_abs_err"] < 1e-4
    assert main(["kernel", "spmv", "--m", "64", "--k", "64", "--pes", "8x8", "--density", "0.1", "--verify"]) == 0


def test_streamed_and_stored_bytes():
    m = MatMul("w", 64, 64, density=0.25)
    assert m.streamed_bytes(2) == 1024 * 2 + 64 * 64 // 8  # the non-zeros + a 1-bit mask per weight
    assert m.stored_bytes(2) == 1024 * (2 + 2)  # value + 16-bit index per non-zero
    assert MatMul("w", 64, 64, density=0.9).stored_bytes(2) == 64 * 64 * 2  # barely sparse: kept dense
    assert MatMul("w", 64, 64).to_dict() == {"name": "w", "m": 64, "k": 64}


# ---- plans ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(mode="train", pes=(16, 16)),
                                dict(pes=(8, 8), users=1, context_len=1, prompt_len=1)])
def test_plan_sweep_monotone_near_linear_and_saturating(kw):
    kw = dict(kw, assume=UNCALIBRATED)  # the mechanism without the PE's fixed costs (see above)
    p = compile_model(module=(_mlp(), (64, 512)), sparsity=0.9, **kw)
    w = p.extra["sparsity"]["weight"]
    s = {r["density"]: r["speedup"] for r in w["sweep"]}
    assert [r["density"] for r in w["sweep"]] == list(DENSITIES)
    assert all(s[a] < s[b] for a, b in zip(DENSITIES, DENSITIES[1:]))
    assert s[0.1] * 0.1 > 0.35 and s[0.25] * 0.25 > 0.45  # near-linear at moderate density
    assert s[0.01] / s[0.02] < 1.3 and s[0.01] < w["max_speedup"] < 2 * s[0.01]  # saturating
    assert 0.02 < w["knee_density"] < 0.5
    assert w["speedup"] == pytest.approx(s[0.1])
    why = " ".join(p.decisions)
    assert f"near-linear down to density ~{w['knee_density']:.2g}" in why and "busiest PE" in why
    dense = compile_model(module=(_mlp(), (64, 512)), **kw)
    key = "step_time_s" if kw.get("mode") == "train" else "decode_latency_s_per_token"
    assert p.projection[key] < dense.projection[key]


@pytest.mark.parametrize("kw", [dict(dict(k)) for k in DENSE_FINGERPRINTS])
def test_dense_plans_unchanged(kw):
    want = DENSE_FINGERPRINTS[tuple(kw.items())]
    assert compile_model(**kw).fingerprint() == want
    assert compile_model(**kw, sparsity=0.0).fingerprint() == want  # no zeros: the dense plan, byte for byte


def test_embeddings_and_head_stay_dense_and_bytes_fall():
    g = capture_zoo("gpt3-1.3b")
    w = sp.weight_sparsity(g, 0.75)
    assert len(w) == 4 * 24 and not any(k.startswith(("embed", "head")) for k in w)
    units = sp.apply(g, w, {}).units
    dense = sum(u.params for u in g.units) * 2
    streamed = sum(u.streamed_weight_bytes(2) for u in units)
    sparse_share = sum(m.m * m.k for u in g.units[1:-1] for m in u.matmuls) * 2 / dense
    assert streamed / dense == pytest.approx(1 - sparse_share * (1 - 0.25 - 1 / 16), rel=1e-3)


def test_params_sparsity_section_changes_the_plan(tmp_path, capsys):
    text = (CONFIGS / "gpt2_tiny_shakespeare.yaml").read_text()
    dense_yaml, sparse_yaml = tmp_path / "dense.yaml", tmp_path / "sparse.yaml"
    dense_yaml.write_text(text)
    sparse_yaml.write_text(text + "\nsparsity:\n    algorithm: static\n    sparsity: 0.8\n"
                                  "    param_filter: ['*mlp*']\n")
    cfg = config_from_name("gpt-mini")
    got = section_sparsity(cfg, {"sparsity": 0.8, "param_filter": ["*mlp*"]})
    assert got == {f"block{i}.{m}": pytest.approx(0.8) for i in range(4) for m in ("up_proj", "down_proj")}
    assert not any(k.startswith(("embed", "head")) for k in section_sparsity(cfg, 0.5))  # default filter
    gmp = {"algorithm": "gmp", "sparsity": {"type": "linear", "init": 0.0, "slope": 0.001}, "update": {"freq": 10}}
    assert list(section_sparsity(cfg, gmp, step=400).values()) == [pytest.approx(0.4)] * 16  # last step
    outs = {}
    for name, path in (("dense", dense_yaml), ("sparse", sparse_yaml)):
        assert main(["compile", "--params", str(path), "--mode", "train", "--pes", "16x16", "--json"]) == 0
        outs[name] = json.loads(capsys.readouterr().out)
    assert "sparsity" not in outs["dense"] and outs["sparse"]["fingerprint"] != outs["dense"]["fingerprint"]
    assert outs["sparse"]["sparsity"]["weight"]["matrices"] == 8
    assert outs["sparse"]["step_time_s"] < outs["dense"]["step_time_s"]
    assert main(["run", "--params", str(sparse_yaml), "--compile_only", "--model_dir", str(tmp_path / "md"),
                 "--target", "wse2"]) == 0
    plan = json.loads((tmp_path / "md" / "plan.json").read_text())
    assert plan["extra"]["sparsity"]["weight"]["matrices"] == 8


def test_activation_sparsity_relu_and_gelu_side_by_side(tmp_path):
    """The same model with a ReLU-like profile (exact zeros, skipped) and a GELU one (no exact zeros)."""
    relu = compile_model(model="gpt-tiny", pes=(16, 16), mode="train", activation_sparsity=0.6)
    gelu = compile_model(model="gpt-tiny", pes=(16, 16), mode="train", activation_sparsity=0.0)
    dense = compile_model(model="gpt-tiny", pes=(16, 16), mode="train")
    a = relu.extra["sparsity"]["activation"]
    assert a["matrices"] == 2 and a["mean_sparsity"] == pytest.approx(0.6)
    assert 0 < a["skipped_multiply_adds"] < 0.6 and a["speedup"] > 1
    assert relu.projection["step_time_s"] < dense.projection["step_time_s"]
    assert gelu.projection["step_time_s"] == dense.projection["step_time_s"]
    assert any("no exact zeros" in d for d in gelu.decisions)
    report = {"layers": [{"layer": "block0", "activation_exact_zero": 0.5}, {"layer": "block1",
                                                                             "activation_exact_zero": 0.7}]}
    (tmp_path / "acts.json").write_text(json.dumps(report))
    g = capture_zoo("gpt-tiny")
    assert sp.activation_sparsity(g, str(tmp_path / "acts.json")) == {"block0.down_proj": 0.5, "block1.down_proj": 0.7}
    assert sp.activation_sparsity(g, "0.2,0.3") == {"block0.down_proj": 0.2, "block1.down_proj": 0.3}
    both = compile_model(model="gpt-tiny", pes=(8, 8), sparsity=0.8, activation_sparsity=str(tmp_path / "acts.json"))
    assert "sparsity" in plan_json(both) and "activations" in plan_summary(both)
    paths = write_outputs(both, tmp_path / "out")
    assert paths[1].read_bytes()[:4] == b"\x89PNG"


# ---- the report ----------------------------------------------------------------------------------------------

def test_report_relu_activation_sparsity_is_the_hand_count():
    torch.manual_seed(0)
    cfg = dataclasses.replace(config_from_name("gpt-tiny"), activation="relu")
    model = build(cfg).eval()
    with torch.no_grad():
        model.blocks[0].attn.q_proj.weight[:4] = 0.0  # 4 rows of 32 -> 128 zeros among block0's matrices
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    rows = {r["layer"]: r for r in measure_sparsity(model, ids, threshold=1e-3)}
    with torch.no_grad():  # by hand: the blocks' forward, the FFN hidden activation counted where it is made
        x = model.embed(ids)
        for i, blk in enumerate(model.blocks):
            x = x + blk.attn(blk.attn_norm(x))
            hidden = blk.mlp.act(blk.mlp.up_proj(blk.mlp_norm(x)))
            assert rows[f"block{i}"]["activation_exact_zero"] == int((hidden == 0).sum()) / hidden.numel()
            x = x + blk.mlp.down_proj(hidden)
    assert 0.3 < rows["block0"]["activation_exact_zero"] < 0.7  # ReLU on random weights: about half
    mats = sum(p.numel() for p in model.blocks[0].parameters() if p.ndim > 1)
    assert rows["block0"]["weight_sparsity"] == 128 / mats and rows["embed"]["activation_exact_zero"] is None


def test_sparsity_report_cli(tmp_path, capsys):
    png, ids = tmp_path / "r.png", tmp_path / "ids.npy"
    assert main(["sparsity-report", "--model", "gpt-tiny", "--seq_len", "16", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "block1" in out and "|a| < 0.01" in out and png.read_bytes()[:4] == b"\x89PNG"
    import numpy as np

    np.save(ids, np.arange(64) % 50)
    assert main(["sparsity-report", "--model", "gpt-tiny", "--seq_len", "16", "--data", str(ids), "--json",
                 "--plot", ""]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["sample"]["source"] == str(ids) and len(rep["layers"]) == 4


@pytest.mark.parametrize("argv, words", [
    (["compile", "--model", "gpt-tiny", "--pes", "8x8", "--sparsity", "1.0"], "--sparsity"),
    (["compile", "--model", "gpt-tiny", "--pes", "8x8", "--activation_sparsity", "0.1,0.2,0.3"], "3 values"),
    (["compile", "--model", "gpt-tiny", "--pes", "8x8", "--activation_sparsity", "/no/such.json"], "cannot read"),
    (["sparsity-report", "--model", "gpt-tiny", "--checkpoint", "x"], "exactly one"),
    (["sparsity-report", "--model", "gpt-tiny", "--seq_len", "16", "--data", "/no/such"], "no such file"),
    (["sparsity-report", "--model", "gpt-tiny", "--threshold", "0"], "--threshold"),
    (["kernel", "spmv", "--m", "64", "--k", "64", "--pes", "8x8", "--density", "1.5"], "--density"),
])
def test_cli_errors_exit_2(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and words in err and err.count("\n") == 1


def test_params_filter_matching_nothing_exits_2(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text((CONFIGS / "gpt2_tiny_shakespeare.yaml").read_text()
                    + "\nsparsity:\n    sparsity: 0.5\n    param_filter: '*nothing*'\n")
    assert main(["compile", "--params", str(path), "--mode", "train", "--pes", "16x16"]) == 2
    assert "matches no parameter" in capsys.readouterr().err
