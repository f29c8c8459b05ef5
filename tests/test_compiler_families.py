"""Every family on the wafer: each published Model Zoo config in tests/data/modelzoo validates, estimates and
compiles with its published parameter count; Mixtral-8x7B's inference needs the systems the arithmetic says
(all experts resident, only the routed ones active); encoders project encoding; a family the compiler does not
project is one error line. The CLI runs in process (`cli.main.main`): torch is imported once."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from waferscale.cli.main import main
from waferscale.compiler import capture, compile_model, moe
from waferscale.fabric.presets import fabric_from_name
from waferscale.models import config_from_name

ZOO = Path(__file__).resolve().parent / "data" / "modelzoo"

# Published parameter counts of the releases each Model Zoo config describes.
PUBLISHED = {
    # GPT-J 6B model card (huggingface.co/EleutherAI/gpt-j-6b): "n_parameters 6,053,381,344"
    "params_gptj_6B.yaml": 6_053_381_344,
    # GPT-NeoX-20B paper (Black et al. 2022, Table 1 / sec. 2): 20,554,567,680 parameters
    "params_gpt_neox_20B.yaml": 20_554_567_680,
    # Falcon-7B: transformers' FalconForCausalLM built from the release's config.json (huggingface.co/tiiuae/
    # falcon-7b) has 6,921,720,704 parameters; the model card rounds it to "7B parameters" (1.1% off)
    "params_falcon_7b.yaml": 6_921_720_704,
    # Mistral 7B paper (Jiang et al. 2023, abstract): "a 7-billion-parameter language model"; the release
    # announcement (mistral.ai/news/announcing-mistral-7b): "Mistral 7B is a 7.3B parameter model"
    "params_mistral_7B.yaml": 7.3e9,
    # MPT-7B model card (huggingface.co/mosaicml/mpt-7b, hyperparameters table): n_parameters 6.7B
    "params_mpt_7B.yaml": 6.7e9,
    # Mixtral of experts (Jiang et al. 2024) and mistral.ai/news/mixtral-of-experts: "46.7B total parameters"
    "params_mixtral_8x7b.yaml": 46.7e9,
    # BERT-base (Devlin et al. 2019, sec. 3): 110M parameters
    "params_bert_base_MSL128.yaml": 110e6,
    # BERT-large with its pre-training heads (huggingface.co/google-bert/bert-large-uncased: 336M params);
    # the paper's rounded figure is 340M
    "params_bert_large_MSL512.yaml": 336e6,
    # RoBERTa-base (huggingface.co/FacebookAI/roberta-base, RobertaForMaskedLM: 124,697,433 parameters) less
    # what Model Zoo's config changes: it uses BERT's 28,996-token cased vocabulary instead of RoBERTa's 50,265
    # (each dropped token: a 768-wide embedding row and a decoder bias) and 512 positions instead of 514
    "params_roberta_base.yaml": 124_697_433 - (50_265 - 28_996) * (768 + 1) - 2 * 768,
    # T5 v1.1-small (transformers' T5ForConditionalGeneration from google/t5-v1_1-small's config.json, the shape
    # FLAN-T5-small shares: 76,961,152) less what Model Zoo's t5_small changes: its head shares the embedding
    # (32,128 x 512), a 32,101-token vocabulary (27 rows fewer), ReLU instead of the gated GELU (no gate matrix in
    # the 16 layers' feed-forwards, 512 x 1024 each), LayerNorms with a bias (42 norms of 512)
    "params_t5_small.yaml": 76_961_152 - 32_128 * 512 - 27 * 512 - 16 * 512 * 1024 + 42 * 512,
    # T5-base (transformers' T5ForConditionalGeneration from google-t5/t5-base's config.json: 222,903,552; the
    # paper's "220 million") with Model Zoo's t5_base changes: a 32,101-token vocabulary (27 rows of 768 fewer)
    # and LayerNorms with a bias (62 norms of 768)
    "params_t5_base.yaml": 222_903_552 - 27 * 768 + 62 * 768,
    # Llama 3 8B and 70B (Llama 3.1 70B has the 70B shape): transformers' LlamaForCausalLM built from
    # meta-llama/Meta-Llama-3-8B's and Meta-Llama-3-70B's config.json (the model cards round to "8B" and "70B")
    "params_llama3_8b.yaml": 8_030_261_248,
    **dict.fromkeys(("params_llama3_70b.yaml", "params_llama3p1_70b_msl_8k.yaml"), 70_553_706_496),
    # Cerebras-GPT muP (same shapes as the standard releases): the model card's training table (huggingface.co/
    # cerebras/Cerebras-GPT-111M) trains each to 20 tokens per parameter, in steps x batch x 2048 tokens
    **{f"params_cerebras_gpt_{size}_mup.yaml": steps * batch * 2048 / 20 for size, steps, batch in (
        ("111m", 9037, 120), ("590m", 21836, 264), ("1p3b", 24334, 528), ("2p7b", 49041, 528))},
}
# Active parameters per token of the mixture-of-experts releases (same sources): "12.9B active parameters"
PUBLISHED_ACTIVE = {"params_mixtral_8x7b.yaml": 12.9e9}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _configs() -> list[str]:
    return sorted(p.name for p in ZOO.glob("*.yaml"))


def test_every_stored_config_has_a_published_count():
    assert set(_configs()) <= set(PUBLISHED), f"add the published count of {set(_configs()) - set(PUBLISHED)}"


@pytest.mark.parametrize("name", _configs())
@pytest.mark.slow
def test_published_config_validates_estimates_and_compiles(capsys, name):
    path = str(ZOO / name)
    want = PUBLISHED[name]
    rc, out, err = _run(capsys, "validate", path)
    assert rc == 0, err
    millions = float(out.split("valid (")[1].split("M-parameter")[0].replace(",", ""))
    assert abs(millions * 1e6 / want - 1) < 0.01, out
    rc, out, err = _run(capsys, "estimate", "--params", path, "--json")
    assert rc == 0, err
    est = json.loads(out)
    assert abs(est["params"] / want - 1) < 0.01
    rc, out, err = _run(capsys, "compile", "--params", path, "--mode", "train", "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["params"] == est["params"] and plan["tokens_per_s"] > 0 and 0 < plan["mfu"] < 1
    if name in PUBLISHED_ACTIVE:
        assert abs(plan["active_params"] / PUBLISHED_ACTIVE[name] - 1) < 0.01
        assert plan["active_params"] == est["active_params"] < plan["params"]
    else:
        assert plan["active_params"] == plan["params"]


def _mixtral_systems() -> int:
    """Systems whose SRAM holds every expert's fp16 weights: params x 2 B over the data bytes of a WSE-3
    (its PEs x (SRAM per PE - the compiler's stated program reserve))."""
    cfg, spec = config_from_name("mixtral-8x7b"), fabric_from_name("wse3")
    return math.ceil(cfg.num_params * 2 / (spec.pes * (spec.sram_bytes_per_pe - spec.program_reserve_bytes_per_pe)))


def test_mixtral_inference_needs_the_systems_its_weights_need(capsys):
    cfg = config_from_name("mixtral-8x7b")
    n = _mixtral_systems()
    assert n > 1
    rc, out, err = _run(capsys, "compile", "--model", "mixtral-8x7b", "--target", "wse3", "--mode", "inference",
                        "--systems", str(n - 1))
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert f"--systems {n}" in err and "experts" in err
    assert f"{cfg.num_params / 1e9:.3g} B" in err and f"{cfg.num_active_params / 1e9:.3g} B" in err

    rc, out, err = _run(capsys, "compile", "--model", "mixtral-8x7b", "--target", "wse3", "--mode", "inference",
                        "--systems", str(n), "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["wafers_per_pipeline"] == n and plan["fits_in_sram"]
    assert plan["params"] == cfg.num_params and plan["active_params"] == cfg.num_active_params
    m = plan["moe"]
    assert (m["experts_per_layer"], m["experts_per_token"], m["moe_layers"]) == (8, 2, cfg.n_layer)
    assert m["weight_bytes_read_per_token"] == 2 * cfg.num_active_params
    assert m["weight_bytes_resident"] == 2 * cfg.num_params
    assert m["routing_bytes_per_token"] == cfg.n_layer * 2 * 2 * cfg.d_model * 2  # k out and k back, fp16
    assert m["load_imbalance"] > 1 and plan["decode_tokens_per_s_per_user"] > 0


def test_mixtral_expert_regions_hold_every_expert():
    cfg = config_from_name("mixtral-tiny")
    plan = compile_model(model="mixtral-tiny", pes=(24, 24))
    units = plan.graph["units"]
    experts = [r for r in plan.regions if r.replica == 0 and units[r.unit].get("expert_of")]
    assert len(experts) == cfg.n_layer * cfg.n_experts
    assert all(r.bytes >= units[r.unit]["params"] * 2 for r in experts)  # resident, idle or not
    assert len({(r.row, r.col) for r in experts}) == len(experts)  # a region each


def test_moe_training_counts_only_routed_experts_flops():
    cfg = config_from_name("mixtral-8x7b")
    seq = 4096
    plan = compile_model(model="mixtral-8x7b", mode="train", seq_len=seq)
    assert plan.strategy == "weight_streaming"
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * (cfg.n_head + 2 * cfg.kv_heads) * hd + cfg.n_head * hd * d
    expert = 3 * d * cfg.ffn_dim
    fwd = cfg.n_layer * (2 * (attn + d * cfg.n_experts + cfg.experts_per_token * expert)
                         + 4 * cfg.n_head * hd * seq) + 2 * cfg.vocab_size * d
    assert plan.projection["model_flops_per_token"] == pytest.approx(3 * fwd)
    assert any("all 8 experts" in s for s in plan.decisions)
    # an expert's weights serve k/E of the tokens: E/k times a dense layer's no-stall minimum T >= (b/3)F/BW
    spec = fabric_from_name("wse3")
    dense = math.ceil(2 / 3 * spec.pes * spec.fp16_flops_per_cycle_per_pe * spec.clock_hz / spec.io_bytes_per_s)
    assert plan.projection["no_stall_min_tokens_per_step"] == math.ceil(8 / 2 * dense)


def test_expected_max_load_matches_exact_small_cases():
    assert moe.expected_max_load(1, 8, 2) == 1.0
    assert moe.expected_max_load(5, 4, 4) == 5.0  # every token uses every expert
    # two tokens, 2 of 8 each: they share an expert with probability 1 - C(6,2)/C(8,2) = 13/28
    assert moe.expected_max_load(2, 8, 2) == pytest.approx(1 + 13 / 28, rel=0.01)
    # one choice each: E[max] of a multinomial, exact by enumerating the 4^3 routings of 3 tokens to 4 experts
    import itertools
    exact = sum(max(r.count(e) for e in range(4)) for r in itertools.product(range(4), repeat=3)) / 4 ** 3
    assert moe.expected_max_load(3, 4, 1) == pytest.approx(exact, rel=0.01)
    assert moe.imbalance(100_000, 8, 2) < 1.02 < moe.imbalance(16, 8, 2)
    assert moe.expected_max_of_k([1.0, 2.0, 3.0, 4.0], 2) == pytest.approx((2 + 3 * 2 + 4 * 3) / 6)


def test_encoder_inference_projects_encoding(capsys):
    rc, out, err = _run(capsys, "compile", "--model", "bert-base", "--mode", "inference", "--seq_len", "128",
                        "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["seq_len"] == 128 and plan["encode_sequences_per_s"] > 0
    assert plan["encode_tokens_per_s"] == pytest.approx(128 * plan["encode_sequences_per_s"])
    assert "decode_tokens_per_s_per_user" not in plan and "kv_cache_bytes" not in plan
    assert any("bidirectional" in s for s in plan["why"])
    rc, out, err = _run(capsys, "compile", "--model", "bert-base", "--mode", "inference", "--users", "4")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--users" in err and "encoder" in err


def test_encoder_trains_with_bidirectional_attention():
    plan = compile_model(model="roberta-base", mode="train", seq_len=512, batch_size=8)
    assert plan.projection["tokens_per_s"] > 0 and any("bidirectional" in s for s in plan.decisions)


def test_a_family_the_compiler_does_not_project_is_one_error_line(capsys, monkeypatch):
    monkeypatch.setattr(capture, "COMPILED_FAMILIES", tuple(f for f in capture.COMPILED_FAMILIES if f != "mpt"))
    for argv in (("compile", "--model", "mpt-7b"), ("estimate", "--params", str(ZOO / "params_mpt_7B.yaml"))):
        rc, out, err = _run(capsys, *argv)
        lines = [ln for ln in err.splitlines() if not ln.startswith("ignored: ")]  # (the file's ignored keys first)
        assert rc == 2 and not out and len(lines) == 1
        assert lines[0].startswith("error: ") and "'mpt'" in err and "llama" in err


def test_t5_graph_has_the_published_shape_and_cross_kv_units():
    for name in ("t5-small", "flan-t5-base"):
        cfg = config_from_name(name)
        g = capture.capture_zoo(name)
        assert g.params == cfg.num_params and g.arch == "encoder_decoder"
        cross = [u for u in g.units if u.name.endswith(".cross_kv")]
        assert len(cross) == cfg.decoder_layers and all(u.stack == "encoder" for u in cross)
        assert all(u.params == 2 * cfg.d_model * cfg.n_head * cfg.head_dim for u in cross)


def test_t5_inference_encodes_once_and_decodes_with_its_kv():
    cfg = config_from_name("flan-t5-small")
    kw = dict(model="flan-t5-small", pes=(128, 128), users=4)
    short = compile_model(**kw, prompt_len=64, context_len=32).projection
    long_out = compile_model(**kw, prompt_len=64, context_len=64).projection
    long_in = compile_model(**kw, prompt_len=256, context_len=32).projection
    inner = cfg.n_head * cfg.head_dim
    # self-attention KV per output token in the decoder only; cross-attention K/V once per input position
    assert short["kv_cache_bytes_per_token"] == cfg.decoder_layers * 2 * inner * 2
    assert short["cross_kv_bytes_per_user"] == cfg.decoder_layers * 2 * inner * 64 * 2
    assert long_in["cross_kv_bytes_per_user"] == 4 * short["cross_kv_bytes_per_user"]
    assert 0 < short["encode_time_s"] < short["time_to_first_token_s"]
    assert long_in["encode_time_s"] > short["encode_time_s"]  # the encoder reads the whole input
    assert long_out["encode_time_s"] == pytest.approx(short["encode_time_s"], rel=0.05)  # not the output's length
    assert long_out["decode_latency_s_per_token"] > short["decode_latency_s_per_token"]  # a longer KV cache


def test_t5_training_counts_both_stacks():
    from waferscale.data.span_corruption import compute_input_and_target_lengths

    cfg = config_from_name("t5-small")
    L = 512
    T = compute_input_and_target_lengths(L)[1]
    plan = compile_model(model="t5-small", mode="train", seq_len=L, batch_size=32)
    assert plan.workload["tokens_per_step"] == 32 * (L + T)
    d, inner, h, dk = cfg.d_model, cfg.n_head * cfg.head_dim, cfg.n_head, cfg.head_dim
    mlp = (3 if cfg.gated_mlp else 2) * d * cfg.ffn_dim
    enc = L * (2 * (4 * d * inner + mlp) + 4 * h * dk * L)
    cross_kv = L * 2 * (2 * d * inner)
    dec = T * (2 * (4 * d * inner + 2 * d * inner + mlp) + 4 * h * dk * T + 4 * h * dk * L)
    head = T * 2 * cfg.vocab_size * d
    want = 3 * (cfg.n_layer * enc + cfg.decoder_layers * (cross_kv + dec) + head) / (L + T)
    assert plan.projection["model_flops_per_token"] == pytest.approx(want)
    streamed = compile_model(model="flan-t5-xl", mode="train", seq_len=L)
    assert streamed.strategy == "weight_streaming" and streamed.projection["tokens_per_s"] > 0


@pytest.mark.parametrize("mode", ["inference", "train"])
def test_copies_on_systems_with_different_logical_meshes_fit_each(mode):
    # seed 1: defects leave system 0 a 16x14 logical mesh and system 1 a 14x15 one
    plan = compile_model(model="gpt-tiny", pes=(16, 16), systems=2, defects=0.05, seed=1, mode=mode)
    assert len({(w["logical_rows"], w["logical_cols"]) for w in plan.wafers}) == 2
    assert {r.system for r in plan.regions} == {0, 1}
    assert all(r.row + r.rows <= plan.wafers[r.system]["logical_rows"] and
               r.col + r.cols <= plan.wafers[r.system]["logical_cols"] for r in plan.regions)
