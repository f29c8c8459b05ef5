"""The encoder families (BERT, RoBERTa): parity with transformers' BertForPreTraining / BertForMaskedLM /
RobertaForMaskedLM on tiny random models built here (masked-LM and next-sentence logits within 1e-4), export back
to transformers, preset parameter counts."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from conftest import tiny_params
from waferscale.errors import CheckpointError, ConfigError
from waferscale.params import params_from_dict
from waferscale.models import hf
from waferscale.models.bert import BERT
from waferscale.models.config import ModelConfig
from waferscale.models.registry import PRESETS, build
from waferscale.zoo.runner import RunOptions, run

transformers = pytest.importorskip("transformers")


def _enc(family: str, **kw) -> ModelConfig:
    base = dict(name=f"t-{family}", family=family, vocab_size=97, n_layer=2, n_head=4, d_model=32, d_ff=48,
                max_seq_len=40, norm_eps=1e-12 if family == "bert" else 1e-5, activation="gelu", block="post_norm",
                lm_head_bias=True, type_vocab_size=2 if family == "bert" else 1,
                pad_token_id=0 if family == "bert" else 1)
    return ModelConfig(**{**base, **kw})


CONFIGS = {
    "bert-pretraining": _enc("bert", nsp_head=True),
    "bert-mlm-untied-gelu-new": _enc("bert", tie_embeddings=False, activation="gelu_tanh", type_vocab_size=3),
    "roberta-mlm": _enc("roberta"),
    "roberta-pad3-untied": _enc("roberta", pad_token_id=3, tie_embeddings=False),
}


def _hf_model(cfg: ModelConfig, seed: int = 0):
    """A transformers encoder of `cfg`'s architecture with random weights (std 0.2 so every path matters)."""
    torch.manual_seed(seed)
    hf_dict = hf.config_to_hf(cfg)
    conf = transformers.AutoConfig.for_model(**hf_dict)
    model = getattr(transformers, hf_dict["architectures"][0])(conf).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "layer_norm.weight" in name.lower() else 0.0))
    return model


def _ids(cfg: ModelConfig, T: int = 40) -> torch.Tensor:
    """Token ids without the padding token (transformers would give it RoBERTa's padding position)."""
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    return torch.where(ids == cfg.pad_token_id, ids + 1, ids)


def _types(cfg: ModelConfig, T: int = 40) -> torch.Tensor:
    return torch.randint(0, cfg.type_vocab_size, (2, T), generator=torch.Generator().manual_seed(2))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _logits(theirs, ids: torch.Tensor, types: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = theirs(input_ids=ids, token_type_ids=types)
    mlm = out.prediction_logits if hasattr(out, "prediction_logits") else out.logits
    return mlm, getattr(out, "seq_relationship_logits", None)


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_config_round_trip(key: str) -> None:
    cfg = CONFIGS[key]
    hf_dict = hf.config_to_hf(cfg)
    assert hf.config_from_hf(hf_dict) == cfg
    assert hf.config_from_hf(transformers.AutoConfig.for_model(**hf_dict).to_dict()) == cfg


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_logits_match_transformers(key: str) -> None:
    cfg = CONFIGS[key]
    theirs = _hf_model(cfg)
    ours = hf.model_from_state_dict(cfg, hf.state_dict_from_hf(theirs.state_dict(), cfg))
    assert isinstance(ours, BERT)
    x, tt = _ids(cfg), _types(cfg)
    with torch.no_grad():
        mlm, nsp = _logits(theirs, x, tt)
        assert _max_diff(ours(x, tt), mlm) <= 1e-4
        if cfg.nsp_head:
            ours_mlm, ours_nsp = ours.pretraining_logits(x, tt)
            assert _max_diff(ours_mlm, mlm) <= 1e-4 and _max_diff(ours_nsp, nsp) <= 1e-4
        else:
            assert nsp is None


def test_roberta_padding_positions_match_transformers() -> None:
    """Padding tokens take RoBERTa's padding position and the others count after it, as in transformers."""
    cfg = CONFIGS["roberta-pad3-untied"]
    theirs = _hf_model(cfg)
    ours = hf.model_from_state_dict(cfg, hf.state_dict_from_hf(theirs.state_dict(), cfg))
    x = _ids(cfg)
    x[0, :5] = x[1, -3:] = cfg.pad_token_id
    with torch.no_grad():
        assert _max_diff(ours.embed(x), theirs.roberta.embeddings(input_ids=x)) <= 1e-5


@pytest.mark.parametrize("key,change", [("bert-pretraining", dict(norm_eps=1e-3)),
                                        ("bert-mlm-untied-gelu-new", dict(activation="relu")),
                                        ("roberta-mlm", dict(family="bert", pad_token_id=0))])
def test_parity_is_sensitive_to_each_knob(key: str, change: dict) -> None:
    """A vacuous pass is ruled out: changing the knob while keeping the weights changes the logits."""
    cfg = CONFIGS[key]
    theirs = _hf_model(cfg)
    sd = hf.state_dict_from_hf(theirs.state_dict(), cfg)
    other = cfg.replace(**change)
    if other.position_offset != cfg.position_offset:  # as if RoBERTa's positions were counted from row 0
        sd["embed.pos.weight"] = sd["embed.pos.weight"][:other.max_seq_len]
    ours = hf.model_from_state_dict(other, sd)
    x, tt = _ids(cfg), _types(cfg)
    with torch.no_grad():
        assert _max_diff(ours(x, tt), _logits(theirs, x, tt)[0]) > 1e-3


def test_state_dict_round_trip_is_exact() -> None:
    for cfg in CONFIGS.values():
        ours = build(cfg, device="cpu")
        back = hf.state_dict_from_hf(hf.state_dict_to_hf(ours.state_dict(), cfg), cfg)
        sd = ours.state_dict()
        assert back.keys() == sd.keys()
        assert all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_export_loads_in_transformers(key: str, tmp_path: Path) -> None:
    cfg = CONFIGS[key]
    torch.manual_seed(3)
    ours = build(cfg, device="cpu").eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf.save_hf_dir(ours, tmp_path / "export")
    arch = hf.config_to_hf(cfg)["architectures"][0]
    theirs = getattr(transformers, arch).from_pretrained(tmp_path / "export").float().eval()
    x, tt = _ids(cfg), _types(cfg)
    with torch.no_grad():
        mlm, nsp = _logits(theirs, x, tt)
        assert _max_diff(ours(x, tt), mlm) <= 1e-4
        if cfg.nsp_head:
            assert _max_diff(ours.pretraining_logits(x, tt)[1], nsp) <= 1e-4
    back = hf.load_hf_dir(tmp_path / "export")
    assert back.config == cfg
    with torch.no_grad():
        assert torch.equal(back(x, tt), ours(x, tt))


def test_masked_lm_checkpoint_with_pretraining_heads_keeps_them(tmp_path: Path) -> None:
    """A BertForPreTraining checkpoint whose config.json says BertForMaskedLM (bert-base-uncased's case): the
    next-sentence head in the weights is loaded, not dropped."""
    cfg = CONFIGS["bert-pretraining"]
    theirs = _hf_model(cfg)
    theirs.config.architectures = ["BertForMaskedLM"]
    theirs.save_pretrained(tmp_path / "ckpt")
    ours = hf.load_hf_dir(tmp_path / "ckpt")
    assert ours.config.nsp_head
    x, tt = _ids(cfg), _types(cfg)
    with torch.no_grad():
        assert _max_diff(ours.pretraining_logits(x, tt)[1], _logits(theirs, x, tt)[1]) <= 1e-4


def test_unsupported_inputs_are_named() -> None:
    hf_dict = hf.config_to_hf(CONFIGS["bert-pretraining"])
    with pytest.raises(CheckpointError, match="position_embedding_type"):
        hf.config_from_hf({**hf_dict, "position_embedding_type": "relative_key"})
    with pytest.raises(CheckpointError, match="is_decoder"):
        hf.config_from_hf({**hf_dict, "is_decoder": True})
    with pytest.raises(CheckpointError, match="roberta hidden_act 'relu'"):
        hf.config_from_hf({**hf.config_to_hf(CONFIGS["roberta-mlm"]), "hidden_act": "relu"})
    with pytest.raises(CheckpointError, match="type_vocab_size >= 1"):
        hf.config_to_hf(CONFIGS["bert-pretraining"].replace(type_vocab_size=0))
    with pytest.raises(ConfigError, match="post_norm"):
        _enc("bert", block="sequential")
    with pytest.raises(ConfigError, match="post_norm"):
        ModelConfig(block="post_norm")
    with pytest.raises(ConfigError, match="pad_token_id"):
        _enc("roberta", pad_token_id=None)
    with pytest.raises(ConfigError, match="no KV cache"):
        build(CONFIGS["roberta-mlm"]).make_kv_caches(1, 8)


# (preset, transformers class, its config) -> parameter counts equal; the published figures are rounded
_PUBLISHED = {"bert-base": 110e6, "bert-large": 340e6, "roberta-base": 125e6, "roberta-large": 355e6}
_ROBERTA_HF = dict(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
                   layer_norm_eps=1e-5)
_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
_HF_OF = {"bert-base": ("BertForPreTraining", "BertConfig", {}),
          "bert-large": ("BertForPreTraining", "BertConfig", _LARGE),
          "roberta-base": ("RobertaForMaskedLM", "RobertaConfig", _ROBERTA_HF),
          "roberta-large": ("RobertaForMaskedLM", "RobertaConfig", {**_ROBERTA_HF, **_LARGE})}


@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_preset_parameter_counts(name: str) -> None:
    cfg = PRESETS[name]
    assert cfg.num_params == build(cfg, device="meta").num_params()
    assert abs(cfg.num_params - _PUBLISHED[name]) / _PUBLISHED[name] < 0.015
    arch, conf, kw = _HF_OF[name]
    with torch.device("meta"):
        theirs = getattr(transformers, arch)(getattr(transformers, conf)(**kw))
    assert cfg.num_params == sum(p.numel() for p in theirs.parameters())


def test_model_zoo_section_keeps_an_encoder_preset_and_trains_masked_lm(corpus: Path, tmp_path: Path) -> None:
    """A Model Zoo section naming an encoder preset describes that encoder, and `wsc run` trains it on the
    masked-LM objective (tests/test_masked_lm.py checks the objective itself)."""
    d = tiny_params(corpus, tmp_path)
    d["model"]["name"] = "bert-tiny"
    d["runconfig"]["max_steps"] = 2
    params = params_from_dict(d, source="test")
    assert params.model.to_model_config() == PRESETS["bert-tiny"].replace(vocab_size=64, max_seq_len=32)
    summary = run(params, RunOptions(model_dir=tmp_path / "run", progress=False), out=io.StringIO())
    assert summary["model"] == "bert-tiny" and summary["final_step"] == 2


def test_streamed_encoder_built_on_meta_gets_berts_initialisation() -> None:
    """MemoryX initialises an encoder built on the meta device by BERT's rule: every matrix N(0, init_std) (no
    GPT-style scaling of the residual projections), biases 0, norms 1, the padding token's embedding 0."""
    from waferscale.runtime.memoryx import MemoryX
    from waferscale.runtime.optim import OptimizerSpec

    cfg = PRESETS["bert-base"].replace(n_layer=8, d_model=64, n_head=4, vocab_size=500)
    w = MemoryX(build(cfg, device="meta"), OptimizerSpec("AdamW", 1e-3)).checkpoint_state()
    for name in ("embed.tok.weight", "blocks.7.attn.o_proj.weight", "blocks.7.mlp.down_proj.weight"):
        assert float(w[name].std()) == pytest.approx(cfg.init_std, rel=0.1), name
    assert not w["embed.tok.weight"][cfg.pad_token_id].any()
    assert float(w["blocks.3.mlp_norm.weight"].min()) == 1.0 and not w["blocks.3.attn.o_proj.bias"].any()
