"""Compiler strategy choices, impossible requests and bad input (numbers derived by hand from WSE.md)."""

import math

import pytest

from waferscale.compiler import compile_model
from waferscale.errors import ConfigError
from waferscale.params import load_params
from waferscale.zoo.wafer import params_graph


def test_small_model_fits_and_is_pipelined_or_replicated():
    # (with the PE's calibrated per-instruction cost a layer spread over the whole mesh can be the fastest:
    # model-parallel is then the choice)
    p = compile_model(model="gpt-tiny", pes=(8, 8))
    assert p.strategy in ("pipelined", "replicated", "model_parallel") and p.fits_in_sram
    # --pes is the mesh the model takes, or with model-parallel the window each layer runs on (side by side)
    assert p.mode == "inference" and (p.pes_used <= 64 or p.strategy == "model_parallel")
    assert all(r.rows * r.cols <= 64 for r in p.regions)
    # with one user the lowest-latency pipeline is one copy
    p1 = compile_model(model="gpt-tiny", pes=(8, 8), users=1, layout="pipelined")
    assert p1.replicas == 1 and p1.strategy == "pipelined"


def test_gpt3_xl_training_on_wse2_streams_weights():
    p = compile_model(model="gpt3-xl", target="wse2", mode="train")
    assert p.strategy == "weight_streaming" and not p.fits_in_sram
    # WSE.md: T >= (b/3) F / BW, fp16 (b=2), F = 745,500 PEs x 8 FLOP/cycle x 1.1 GHz, BW = 150 GB/s
    F = 745_500 * 8 * 1.1e9
    assert p.projection["no_stall_min_tokens_per_step"] == math.ceil(2 / 3 * F / 150e9) == 29_158
    pr = p.projection
    assert 0 < pr["mfu"] < 1 and pr["step_time_s"] > 0
    assert pr["tokens_per_s"] == pytest.approx(p.workload["tokens_per_step"] / pr["step_time_s"])
    assert pr["bottleneck"] in ("compute", "SRAM", "fabric latency", "routing", "I/O", "MemoryX update")
    assert [r["systems"] for r in pr["scaling"]][:3] == [1, 2, 4]
    assert "weight streaming" in p.explain()


@pytest.mark.parametrize("systems", [1, 4])
def test_training_scaling_is_weak_and_never_superlinear(systems):
    """GPT-3 XL with its params YAML (batch 528): the scaling table holds the per-system batch fixed (global
    batch grows with N, as --num_csx does) and charges SwarmX, so efficiency never exceeds 100%, falls with
    the tree depth, and the plan's own row equals its projection."""
    p = compile_model(graph=params_graph(load_params("configs/gpt3_xl.yaml")), target="wse2", mode="train",
                      systems=systems)
    sc = p.projection["scaling"]
    per = 528 // systems
    assert [r["systems"] for r in sc] == [1, 2, 4, 8, 16]
    assert all(r["per_system_batch"] == per and r["global_batch"] == r["systems"] * per for r in sc)
    eff = [r["efficiency"] for r in sc]
    assert eff[0] == 1.0 and all(0.9 < e <= 1.0 for e in eff) and eff == sorted(eff, reverse=True)
    assert [r["swarmx_levels"] for r in sc] == [0, 1, 1, 2, 2]  # ceil(log4 N): the 1:4 tree
    assert all(r["swarmx_exposed_s"] >= 0 for r in sc) and sc[-1]["swarmx_exposed_s"] > 0
    own = next(r for r in sc if r["systems"] == systems)
    assert own["step_time_s"] == pytest.approx(p.projection["step_time_s"])
    assert own["tokens_per_s"] == pytest.approx(p.projection["tokens_per_s"])


def test_resident_training_scaling_pays_the_gradient_allreduce():
    p = compile_model(model="gpt-tiny", pes=(64, 64), mode="train", batch_size=8, seq_len=64, systems=2)
    sc = p.projection["scaling"]
    assert sc[0]["efficiency"] == 1.0 and all(r["efficiency"] < 1.0 for r in sc[1:])
    assert any("gradients" in d and "SwarmX" in d for d in p.decisions)


def test_defects_charge_detours_in_the_projection():
    """The defect map reaches the cost model: each placed region's own routes (detours) are charged, so the
    same request is slower on a defective wafer, and the plan says by how much."""
    kw = dict(model="llama-tiny", pes=(48, 40), users=1)
    clean = compile_model(**kw)
    bad = compile_model(**kw, defects=0.03, seed=2)
    assert bad.projection["decode_latency_s_per_token"] > clean.projection["decode_latency_s_per_token"]
    assert any(d.startswith("detours:") for d in bad.decisions)
    assert "defect_detours" in bad.assumptions and "defect_detours" not in clean.assumptions


def test_gqa_kv_heads_reach_the_attention_cost():
    from waferscale.compiler import capture
    from waferscale.compiler.project import _key

    g = capture.capture_zoo("llama3.1-8b")
    block = next(u for u in g.units if u.kind == "block")
    assert block.kv_heads == 8 and block.n_heads == 32 and _key(block)[4] == 8


def test_llama70b_on_one_wse3_is_impossible_with_numbers():
    with pytest.raises(ConfigError) as e:
        compile_model(model="llama3.1-70b", target="wse3", systems=1)
    msg = str(e.value)
    assert "141.1 GB" in msg and "--systems 4" in msg and "38.0 GB" in msg


def test_llama70b_on_four_wse3_is_a_multi_wafer_pipeline():
    p = compile_model(model="llama3.1-70b", target="wse3", systems=4)
    assert p.strategy == "multi_wafer_pipelined" and p.wafers_per_pipeline == 4
    systems = [r.system for r in sorted(p.regions, key=lambda r: r.stage)]
    assert systems == sorted(systems) and set(systems) == {0, 1, 2, 3}  # stages flow wafer 0 -> 3
    assert "only activations" in p.explain()
    # a boundary hop costs at least the inter-system latency: decode latency >= 3 x 5 us + 1 feedback hop
    assert p.projection["decode_latency_s_per_token"] > 4 * 5e-6


def test_llama8b_fits_one_wse3():
    p = compile_model(model="llama3.1-8b", target="wse3")
    assert p.strategy in ("pipelined", "replicated") and p.wafers_per_pipeline == 1
    pr = p.projection
    assert pr["aggregate_decode_tokens_per_s"] >= pr["decode_tokens_per_s_per_user"]
    assert pr["time_to_first_token_s"] > 0 and pr["prefill_tokens_per_s"] > 0


def test_small_model_training_is_resident():
    p = compile_model(model="gpt-tiny", pes=(64, 64), mode="train", batch_size=8, seq_len=64)
    assert p.strategy in ("pipelined", "replicated") and p.fits_in_sram
    assert p.projection["weights_streamed"] is False and p.projection["tokens_per_s"] > 0


@pytest.mark.parametrize("kw, needle", [
    (dict(model="gpt-tiny", batch_size=0, mode="train"), "--batch_size"),
    (dict(model="gpt-tiny", seq_len=-3, mode="train"), "--seq_len"),
    (dict(model="gpt-tiny", systems=0), "--systems"),
    (dict(model="gpt-tiny", defects=1.0), "--defects"),
    (dict(model="gpt-tiny", target="wse9"), "unknown target"),
    (dict(model="gpt-tiny", pes=(1, 2)), "usable PEs"),
    (dict(model="gpt-tiny", mode="serve"), "--mode"),
    (dict(model="gpt-tiny", context_len=4096), "context_len"),
    (dict(model="gpt-tiny", prompt_len=60, context_len=32), "prompt_len"),
    (dict(model="nope-7b"), "unknown model"),
    (dict(), "exactly one"),
    (dict(model="gpt-tiny", users=10_000_000), "users"),
])
def test_bad_input_is_one_clear_error(kw, needle):
    with pytest.raises(ConfigError) as e:
        compile_model(**kw)
    assert needle in str(e.value)
