"""Hugging Face interop: logits parity with transformers' GPT-2 and Llama, export, import, sharding, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_helpers import assert_config_round_trips, ids, max_diff, perturbed
from waferscale.errors import CheckpointError
from waferscale.models import hf
from waferscale.models.config import ModelConfig, RopeScaling
from waferscale.models.registry import build

transformers = pytest.importorskip("transformers")


def _gpt(**kw) -> ModelConfig:
    base = dict(name="t-gpt", family="gpt", vocab_size=97, n_layer=2, n_head=4, d_model=32, max_seq_len=64,
                activation="gelu_tanh")
    return ModelConfig(**{**base, **kw})


def _llama(**kw) -> ModelConfig:
    base = dict(name="t-llama", family="llama", vocab_size=97, n_layer=2, n_head=4, n_kv_head=4, d_model=32,
                d_ff=48, max_seq_len=64, norm="rmsnorm", activation="swiglu", position="rotary",
                rope_theta=10000.0, tie_embeddings=False, attn_bias=False, mlp_bias=False)
    return ModelConfig(**{**base, **kw})


# head_dim 8 -> rotary wavelengths 6.3, 63, 628, 6283 positions. With original context 32 and factors (1, 8),
# the first is kept, the second is interpolated and the last two are divided by `factor`: all three branches
# of the llama3 rule are exercised.
_L3 = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=8.0, original_max_position_embeddings=32)

CONFIGS = {
    "gpt2-tied": _gpt(),
    "gpt2-untied-gelu-dff": _gpt(tie_embeddings=False, activation="gelu", d_ff=48, norm_eps=1e-6),
    "llama-mha-untied": _llama(),
    "llama-gqa-tied": _llama(n_kv_head=2, tie_embeddings=True),
    "llama-mqa-llama3-rope": _llama(n_kv_head=1, rope_scaling=_L3, rope_theta=500.0),
    "llama-bias": _llama(n_kv_head=2, attn_bias=True, mlp_bias=True),
}


def _hf_model(cfg: ModelConfig, seed: int = 0):
    """A transformers model of `cfg`'s architecture with random weights (std 0.2 so every path matters)."""
    torch.manual_seed(seed)
    conf = transformers.AutoConfig.for_model(**hf.config_to_hf(cfg))
    model = transformers.AutoModelForCausalLM.from_config(conf).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight",
                                                                         "layernorm.weight", "norm.weight")) else 0.0))
    return model


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_config_round_trip(key: str) -> None:
    assert_config_round_trips(CONFIGS[key])


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_logits_match_transformers(key: str) -> None:
    cfg = CONFIGS[key]
    theirs = _hf_model(cfg)
    ours = hf.model_from_state_dict(cfg, hf.state_dict_from_hf(theirs.state_dict(), cfg))
    x = ids(cfg)
    with torch.no_grad():
        diff = max_diff(ours(x), theirs(x).logits)
    assert diff <= 1e-4, f"{key}: max |logit difference| {diff}"


def test_parity_test_is_sensitive_to_rope_scaling() -> None:
    """Guard against a vacuous pass: dropping the llama3 scaling must change the logits measurably."""
    cfg = CONFIGS["llama-mqa-llama3-rope"]
    theirs = _hf_model(cfg)
    plain = cfg.replace(rope_scaling=None)
    ours = hf.model_from_state_dict(plain, hf.state_dict_from_hf(theirs.state_dict(), plain))
    x = ids(cfg)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x).logits) > 1e-2


def test_gpt2_bare_model_names_and_mask_buffers_are_accepted() -> None:
    """The original GPT-2 checkpoints hold GPT2Model names (no `transformer.` prefix) and `attn.bias` masks."""
    cfg = CONFIGS["gpt2-tied"]
    theirs = _hf_model(cfg)
    sd = {k.removeprefix("transformer."): v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    sd["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    ours = hf.model_from_state_dict(cfg, hf.state_dict_from_hf(sd, cfg))
    x = ids(cfg)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x).logits) <= 1e-4


def test_state_dict_round_trip_is_exact() -> None:
    for cfg in CONFIGS.values():
        ours = perturbed(cfg)
        back = hf.state_dict_from_hf(hf.state_dict_to_hf(ours.state_dict(), cfg), cfg)
        sd = ours.state_dict()
        assert back.keys() == sd.keys()
        for k in sd:
            assert torch.equal(back[k], sd[k]), k


def test_tied_head_is_not_written() -> None:
    assert "lm_head.weight" not in hf.state_dict_to_hf(perturbed(CONFIGS["gpt2-tied"]).state_dict(),
                                                        CONFIGS["gpt2-tied"])
    assert "lm_head.weight" in hf.state_dict_to_hf(perturbed(CONFIGS["llama-mha-untied"]).state_dict(),
                                                    CONFIGS["llama-mha-untied"])


# ---- export: ours -> directory -> transformers ------------------------------------------------------------

@pytest.mark.parametrize("key", ["gpt2-tied", "gpt2-untied-gelu-dff", "llama-gqa-tied", "llama-mqa-llama3-rope"])
def test_export_loads_in_transformers(key: str, tmp_path: Path) -> None:
    cfg = CONFIGS[key]
    ours = perturbed(cfg)
    out = tmp_path / "export"
    hf.save_hf_dir(ours, out)
    assert {p.name for p in out.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    x = ids(cfg)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x).logits) <= 1e-4
    # ... and back into ours, the same model (tie restored, no lm_head stored when tied)
    again = hf.load_hf_dir(out)
    assert again.config == cfg
    assert (again.head.lm_head.weight is again.embed.tok.weight) == cfg.tie_embeddings
    with torch.no_grad():
        assert max_diff(ours(x), again(x)) == 0.0


def test_export_writes_tokenizer_and_special_ids(tmp_path: Path) -> None:
    class FakeTokenizer:
        eos_id, bos_id = 2, 1

        def save(self, directory: str) -> None:
            (Path(directory) / "tokenizer.json").write_text("{}")

    hf.save_hf_dir(perturbed(CONFIGS["llama-gqa-tied"]), tmp_path / "m", tokenizer=FakeTokenizer())
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    gen = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    assert conf["eos_token_id"] == gen["eos_token_id"] == 2 and conf["bos_token_id"] == 1


def test_failed_export_leaves_nothing_behind(tmp_path: Path) -> None:
    class BrokenTokenizer:
        def save(self, directory: str) -> None:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        hf.save_hf_dir(perturbed(CONFIGS["gpt2-tied"]), tmp_path / "m", tokenizer=BrokenTokenizer())
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temp dir


def test_export_over_an_earlier_sharded_save_replaces_it(tmp_path: Path) -> None:
    cfg = CONFIGS["llama-mha-untied"]
    out = tmp_path / "m"
    _hf_model(cfg).save_pretrained(out, max_shard_size="20KB")
    assert (out / hf.INDEX_NAME).is_file()
    (out / "notes.txt").write_text("mine")
    ours = perturbed(cfg, seed=5)
    hf.save_hf_dir(ours, out)
    assert not (out / hf.INDEX_NAME).exists() and [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert (out / "notes.txt").read_text() == "mine"  # files that are not ours are left alone
    x = ids(cfg)
    with torch.no_grad():
        assert max_diff(ours(x), hf.load_hf_dir(out)(x)) == 0.0


def test_meta_model_cannot_be_exported(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="meta"):
        hf.save_hf_dir(build(CONFIGS["gpt2-tied"], device="meta"), tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_config_without_hf_equivalent_is_refused() -> None:
    with pytest.raises(CheckpointError, match="no Hugging Face equivalent"):
        hf.config_to_hf(_gpt(attn_bias=False))


# ---- import: transformers -> directory -> ours ------------------------------------------------------------

@pytest.mark.parametrize("key, shard", [("gpt2-tied", None), ("llama-gqa-tied", None),
                                        ("llama-mqa-llama3-rope", "20KB"), ("gpt2-untied-gelu-dff", "20KB")])
def test_hf_saved_dir_loads(key: str, shard: str | None, tmp_path: Path) -> None:
    cfg = CONFIGS[key]
    theirs = _hf_model(cfg)
    kw = {"max_shard_size": shard} if shard else {}
    theirs.save_pretrained(tmp_path, safe_serialization=True, **kw)
    assert (tmp_path / hf.INDEX_NAME).is_file() == bool(shard)
    if shard:
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = hf.load_hf_dir(tmp_path)
    assert ours.config == cfg and not ours.training
    x = ids(cfg)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x).logits) <= 1e-4


def test_load_hf_dir_dtype(tmp_path: Path) -> None:
    cfg = CONFIGS["llama-gqa-tied"]
    _hf_model(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    assert hf.load_hf_dir(tmp_path).embed.tok.weight.dtype == torch.bfloat16  # as stored
    m = hf.load_hf_dir(tmp_path, dtype=torch.float32)
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    assert m.head.lm_head.weight is m.embed.tok.weight


def test_architecture_mismatch_names_key_and_shapes(tmp_path: Path) -> None:
    small, big = CONFIGS["llama-gqa-tied"], CONFIGS["llama-gqa-tied"].replace(d_model=64)
    _hf_model(small).save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf.update(hf.config_to_hf(big))
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match=r"another architecture") as e:
        hf.load_hf_dir(tmp_path)
    msg = str(e.value)
    assert "'model.embed_tokens.weight' is [97, 32] in the checkpoint but the model expects [97, 64]" in msg


def test_other_family_weights_are_refused(tmp_path: Path) -> None:
    gpt_sd = _hf_model(CONFIGS["gpt2-tied"]).state_dict()
    with pytest.raises(CheckpointError, match=r"missing key.*unexpected key.*another architecture"):
        hf.state_dict_from_hf(gpt_sd, CONFIGS["llama-gqa-tied"])


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    cfg = CONFIGS["llama-mha-untied"]
    sd = dict(_hf_model(cfg).state_dict())
    del sd["lm_head.weight"]
    with pytest.raises(CheckpointError, match=r"1 missing key\(s\), e.g. 'lm_head.weight'"):
        hf.state_dict_from_hf(sd, cfg)


def test_unsupported_configs_are_checkpoint_errors() -> None:
    with pytest.raises(CheckpointError, match="unsupported model_type 'xlnet'"):
        hf.config_from_hf({"model_type": "xlnet"})
    llama = hf.config_to_hf(CONFIGS["llama-gqa-tied"])
    with pytest.raises(CheckpointError, match="'yarn'"):
        hf.config_from_hf({**llama, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}})
    with pytest.raises(CheckpointError, match="hidden_size"):
        hf.config_from_hf({k: v for k, v in llama.items() if k != "hidden_size"})


def test_legacy_llama_config_keys() -> None:
    """transformers 4.x config.json: rope_theta / rope_scaling at top level, no rope_parameters, no head_dim."""
    cfg = CONFIGS["llama-mqa-llama3-rope"]
    legacy = {k: v for k, v in hf.config_to_hf(cfg).items() if k not in ("rope_parameters", "head_dim")}
    assert hf.config_from_hf(legacy) == cfg


def test_pickles_are_never_loaded(tmp_path: Path) -> None:
    cfg = CONFIGS["gpt2-tied"]
    (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(cfg)))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(CheckpointError, match="pickled checkpoints are not loaded"):
        hf.load_hf_dir(tmp_path)


def test_truncated_safetensors_is_a_checkpoint_error(tmp_path: Path) -> None:
    hf.save_hf_dir(perturbed(CONFIGS["gpt2-tied"]), tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated"):
        hf.load_hf_dir(tmp_path / "m")


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        hf.load_hf_dir(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        hf.load_hf_dir(tmp_path / "nope")


def test_load_pretrained_dispatches_to_hf_dirs(tmp_path: Path) -> None:
    from waferscale.models.pretrained import load_pretrained

    cfg = CONFIGS["gpt2-tied"]
    ours = perturbed(cfg)
    hf.save_hf_dir(ours, tmp_path / "m")
    x = ids(cfg)
    with torch.no_grad():
        assert max_diff(load_pretrained(tmp_path / "m")(x), ours(x)) == 0.0
    with pytest.raises(CheckpointError, match="neither a pretrained model name"):
        load_pretrained(tmp_path / "missing")
