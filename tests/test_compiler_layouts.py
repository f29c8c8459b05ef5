"""The model-parallel layout (each layer across a large mesh, layers in sequence) and the choice between it and one
pipelined region per layer: where the weights live, that they fit, that decode gets slower as the mesh grows,
and that the choice follows the aggregate rate for the users asked for."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import wsc
from waferscale.compiler import compile_model
from waferscale.compiler.capture import capture_config
from waferscale.compiler.strategy import data_bytes_per_pe
from waferscale.errors import ConfigError
from waferscale.fabric.presets import fabric_from_name
from waferscale.models.config import ModelConfig


def _per_pe_load(plan, rows: int, cols: int) -> np.ndarray:
    """Bytes per PE of every window's weights, recomputed from the plan's regions (independently of placement)."""
    load = np.zeros((rows, cols))
    for r in plan.regions:
        load[r.row:r.row + r.rows, r.col:r.col + r.cols] += r.bytes / r.area
    return load


def test_llama3_8b_on_a_420x420_wse2_mesh_compiles_and_states_where_the_weights_live():
    plan = compile_model(model="llama3.1-8b", target="wse2", pes=(420, 420), users=1, context_len=4096)
    p = plan.projection
    assert plan.strategy == "model_parallel" and p["layout"] == "model_parallel" and p["window"] == "420x420"
    assert "refused" in p["layouts"]["pipelined"]  # 16 GB of weights cannot sit in one 420x420 mesh
    full = fabric_from_name("wse2")
    blocks = [r for r in plan.regions if r.name.startswith("block")]
    assert len(blocks) == 32 and all((r.rows, r.cols) == (420, 420) for r in blocks)
    for r in plan.regions:  # every window on the wafer
        assert 0 <= r.row and r.row + r.rows <= full.rows and 0 <= r.col and r.col + r.cols <= full.cols
    load = _per_pe_load(plan, full.rows, full.cols)
    assert load.max() <= data_bytes_per_pe(full)  # the weights fit every PE they are spread over
    # the plan's own peak adds the KV cache and activations to the most loaded PE's weights: at least the weights
    # recounted here from the windows, at most those plus every unit's cache and activations spread over a window
    kv_and_acts = p["kv_cache_bytes"] + sum(2 * (u["d_in"] + u["d_out"]) * 2 for u in plan.graph["units"])
    assert load.max() <= p["peak_bytes_per_pe"] <= load.max() + kv_and_acts / (420 * 420)
    assert plan.pes_used == int((load > 0).sum()) <= full.rows * full.cols
    assert 100 < p["decode_tokens_per_s_per_user"] < 100_000 and p["users_in_flight"] == 1
    assert any("420x420 window" in d for d in plan.decisions)


def _one_layer(dim: int = 4096, ffn: int = 14336) -> object:
    cfg = ModelConfig(family="llama", vocab_size=1024, n_layer=1, n_head=32, n_kv_head=8, d_model=dim, d_ff=ffn,
                      max_seq_len=8192, norm="rmsnorm", activation="swiglu", position="rotary", tie_embeddings=False,
                      attn_bias=False, mlp_bias=False)
    return capture_config(cfg, source="test: one Llama-3-8B-sized layer")


@pytest.mark.slow
def test_decode_gets_slower_as_the_mesh_grows():
    """Per-PE work shrinks with the mesh, but every GEMV's all-reduce crosses the mesh: past a few hundred PEs
    a side the hops win, as WaferLLM measured (Table 4: 420x420 faster than 540x540 than 660x660)."""
    g = _one_layer()
    times = []
    for side in (420, 540, 660):
        plan = compile_model(graph=g, target="wse2", pes=(side, side), users=1, context_len=4096,
                             layout="model_parallel")
        times.append(plan.projection["unit_times_s"][1])  # the block
    assert times[0] < times[1] < times[2]


@pytest.mark.slow
def test_auto_keeps_the_higher_aggregate_rate_and_says_why():
    many = compile_model(model="llama3.1-8b")  # a service: each layout with its best number of users
    one = compile_model(model="llama3.1-8b", users=1)  # one user: the lower latency wins
    for plan in (many, one):
        lay = plan.projection["layouts"]
        chosen = plan.projection["layout"]
        other = next(k for k in lay if k != chosen)
        assert lay[chosen]["aggregate_decode_tokens_per_s"] >= lay[other]["aggregate_decode_tokens_per_s"]
        assert any(d.startswith("layout: ") for d in plan.decisions)
    assert one.projection["layout"] == "model_parallel"
    assert one.projection["decode_tokens_per_s_per_user"] > many.projection["decode_tokens_per_s_per_user"]


def test_layout_refusals_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not cover a mixture of experts"):
        compile_model(model="mixtral-tiny", layout="model_parallel")
    with pytest.raises(ConfigError, match="--layout"):
        compile_model(model="gpt-tiny", mode="train", layout="pipelined")
    with pytest.raises(ConfigError, match="--layout must be one of"):
        compile_model(model="gpt-tiny", layout="diagonal")
    r = wsc("compile", "--model", "gpt-tiny", "--mode", "train", "--layout", "model_parallel")
    assert r.returncode == 2 and "drop --layout" in r.stderr and "Traceback" not in r.stderr
