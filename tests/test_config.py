"""Params YAML <-> typed dataclasses: shipped configs, round trips, the Model Zoo mapping, and every error class."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from waferscale.params import (InputParams, ModelParams, OptimizerParams, Params, RunConfig, load_params,
                               params_from_dict, save_params)
from waferscale.errors import ConfigError
from waferscale.models.config import RopeScaling
from waferscale.models.init import Initializer
from waferscale.models.registry import config_from_name

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def tiny() -> dict:
    """A small, valid legacy-layout params dict."""
    return {
        "train_input": {"data_dir": "shakespeare", "batch_size": 8, "max_sequence_length": 32},
        "model": {"name": "gpt-tiny"},
        "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-3},
        "runconfig": {"max_steps": 10},
    }


def write(tmp_path: Path, d: dict, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def error_of(tmp_path: Path, d: dict) -> str:
    path = write(tmp_path, d)
    with pytest.raises(ConfigError) as e:
        load_params(path)
    msg = str(e.value)
    assert msg.startswith(str(path)), msg  # every message names the file
    return msg


# ---- shipped configs -----------------------------------------------------------------------------------

def test_configs_are_shipped() -> None:
    names = {p.name for p in CONFIGS}
    assert {"gpt2_tiny_shakespeare.yaml", "gpt3_xl.yaml", "llama2_70b.yaml", "llama3.1_8b.yaml",
            "smollm2_135m_finetune.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_round_trips(path: Path, tmp_path: Path) -> None:
    params = load_params(path)
    assert params.source == str(path)
    cfg = params.model.to_model_config()  # shapes only; nothing is materialized
    assert cfg.num_params > 0
    assert Params.from_dict(params.to_dict()) == params
    assert params_from_dict(yaml.safe_load(params.to_yaml())) == params
    save_params(params, tmp_path / "saved.yaml")
    assert load_params(tmp_path / "saved.yaml") == params


def test_demo_config_is_small_and_fast() -> None:
    p = load_params(next(c for c in CONFIGS if c.name == "gpt2_tiny_shakespeare.yaml"))
    cfg = p.model.to_model_config()
    assert cfg.num_params < 2_000_000 and cfg.n_layer == 4 and cfg.d_model == 128
    assert p.train_input.tokenizer == "char" and p.train_input.data_dir == ["shakespeare"]
    tokens_per_step = p.train_input.batch_size * (p.train_input.max_sequence_length or cfg.max_seq_len)
    assert 1_000 <= tokens_per_step <= 4_096
    assert 200 <= p.runconfig.max_steps <= 400 and p.runconfig.log_steps == 1
    assert p.runconfig.max_steps % p.runconfig.checkpoint_steps == 0  # the last step is a checkpoint step
    assert p.model.half_dtype is None
    phases = p.optimizer.learning_rate
    assert [ph["scheduler"] for ph in phases] == ["Linear", "CosineDecay"]
    assert sum(ph["total_iters"] for ph in phases) == p.runconfig.max_steps


def test_gpt3_xl_matches_the_preset() -> None:
    p = load_params(next(c for c in CONFIGS if c.name == "gpt3_xl.yaml"))
    cfg, preset = p.model.to_model_config(), config_from_name("gpt3-1.3b")
    assert cfg.num_params == preset.num_params
    assert (cfg.d_model, cfg.n_layer, cfg.n_head, cfg.ffn_dim, cfg.max_seq_len, cfg.vocab_size) == \
        (2048, 24, 16, 8192, 2048, 50257)
    assert cfg.name == "gpt3-1.3b"  # an explicit shape is named after the preset it equals
    assert p.model.half_dtype == "bfloat16"  # cbfloat16 on a host
    assert p.optimizer.loss_scaling_factor == "dynamic"
    assert p.train_input.micro_batch_size == 88


def test_llama_configs_match_the_presets() -> None:
    p70 = load_params(next(c for c in CONFIGS if c.name == "llama2_70b.yaml")).model.to_model_config()
    # a Model Zoo config's model (no preset named) initializes as Model Zoo's: truncated_normal(0, initializer_range)
    assert p70.embedding_initializer == Initializer("truncated_normal", mean=0.0, std=0.02)
    assert p70.replace(embedding_initializer=None) == config_from_name("llama2-70b")
    assert p70.num_params == config_from_name("llama2-70b").num_params
    assert p70.kv_heads == 8 and p70.norm == "rmsnorm" and p70.activation == "swiglu" and p70.family == "llama"
    p8 = load_params(next(c for c in CONFIGS if c.name == "llama3.1_8b.yaml")).model.to_model_config()
    assert p8.replace(embedding_initializer=None) == config_from_name("llama3.1-8b")
    assert p8.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192)


def test_smollm2_finetune_config() -> None:
    p = load_params(next(c for c in CONFIGS if c.name == "smollm2_135m_finetune.yaml"))
    assert p.model.pretrained == "smollm2-135m-instruct"
    assert p.train_input.tokenizer == "smollm2"
    assert p.model.to_model_config().num_params == config_from_name("smollm2-135m").num_params


# ---- the Model Zoo -> ModelConfig mapping ---------------------------------------------------------------

def gpt_keys(**extra) -> dict:
    return {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4,
            "max_position_embeddings": 32, **extra}


def test_gpt_keys_map_with_model_zoo_defaults() -> None:
    cfg = ModelParams(**gpt_keys()).to_model_config()
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layer, cfg.n_head, cfg.max_seq_len) == (100, 64, 2, 4, 32)
    assert cfg.family == "gpt" and cfg.activation == "gelu" and cfg.position == "learned"
    assert cfg.norm == "layernorm" and cfg.tie_embeddings and cfg.attn_bias and cfg.mlp_bias
    assert cfg.ffn_dim == 256

    cfg = ModelParams(**gpt_keys(nonlinearity="gelu_new", filter_size=128, share_embedding_weights=False,
                                 use_projection_bias_in_attention=False, use_ffn_bias_in_attention=False,
                                 use_ffn_bias=False, layer_norm_epsilon=1e-6, dropout_rate=0.1,
                                 initializer_range=0.01)).to_model_config()
    assert cfg.activation == "gelu_tanh" and cfg.d_ff == 128 and not cfg.tie_embeddings
    assert not cfg.attn_bias and not cfg.mlp_bias and cfg.norm_eps == 1e-6
    assert cfg.dropout == 0.1 and cfg.init_std == 0.01


def test_llama_keys_map() -> None:
    cfg = ModelParams(**gpt_keys(nonlinearity="swiglu", norm_type="rmsnorm", position_embedding_type="rotary",
                                 rope_theta=5e5, extra_attention_params={"num_kv_groups": 2}, rotary_dim=16,
                                 pos_scaling_type="llama3", pos_scaling_factor=8.0,
                                 pos_scaling_extra_args={"original_max_position_embeddings": 16})
                      ).to_model_config()
    assert cfg.family == "llama" and cfg.activation == "swiglu" and cfg.norm == "rmsnorm"
    assert cfg.position == "rotary" and cfg.rope_theta == 5e5 and cfg.kv_heads == 2
    assert cfg.rope_scaling == RopeScaling(factor=8.0, original_max_position_embeddings=16)


def test_preset_name_with_overrides_and_family_labels() -> None:
    cfg = ModelParams(name="gpt-tiny", vocab_size=65, num_hidden_layers=3).to_model_config()
    assert (cfg.vocab_size, cfg.n_layer, cfg.d_model) == (65, 3, 32)
    assert ModelParams(name="GPT3-XL").to_model_config().num_params == config_from_name("gpt3-1.3b").num_params
    # a Model Zoo family name is a label, not a preset: the shape keys are then required
    cfg = ModelParams(name="llama", **gpt_keys(nonlinearity="swiglu")).to_model_config()
    assert cfg.family == "llama"
    with pytest.raises(ConfigError, match="hidden_size: is required"):
        ModelParams(name="llama", vocab_size=10)


@pytest.mark.parametrize("extra, match", [
    ({"position_embedding_type": "fixed"}, "position_embedding_type: expected one of 'learned', 'rotary'"),
    ({"embedding_layer_norm": True}, "embedding_layer_norm"),
    ({"num_heads": 5}, r"hidden_size \(64\) must be divisible by num_heads \(5\)"),
    ({"position_embedding_type": "rotary", "rotary_dim": 64}, r"rotary_dim must be in 1\.\.head dim"),
    ({"use_projection_bias_in_attention": True, "use_ffn_bias_in_attention": False}, "all on or all off"),
    ({"attention_dropout_rate": 0.2}, "one dropout rate"),
    ({"pos_scaling_type": "linear", "pos_scaling_factor": 2.0}, "only 'llama3'"),
    ({"nonlinearity": "tanh"}, "nonlinearity: expected one of"),
])
def test_unsupported_model_keys_are_refused(tmp_path: Path, extra: dict, match: str) -> None:
    d = tiny()
    d["model"] = gpt_keys(**extra)
    msg = error_of(tmp_path, d)
    assert "model" in msg
    assert re.search(match, msg), msg


def test_half_dtype() -> None:
    assert ModelParams(name="gpt-tiny").half_dtype is None
    assert ModelParams(name="gpt-tiny", mixed_precision=True).half_dtype == "float16"  # Model Zoo's default
    assert ModelParams(name="gpt-tiny", mixed_precision=True, fp16_type="cbfloat16").half_dtype == "bfloat16"
    assert ModelParams(name="gpt-tiny", mixed_precision=True, use_bfloat16=True).half_dtype == "bfloat16"
    assert ModelParams(name="gpt-tiny", fp16_type="bfloat16").half_dtype is None  # mixed_precision off


# ---- accepted spellings ---------------------------------------------------------------------------------

def test_legacy_spellings_and_ignored_keys(tmp_path: Path) -> None:
    d = tiny()
    d["train_input"].update(micro_batch_size="auto", prefetch_factor=10, data_processor="GptHDF5DataProcessor")
    d["model"].update(attention_type="scaled_dot_product", attention_module="aiayn_attention",
                      precision_opt_level=1, loss_weight=0.5, mixed_precision=True, use_bfloat16=True)
    d["optimizer"] = {"optimizer_type": "adamw", "weight_decay_rate": 0.1, "learning_rate": [
        {"scheduler": "LinearLR", "initial_learning_rate": 0.0, "end_learning_rate": 1e-3, "steps": 5},
        {"scheduler": "cosinedecay", "initial_learning_rate": 1e-3, "end_learning_rate": 1e-4, "decay_steps": 50},
        {"scheduler": "Constant", "learning_rate": 1e-4}]}
    d["runconfig"].update(save_checkpoint_steps=5, save_summary_steps=100)
    p = load_params(write(tmp_path, d))
    assert p.train_input.micro_batch_size is None and p.train_input.data_processor == "GptHDF5DataProcessor"
    assert p.optimizer.optimizer_type == "AdamW" and p.optimizer.weight_decay == 0.1
    assert p.optimizer.learning_rate == [  # (defaults filled in: Linear's cycle, as Cerebras' LinearLR takes it)
        {"scheduler": "Linear", "initial_learning_rate": 0.0, "end_learning_rate": 1e-3, "total_iters": 5,
         "cycle": False},
        {"scheduler": "CosineDecay", "initial_learning_rate": 1e-3, "end_learning_rate": 1e-4, "total_iters": 50},
        {"scheduler": "Constant", "learning_rate": 1e-4}]
    assert p.runconfig.checkpoint_steps == 5
    assert p.model.half_dtype == "bfloat16" and p.model.loss_weight == 0.5
    assert set(p.ignored) == {"train_input.prefetch_factor", "model.precision_opt_level", "runconfig.save_summary_steps",
                              "model.loss_weight"}
    assert Params.from_dict(p.to_dict()) == p


def test_single_values_and_single_scheduler_dict(tmp_path: Path) -> None:
    d = tiny()
    d["optimizer"]["learning_rate"] = {"scheduler": "Exponential", "initial_learning_rate": 0.1,
                                       "total_iters": 10, "decay_rate": 0.5}
    p = load_params(write(tmp_path, d))
    assert p.train_input.data_dir == ["shakespeare"]  # a str becomes [str]
    assert p.optimizer.learning_rate == [{"scheduler": "Exponential", "initial_learning_rate": 0.1,
                                          "total_iters": 10, "decay_rate": 0.5, "staircase": False}]


def test_exponent_without_dot_is_a_number(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(tiny()).replace("0.001", "1e-3"))
    assert "1e-3" in path.read_text()
    assert load_params(path).optimizer.learning_rate == 1e-3


def test_trainer_layout_maps_to_the_legacy_one() -> None:
    legacy = load_params(next(c for c in CONFIGS if c.name == "llama3.1_8b.yaml"))
    model = {k: v for k, v in legacy.to_dict()["model"].items() if k not in ("mixed_precision", "fp16_type")}
    trainer = {"trainer": {
        "init": {
            "backend": {"backend_type": "CSX", "cluster_config": {"num_csx": 2}},
            "model_dir": "./md", "seed": 7,
            "model": {**model, "name": "llama", "attention_module": "multiquery_attention"},
            "optimizer": {"AdamW": {"betas": [0.9, 0.95], "weight_decay": 0.1, "correct_bias": True}},
            "schedulers": [{"SequentialLR": {"schedulers": [
                {"LinearLR": {"initial_learning_rate": 0.0, "end_learning_rate": 1e-4, "total_iters": 10}},
                {"CosineDecayLR": {"initial_learning_rate": 1e-4, "end_learning_rate": 1e-5, "total_iters": 90}},
            ]}}],
            "precision": {"enabled": True, "fp16_type": "cbfloat16", "loss_scaling_factor": "dynamic",
                          "max_gradient_norm": 1.0, "log_loss_scale": True},
            "loop": {"max_steps": 100, "eval_steps": 2, "eval_frequency": 50},
            "checkpoint": {"steps": 25, "save_initial_checkpoint": False},
            "logging": {"log_steps": 1},
            "callbacks": [{"ScopedTrainFlags": {"csx.performance.micro_batch_size": 4}}, {"ComputeNorm": {}}],
        },
        "fit": {"train_dataloader": {"data_dir": "shakespeare", "batch_size": 16, "max_sequence_length": 64,
                                     "data_processor": "GptHDF5MapDataProcessor", "num_workers": 8},
                "val_dataloader": {"data_dir": "shakespeare", "batch_size": 16}},
    }}
    p = params_from_dict(trainer, "trainer.yaml")
    assert p.model.to_model_config().replace(name="x") == legacy.model.to_model_config().replace(name="x")
    assert p.model.half_dtype == "bfloat16"
    assert p.optimizer.optimizer_type == "AdamW" and p.optimizer.max_gradient_norm == 1.0
    assert [ph["scheduler"] for ph in p.optimizer.learning_rate] == ["Linear", "CosineDecay"]
    rc = p.runconfig
    assert (rc.max_steps, rc.eval_steps, rc.eval_frequency, rc.checkpoint_steps, rc.num_csx, rc.seed) == \
        (100, 2, 50, 25, 2, 7)
    assert "trainer.init.callbacks[1].ComputeNorm" in p.ignored
    assert p.train_input.micro_batch_size == 4 and p.eval_input is not None


def test_trainer_layout_errors() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.init\.lop: unknown key 'lop' \(did you mean 'loop'\?\)"):
        params_from_dict({"trainer": {"init": {"lop": {}}}}, "t.yaml")
    with pytest.raises(ConfigError, match="multi-phase"):
        params_from_dict({"trainer": [{"trainer": {}}, {"trainer": {}}]}, "t.yaml")


# ---- errors ----------------------------------------------------------------------------------------------

def test_unknown_key_names_path_line_and_suggestion(tmp_path: Path) -> None:
    d = tiny()
    d["optimizer"]["learning_rate"] = [
        {"scheduler": "Linear", "initial_learning_rate": 0.0, "end_learning_rate": 1e-3, "total_iters": 5},
        {"schedular": "CosineDecay", "initial_learning_rate": 1e-3, "end_learning_rate": 0.0, "total_iters": 5}]
    msg = error_of(tmp_path, d)
    assert "optimizer.learning_rate[1].schedular" in msg and "did you mean 'scheduler'?" in msg

    d = tiny()
    d["train_input"]["batch_sise"] = 8
    msg = error_of(tmp_path, d)
    assert "train_input.batch_sise" in msg and "did you mean 'batch_size'?" in msg
    line = next(i for i, ln in enumerate(write(tmp_path, d).read_text().splitlines(), 1) if "batch_sise" in ln)
    assert msg.startswith(f"{tmp_path / 'p.yaml'}:{line}:")

    d = tiny()
    d["trian_input"] = d.pop("train_input")
    assert "did you mean 'train_input'?" in error_of(tmp_path, d)

    d = tiny()
    d["optimizer"]["learning_rate"] = {"scheduler": "CosineDecy", "initial_learning_rate": 1.0,
                                       "end_learning_rate": 0.0, "total_iters": 5}
    assert "did you mean 'CosineDecay'?" in error_of(tmp_path, d)


@pytest.mark.parametrize("section, key, value, expected", [
    ("train_input", "batch_size", "abc", "expected an integer, got 'abc'"),
    ("train_input", "batch_size", 8.0, "expected an integer, got 8.0"),
    ("train_input", "shuffle", "yes please", "expected true or false"),
    ("optimizer", "betas", 0.9, "expected a list of 2 numbers"),
    ("optimizer", "learning_rate", "fast", "expected a number, a scheduler mapping"),
    ("runconfig", "max_steps", None, "got nothing (null)"),
    ("model", "extra_attention_params", 8, "expected a mapping"),
])
def test_wrong_type(tmp_path: Path, section: str, key: str, value: object, expected: str) -> None:
    d = tiny()
    d[section][key] = value
    msg = error_of(tmp_path, d)
    assert f"{section}.{key}" in msg and expected in msg, msg


@pytest.mark.parametrize("section, key", [
    ("train_input", "batch_size"), ("train_input", "data_dir"), ("optimizer", "learning_rate"),
    ("optimizer", "optimizer_type"), ("runconfig", "max_steps"), (None, "model"), (None, "runconfig"),
])
def test_missing_required_key(tmp_path: Path, section: str | None, key: str) -> None:
    d = tiny()
    (d[section] if section else d).pop(key)
    msg = error_of(tmp_path, d)
    assert f"missing required key '{key}'" in msg and f"add `{key}: ...`" in msg, msg


def test_missing_model_shape_without_preset(tmp_path: Path) -> None:
    d = tiny()
    d["model"] = {"hidden_size": 64}
    msg = error_of(tmp_path, d)
    assert "model.vocab_size: is required" in msg and "model.name" in msg


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["train_input"].update(batch_size=0), "train_input.batch_size: must be a positive integer"),
    (lambda d: d["train_input"].update(micro_batch_size=3), "3 does not divide batch_size 8"),
    (lambda d: d["runconfig"].update(max_steps=0), "runconfig.max_steps: must be a positive integer"),
    (lambda d: d["runconfig"].update(num_csx=3), "not divisible by runconfig.num_csx 3"),
    (lambda d: d["runconfig"].update(num_csx=2) or d["train_input"].update(micro_batch_size=8),
     "does not divide the per-system batch 4"),
    (lambda d: d["train_input"].update(max_sequence_length=65), "exceeds the model's max_position_embeddings 64"),
    (lambda d: d["train_input"].update(val_fraction=1.5), "val_fraction: must be in [0, 1)"),
    (lambda d: d["optimizer"].update(learning_rate=-1.0), "must be >= 0"),
    (lambda d: d["optimizer"].update(optimizer_type="Adam", correct_bias=False),
     "correct_bias: false applies to AdamW only"),
    (lambda d: d["optimizer"].update(optimizer_type="Adafactr"), "optimizer_type: expected one of 'SGD'"),
    (lambda d: d["optimizer"].update(optimizer_type="AdaFactor", eps=1e-8),
     "optimizer.eps: Adafactor takes two numbers"),
    (lambda d: d["optimizer"].update(max_gradient_norm=0.0), "max_gradient_norm: must be > 0"),
    (lambda d: d["optimizer"].update(learning_rate=[{"scheduler": "Constant", "learning_rate": 1.0},
                                                    {"scheduler": "Constant", "learning_rate": 0.5}]),
     "learning_rate[0].total_iters: is required for every phase but the last"),
    (lambda d: d["runconfig"].update(execution="warp"), "runconfig.execution: expected one of 'auto'"),
    (lambda d: d["model"].update(name="gpt-tinny"), "did you mean 'gpt-tiny'"),
])
def test_nonsensical_values(tmp_path: Path, mutate, expected: str) -> None:
    d = copy.deepcopy(tiny())
    mutate(d)
    msg = error_of(tmp_path, d)
    assert expected in msg, msg


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("train_input:\n  batch_size: 8\n  data_dir: [a, b\nmodel: {name: gpt-tiny}\n")
    with pytest.raises(ConfigError, match=rf"^{path}:4:\d+: malformed YAML"):
        load_params(path)
    path.write_text("runconfig: {max_steps: 1}\nrunconfig: {max_steps: 2}\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: duplicate key 'runconfig' \(first on line 1\)"):
        load_params(path)


def test_missing_file_and_bad_top_level(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: no such params file"):
        load_params(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_params(tmp_path)
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=rf"^{path}: the top level must be a mapping"):
        load_params(path)
    path.write_text("")
    with pytest.raises(ConfigError, match="got an empty file"):
        load_params(path)
    with pytest.raises(ConfigError, match="mixes the trainer layout"):
        params_from_dict({"trainer": {}, "model": {}})


def test_objects_built_in_code_are_validated() -> None:
    with pytest.raises(ConfigError, match="device: expected one of"):
        RunConfig(max_steps=10, device="tpu")
    with pytest.raises(ConfigError, match="max_steps: must be a positive integer"):
        RunConfig(max_steps=-1)
    with pytest.raises(ConfigError, match="micro_batch_size"):
        InputParams(data_dir="x", batch_size=8, micro_batch_size=3)
    assert InputParams(data_dir="x", batch_size=8).data_dir == ["x"]
    opt = OptimizerParams(optimizer_type="SGD", learning_rate={"scheduler": "linearlr", "initial_learning_rate": 1.0,
                                                               "end_learning_rate": 0.0, "total_iters": 4})
    assert opt.learning_rate == [{"scheduler": "Linear", "initial_learning_rate": 1.0, "end_learning_rate": 0.0,
                                  "total_iters": 4, "cycle": False}]
