"""Hugging Face checkpoints in and out: config.json <-> ModelConfig, HF parameter names <-> ours.

These HF architectures map onto the zoo:

* ``gpt2`` (``GPT2LMHeadModel``): LayerNorm, learned positions, biases everywhere. Its ``Conv1D`` layers store
  weights as (in, out), the transpose of ``nn.Linear``; ``c_attn`` packs q, k, v along the output dimension.
* ``llama`` (``LlamaForCausalLM``): RMSNorm, rotary (rotate_half layout, as ours), SwiGLU, optional
  llama3 ``rope_scaling``. Parameter names differ from ours only by renaming. ``mistral`` is the same with a
  ``sliding_window``.
* ``gptj``: parallel attention + MLP under one LayerNorm, partial rotary in GPT-J's interleaved layout, an LM
  head with a bias.
* ``gpt_neox``, ``falcon`` and ``mpt`` fuse q, k, v into one matrix (``query_key_value`` / ``Wqkv``): GPT-NeoX
  as [q, k, v] per head, Falcon as [its query heads, k, v] per key/value head (multi-query: one group), MPT as
  plain [q; k; v]. GPT-NeoX has partial rotary and (optionally) a parallel residual, Falcon parallel blocks
  with one or two norms, MPT ALiBi and bias-free LayerNorms.
* ``mixtral`` (``MixtralForCausalLM``): a mistral whose MLPs are experts: ``block_sparse_moe.gate`` is our
  ``mlp.router``, ``experts.N.w1`` / ``w3`` / ``w2`` expert N's gate / up / down projections.
* ``bert`` (``BertForPreTraining``, ``BertForMaskedLM``) and ``roberta`` (``RobertaForMaskedLM``): encoders with
  the masked-LM head (``cls.predictions`` / ``lm_head``) and, for BERT, the pooler and next-sentence classifier
  where the checkpoint holds them. RoBERTa's position table starts after its padding token (``pad_token_id + 1``
  rows ahead), so ``max_position_embeddings`` is our ``max_seq_len`` plus those rows.

Weights are read from safetensors only (one file or shards named by ``model.safetensors.index.json``); pickled
``pytorch_model.bin`` files are refused, never unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from waferscale.errors import CheckpointError
from waferscale.models.config import ModelConfig, RopeScaling
from waferscale.models.layers import Attention, CausalLM
from waferscale.models.registry import build
from waferscale.util.files import atomic_dir

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "gptj", "gpt_neox", "falcon", "mpt", "mistral", "mixtral", "bert",
                         "roberta")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

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


def _encoder_renames(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, HF name) of every encoder tensor (see `_renames`)."""
    root = cfg.family  # "bert." / "roberta."
    head, norm = ("lm_head", "lm_head.layer_norm") if cfg.family == "roberta" else \
        ("cls.predictions", "cls.predictions.transform.LayerNorm")
    emb = f"{root}.embeddings"
    modules = [("embed.tok", f"{emb}.word_embeddings"), ("embed.pos", f"{emb}.position_embeddings"),
               ("embed.segment", f"{emb}.token_type_embeddings"), ("embed.norm", f"{emb}.LayerNorm"),
               ("head.dense", "lm_head.dense" if cfg.family == "roberta" else "cls.predictions.transform.dense"),
               ("head.norm", norm), ("head.pooler", f"{root}.pooler.dense"), ("head.nsp", "cls.seq_relationship")]
    per_layer = [*((f"attn.{n}_proj", f"attention.self.{hf}") for n, hf in zip("qkv", ("query", "key", "value"))),
                 ("attn.o_proj", "attention.output.dense"), ("attn_norm", "attention.output.LayerNorm"),
                 ("mlp.up_proj", "intermediate.dense"), ("mlp.down_proj", "output.dense"),
                 ("mlp_norm", "output.LayerNorm")]
    modules += [(f"blocks.{i}.{ours}", f"{root}.encoder.layer.{i}.{theirs}")
                for i in range(cfg.n_layer) for ours, theirs in per_layer]
    if not cfg.tie_embeddings:
        modules.append(("head.lm_head", f"{head}.decoder"))
    pairs = [(f"{ours}.{p}", f"{theirs}.{p}") for ours, theirs in modules for p in ("weight", "bias")]
    return [(o, t) for o, t in pairs if o != "head.lm_head.bias"] + [("head.lm_head.bias", f"{head}.bias")]


def _decoder_bias_name(cfg: ModelConfig) -> str:
    """The MLM decoder's own bias: transformers computes with it and ties it to the head's `bias` only with tied
    embeddings (5.x). Read in preference to `bias`, written beside it when untied."""
    return "lm_head.decoder.bias" if cfg.family == "roberta" else "cls.predictions.decoder.bias"


def _normalize_encoder_key(key: str, cfg: ModelConfig) -> str | None:
    """Full `BertForPreTraining` / `RobertaForMaskedLM` name of `key`, or None for what needs no loading: the
    buffers of position and token type ids, the decoder's bias (transformers ties it to the head's `bias`), a
    tied decoder, and a BertForPreTraining checkpoint's next-sentence head where the config has none."""
    root, head = f"{cfg.family}.", "lm_head." if cfg.family == "roberta" else "cls."
    if not key.startswith((root, head)):
        key = root + key  # saved from the bare model (BertModel, RobertaModel)
    ignored = (key.endswith(("embeddings.position_ids", "embeddings.token_type_ids", "decoder.bias"))
               or key.endswith("decoder.weight") and cfg.tie_embeddings
               or not cfg.nsp_head and (key.startswith((f"{root}pooler.", "cls.seq_relationship."))))
    return None if ignored else key


_FROM_HF = {"gptj": _gptj_from_hf, "gpt_neox": _gpt_neox_from_hf, "falcon": _falcon_from_hf, "mpt": _mpt_from_hf,
            "bert": _encoder_from_hf, "roberta": _encoder_from_hf}


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


def _hf_model_type(cfg: ModelConfig) -> str:
    """Which HF architecture expresses this config exactly: the family's own for GPT-J, GPT-NeoX, Falcon, MPT and
    Mistral (checked to fit it), else decided by structure (GPT-2 or Llama shapes); Mixtral for experts on a
    Mistral shape."""
    if cfg.is_encoder:
        return cfg.family
    if cfg.n_experts:
        try:
            _hf_model_type(cfg.replace(family="mistral", n_experts=0))
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
    mt = _hf_model_type(cfg)
    if cfg.is_encoder:
        return _encoder_to_hf(cfg)
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


# ---- parameter names ----------------------------------------------------------------------------------

def _t(x: Tensor) -> Tensor:
    return x.t().contiguous()


def _conv1d(hf_name: str, t: Tensor) -> Tensor:
    """GPT-2's Conv1D matrices (inside `transformer.h.*`) are stored (in, out), the transpose of nn.Linear's:
    transposing converts either way."""
    return _t(t) if hf_name.startswith("transformer.h.") and t.ndim == 2 else t


def _renames(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, HF name) of every tensor but the packed q/k/v (GPT-2, GPT-NeoX, Falcon, MPT), biases included
    whether the model has them or not; `lm_head` only when it is not tied (HF does not save a tied head) but its
    bias (GPT-J's) either way."""
    if cfg.is_encoder:
        return _encoder_renames(cfg)
    mt, head = _hf_model_type(cfg), "lm_head"
    if mt == "gpt2":
        modules = [("embed.tok", "transformer.wte"), ("embed.pos", "transformer.wpe"),
                   ("head.norm", "transformer.ln_f")]
        layers = "transformer.h"
        per_layer = [("attn_norm", "ln_1"), ("mlp_norm", "ln_2"), ("attn.o_proj", "attn.c_proj"),
                     ("mlp.up_proj", "mlp.c_fc"), ("mlp.down_proj", "mlp.c_proj")]
    elif mt in _LAYOUTS:
        emb, final_norm, head, layers, per_layer = _LAYOUTS[mt]
        modules = [("embed.tok", emb), ("head.norm", final_norm)]
        per_layer = [*_FALCON_NORMS[cfg.block], *per_layer] if mt == "falcon" else per_layer
    else:
        modules = [("embed.tok", "model.embed_tokens"), ("head.norm", "model.norm")]
        layers = "model.layers"
        per_layer = [("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
                     *((f"attn.{n}_proj", f"self_attn.{n}_proj") for n in "qkvo"),
                     *(_moe_renames(cfg) if cfg.n_experts else
                       ((f"mlp.{n}_proj",) * 2 for n in ("gate", "up", "down")))]
    modules += [(f"blocks.{i}.{ours}", f"{layers}.{i}.{theirs}")
                for i in range(cfg.n_layer) for ours, theirs in per_layer]
    if not cfg.tie_embeddings:
        modules.append(("head.lm_head", head))
    pairs = [(f"{ours}.{p}", f"{theirs}.{p}") for ours, theirs in modules for p in ("weight", "bias")]
    return pairs if not cfg.tie_embeddings else [*pairs, ("head.lm_head.bias", f"{head}.bias")]


def _moe_renames(cfg: ModelConfig) -> list[tuple[str, str]]:
    """A Mixtral layer's router and experts: w1 is the gate projection, w3 the up and w2 the down projection."""
    return [("mlp.router", "block_sparse_moe.gate"),
            *((f"mlp.experts.{e}.{ours}_proj", f"block_sparse_moe.experts.{e}.{w}")
              for e in range(cfg.n_experts) for ours, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")))]


# model type -> (token embedding, final norm, LM head, layer list, per-layer (ours, theirs) module names)
_LAYOUTS: dict[str, tuple[str, str, str, str, list[tuple[str, str]]]] = {
    "gptj": ("transformer.wte", "transformer.ln_f", "lm_head", "transformer.h", [
        ("attn_norm", "ln_1"), *((f"attn.{n}_proj",) * 2 for n in "qkv"), ("attn.o_proj", "attn.out_proj"),
        ("mlp.up_proj", "mlp.fc_in"), ("mlp.down_proj", "mlp.fc_out")]),
    "gpt_neox": ("gpt_neox.embed_in", "gpt_neox.final_layer_norm", "embed_out", "gpt_neox.layers", [
        ("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"), ("attn.o_proj", "attention.dense"),
        ("mlp.up_proj", "mlp.dense_h_to_4h"), ("mlp.down_proj", "mlp.dense_4h_to_h")]),
    "falcon": ("transformer.word_embeddings", "transformer.ln_f", "lm_head", "transformer.h", [
        ("attn.o_proj", "self_attention.dense"), ("mlp.up_proj", "mlp.dense_h_to_4h"),
        ("mlp.down_proj", "mlp.dense_4h_to_h")]),
    "mpt": ("transformer.wte", "transformer.norm_f", "lm_head", "transformer.blocks", [
        ("attn_norm", "norm_1"), ("mlp_norm", "norm_2"), ("attn.o_proj", "attn.out_proj"),
        ("mlp.up_proj", "ffn.up_proj"), ("mlp.down_proj", "ffn.down_proj")]),
}
_FALCON_NORMS = {"sequential": [("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")],
                 "parallel": [("attn_norm", "ln_attn"), ("mlp_norm", "ln_mlp")],
                 "parallel_shared_norm": [("attn_norm", "input_layernorm")]}
_FUSED_QKV = {"gpt_neox": "attention.query_key_value", "falcon": "self_attention.query_key_value",
              "mpt": "attn.Wqkv"}


def _qkv_groups(cfg: ModelConfig, mt: str) -> int:
    """How many [q heads, k, v] runs the fused matrix holds: one per head (GPT-NeoX), per kv head (Falcon), or
    one (MPT: [q; k; v])."""
    return {"gpt_neox": cfg.n_head, "falcon": cfg.kv_heads, "mpt": 1}[mt]


def _join_qkv(q: Tensor, k: Tensor, v: Tensor, groups: int) -> Tensor:
    """q (nh*hd, ...), k and v (nkv*hd, ...) -> the fused rows ((nh + 2 nkv) hd, ...), `groups` runs of
    [their query rows, key rows, value rows]."""
    rest = q.shape[1:]
    return torch.cat([t.reshape(groups, -1, *rest) for t in (q, k, v)], dim=1).reshape(-1, *rest)


def _split_qkv(t: Tensor, cfg: ModelConfig, groups: int) -> list[Tensor]:
    """Inverse of _join_qkv: the fused rows -> [q (nh*hd, ...), k (nkv*hd, ...), v (nkv*hd, ...)]."""
    rest = t.shape[1:]
    sizes = [n * cfg.head_dim // groups for n in (cfg.n_head, cfg.kv_heads, cfg.kv_heads)]
    return [x.reshape(-1, *rest).contiguous() for x in t.reshape(groups, -1, *rest).split(sizes, dim=1)]


def state_dict_to_hf(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Our names -> HF names (GPT-2 weights transposed to Conv1D's (in, out), q/k/v packed into c_attn).

    With tied embeddings `lm_head.weight` is omitted, as HF saves it.
    """
    mt = _hf_model_type(cfg)
    out = {theirs: _conv1d(theirs, sd[ours]) if mt == "gpt2" else sd[ours] for ours, theirs in _renames(cfg)
           if ours in sd}
    if mt in _FUSED_QKV:
        for i, p in ((i, p) for i in range(cfg.n_layer) for p in ("weight", "bias")):
            b = f"blocks.{i}.attn."
            if f"{b}q_proj.{p}" in sd:
                out[f"{_LAYOUTS[mt][3]}.{i}.{_FUSED_QKV[mt]}.{p}"] = _join_qkv(
                    *(sd[f"{b}{n}_proj.{p}"] for n in "qkv"), _qkv_groups(cfg, mt))
    if mt == "gpt2":
        for i in range(cfg.n_layer):
            b, h = f"blocks.{i}.attn.", f"transformer.h.{i}.attn.c_attn."
            out[h + "weight"] = _t(torch.cat([sd[f"{b}{n}_proj.weight"] for n in "qkv"]))  # 3 x (C, C) -> (C, 3C)
            out[h + "bias"] = torch.cat([sd[f"{b}{n}_proj.bias"] for n in "qkv"])  # (3C,)
    if cfg.is_encoder and not cfg.tie_embeddings and "head.lm_head.bias" in sd:
        out[_decoder_bias_name(cfg)] = sd["head.lm_head.bias"].clone()  # (see _decoder_bias_name)
    return out


def _normalize_hf_key(key: str, model_type: str, cfg: ModelConfig) -> str | None:
    """Full `*ForCausalLM` name for `key`, or None for entries HF itself ignores (buffers, tied head)."""
    if cfg.is_encoder:
        return _normalize_encoder_key(key, cfg)
    root = "model." if model_type in ("llama", "mistral", "mixtral") else \
        "gpt_neox." if model_type == "gpt_neox" else "transformer."
    head = _LAYOUTS[model_type][2] if model_type in _LAYOUTS else "lm_head"
    if model_type == "gpt_neox" and key.startswith("lm_head."):
        key = "embed_out." + key.removeprefix("lm_head.")  # transformers>=5 names GPT-NeoX's head lm_head
    if not key.startswith((root, f"{head}.")):
        key = root + key  # saved from the bare model (GPT2Model, LlamaModel, ...)
    ignored = (re.search(r"\.(attn|attention)\.(masked_)?bias$", key)  # causal masks of old GPT-2/J/NeoX files
               or key.endswith("rotary_emb.inv_freq") or (key == f"{head}.weight" and cfg.tie_embeddings))
    return None if ignored else key


def _check_against(found: dict[str, Tensor], expected: dict[str, Tensor], cfg: ModelConfig, where: str) -> None:
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    wrong = [k for k in expected if k in found and found[k].shape != expected[k].shape]
    if not (missing or unexpected or wrong):
        return
    problems = []
    if wrong:
        problems.append("shape mismatch: " + "; ".join(
            f"{k!r} is {list(found[k].shape)} in the checkpoint but the model expects {list(expected[k].shape)}"
            for k in wrong[:5]) + (f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else ""))
    for what, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            problems.append(f"{len(keys)} {what} key(s), e.g. " + ", ".join(repr(k) for k in keys[:5]))
    raise CheckpointError(f"{where} does not fit model {cfg.name!r} ({cfg.n_layer} layers, d_model "
                          f"{cfg.d_model}, vocab {cfg.vocab_size}): {'; '.join(problems)}. Is it a checkpoint of "
                          "another architecture? Check that the config (config.json, GGUF metadata) belongs to "
                          "these weights.")


def state_dict_from_hf(sd: dict[str, Tensor], cfg: ModelConfig, *, where: str = "checkpoint") -> dict[str, Tensor]:
    """HF names -> ours, validated first: missing/unexpected keys or wrong shapes raise CheckpointError.

    Accepts `*ForCausalLM` names and bare-model names (no `transformer.`/`model.` prefix). With tied
    embeddings the result holds the embedding under both `embed.tok.weight` and `head.lm_head.weight`.
    """
    mt = _hf_model_type(cfg)
    norm = {nk: v for k, v in sd.items() if (nk := _normalize_hf_key(k, mt, cfg)) is not None}
    expected = state_dict_to_hf(build(cfg, device="meta").state_dict(), cfg)
    _check_against(norm, {k: v for k, v in expected.items() if _normalize_hf_key(k, mt, cfg) is not None}, cfg, where)
    out = {ours: _conv1d(theirs, norm[theirs]) if mt == "gpt2" else norm[theirs] for ours, theirs in _renames(cfg)
           if theirs in norm}
    if mt in _FUSED_QKV:
        for i, p in ((i, p) for i in range(cfg.n_layer) for p in ("weight", "bias")):
            fused = norm.get(f"{_LAYOUTS[mt][3]}.{i}.{_FUSED_QKV[mt]}.{p}")
            if fused is not None:
                for n, t in zip("qkv", _split_qkv(fused, cfg, _qkv_groups(cfg, mt))):
                    out[f"blocks.{i}.attn.{n}_proj.{p}"] = t
    if mt == "gpt2":
        for i in range(cfg.n_layer):
            b, h = f"blocks.{i}.attn.", f"transformer.h.{i}.attn.c_attn."
            qkv_w, qkv_b = _t(norm[h + "weight"]), norm[h + "bias"]  # (3C, C), (3C,)
            for n, w, bias in zip("qkv", qkv_w.chunk(3), qkv_b.chunk(3)):
                out[f"{b}{n}_proj.weight"], out[f"{b}{n}_proj.bias"] = w.contiguous(), bias.contiguous()  # (C, C), (C,)
    if cfg.is_encoder and _decoder_bias_name(cfg) in sd:
        out["head.lm_head.bias"] = sd[_decoder_bias_name(cfg)]
    if cfg.tie_embeddings:
        out["head.lm_head.weight"] = out["embed.tok.weight"]
    return out


# ---- building a model from a state dict without initialising it first --------------------------------

def model_from_state_dict(cfg: ModelConfig, sd: dict[str, Tensor], device: torch.device | str = "cpu",
                          dtype: torch.dtype | None = None, *, where: str = "state dict") -> CausalLM:
    """Build `cfg` on the meta device and adopt the tensors of `sd` (our names): no random init, no double copy.

    dtype=None keeps the dtype of `embed.tok.weight` in `sd` for every floating-point parameter.
    """
    model = build(cfg, device="meta")
    _check_against(sd, model.state_dict(), cfg, where)
    dtype = dtype or sd["embed.tok.weight"].dtype
    unique = {id(v): v for v in sd.values()}  # a tensor stored under two names (tied embeddings) is moved once
    moved = {i: v.to(device=device, dtype=dtype) for i, v in unique.items()}
    sd = {k: moved[id(v)] for k, v in sd.items()}
    model.load_state_dict(sd, strict=True, assign=True)
    if cfg.tie_embeddings:  # assign=True replaced the two references separately
        model.head.lm_head.weight = model.embed.tok.weight
    for m in model.modules():  # non-persistent buffers are computed, not stored
        if isinstance(m, Attention):
            m.init_buffers(device)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"model_from_state_dict left tensors on the meta device: {still_meta[:5]}")
    return model.eval()


# ---- directories --------------------------------------------------------------------------------------

def _weight_files(d: Path) -> list[Path]:
    index = d / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = [d / f for f in dict.fromkeys(weight_map.values())]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} names shard(s) that are missing: {', '.join(absent)}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
        hint = (f" It holds {', '.join(pickles)}: pickled checkpoints are not loaded (they can run code); convert "
                "them to safetensors first, e.g. `model.save_pretrained(dir, safe_serialization=True)` with "
                "transformers.") if pickles else ""
        raise CheckpointError(f"{d}: no *.safetensors weights found.{hint}")
    return files


def read_hf_dir(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Tensor]]:
    """config.json and all safetensors tensors (HF names, as stored) of a HF model directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory; expected a Hugging Face model directory with config.json "
                              "and *.safetensors")
    cfg_path = d / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(f"{d}: no {CONFIG_NAME}; a Hugging Face model directory needs one")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from None
    cfg = config_from_hf(hf)
    sd: dict[str, Tensor] = {}
    for f in _weight_files(d):
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot read safetensors file ({e}); is it truncated?") from None
        dup = sorted(set(part) & set(sd))
        if dup:
            raise CheckpointError(f"{f}: tensor(s) {dup[:5]} also appear in another shard")
        sd.update(part)
    if cfg.family == "bert" and not cfg.nsp_head and any(k.endswith("seq_relationship.weight") for k in sd):
        cfg = cfg.replace(nsp_head=True)  # e.g. bert-base-uncased: "BertForMaskedLM" with its pre-training heads
    return cfg, sd


def load_hf_dir(path: str | os.PathLike, device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None) -> CausalLM:
    """Load a HF GPT-2 or Llama directory (config.json + safetensors, sharded or not) as a CausalLM in eval mode.

    dtype=None keeps the checkpoint's dtype (that of its token embedding).
    """
    cfg, hf_sd = read_hf_dir(path)
    sd = state_dict_from_hf(hf_sd, cfg, where=f"checkpoint {str(path)!r}")
    return model_from_state_dict(cfg, sd, device=device, dtype=dtype)


def save_hf_dir(model: CausalLM, out_dir: str | os.PathLike, tokenizer: Any = None) -> None:
    """Write config.json, generation_config.json, model.safetensors (and the tokenizer's files) to `out_dir`.

    Everything is written to a temporary sibling directory first; only complete files are moved into
    `out_dir` (a fresh directory is renamed into place in one step). Tied embeddings are stored once.
    """
    from safetensors.torch import save_file

    cfg: ModelConfig = model.config
    hf_config = config_to_hf(cfg)  # raises before anything is written if not expressible
    if any(p.is_meta for p in model.parameters()):
        raise CheckpointError(f"model {cfg.name!r} lives on the meta device (shapes only); materialize or load "
                              "weights before saving")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)

    hf_config["torch_dtype"] = str(model.embed.tok.weight.dtype).removeprefix("torch.")
    gen: dict[str, Any] = {"_from_model_config": True}
    for key, attr in (("bos_token_id", "bos_id"), ("eos_token_id", "eos_id")):  # waferscale.data Tokenizer
        val = getattr(tokenizer, attr, None)
        if isinstance(val, int):
            hf_config[key] = gen[key] = val

    with atomic_dir(out, install=_move_into_place) as tmp:
        sd = {k: v.detach().to("cpu").contiguous() for k, v in state_dict_to_hf(model.state_dict(), cfg).items()}
        save_file(sd, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save(str(tmp))


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out` if `out` is absent or empty; else replace file by file, dropping stale weights."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(tmp, out)
        return
    written = {p.name for p in tmp.iterdir()}
    for p in tmp.iterdir():
        dest = out / p.name
        if dest.is_dir() and not p.is_dir():
            raise CheckpointError(f"{dest}: is a directory; cannot replace it with a file")
        if p.is_dir() and dest.exists():
            shutil.rmtree(dest)
        os.replace(p, dest)
    # Shards or an index from an earlier save would shadow (or mix with) the new weights.
    for stale in [*out.glob("*.safetensors"), out / INDEX_NAME]:
        if stale.name not in written and stale.is_file():
            stale.unlink()


__all__ = ["config_from_hf", "config_to_hf", "state_dict_from_hf", "state_dict_to_hf", "load_hf_dir",
           "save_hf_dir", "read_hf_dir", "model_from_state_dict", "SUPPORTED_MODEL_TYPES"]
