"""GGUF (llama.cpp) checkpoints of the Llama architecture -> CausalLM.

Quantized tensors (Q4_1, Q8_0, ...) are turned back into floats with `gguf.quants.dequantize`: the result
is the quantized model itself, not the original fp16 release. Three conversions matter:

* GGUF lists shapes innermost-first, so a (out, in) `nn.Linear` weight shows as [in, out]; the numpy data is
  already (out, in) row-major, which is what `dequantize` returns.
* llama.cpp's converter permutes the rows of the Q and K projections so that its rotary kernel can rotate
  adjacent pairs (x0, x1), (x2, x3), ...; our rotary (Hugging Face rotate_half) pairs x_i with x_{i+hd/2}.
  `unpermute_qk` undoes that. Without it the model still writes text, but perplexity roughly quadruples
  (measured in tests/test_gguf.py).
* Tied embeddings: a file without `output.weight` uses `token_embd.weight` as the LM head.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from waferscale.errors import CheckpointError
from waferscale.models.config import ModelConfig, RopeScaling
from waferscale.models.hf import model_from_state_dict
from waferscale.models.layers import CausalLM, rope_inv_freq
from waferscale.util.gguf import gguf_metadata, read_gguf

# GGUF per-block tensor name -> ours (blocks.{i}.<ours>)
_BLOCK_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "attn.q_proj", "attn_k": "attn.k_proj", "attn_v": "attn.v_proj",
    "attn_output": "attn.o_proj", "ffn_norm": "mlp_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "embed.tok.weight", "output_norm.weight": "head.norm.weight",
              "output.weight": "head.lm_head.weight"}
# Metadata arrays longer than this (token lists, merges, scores) stay out of the returned metadata dict.
_MAX_META_ARRAY = 64


def _f32(x: Any) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06. Take the shortest decimal that
    rounds to the same float32, so configs compare equal to the presets they came from."""
    return float(str(np.float32(x)))


def _name_from_path(path: str | os.PathLike) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'smollm2-135m-instruct' (the quantization tag is dropped)."""
    stem = Path(path).name.lower().removesuffix(".gguf")
    return re.sub(r"[.\-_](i?q\d[\w]*|f16|f32|bf16)$", "", stem) or stem


def _rope_scaling(meta: dict[str, Any], freqs: Any, head_dim: int, theta: float) -> RopeScaling | None:
    """Llama-3.1 GGUFs store the per-frequency divisors as a `rope_freqs.weight` tensor (`freqs`) instead of
    parameters; accept it when it equals the llama3 scaling described by the metadata (or Llama 3.1's defaults)."""
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind not in ("none", "llama3"):
        raise CheckpointError(f"GGUF rope scaling type {kind!r} is not supported")
    if freqs is None:
        return None
    default = RopeScaling()
    scaling = RopeScaling(
        factor=_f32(meta.get("llama.rope.scaling.factor", default.factor)),
        low_freq_factor=_f32(meta.get("llama.rope.scaling.low_freq_factor", default.low_freq_factor)),
        high_freq_factor=_f32(meta.get("llama.rope.scaling.high_freq_factor", default.high_freq_factor)),
        original_max_position_embeddings=int(meta.get("llama.rope.scaling.original_context_length",
                                                      default.original_max_position_embeddings)))
    stored = torch.from_numpy(np.asarray(freqs.data, dtype=np.float32).reshape(-1).copy())
    expected = rope_inv_freq(head_dim, theta, None) / rope_inv_freq(head_dim, theta, scaling)
    if stored.shape != expected.shape or not torch.allclose(stored, expected, rtol=1e-3):
        raise CheckpointError("GGUF rope_freqs.weight does not match llama3 rope scaling "
                              f"{scaling}; other frequency tables are not supported")
    return scaling


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], name: str | None = None) -> ModelConfig:
    """ModelConfig from a GGUF file's `llama.*` metadata (as `gguf_metadata` decodes it) and its tensors by name.

    Vocabulary size is the length of `tokenizer.ggml.tokens` (else `llama.vocab_size`, else the embedding's
    rows); embeddings are tied when the file has no `output.weight` tensor.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    try:
        d, n_head = int(meta["llama.embedding_length"]), int(meta["llama.attention.head_count"])
        n_layer, d_ff = int(meta["llama.block_count"]), int(meta["llama.feed_forward_length"])
    except KeyError as e:
        raise CheckpointError(f"GGUF metadata lacks {e.args[0]!r}") from None
    if "tokenizer.ggml.tokens" in meta:
        vocab = len(meta["tokenizer.ggml.tokens"])
    elif "llama.vocab_size" in meta:
        vocab = int(meta["llama.vocab_size"])
    else:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    rope_dim = meta.get("llama.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != d // n_head:
        raise CheckpointError(f"GGUF rope.dimension_count {rope_dim} != head_dim {d // n_head}; partial rotary "
                              "embeddings are not supported")
    theta = _f32(meta.get("llama.rope.freq_base", 10000.0))
    try:
        return ModelConfig(
            name=name or str(meta.get("general.name", "gguf-llama")).lower().replace(" ", "-"),
            family="llama", vocab_size=vocab, n_layer=n_layer, n_head=n_head,
            n_kv_head=int(meta.get("llama.attention.head_count_kv", n_head)), d_model=d, d_ff=d_ff,
            max_seq_len=int(meta.get("llama.context_length", 2048)), norm="rmsnorm",
            norm_eps=_f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)), activation="swiglu",
            position="rotary", rope_theta=theta,
            rope_scaling=_rope_scaling(meta, tensors.get("rope_freqs.weight"), d // n_head, theta),
            tie_embeddings="output.weight" not in tensors, attn_bias="blk.0.attn_q.bias" in tensors,
            mlp_bias="blk.0.ffn_up.bias" in tensors)
    except ValueError as e:
        raise CheckpointError(f"GGUF metadata describes an invalid model: {e}") from None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K weight (out, in) or bias (out,).

    The converter applies w.reshape(n_head, 2, hd/2, ...).swapaxes(1, 2): within each head, rows become the
    interleaved pairs (0, hd/2), (1, hd/2+1), ... We reshape as (n_head, hd/2, 2, ...) and swap back.
    """
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              *, undo_rope_permutation: bool = True) -> tuple[CausalLM, dict]:
    """Load a Llama-architecture GGUF file, dequantized, as a CausalLM in eval mode.

    Returns (model, metadata): metadata holds the scalar and short-array GGUF keys (`general.*`,
    `tokenizer.chat_template`, `tokenizer.ggml.eos_token_id`, ...; the token list and merges are left out)
    plus "path". The model's config is named after the file ("SmolLM2-135M-Instruct.Q4_1.gguf" ->
    "smollm2-135m-instruct"). `undo_rope_permutation=False` exists only to demonstrate the trap in tests.
    """
    from gguf.quants import dequantize

    reader = read_gguf(path)
    meta = gguf_metadata(path, reader=reader)  # decoded once per file: the tokenizer reuses it
    cfg = config_from_gguf(meta, {t.name: t for t in reader.tensors}, name=_name_from_path(path))
    sd: dict[str, Tensor] = {}
    unknown: list[str] = []
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # folded into cfg.rope_scaling
            continue
        ours = _TOP_NAMES.get(t.name)
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if ours is None and m and m.group(2) in _BLOCK_NAMES:
            ours = f"blocks.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
        if ours is None:
            unknown.append(t.name)
            continue
        try:
            w = dequantize(t.data, t.tensor_type)  # (out, in) for matrices: GGUF's shape reversed
        except NotImplementedError as e:
            raise CheckpointError(f"{path}: tensor {t.name!r} uses quantization {t.tensor_type.name}, which "
                                  f"gguf.quants cannot dequantize ({e})") from None
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))
        if undo_rope_permutation and m and m.group(2) in ("attn_q", "attn_k"):
            w = unpermute_qk(w, cfg.n_head if m.group(2) == "attn_q" else cfg.kv_heads)
        t_ours = torch.empty(w.shape, dtype=torch.float32)  # one copy out of the (read-only) memory map
        t_ours.numpy()[...] = w
        sd[ours] = t_ours
    if unknown:
        raise CheckpointError(f"{path}: tensor(s) {unknown[:5]} are not part of the Llama architecture this "
                              "loader knows; checkpoint of another architecture?")
    if cfg.tie_embeddings and "embed.tok.weight" in sd:
        sd["head.lm_head.weight"] = sd["embed.tok.weight"]
    model = model_from_state_dict(cfg, sd, device=device, dtype=dtype, where=f"GGUF file {str(path)!r}")
    return model, {"path": str(path), **{k: v for k, v in meta.items()
                                         if not (isinstance(v, list) and len(v) > _MAX_META_ARRAY)}}


__all__ = ["load_gguf", "config_from_gguf", "unpermute_qk"]
