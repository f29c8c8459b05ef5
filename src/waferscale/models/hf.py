"""Hugging Face checkpoints in and out: config.json <-> ModelConfig, HF parameter names <-> ours.

Two HF architectures map onto the zoo:

* ``gpt2`` (``GPT2LMHeadModel``): LayerNorm, learned positions, biases everywhere. Its ``Conv1D`` layers store
  weights as (in, out), the transpose of ``nn.Linear``; ``c_attn`` packs q, k, v along the output dimension.
* ``llama`` (``LlamaForCausalLM``): RMSNorm, rotary (rotate_half layout, as ours), SwiGLU, optional
  llama3 ``rope_scaling``. Parameter names differ from ours only by renaming.
* ``mixtral`` (``MixtralForCausalLM``): a llama shape whose MLPs are experts: ``block_sparse_moe.gate`` is our
  ``mlp.router``, ``experts.N.w1`` / ``w3`` / ``w2`` expert N's gate / up / down projections.

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
from waferscale.models.layers import Attention, CausalLM, rope_inv_freq
from waferscale.models.registry import build
from waferscale.util.files import atomic_dir

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mixtral")
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


def _mixtral_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Mixtral: Llama's config.json keys (attention, rotary, norms) and the experts'."""
    if float(hf.get("router_jitter_noise") or 0.0):
        raise CheckpointError(f"mixtral router_jitter_noise {hf['router_jitter_noise']} is not supported (training "
                              f"noise on the router's input); only 0")
    if hf.get("sliding_window"):
        raise CheckpointError(f"mixtral sliding_window {hf['sliding_window']} is not supported; only null")
    return config_from_hf({**hf, "model_type": "llama"}).replace(
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
        if mt == "llama":
            if hf.get("hidden_act", "silu") != "silu":
                raise CheckpointError(f"llama hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
            d, nh = int(hf["hidden_size"]), int(hf["num_attention_heads"])
            if hf.get("head_dim") not in (None, d // nh):
                raise CheckpointError(f"llama head_dim {hf['head_dim']} != hidden_size / num_attention_heads "
                                      f"({d // nh}); decoupled head sizes are not supported")
            theta, scaling = _rope_from_hf(hf)
            nkv = hf.get("num_key_value_heads")
            return ModelConfig(
                name=_hf_name(hf), family="llama", vocab_size=int(hf["vocab_size"]),
                n_layer=int(hf["num_hidden_layers"]), n_head=nh, n_kv_head=int(nkv) if nkv else None, d_model=d,
                d_ff=int(hf["intermediate_size"]), max_seq_len=int(hf.get("max_position_embeddings", 2048)),
                norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu",
                position="rotary", rope_theta=theta, rope_scaling=scaling,
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attn_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
                dropout=float(hf.get("attention_dropout", 0.0)), init_std=float(hf.get("initializer_range", 0.02)))
    except KeyError as e:
        raise CheckpointError(f"{mt} config.json lacks the key {e.args[0]!r}") from None
    except ValueError as e:  # ModelConfig validation
        raise CheckpointError(f"config.json describes an invalid model: {e}") from None
    raise CheckpointError(f"unsupported model_type {mt!r} in config.json; "
                          f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


def _hf_model_type(cfg: ModelConfig) -> str:
    """Which HF architecture expresses this config exactly (decided by structure, not by the family label)."""
    if cfg.n_experts:  # Mixtral: experts on a bias-free Llama shape
        try:
            dense = _hf_model_type(cfg.replace(n_experts=0))
        except CheckpointError:
            dense = None
        if dense != "llama" or cfg.attn_bias or cfg.mlp_bias:
            raise CheckpointError(f"model {cfg.name!r} cannot be saved as Hugging Face mixtral: it needs experts on "
                                  f"a llama shape without biases (rmsnorm, rotary, swiglu; has norm={cfg.norm}, "
                                  f"position={cfg.position}, activation={cfg.activation}, attn_bias={cfg.attn_bias}, "
                                  f"mlp_bias={cfg.mlp_bias})")
        return "mixtral"
    if (cfg.norm, cfg.position) == ("layernorm", "learned") and cfg.activation in _GPT2_ACT_TO_HF \
            and cfg.attn_bias and cfg.mlp_bias:
        return "gpt2"
    if (cfg.norm, cfg.position, cfg.activation) == ("rmsnorm", "rotary", "swiglu"):
        return "llama"
    raise CheckpointError(
        f"model {cfg.name!r} (norm={cfg.norm}, position={cfg.position}, activation={cfg.activation}, "
        f"attn_bias={cfg.attn_bias}, mlp_bias={cfg.mlp_bias}) has no Hugging Face equivalent; exportable are "
        "GPT-2 shapes (layernorm, learned positions, gelu/gelu_tanh/relu, biases) and Llama shapes "
        "(rmsnorm, rotary, swiglu)")


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> a config.json dict that `transformers.AutoConfig` reads (4.x legacy keys and 5.x keys)."""
    mt = _hf_model_type(cfg)
    if mt == "mixtral":
        return {**config_to_hf(cfg.replace(family="llama", n_experts=0)), "architectures": ["MixtralForCausalLM"],
                "model_type": "mixtral", "num_local_experts": cfg.n_experts,
                "num_experts_per_tok": cfg.experts_per_token, "router_aux_loss_coef": cfg.router_aux_loss_coef,
                "router_jitter_noise": 0.0, "sliding_window": None, "output_router_logits": False}
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
    """(our name, HF name) of every tensor but GPT-2's packed c_attn, biases included whether the model has them
    or not; `lm_head` only when it is not tied (HF does not save a tied head)."""
    if _hf_model_type(cfg) == "gpt2":
        modules = [("embed.tok", "transformer.wte"), ("embed.pos", "transformer.wpe"),
                   ("head.norm", "transformer.ln_f")]
        layers = "transformer.h"
        per_layer = [("attn_norm", "ln_1"), ("mlp_norm", "ln_2"), ("attn.o_proj", "attn.c_proj"),
                     ("mlp.up_proj", "mlp.c_fc"), ("mlp.down_proj", "mlp.c_proj")]
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
        modules.append(("head.lm_head", "lm_head"))
    return [(f"{ours}.{p}", f"{theirs}.{p}") for ours, theirs in modules for p in ("weight", "bias")]


def _moe_renames(cfg: ModelConfig) -> list[tuple[str, str]]:
    """A Mixtral layer's router and experts: w1 is the gate projection, w3 the up and w2 the down projection."""
    return [("mlp.router", "block_sparse_moe.gate"),
            *((f"mlp.experts.{e}.{ours}_proj", f"block_sparse_moe.experts.{e}.{w}")
              for e in range(cfg.n_experts) for ours, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")))]


def state_dict_to_hf(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Our names -> HF names (GPT-2 weights transposed to Conv1D's (in, out), q/k/v packed into c_attn).

    With tied embeddings `lm_head.weight` is omitted, as HF saves it.
    """
    out = {theirs: _conv1d(theirs, sd[ours]) for ours, theirs in _renames(cfg) if ours in sd}
    if _hf_model_type(cfg) == "gpt2":
        for i in range(cfg.n_layer):
            b, h = f"blocks.{i}.attn.", f"transformer.h.{i}.attn.c_attn."
            out[h + "weight"] = _t(torch.cat([sd[f"{b}{n}_proj.weight"] for n in "qkv"]))  # 3 x (C, C) -> (C, 3C)
            out[h + "bias"] = torch.cat([sd[f"{b}{n}_proj.bias"] for n in "qkv"])  # (3C,)
    return out


def _normalize_hf_key(key: str, model_type: str, cfg: ModelConfig) -> str | None:
    """Full `*ForCausalLM` name for `key`, or None for entries HF itself ignores (buffers, tied head)."""
    root = "transformer." if model_type == "gpt2" else "model."
    if not key.startswith((root, "lm_head.")):
        key = root + key  # saved from the bare GPT2Model / LlamaModel
    ignored = (model_type == "gpt2" and re.search(r"\.attn\.(masked_)?bias$", key)  # old GPT-2 causal masks
               or key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and cfg.tie_embeddings))
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
    _check_against(norm, state_dict_to_hf(build(cfg, device="meta").state_dict(), cfg), cfg, where)
    out = {ours: _conv1d(theirs, norm[theirs]) for ours, theirs in _renames(cfg) if theirs in norm}
    if mt == "gpt2":
        for i in range(cfg.n_layer):
            b, h = f"blocks.{i}.attn.", f"transformer.h.{i}.attn.c_attn."
            qkv_w, qkv_b = _t(norm[h + "weight"]), norm[h + "bias"]  # (3C, C), (3C,)
            for n, w, bias in zip("qkv", qkv_w.chunk(3), qkv_b.chunk(3)):
                out[f"{b}{n}_proj.weight"], out[f"{b}{n}_proj.bias"] = w.contiguous(), bias.contiguous()  # (C, C), (C,)
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
        if isinstance(m, Attention) and m.rotary:
            m.inv_freq = rope_inv_freq(m.hd, cfg.rope_theta, cfg.rope_scaling, device=device)
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
