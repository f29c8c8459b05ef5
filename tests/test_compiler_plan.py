"""Plan JSON round trip, fingerprint stability, outputs, hand-derived projections, estimate and capture."""

import json
import math

import pytest
import torch
from torch import nn

from waferscale.compiler import (Plan, compile_model, estimate_memory, estimate_table, plan_json, plan_summary,
                                 write_outputs)
from waferscale.compiler.capture import capture_module, capture_zoo
from waferscale.errors import ConfigError
from waferscale.fabric import cost_matmul
from waferscale.fabric.presets import fabric_from_name
from waferscale.params import load_params
from waferscale.zoo.wafer import params_graph


def test_json_round_trip_and_fingerprint_stable():
    p = compile_model(model="gpt-tiny", pes=(8, 8), defects=0.05, seed=3)
    q = Plan.from_json(p.to_json())
    assert q.to_dict() == p.to_dict() and q.fingerprint() == p.fingerprint()
    assert compile_model(model="gpt-tiny", pes=(8, 8), defects=0.05, seed=3).fingerprint() == p.fingerprint()
    assert compile_model(model="gpt-tiny", pes=(8, 8), defects=0.05, seed=4).fingerprint() != p.fingerprint()
    d = json.loads(p.to_json())
    d["pes_used"] += 1
    with pytest.raises(ConfigError, match="fingerprint"):
        Plan.from_dict(d)
    d = json.loads(p.to_json())
    d["version"] = 999
    with pytest.raises(ConfigError, match="version"):
        Plan.from_dict(d)


@pytest.mark.parametrize("mode", ["inference", "train"])
def test_json_summary_and_outputs(tmp_path, mode):
    p = compile_model(model="gpt-tiny", pes=(16, 16), mode=mode, defects=0.02, seed=1)
    j = plan_json(p)
    for k in ("strategy", "fits_in_sram", "pes_used", "bottleneck", "assumptions"):
        assert k in j
    keys = ("decode_tokens_per_s_per_user", "aggregate_decode_tokens_per_s", "prefill_tokens_per_s",
            "time_to_first_token_s") if mode == "inference" else \
        ("step_time_s", "tokens_per_s", "mfu", "no_stall_min_tokens_per_step")
    for k in keys:
        assert k in j and j[k] is not None
    json.dumps(j)
    s = plan_summary(p)
    assert "bottleneck" in s and "assumptions" in s and "clock 1.1 GHz" in s and len(s.splitlines()) < 40
    paths = write_outputs(p, tmp_path / "out")
    assert [x.name for x in paths] == ["plan.json", "wafer.png", "wafer.svg", "trace.json"]
    assert Plan.from_json(paths[0].read_text()).fingerprint() == p.fingerprint()
    assert paths[1].read_bytes()[:4] == b"\x89PNG" and b"<svg" in paths[2].read_bytes()[:2000]
    tr = json.loads(paths[3].read_text())
    assert any(e["ph"] == "X" for e in tr["traceEvents"])
    assert not list((tmp_path / "out").glob(".*tmp"))


def _single_matrix_plan(m, k, assume=None):
    net = nn.Sequential(nn.Linear(k, m, bias=False))
    return compile_model(module=(net, (1, k)), pes=(8, 8), users=1, context_len=1, prompt_len=1, assume=assume)


def test_decode_golden_compute_bound_matrix():
    """One 512x512 GEMV on an 8x8 mesh: latency = the cost model's GEMV cycles on the placed region + the
    sampled token's ramp out/in (2 x 2 cycles) + 1 wavelet, at 1.1 GHz; throughput below the compute roof."""
    p = _single_matrix_plan(512, 512)
    spec = fabric_from_name("wse3", pes=(8, 8))
    (r,) = p.regions
    cyc = cost_matmul.gemv_cycles(spec, 512, 512, r.rows, r.cols).total
    assert p.projection["decode_latency_s_per_token"] == pytest.approx((cyc + 2 * 2 + 1) / 1.1e9)
    roof = 64 * 16 * 1.1e9 / (2 * 512 * 512)  # PEs x FLOP/cycle x clock / FLOPs per token
    tps = p.projection["decode_tokens_per_s_per_user"]
    assert 0.25 * roof < tps <= roof
    assert p.bottleneck in ("compute", "SRAM")


def test_decode_golden_fabric_bound_tiny_matrix():
    """A 16x16 GEMV spread over the mesh: a handful of FMACs per PE, so the hops and ramps dominate the FMACs;
    with the PE's calibrated vector-instruction setup (fabric/pe.py), the few vector instructions per PE weigh
    as much as the hops."""
    p = _single_matrix_plan(16, 16, assume={"vector_op_cycles": 0})  # the FMACs alone against the hops
    (r,) = [x for x in p.regions if x.replica == 0]  # (a smaller copy may serve one user with less latency)
    assert p.bottleneck == "fabric latency"
    hops = min(r.rows, 16) - 1 + min(r.cols, 16) - 1
    assert p.projection["decode_latency_s_per_token"] >= hops / 1.1e9
    cal = _single_matrix_plan(16, 16)
    assert cal.bottleneck in ("fabric latency", "compute")
    assert cal.projection["decode_latency_s_per_token"] > p.projection["decode_latency_s_per_token"]


def test_estimate_gpt3_xl():
    d = estimate_memory(model="gpt3-1.3b", target="wse3", batch_size=1)  # one sequence in flight
    n, held = 1_315_723_264, 1_315_723_264 + 50257 * 2048  # the tied embedding is held again by the LM head
    assert d["params"] == n and d["params_held"] == held
    items = {r["item"]: r["bytes"] for r in d["rows"]}
    assert items["weights"] == 2 * held and items["gradients"] == 2 * held and items["master weights"] == 4 * held
    assert items["Adam 1st moment"] == items["Adam 2nd moment"] == 4 * held
    assert d["optimizer_state_bytes"] == 12 * held and items["activations"] == d["activations_bytes"] > 0
    assert d["training_bytes"] == 16 * held + d["activations_bytes"]
    assert d["training_fits_in_sram"] and d["inference_fits_in_sram"]
    t = estimate_table(d)
    assert f"{d['training_bytes'] / 1e9:.2f} GB" in t and "2.63 GB" in t  # the total; fp16 weights for inference
    d32 = estimate_memory(model="gpt3-1.3b", mixed_precision=False, batch_size=1)
    assert d32["training_bytes"] - d32["activations_bytes"] == 16 * held
    assert "master weights" not in {r["item"] for r in d32["rows"]}
    assert not estimate_memory(model="llama3.1-70b")["inference_fits_in_sram"]
    assert estimate_memory(model="llama3.1-70b")["inference_systems_needed"] == 4


def test_capture_zoo_matches_config():
    from waferscale.models import config_from_name

    for name in ("gpt3-1.3b", "llama3.1-8b"):
        g, cfg = capture_zoo(name), config_from_name(name)
        assert g.params == cfg.num_params and g.n_blocks == cfg.n_layer
        # matmul weights only (biases and norms are not matmuls): within 0.1% of the config's 6N + 12LHT
        assert g.model_flops_per_token(2048, True) == pytest.approx(cfg.flops_per_token(2048, True), rel=1e-3)
        assert g.kv_elems_per_token == 2 * cfg.n_layer * cfg.kv_heads * cfg.head_dim


def test_capture_arbitrary_module_and_compile():
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    g = capture_module(net, (4, 64))
    assert [u.params for u in g.units] == [64 * 256 + 256, 256 * 10 + 10]
    assert [(m.m, m.k) for u in g.units for m in u.matmuls] == [(256, 64), (10, 256)]
    assert net[0].weight.device.type == "cpu" and not net[0].weight.is_meta  # the user's module is untouched

    class Tok(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 32)
            self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
            self.out = nn.Linear(32, 100)

        def forward(self, idx):
            x = self.emb(idx)
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.out(x)

    g = capture_module(Tok(), (2, 16))
    assert [u.name for u in g.units] == ["emb", "layers.0", "layers.1", "layers.2", "out"]
    p = compile_model(module=Tok(), pes=(8, 8))
    assert p.fits_in_sram and len({r.unit for r in p.regions}) == 5
    with pytest.raises(ConfigError, match="could not trace"):
        capture_module(net, (4, 63))
    with pytest.raises(ConfigError):
        compile_model(module="not a module")


def test_params_yaml():
    p = compile_model(graph=params_graph(load_params("configs/gpt3_xl.yaml")), target="wse2", mode="train")
    assert p.workload["batch_size"] == 528 and p.workload["seq_len"] == 2048
    assert p.strategy == "weight_streaming"
    assert math.isclose(p.projection["tokens_per_s"] * p.projection["step_time_s"], 528 * 2048)
