"""Hugging Face config.json <-> ModelConfig, for every architecture `hf.py` maps (its docstring lists them):
which HF model type expresses a config exactly, and the keys each type reads and writes."""

from __future__ import annotations

import dataclasses
from typing import Any

from waferscale.errors import CheckpointError
from waferscale.models.config import ModelConfig, RopeScaling

__all__ = ["SUPPORTED_MODEL_TYPES", "config_from_hf", "config_to_hf", "hf_model_type"]

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "gptj", "gpt_neox", "falcon", "mpt", "mistral", "mixtral", "bert",
                         "roberta", "t5")
_GPT2_ACT_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                     "gelu": "gelu", "relu": "relu"}
_GPT2_ACT_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


# ---- configs ------------------------------------------------------------------------------------------

def _hf_name(hf: dict[str, Any]) -> str:
    if hf.get("waferscale_name"):
        return str(hf["waferscale_name"])
    src = str(hf.get("_name_or_path") or "").rstrip("/")
    return src.rsplit("/", 1)[-1].lower() if src else f"hf-{hf.get('model_type')}"


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read rope theta and scaling from either transformers>=5 `rope_parameters` or the legacy keys."""
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rs = params if params.get("rope_type", "default") != "default" else legacy
    kind = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"rope scaling type {kind!r} is not supported (only 'llama3' and none); "
                              f"config: {rs}")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rs]
    if missing:
        raise CheckpointError(f"llama3 rope scaling lacks {missing}; config: {rs}")
    return theta, RopeScaling(**{k: float(rs[k]) for k in keys[:3]}, original_max_position_embeddings=int(rs[keys[3]]))


def _act_from_hf(mt: str, act: str) -> str:
    if act not in _GPT2_ACT_FROM_HF:
        raise CheckpointError(f"{mt} activation {act!r} is not supported; supported: {sorted(_GPT2_ACT_FROM_HF)}")
    return _GPT2_ACT_FROM_HF[act]


def _rotary_dim(hd: int, rot: int | None) -> int | None:
    """ModelConfig.rotary_dim: None when the whole head rotates."""
    return None if rot in (None, hd) else rot


def _gptj_from_hf(hf: dict[str, Any]) -> ModelConfig:
    d, nh = int(hf["n_embd"]), int(hf["n_head"])
    return ModelConfig(
        name=_hf_name(hf), family="gptj", vocab_size=int(hf["vocab_size"]), n_layer=int(hf["n_layer"]), n_head=nh,
        d_model=d, d_ff=int(hf["n_inner"]) if hf.get("n_inner") else None, max_seq_len=int(hf["n_positions"]),
        norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation=_act_from_hf("gptj", hf.get("activation_function", "gelu_new")), position="rotary",
        rotary_dim=_rotary_dim(d // nh, hf.get("rotary_dim")), rotary_interleaved=True, block="parallel_shared_norm",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), attn_bias=False, mlp_bias=True, lm_head_bias=True,
        dropout=float(hf.get("resid_pdrop", 0.0)), init_std=float(hf.get("initializer_range", 0.02)))


def _gpt_neox_from_hf(hf: dict[str, Any]) -> ModelConfig:
    d, nh = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise CheckpointError(f"gpt_neox rope scaling is not supported; config: {rope or hf.get('rope_scaling')}")
    pct = float(rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)))
    return ModelConfig(
        name=_hf_name(hf), family="gpt_neox", vocab_size=int(hf["vocab_size"]), n_layer=int(hf["num_hidden_layers"]),
        n_head=nh, d_model=d, d_ff=int(hf["intermediate_size"]),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        norm="layernorm", norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
        activation=_act_from_hf("gpt_neox", hf.get("hidden_act", "gelu")), position="rotary",
        rotary_dim=_rotary_dim(d // nh, int(d // nh * pct)),  # int(), as transformers rounds it
        rope_theta=float(rope.get("rope_theta", hf.get("rotary_emb_base", hf.get("rope_theta", 10000.0)))),
        block="parallel" if hf.get("use_parallel_residual", True) else "sequential",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), attn_bias=bool(hf.get("attention_bias", True)),
        mlp_bias=True, dropout=float(hf.get("hidden_dropout", 0.0)), init_std=float(hf.get("initializer_range", 0.02)))


def _falcon_from_hf(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("alibi"):
        raise CheckpointError("falcon with alibi=true (Falcon-RW) is not supported; rotary Falcon models are")
    d = int(hf.get("hidden_size") or hf["n_embed"])
    nh = int(hf.get("num_attention_heads") or hf["n_head"])
    new, parallel = bool(hf.get("new_decoder_architecture", False)), bool(hf.get("parallel_attn", True))
    if new and not parallel:
        raise CheckpointError("falcon with new_decoder_architecture=true needs parallel_attn=true")
    # transformers reads num_kv_heads only in the new architecture; the old one is multi-query or multi-head
    nkv = int(hf.get("num_kv_heads") or hf.get("n_head_kv") or nh) if new else \
        1 if hf.get("multi_query", True) else nh
    two_norms = new and (hf.get("num_ln_in_parallel_attn") or 2) == 2
    theta, scaling = _rope_from_hf(hf)
    bias = bool(hf.get("bias", False))
    return ModelConfig(
        name=_hf_name(hf), family="falcon", vocab_size=int(hf["vocab_size"]),
        n_layer=int(hf.get("num_hidden_layers") or hf["n_layer"]), n_head=nh, n_kv_head=nkv, d_model=d,
        d_ff=int(hf.get("ffn_hidden_size") or 4 * d), max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation=_act_from_hf("falcon", hf.get("activation", "gelu")), position="rotary", rope_theta=theta,
        rope_scaling=scaling, block=("parallel" if two_norms else "parallel_shared_norm") if parallel else "sequential",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), attn_bias=bias, mlp_bias=bias,
        dropout=float(hf.get("hidden_dropout", 0.0)), init_std=float(hf.get("initializer_range", 0.02)))


# MPT attn_config entries transformers' MptAttention reads, and the only values we reproduce
_MPT_ATTN = {"alibi": True, "alibi_bias_max": 8, "clip_qkv": None, "qk_ln": False, "softmax_scale": None,
             "prefix_lm": False, "attn_uses_sequence_id": False, "attn_type": "multihead_attention"}


def _mpt_from_hf(hf: dict[str, Any]) -> ModelConfig:
    attn = hf.get("attn_config") or {}
    bad = {k: attn[k] for k, v in _MPT_ATTN.items() if k in attn and attn[k] != v}
    if bad:
        raise CheckpointError(f"mpt attn_config {bad} is not supported; supported: {_MPT_ATTN}")
    if not hf.get("no_bias", True) or hf.get("logit_scale") is not None or hf.get("expansion_ratio", 4) != 4:
        raise CheckpointError("mpt with no_bias=false, a logit_scale or expansion_ratio != 4 is not supported "
                              "(transformers' MPT has no biases, no logit scale and a 4x MLP)")
    d = int(hf["d_model"])
    return ModelConfig(
        name=_hf_name(hf), family="mpt", vocab_size=int(hf["vocab_size"]), n_layer=int(hf["n_layers"]),
        n_head=int(hf["n_heads"]), d_model=d, d_ff=4 * d, max_seq_len=int(hf.get("max_seq_len", 2048)),
        norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), norm_bias=False, activation="gelu",
        position="alibi", tie_embeddings=bool(hf.get("tie_word_embeddings", True)), attn_bias=False, mlp_bias=False,
        dropout=float(hf.get("resid_pdrop", 0.0)), init_std=float(hf.get("initializer_range", 0.02)))


# BERT / RoBERTa config.json entries that change the computation, and the only values we reproduce
_ENCODER_FIXED = {"position_embedding_type": "absolute", "is_decoder": False, "add_cross_attention": False}


def _encoder_from_hf(hf: dict[str, Any]) -> ModelConfig:
    mt = hf["model_type"]
    bad = {k: hf[k] for k, v in _ENCODER_FIXED.items() if k in hf and hf[k] != v}
    if bad:
        raise CheckpointError(f"{mt} {bad} is not supported; supported: {_ENCODER_FIXED}")
    act = hf.get("hidden_act", "gelu")
    if mt == "roberta" and act != "gelu":  # RobertaLMHead applies exact GELU whatever hidden_act says
        raise CheckpointError(f"roberta hidden_act {act!r} is not supported (only 'gelu')")
    pad = int(hf.get("pad_token_id", 1 if mt == "roberta" else 0))
    offset = pad + 1 if mt == "roberta" else 0
    return ModelConfig(
        name=_hf_name(hf), family=mt, vocab_size=int(hf["vocab_size"]), n_layer=int(hf["num_hidden_layers"]),
        n_head=int(hf["num_attention_heads"]), d_model=int(hf["hidden_size"]), d_ff=int(hf["intermediate_size"]),
        max_seq_len=int(hf.get("max_position_embeddings", 512)) - offset, norm="layernorm",
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)), activation=_act_from_hf(mt, act), position="learned",
        block="post_norm", tie_embeddings=bool(hf.get("tie_word_embeddings", True)), lm_head_bias=True,
        type_vocab_size=int(hf.get("type_vocab_size", 2)), pad_token_id=pad,
        nsp_head="BertForPreTraining" in (hf.get("architectures") or ()),
        dropout=float(hf.get("hidden_dropout_prob", 0.0)), init_std=float(hf.get("initializer_range", 0.02)))


def _encoder_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    off = [f"{k}={v!r} (has {getattr(cfg, k)!r})" for k, v in dict(
        norm="layernorm", norm_bias=True, attn_bias=True, mlp_bias=True, lm_head_bias=True).items()
        if getattr(cfg, k) != v]
    if cfg.activation not in _GPT2_ACT_TO_HF or cfg.family == "roberta" and cfg.activation != "gelu":
        off.append(f"activation {'gelu' if cfg.family == 'roberta' else ' or '.join(_GPT2_ACT_TO_HF)} "
                   f"(has {cfg.activation!r})")
    if cfg.type_vocab_size < 1:
        off.append("type_vocab_size >= 1 (transformers' encoders always have token type embeddings)")
    if cfg.family == "roberta" and cfg.nsp_head:
        off.append("no next-sentence head (RobertaForMaskedLM has none)")
    if off:
        raise CheckpointError(f"model {cfg.name!r} cannot be saved as Hugging Face {cfg.family}: it needs "
                              + "; ".join(off))
    arch = "RobertaForMaskedLM" if cfg.family == "roberta" else \
        "BertForPreTraining" if cfg.nsp_head else "BertForMaskedLM"
    return {
        "architectures": [arch], "model_type": cfg.family, "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "intermediate_size": cfg.ffn_dim,
        "hidden_act": _GPT2_ACT_TO_HF[cfg.activation], "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.dropout, "max_position_embeddings": cfg.max_seq_len + cfg.position_offset,
        "type_vocab_size": cfg.type_vocab_size, "initializer_range": cfg.init_std, "layer_norm_eps": cfg.norm_eps,
        "pad_token_id": cfg.pad_token_id, **_ENCODER_FIXED, "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": False, "waferscale_name": cfg.name,
    }


# T5's feed_forward_proj <-> our activation: v1.0 relu, v1.1 / FLAN-T5 gated-gelu (tanh-approximate GELU)
_T5_FF_FROM_HF = {"relu": "relu", "gated-gelu": "geglu", "gated-silu": "swiglu", "gelu": "gelu",
                  "gelu_new": "gelu_tanh", "gated-gelu_new": "geglu"}
_T5_FF_TO_HF = {"relu": "relu", "geglu": "gated-gelu", "swiglu": "gated-silu", "gelu": "gelu", "gelu_tanh": "gelu_new"}


def _t5_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """T5 / T5 v1.1 / FLAN-T5. Whether the head is tied (and the decoder's output scaled by d_model**-0.5) is
    `scale_decoder_outputs` where transformers 5 wrote it (it then always says tie_word_embeddings: true), else
    `tie_word_embeddings` (false in v1.1 and FLAN-T5)."""
    ff = str(hf.get("feed_forward_proj", "relu"))
    if ff not in _T5_FF_FROM_HF:
        raise CheckpointError(f"t5 feed_forward_proj {ff!r} is not supported; supported: {', '.join(_T5_FF_FROM_HF)}")
    if not hf.get("is_encoder_decoder", True):
        raise CheckpointError("t5 with is_encoder_decoder false (an encoder or decoder alone) is not supported; "
                              "supported: T5ForConditionalGeneration")
    pad = int(hf.get("pad_token_id", 0))
    start = hf.get("decoder_start_token_id", pad)
    if start is not None and int(start) != pad:
        raise CheckpointError(f"t5 decoder_start_token_id {start} differs from pad_token_id {pad}; supported: the "
                              "decoder starts from the padding token, as T5 does")
    tied = bool(hf["scale_decoder_outputs"] if "scale_decoder_outputs" in hf else hf.get("tie_word_embeddings", True))
    n_layer = int(hf["num_layers"])
    n_dec = int(hf.get("num_decoder_layers") or n_layer)
    return ModelConfig(
        name=_hf_name(hf), family="t5", vocab_size=int(hf["vocab_size"]), n_layer=n_layer,
        n_decoder_layer=n_dec if n_dec != n_layer else None, n_head=int(hf["num_heads"]), d_model=int(hf["d_model"]),
        d_kv=int(hf["d_kv"]), d_ff=int(hf["d_ff"]), max_seq_len=int(hf.get("n_positions") or 512), norm="rmsnorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)), activation=_T5_FF_FROM_HF[ff], position="relative",
        relative_attention_num_buckets=int(hf.get("relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(hf.get("relative_attention_max_distance", 128)),
        tie_embeddings=tied, attn_bias=False, mlp_bias=False, pad_token_id=pad,
        dropout=float(hf.get("dropout_rate", 0.0)))


def _t5_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    off = [f"norm 'rmsnorm' (T5's LayerNorm; has {cfg.norm!r})"] if cfg.norm != "rmsnorm" else []
    if cfg.activation not in _T5_FF_TO_HF:
        off.append(f"activation {' or '.join(_T5_FF_TO_HF)} (has {cfg.activation!r})")
    if off:
        raise CheckpointError(f"model {cfg.name!r} cannot be saved as Hugging Face t5: it needs " + "; ".join(off))
    return {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model, "d_kv": cfg.head_dim, "d_ff": cfg.ffn_dim, "num_layers": cfg.n_layer,
        "num_decoder_layers": cfg.decoder_layers, "num_heads": cfg.n_head,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
        "relative_attention_max_distance": cfg.relative_attention_max_distance, "dropout_rate": cfg.dropout,
        "layer_norm_epsilon": cfg.norm_eps, "feed_forward_proj": _T5_FF_TO_HF[cfg.activation],
        "tie_word_embeddings": cfg.tie_embeddings, "n_positions": cfg.max_seq_len, "pad_token_id": cfg.pad_token_id,
        "decoder_start_token_id": cfg.pad_token_id, "is_encoder_decoder": True, "initializer_factor": 1.0,
        "use_cache": True, "waferscale_name": cfg.name,
    }


_FROM_HF = {"gptj": _gptj_from_hf, "gpt_neox": _gpt_neox_from_hf, "falcon": _falcon_from_hf, "mpt": _mpt_from_hf,
            "bert": _encoder_from_hf, "roberta": _encoder_from_hf, "t5": _t5_from_hf}


def _mixtral_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Mixtral: Mistral's config.json (attention, rotary, norms, sliding window) and the experts'."""
    if float(hf.get("router_jitter_noise") or 0.0):
        raise CheckpointError(f"mixtral router_jitter_noise {hf['router_jitter_noise']} is not supported (training "
                              f"noise on the router's input); only 0")
    return config_from_hf({**hf, "model_type": "mistral"}).replace(
        family="mixtral", n_experts=int(hf["num_local_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))  # (transformers' default)


def config_from_hf(hf_config: dict) -> ModelConfig:
    """A HF config.json (as a dict) -> ModelConfig. Options we cannot reproduce exactly raise CheckpointError."""
    hf = hf_config
    mt = hf.get("model_type")
    try:
        if mt == "mixtral":
            return _mixtral_from_hf(hf)
        if mt == "gpt2":
            act = hf.get("activation_function", "gelu_new")
            if act not in _GPT2_ACT_FROM_HF:
                raise CheckpointError(f"gpt2 activation_function {act!r} is not supported; "
                                      f"supported: {sorted(_GPT2_ACT_FROM_HF)}")
            if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
                raise CheckpointError("gpt2 configs with scale_attn_weights=false or "
                                      "scale_attn_by_inverse_layer_idx=true are not supported")
            return ModelConfig(
                name=_hf_name(hf), family="gpt", vocab_size=int(hf["vocab_size"]), n_layer=int(hf["n_layer"]),
                n_head=int(hf["n_head"]), d_model=int(hf["n_embd"]),
                d_ff=int(hf["n_inner"]) if hf.get("n_inner") else None, max_seq_len=int(hf["n_positions"]),
                norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                activation=_GPT2_ACT_FROM_HF[act], position="learned",
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)), attn_bias=True, mlp_bias=True,
                dropout=float(hf.get("resid_pdrop", 0.0)), init_std=float(hf.get("initializer_range", 0.02)))
        if mt in ("llama", "mistral"):
            if hf.get("hidden_act", "silu") != "silu":
                raise CheckpointError(f"{mt} hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
            d, nh = int(hf["hidden_size"]), int(hf["num_attention_heads"])
            if hf.get("head_dim") not in (None, d // nh):
                raise CheckpointError(f"{mt} head_dim {hf['head_dim']} != hidden_size / num_attention_heads "
                                      f"({d // nh}); decoupled head sizes are not supported")
            theta, scaling = _rope_from_hf(hf)
            nkv = hf.get("num_key_value_heads")
            return ModelConfig(
                name=_hf_name(hf), family=mt, vocab_size=int(hf["vocab_size"]),
                n_layer=int(hf["num_hidden_layers"]), n_head=nh, n_kv_head=int(nkv) if nkv else None, d_model=d,
                d_ff=int(hf["intermediate_size"]), max_seq_len=int(hf.get("max_position_embeddings", 2048)),
                norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu",
                position="rotary", rope_theta=theta, rope_scaling=scaling,
                sliding_window=int(hf["sliding_window"]) if mt == "mistral" and hf.get("sliding_window") else None,
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attn_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
                dropout=float(hf.get("attention_dropout", 0.0)), init_std=float(hf.get("initializer_range", 0.02)))
        if mt in _FROM_HF:
            return _FROM_HF[mt](hf)
    except KeyError as e:
        raise CheckpointError(f"{mt} config.json lacks the key {e.args[0]!r}") from None
    except ValueError as e:  # ModelConfig validation
        raise CheckpointError(f"config.json describes an invalid model: {e}") from None
    raise CheckpointError(f"unsupported model_type {mt!r} in config.json; "
                          f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


def _family_needs(cfg: ModelConfig) -> dict[str, Any]:
    """What transformers' architecture of `cfg.family` can express: ModelConfig attribute -> required value."""
    plain = dict(norm="layernorm", norm_bias=True, lm_head_bias=False, sliding_window=None, rotary_interleaved=False,
                 rotary_dims=cfg.head_dim, position="rotary", kv_heads=cfg.n_head, rope_scaling=None)
    return {
        "gptj": {**plain, "rotary_dims": cfg.rotary_dims, "rotary_interleaved": True, "block": "parallel_shared_norm",
                 "attn_bias": False, "mlp_bias": True, "lm_head_bias": True, "rope_theta": 10000.0},
        "gpt_neox": {**plain, "rotary_dims": cfg.rotary_dims, "mlp_bias": True,
                     "block": cfg.block if cfg.block != "parallel_shared_norm" else "parallel or sequential"},
        "falcon": {**plain, "kv_heads": cfg.kv_heads, "rope_scaling": cfg.rope_scaling, "mlp_bias": cfg.attn_bias},
        "mpt": {**plain, "norm_bias": False, "position": "alibi", "rotary_dims": 0, "block": "sequential",
                "attn_bias": False, "mlp_bias": False, "activation": "gelu", "ffn_dim": 4 * cfg.d_model},
        "mistral": {**plain, "norm": "rmsnorm", "kv_heads": cfg.kv_heads, "sliding_window": cfg.sliding_window,
                    "activation": "swiglu", "block": "sequential", "attn_bias": False, "mlp_bias": False,
                    "rope_scaling": cfg.rope_scaling},
    }[cfg.family]


def hf_model_type(cfg: ModelConfig) -> str:
    """Which HF architecture expresses this config exactly: the family's own for GPT-J, GPT-NeoX, Falcon, MPT and
    Mistral (checked to fit it), else decided by structure (GPT-2 or Llama shapes); Mixtral for experts on a
    Mistral shape."""
    if cfg.has_mup:  # transformers' architectures have no such multipliers (a tied head cannot fold them in)
        raise CheckpointError(f"model {cfg.name!r} cannot be saved as Hugging Face: its muP scaling (embeddings_scale "
                              f"{cfg.embeddings_scale}, output_logits_scale {cfg.output_logits_scale}, "
                              f"scale_qk_dot_by_d {cfg.scale_qk_dot_by_d}, attention_logits_alpha "
                              f"{cfg.attention_logits_alpha}) has no place in their configs")
    if cfg.is_encoder or cfg.is_encoder_decoder:
        return cfg.family
    if cfg.n_experts:
        try:
            hf_model_type(cfg.replace(family="mistral", n_experts=0))
        except CheckpointError as e:
            raise CheckpointError(f"model {cfg.name!r} cannot be saved as Hugging Face mixtral (experts on a mistral "
                                  f"shape): {str(e).partition(': ')[2]}") from None
        return "mixtral"
    if cfg.family in _FAMILY_TYPES:
        needs = _family_needs(cfg)
        if cfg.family in ("gptj", "gpt_neox", "falcon") and cfg.activation not in _GPT2_ACT_TO_HF:
            needs["activation"] = " or ".join(_GPT2_ACT_TO_HF)
        off = [f"{k}={v!r} (has {getattr(cfg, k)!r})" for k, v in needs.items() if getattr(cfg, k) != v]
        if cfg.family == "falcon" and cfg.block == "sequential" and cfg.kv_heads not in (1, cfg.n_head):
            off.append(f"grouped-query attention ({cfg.kv_heads} kv heads) with parallel blocks (has sequential)")
        if off:
            raise CheckpointError(f"model {cfg.name!r} cannot be saved as Hugging Face {cfg.family}: it needs "
                                  + "; ".join(off))
        return cfg.family
    plain = (cfg.block, cfg.rotary_dims in (0, cfg.head_dim), cfg.rotary_interleaved, cfg.norm_bias,
             cfg.lm_head_bias, cfg.sliding_window) == ("sequential", True, False, True, False, None)
    if plain and (cfg.norm, cfg.position) == ("layernorm", "learned") and cfg.activation in _GPT2_ACT_TO_HF \
            and cfg.attn_bias and cfg.mlp_bias:
        return "gpt2"
    if plain and (cfg.norm, cfg.position, cfg.activation) == ("rmsnorm", "rotary", "swiglu"):
        return "llama"
    raise CheckpointError(
        f"model {cfg.name!r} (family={cfg.family}, norm={cfg.norm}, position={cfg.position}, "
        f"activation={cfg.activation}, block={cfg.block}, attn_bias={cfg.attn_bias}, mlp_bias={cfg.mlp_bias}) has "
        "no Hugging Face equivalent; exportable are GPT-2 shapes (layernorm, learned positions, gelu/gelu_tanh/relu, "
        "biases), Llama shapes (rmsnorm, rotary, swiglu) and the families " + ", ".join(_FAMILY_TYPES))


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """rope_theta / rope_scaling (transformers 4.x) and rope_parameters (5.x)."""
    scaling = None if cfg.rope_scaling is None else {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    rope = {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": rope}


def _gptj_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["GPTJForCausalLM"], "model_type": "gptj", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
        "n_inner": cfg.d_ff, "rotary_dim": cfg.rotary_dims, "activation_function": _GPT2_ACT_TO_HF[cfg.activation],
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True, "waferscale_name": cfg.name,
    }


def _gpt_neox_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    pct = cfg.rotary_dims / cfg.head_dim
    if int(cfg.head_dim * pct) != cfg.rotary_dims:
        raise CheckpointError(f"model {cfg.name!r}: rotary_dim {cfg.rotary_dims} is not a fraction of head_dim "
                              f"{cfg.head_dim} that transformers' GPT-NeoX (int(head_dim * rotary_pct)) reproduces")
    return {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "hidden_act": _GPT2_ACT_TO_HF[cfg.activation],
        "rotary_pct": pct, "rotary_emb_base": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": pct},
        "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
        "layer_norm_eps": cfg.norm_eps, "use_parallel_residual": cfg.block == "parallel",
        "attention_bias": cfg.attn_bias, "attention_dropout": cfg.dropout, "hidden_dropout": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True, "waferscale_name": cfg.name,
    }


def _falcon_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    # The old architecture holds multi-head or multi-query attention with one norm; anything else is the new one.
    old = cfg.block != "parallel" and cfg.kv_heads in (1, cfg.n_head)
    return {
        "architectures": ["FalconForCausalLM"], "model_type": "falcon", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "ffn_hidden_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_kv_heads": cfg.kv_heads, "new_decoder_architecture": not old,
        "multi_query": old and cfg.kv_heads == 1, "parallel_attn": cfg.block != "sequential",
        "num_ln_in_parallel_attn": None if old else 2 if cfg.block == "parallel" else 1, "alibi": False,
        "bias": cfg.attn_bias, "activation": _GPT2_ACT_TO_HF[cfg.activation], "layer_norm_epsilon": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, **_rope_to_hf(cfg), "hidden_dropout": cfg.dropout,
        "attention_dropout": cfg.dropout, "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True, "waferscale_name": cfg.name,
    }


def _mpt_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["MptForCausalLM"], "model_type": "mpt", "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model, "n_heads": cfg.n_head, "n_layers": cfg.n_layer, "expansion_ratio": 4,
        "max_seq_len": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps, "no_bias": True, "learned_pos_emb": False,
        # transformers 5 types attn_pdrop as int: a float 0.0 fails its validation, so no dropout is written 0
        "attn_config": {**_MPT_ATTN, "attn_pdrop": cfg.dropout or 0}, "resid_pdrop": cfg.dropout,
        "emb_pdrop": cfg.dropout,
        "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True,
        "waferscale_name": cfg.name,
    }


_FAMILY_TYPES = {"gptj": _gptj_to_hf, "gpt_neox": _gpt_neox_to_hf, "falcon": _falcon_to_hf, "mpt": _mpt_to_hf,
                 "mistral": None}  # mistral: the llama config and a sliding window


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> a config.json dict that `transformers.AutoConfig` reads (4.x legacy keys and 5.x keys)."""
    mt = hf_model_type(cfg)
    if cfg.is_encoder:
        return _encoder_to_hf(cfg)
    if cfg.is_encoder_decoder:
        return _t5_to_hf(cfg)
    if mt == "mixtral":
        return {**config_to_hf(cfg.replace(family="mistral", n_experts=0)), "architectures": ["MixtralForCausalLM"],
                "model_type": "mixtral", "num_local_experts": cfg.n_experts,
                "num_experts_per_tok": cfg.experts_per_token, "router_aux_loss_coef": cfg.router_aux_loss_coef,
                "router_jitter_noise": 0.0, "output_router_logits": False}
    if mt == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_inner": cfg.d_ff, "activation_function": _GPT2_ACT_TO_HF[cfg.activation],
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.init_std, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True, "waferscale_name": cfg.name,
            # GPT2Config defaults both to 50256, GPT-2's <|endoftext|>: right only for GPT-2's own vocabulary.
            "bos_token_id": 50256 if cfg.vocab_size == 50257 else None,
            "eos_token_id": 50256 if cfg.vocab_size == 50257 else None,
        }
    if _FAMILY_TYPES.get(mt):
        return _FAMILY_TYPES[mt](cfg)
    if mt == "mistral":
        return {**config_to_hf(cfg.replace(family="llama", sliding_window=None)),
                "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": cfg.sliding_window}
    scaling = None if cfg.rope_scaling is None else {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    rope = {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "rope_parameters": rope, "attention_bias": cfg.attn_bias, "attention_dropout": cfg.dropout,
        "mlp_bias": cfg.mlp_bias, "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True,
        "pretraining_tp": 1, "waferscale_name": cfg.name,
    }
