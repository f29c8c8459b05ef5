"""Hugging Face checkpoints in and out: HF parameter names <-> ours, and directories (config.json <-> ModelConfig
is `hf_config.py`'s).

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
* ``t5`` (``T5ForConditionalGeneration``; FLAN-T5 is T5 v1.1: ``feed_forward_proj`` "gated-gelu", untied head):
  ``shared`` is our token embedding, ``encoder.block.N.layer.*`` / ``decoder.block.N.layer.*`` our
  ``encoder.N`` / ``decoder.N`` sub-layers, the relative-attention bias of each stack's first layer its table.
* ``bert`` (``BertForPreTraining``, ``BertForMaskedLM``) and ``roberta`` (``RobertaForMaskedLM``): encoders with
  the masked-LM head (``cls.predictions`` / ``lm_head``) and, for BERT, the pooler and next-sentence classifier
  where the checkpoint holds them. RoBERTa's position table starts after its padding token (``pad_token_id + 1``
  rows ahead), so ``max_position_embeddings`` is our ``max_seq_len`` plus those rows.

Weights are read from safetensors only (one file or shards named by ``model.safetensors.index.json``); pickled
``pytorch_model.bin`` files are refused, never unpickled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from waferscale.errors import CheckpointError
from waferscale.models.config import ModelConfig
from waferscale.models.hf_config import SUPPORTED_MODEL_TYPES, config_from_hf, config_to_hf, hf_model_type
from waferscale.models.layers import Attention, CausalLM
from waferscale.models.modelzoo import fold_mup
from waferscale.models.registry import build
from waferscale.util.files import atomic_dir

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


# ---- parameter names ----------------------------------------------------------------------------------

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


def _t5_renames(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, HF name) of every T5 tensor: the shared embedding, each stack's relative-bias table (in its
    first layer), the layers' sub-layers (layer.0 self-attention, decoder layer.1 cross-attention, the last the
    feed-forward: wi or wi_0 / wi_1, wo), the final norms and an untied head."""
    ff = [("mlp.gate_proj", "wi_0"), ("mlp.up_proj", "wi_1")] if cfg.gated_mlp else [("mlp.up_proj", "wi")]
    ff.append(("mlp.down_proj", "wo"))

    def attn(ours: str, hf: str) -> list[tuple[str, str]]:
        return [(f"{ours}.{n}_proj", f"{hf}.{n}") for n in "qkvo"]

    modules = [("embed.tok", "shared"), ("encoder_norm.norm", "encoder.final_layer_norm"),
               ("head.norm", "decoder.final_layer_norm"),
               ("encoder.0.rel", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias"),
               ("decoder.0.rel", "decoder.block.0.layer.0.SelfAttention.relative_attention_bias")]
    for i in range(cfg.n_layer):
        e, h = f"encoder.{i}", f"encoder.block.{i}.layer"
        modules += [(f"{e}.attn_norm", f"{h}.0.layer_norm"), *attn(f"{e}.attn", f"{h}.0.SelfAttention"),
                    (f"{e}.mlp_norm", f"{h}.1.layer_norm"), *((f"{e}.{o}", f"{h}.1.DenseReluDense.{t}") for o, t in ff)]
    for i in range(cfg.decoder_layers):
        d, h = f"decoder.{i}", f"decoder.block.{i}.layer"
        modules += [(f"{d}.attn_norm", f"{h}.0.layer_norm"), *attn(f"{d}.attn", f"{h}.0.SelfAttention"),
                    (f"{d}.cross_norm", f"{h}.1.layer_norm"), *attn(f"{d}.cross", f"{h}.1.EncDecAttention"),
                    (f"{d}.mlp_norm", f"{h}.2.layer_norm"), *((f"{d}.{o}", f"{h}.2.DenseReluDense.{t}") for o, t in ff)]
    if not cfg.tie_embeddings:
        modules.append(("head.lm_head", "lm_head"))
    return [(f"{ours}.{p}", f"{theirs}.{p}") for ours, theirs in modules for p in ("weight", "bias")]


def _normalize_t5_key(key: str, cfg: ModelConfig) -> str | None:
    """None for what T5 checkpoints hold but need not load: the stacks' copies of the shared embedding, a tied
    head, and the unused cross-attention bias table some old checkpoints carry."""
    ignored = (key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
               or key == "lm_head.weight" and cfg.tie_embeddings
               or key == "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")
    return None if ignored else key


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
    if cfg.is_encoder_decoder:
        return _t5_renames(cfg)
    mt, head = hf_model_type(cfg), "lm_head"
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
    mt = hf_model_type(cfg)
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
    if cfg.is_encoder_decoder:
        return _normalize_t5_key(key, cfg)
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
    mt = hf_model_type(cfg)
    if cfg.is_encoder_decoder and not cfg.tie_embeddings and "lm_head.weight" not in sd and "shared.weight" in sd:
        sd = {**sd, "lm_head.weight": sd["shared.weight"]}  # transformers 5 ties every T5's head, saves it if apart
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
    if cfg.is_encoder_decoder:  # every layer of a stack holds (borrows) its first layer's bias table
        for stack, n in (("encoder", cfg.n_layer), ("decoder", cfg.decoder_layers)):
            out.update({f"{stack}.{i}.rel.weight": out[f"{stack}.0.rel.weight"] for i in range(1, n)})
    if cfg.tie_embeddings:
        out["head.lm_head.weight"] = out["embed.tok.weight"]
    return out


# ---- building a model from a state dict without initialising it first --------------------------------

def model_from_state_dict(cfg: ModelConfig, sd: dict[str, Tensor], device: torch.device | str = "cpu",
                          dtype: torch.dtype | None = None, *, where: str = "state dict") -> CausalLM:
    """Build `cfg` on the meta device and adopt the tensors of `sd` (our names): no random init, no double copy.

    dtype=None keeps the dtype of `embed.tok.weight` in `sd` for every floating-point parameter. A tensor of `sd`
    on the meta device stays there (its values are held elsewhere: models/gguf.py's `keep_quantized`).
    """
    model = build(cfg, device="meta")
    _check_against(sd, model.state_dict(), cfg, where)
    dtype = dtype or sd["embed.tok.weight"].dtype
    unique = {id(v): v for v in sd.values()}  # a tensor stored under two names (tied embeddings) is moved once
    moved = {i: v if v.is_meta else v.to(device=device, dtype=dtype) for i, v in unique.items()}
    sd = {k: moved[id(v)] for k, v in sd.items()}
    model.load_state_dict(sd, strict=True, assign=True)
    if cfg.tie_embeddings:  # assign=True replaced the two references separately
        model.head.lm_head.weight = model.embed.tok.weight
    for m in model.modules():  # non-persistent buffers are computed, not stored
        if isinstance(m, Attention):
            m.init_buffers(device)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                  if t.is_meta and not (n in sd and sd[n].is_meta)]
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

    # Hugging Face's models have no muP scalings: they are folded into the weights (as Model Zoo's converter does)
    weights, cfg = fold_mup(model.state_dict(), model.config)
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
        sd = {k: v.detach().to("cpu").contiguous() for k, v in state_dict_to_hf(weights, cfg).items()}
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
