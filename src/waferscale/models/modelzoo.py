"""Cerebras Model Zoo parameter names <-> ours, for the decoders Model Zoo builds as `GPT2LMHeadModel` (its
gpt2 / gpt3 / llama / mistral configs).

The names follow Model Zoo's own HF <-> CS checkpoint converters (`tools/checkpoint_converters/gpt2_hf_cs.py`,
`llama.py`):

    embedding_layer.word_embeddings / .position_embeddings      embed.tok / embed.pos
    transformer_decoder.layers.N.norm1 / norm3                  blocks.N.attn_norm / mlp_norm
    ....self_attn.proj_{q,k,v}_dense_layer, proj_output_dense_layer   blocks.N.attn.{q,k,v,o}_proj
    ....ffn.ffn.0.linear_layer / ffn.ffn.0.linear_layer_for_glu       blocks.N.mlp.up_proj / gate_proj
    ....ffn.ffn.1.linear_layer                                         blocks.N.mlp.down_proj
    transformer_decoder.norm (CS 1.7 also saved it as ln_f)     head.norm
    lm_head                                                      head.lm_head (tied: the word embeddings)

Model Zoo's rotary embedding rotates interleaved pairs (x0, y0, x1, y1, ...) where ours (and HF's) rotates the
halves (x0, x1, ..., y0, y1, ...): each head's first `rotary_dim` rows of the q and k projections are permuted
from the one layout to the other, as the llama converter does. Model Zoo 2.x saves its wrapper module's state
dict (every name under `model.`) and loads that or the bare decoder's (`trainer/callbacks/model.py`); either form
is read, the first is written.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from waferscale.errors import CheckpointError
from waferscale.models.config import ModelConfig

FAMILIES = ("gpt", "llama", "mistral")  # built by Model Zoo's GPT2LMHeadModel


def tensor_renames(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, Model Zoo name) of every tensor the model may have, biases included."""
    modules = [("embed.tok", "embedding_layer.word_embeddings"), ("embed.pos", "embedding_layer.position_embeddings"),
               ("head.norm", "transformer_decoder.norm"), ("head.lm_head", "lm_head")]
    ffn = [("mlp.up_proj", "ffn.ffn.0.linear_layer"), ("mlp.gate_proj", "ffn.ffn.0.linear_layer_for_glu"),
           ("mlp.down_proj", "ffn.ffn.1.linear_layer")]
    per_layer = [("attn_norm", "norm1"), ("mlp_norm", "norm3"),
                 *((f"attn.{n}_proj", f"self_attn.proj_{n}_dense_layer") for n in "qkv"),
                 ("attn.o_proj", "self_attn.proj_output_dense_layer"), *ffn]
    modules += [(f"blocks.{i}.{ours}", f"transformer_decoder.layers.{i}.{theirs}")
                for i in range(cfg.n_layer) for ours, theirs in per_layer]
    return [(f"{ours}.{p}", f"{theirs}.{p}") for ours, theirs in modules for p in ("weight", "bias")]


def halves_from_pairs(t: Tensor, heads: int, rotary_dim: int) -> Tensor:
    """Rows of each head's rotary part from interleaved pairs (x0, y0, x1, y1, ...) to halves (x0, x1, ..., y0,
    y1, ...); the rest of the head passes through. `t` is a projection weight (rows, in) or bias (rows,)."""
    rest = t.shape[1:]
    h = t.reshape(heads, -1, *rest)
    rot = h[:, :rotary_dim].reshape(heads, rotary_dim // 2, 2, *rest).transpose(1, 2).reshape(heads, rotary_dim,
                                                                                               *rest)
    return torch.cat([rot, h[:, rotary_dim:]], dim=1).reshape(t.shape).contiguous()


def pairs_from_halves(t: Tensor, heads: int, rotary_dim: int) -> Tensor:
    """The inverse of `halves_from_pairs`: halves (x0, x1, ..., y0, y1, ...) to interleaved pairs."""
    rest = t.shape[1:]
    h = t.reshape(heads, -1, *rest)
    rot = h[:, :rotary_dim].reshape(heads, 2, rotary_dim // 2, *rest).transpose(1, 2).reshape(heads, rotary_dim,
                                                                                               *rest)
    return torch.cat([rot, h[:, rotary_dim:]], dim=1).reshape(t.shape).contiguous()


def rotary_rows(cfg: ModelConfig, ours: str) -> int | None:
    """The heads whose rotary rows are laid out differently in Model Zoo (q and k of a rotate-halves model)."""
    if cfg.position != "rotary" or cfg.rotary_interleaved or ours.split(".")[-2] not in ("q_proj", "k_proj"):
        return None
    return cfg.n_head if ".q_proj." in ours else cfg.kv_heads


def state_dict_to_zoo(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Ours -> the model state dict Model Zoo 2.x saves and loads: its wrapper module's names (`model.` + the
    decoder's), the tied head under both its names (one tensor), q and k rows in its interleaved rotary layout."""
    if cfg.family not in FAMILIES:
        raise CheckpointError(f"Model Zoo checkpoints are written for GPT and Llama models, not {cfg.family}")
    rotary_dim = cfg.rotary_dim or cfg.head_dim
    out: dict[str, Tensor] = {}
    for ours, theirs in tensor_renames(cfg):
        t = sd.get(ours)
        if t is None or (ours == "head.lm_head.weight" and cfg.tie_embeddings):
            continue
        heads = rotary_rows(cfg, ours)
        out[f"model.{theirs}"] = pairs_from_halves(t, heads, rotary_dim) if heads else t
    if cfg.tie_embeddings:
        out["model.lm_head.weight"] = out["model.embedding_layer.word_embeddings.weight"]
    return out


def _strip_wrapper(sd: dict[str, Any]) -> dict[str, Any]:
    """Names without the `model.` prefix of Model Zoo's wrapper module, where the decoder's names have it."""
    if any(k.startswith("model.transformer_decoder.") for k in sd):
        return {k.removeprefix("model."): v for k, v in sd.items()}
    return sd


def state_dict_from_zoo(sd: dict[str, Any], cfg: ModelConfig, *, where: str,
                        drop_unmatched: bool = False) -> dict[str, Tensor]:
    """A Model Zoo model state dict -> ours for `cfg`. Names it does not know are an error (or, with
    `drop_unmatched`, left out); missing ones are left to the caller's check against the model."""
    if cfg.family not in FAMILIES:
        raise CheckpointError(f"{where}: Model Zoo checkpoints are read for GPT and Llama models; the params give a "
                              f"{cfg.family} model")
    sd = dict(_strip_wrapper(sd))
    for p in ("weight", "bias"):  # CS 1.7 saved the final norm twice
        ln_f = sd.pop(f"ln_f.{p}", None)
        if ln_f is not None:
            sd.setdefault(f"transformer_decoder.norm.{p}", ln_f)
    head = sd.get("lm_head.weight")
    emb = sd.get("embedding_layer.word_embeddings.weight")
    if cfg.tie_embeddings:
        if head is not None and emb is not None and head is not emb and not torch.equal(head, emb):
            raise CheckpointError(f"{where}: share_embedding_weights is true but lm_head.weight differs from "
                                  f"embedding_layer.word_embeddings.weight; set share_embedding_weights: false")
        sd.pop("lm_head.weight", None)
        if emb is None and head is not None:  # Model Zoo may keep the tied tensor under the head's name only
            sd["embedding_layer.word_embeddings.weight"] = head
    out: dict[str, Tensor] = {}
    rotary_dim = cfg.rotary_dim or cfg.head_dim
    for ours, theirs in tensor_renames(cfg):
        t = sd.pop(theirs, None)
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise CheckpointError(f"{where}: {theirs} is a {type(t).__name__}, not a tensor")
        heads = rotary_rows(cfg, ours)
        if heads:
            if t.shape[0] != heads * cfg.head_dim:
                raise CheckpointError(f"{where}: {theirs} has {t.shape[0]} rows; {heads} heads of {cfg.head_dim} "
                                      f"need {heads * cfg.head_dim} (is the params file the checkpoint's?)")
            t = halves_from_pairs(t, heads, rotary_dim)
        out[ours] = t
    if sd and not drop_unmatched:
        unknown = sorted(sd)
        raise CheckpointError(f"{where}: tensor {unknown[0]!r} is not a Model Zoo {cfg.family} parameter name"
                              f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}; check that the "
                              f"params file describes this checkpoint's model")
    return out


def fold_mup(sd: dict[str, Tensor], cfg: ModelConfig) -> tuple[dict[str, Tensor], ModelConfig]:
    """A muP model's scalings folded into its weights, for a format that has none (Hugging Face's), as Model Zoo's
    `Converter_sP_muP` (tools/checkpoint_converters/mup.py) does: the token and position embeddings times
    embeddings_scale, the LM head times output_logits_scale (so the head is untied), and the key projection times
    what turns its attention scale into the standard 1/sqrt(head size) (Model Zoo's converter divides by
    sqrt(head size) for scale_qk_dot_by_d; attention_logits_alpha, which it predates, folds the same way).
    Returns the weights and the standard-parameterization config they compute the same logits under."""
    if not getattr(cfg, "has_mup", False):
        return sd, cfg
    out = dict(sd)
    out["head.lm_head.weight"] = sd.get("head.lm_head.weight", sd["embed.tok.weight"]) * cfg.output_logits_scale
    if "head.lm_head.bias" in sd:
        out["head.lm_head.bias"] = sd["head.lm_head.bias"] * cfg.output_logits_scale
    for name in ("embed.tok.weight", "embed.pos.weight"):
        if name in sd:
            out[name] = sd[name] * cfg.embeddings_scale
    k = cfg.attention_scale * math.sqrt(cfg.head_dim)
    for name in sd:
        if ".attn.k_proj." in name:
            out[name] = sd[name] * k
    return out, cfg.replace(embeddings_scale=1.0, output_logits_scale=1.0, scale_qk_dot_by_d=False,
                            attention_logits_alpha=1.0, tie_embeddings=False)


def fold_mup_model(model: torch.nn.Module) -> torch.nn.Module:
    """`fold_mup` applied to a built model: a standard-parameterization copy (same device and dtype) that computes
    the same logits, for code that runs the standard model's arithmetic only (the serving kernels). A model
    without muP is returned as it is."""
    if not getattr(model.config, "has_mup", False):
        return model
    from waferscale.models.registry import build

    sd, cfg = fold_mup(model.state_dict(), model.config)
    p = next(model.parameters())
    folded = build(cfg, device=p.device, dtype=p.dtype)
    folded.load_state_dict(sd)
    return folded


def model_state(ckpt: Any, where: str) -> dict[str, Any]:
    """The model state dict of a loaded Model Zoo checkpoint ({"model": ..., "optimizer": ..., ...})."""
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        found = sorted(map(str, ckpt))[:6] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{where} holds no 'model' state dict (found {found}); a Model Zoo checkpoint has "
                              f"'model', 'optimizer', 'global_step', ...")
    return ckpt["model"]
