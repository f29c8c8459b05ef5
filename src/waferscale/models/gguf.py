"""GGUF (llama.cpp) checkpoints -> the zoo's models, for the architectures llama.cpp defines and the zoo has:

* ``llama``: Llama, and Mistral (llama.cpp's converter writes Mistral as ``llama`` without its sliding window, and
  llama.cpp attends to the whole context, so such a file loads as a Llama); with ``llama.expert_count`` > 0 it is
  a Mixtral (``ffn_gate_inp`` is the router, ``ffn_{gate,up,down}_exps`` the experts stacked on one axis).
* ``gptneox`` (GPT-NeoX, Pythia), ``falcon`` and ``mpt``: q, k and v fused into one ``attn_qkv`` matrix. The
  converter reorders GPT-NeoX's per-head [q, k, v] runs and Falcon's per-group [queries, k, v] runs into plain
  [all q; all k; all v] rows (MPT's Wqkv already is), so all three split the same way. Falcon's ``attn_norm``
  feeds the MLP (and attention too in Falcon-7B's one-norm blocks); Falcon-40B's ``attn_norm_2`` is the
  attention's own norm. llama.cpp runs Falcon with parallel blocks only, and MPT with ALiBi.
* ``t5`` (T5, FLAN-T5): ``enc.blk.*`` and ``dec.blk.*`` stacks; each stack's relative bias table
  (``attn_rel_b``) is its first block's and serves every layer; ``ffn_gate`` present means v1.1's gated GELU.
  The head size is ``attention.key_length`` (d_kv); the decoder starts from ``decoder_start_token_id``.

Quantized tensors (Q4_1, Q8_0, ...) are turned back into floats with `gguf.quants.dequantize`: the result
is the quantized model itself, not the original fp16 release. Three more conversions matter:

* GGUF lists shapes innermost-first, so a (out, in) `nn.Linear` weight shows as [in, out]; the numpy data is
  already (out, in) row-major, which is what `dequantize` returns.
* llama.cpp's converter permutes the rows of the ``llama`` Q and K projections so that its rotary kernel can
  rotate adjacent pairs (x0, x1), (x2, x3), ...; our rotary (Hugging Face rotate_half) pairs x_i with x_{i+hd/2}.
  `unpermute_qk` undoes that. Without it the model still writes text, but perplexity roughly quadruples
  (measured in tests/test_gguf.py). GPT-NeoX and Falcon are stored unpermuted (llama.cpp rotates them as NeoX
  does, rotate_half over the first ``rope.dimension_count`` dims).
* Tied embeddings: a file without `output.weight` uses `token_embd.weight` as the LM head.

`load_gguf(..., keep_quantized=True)` leaves the matrices in the file's precision instead: the token embedding,
the head and every block's projections stay on the meta device and the model's `gguf_matrices` maps their names
to `GGUFMatrix` (the rows of a tensor's blocks, in place in the memory map). Every conversion above that moves
whole rows (the Q/K un-permutation, splitting attn_qkv, the experts' stacks) is then a row index into the
stored rows, computed by the same code on the row numbers instead of the values. The serving engine runs them
(serve/file_weights.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
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

# llama.cpp architecture -> what it loads as (the refusal of any other lists these)
ARCHITECTURES = {"llama": "Llama, Mistral, Mixtral", "gptneox": "GPT-NeoX, Pythia", "falcon": "Falcon",
                 "mpt": "MPT", "t5": "T5, FLAN-T5"}
# architectures llama.cpp names, of families the zoo has, that no GGUF file can give us, and why
_WHY_NOT = {
    "bert": "llama.cpp's BERT files hold the encoder for sentence embeddings without the masked-LM head, which its "
            "converter drops and the zoo's BERT needs; load the Hugging Face checkpoint instead",
    "gptj": "llama.cpp names it but neither converts nor runs it, so no GGUF layout of it exists",
}
# GGUF per-block tensor name -> ours (blocks.{i}.<ours>), per architecture; `attn_qkv` is split into q, k, v and
# the `*_exps` stacks into one tensor per expert
_LAYERNORM_BLOCK = {"attn_norm": "attn_norm", "attn_output": "attn.o_proj", "ffn_norm": "mlp_norm",
                    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK_NAMES = {
    "llama": {"attn_norm": "attn_norm", "attn_q": "attn.q_proj", "attn_k": "attn.k_proj", "attn_v": "attn.v_proj",
              "attn_output": "attn.o_proj", "ffn_norm": "mlp_norm", "ffn_gate": "mlp.gate_proj",
              "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.router"},
    "gptneox": _LAYERNORM_BLOCK, "mpt": _LAYERNORM_BLOCK,
    # Falcon-7B: one norm feeds attention and MLP. Falcon-40B: attn_norm (ln_mlp) feeds the MLP and attn_norm_2
    # (ln_attn) the attention.
    "falcon": {"attn_norm": "attn_norm", "attn_output": "attn.o_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"},
    "falcon_two_norms": {"attn_norm": "mlp_norm", "attn_norm_2": "attn_norm", "attn_output": "attn.o_proj",
                         "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_TOP_NAMES = {"token_embd": "embed.tok", "output_norm": "head.norm", "output": "head.lm_head",
              "enc.output_norm": "encoder_norm.norm", "dec.output_norm": "head.norm"}
# T5: {enc,dec}.blk.{i}.<GGUF> -> {encoder,decoder}.{i}.<ours>; each stack's relative bias table is block 0's
_T5_BLOCK = {"attn_norm": "attn_norm", "attn_rel_b": "rel", "cross_attn_norm": "cross_norm", "ffn_norm": "mlp_norm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             **{f"{g}attn_{x}": f"{o}.{x}_proj" for g, o in (("", "attn"), ("cross_", "cross")) for x in "qkvo"}}
# our names of the matrices that run in a file's precision (suffixes): what `keep_quantized` leaves undequantized
SERVED_MATRICES = ("_proj.weight", "embed.tok.weight", "head.lm_head.weight", "mlp.router.weight")
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


def _arch_settings(arch: str, get: Any, has: Any, head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields that differ between architectures, from `{arch}.*` metadata (`get(key, default)`)
    and which tensors exist (`has(name)`: biases and Falcon-40B's second norm are optional)."""
    rope = dict(position="rotary", rope_theta=_f32(get("rope.freq_base", 10000.0)))
    rope_dim = int(get("rope.dimension_count", head_dim))
    layernorm = dict(norm="layernorm", norm_eps=_f32(get("attention.layer_norm_epsilon", 1e-5)),
                     norm_bias=has("blk.0.attn_norm.bias"), activation="gelu")
    if arch in ("llama", "falcon") and rope_dim != head_dim:
        raise CheckpointError(f"GGUF {arch}.rope.dimension_count {rope_dim} != head_dim {head_dim}; partial rotary "
                              f"embeddings are not supported for {arch}")
    if arch != "llama" and get("rope.scaling.type", "none") != "none":  # (llama's: see _rope_scaling)
        raise CheckpointError(f"GGUF {arch}.rope.scaling.type {get('rope.scaling.type')!r} is not supported")
    biases = dict(attn_bias=has("blk.0.attn_q.bias") or has("blk.0.attn_qkv.bias"), mlp_bias=has("blk.0.ffn_up.bias"))
    if arch == "llama":
        n_experts = int(get("expert_count", 0))
        moe = dict(n_experts=n_experts, experts_per_token=int(get("expert_used_count", 2))) if n_experts else {}
        return dict(family="mixtral" if n_experts else "llama", norm="rmsnorm", activation="swiglu", **rope, **moe,
                    norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)), **biases)
    if arch == "t5":  # gated-GELU FFNs are T5 v1.1 / FLAN-T5's, ReLU ones v1.0's
        return dict(family="t5", norm="rmsnorm", norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
                    activation="geglu" if has("enc.blk.0.ffn_gate.weight") else "relu", position="relative",
                    d_kv=int(get("attention.key_length", head_dim)), pad_token_id=int(get("decoder_start_token_id", 0)),
                    relative_attention_num_buckets=int(get("attention.relative_buckets_count", 32)),
                    attn_bias=False, mlp_bias=False)
    if arch == "gptneox":
        return dict(family="gpt_neox", **layernorm, **rope, **biases, rotary_dim=None if rope_dim == head_dim else
                    rope_dim, block="parallel" if get("use_parallel_residual", True) else "sequential")
    if arch == "falcon":  # llama.cpp's Falcon has parallel blocks only
        return dict(family="falcon", **layernorm, **rope, **biases,
                    block="parallel" if has("blk.0.attn_norm_2.weight") else "parallel_shared_norm")
    # mpt: ALiBi with MPT's alibi_bias_max 8, what our ALiBi slopes are
    for key, supported in (("attention.max_alibi_bias", 8.0), ("attention.clamp_kqv", None)):
        if get(key, supported) != supported:
            raise CheckpointError(f"GGUF mpt.{key} {get(key)} is not supported (supported: {supported})")
    return dict(family="mpt", **layernorm, **biases, position="alibi")


def _tied(tensors: dict[str, Any]) -> bool:
    """Whether the LM head is the token embedding: no `output.weight`, or (the converter copies a head that the
    checkpoint stores even when tied) one equal to it, which matters for T5 v1.0, whose tied head also scales
    the decoder's output by d_model**-0.5 (llama.cpp omits that scale: its logits are d_model**0.5 times larger)."""
    out, emb = tensors.get("output.weight"), tensors.get("token_embd.weight")
    return out is None or (emb is not None and out.tensor_type == emb.tensor_type
                           and np.array_equal(np.asarray(out.data), np.asarray(emb.data)))


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], name: str | None = None) -> ModelConfig:
    """ModelConfig from a GGUF file's `{arch}.*` metadata (as `gguf_metadata` decodes it) and its tensors by name.

    Vocabulary size is the length of `tokenizer.ggml.tokens` (else `{arch}.vocab_size`, else the embedding's
    rows); embeddings are tied when the file has no `output.weight` or one equal to them. Metadata llama.cpp
    reads with a default (rope base, norm epsilon, key/value heads) takes llama.cpp's default when absent.
    """
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        why = f" ({_WHY_NOT[arch]})" if arch in _WHY_NOT else ""
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported{why}; supported: "
                              + ", ".join(f"{a} ({what})" for a, what in ARCHITECTURES.items()))

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def need(key: str) -> int:
        if f"{arch}.{key}" not in meta:
            raise CheckpointError(f"GGUF metadata lacks '{arch}.{key}'")
        return int(meta[f"{arch}.{key}"])

    d, n_head = need("embedding_length"), need("attention.head_count")
    for key in ("attention.key_length", "attention.value_length"):  # written when config.json has a head_dim
        if arch != "t5" and get(key, d // n_head) != d // n_head:  # (T5's is d_kv)
            raise CheckpointError(f"GGUF {arch}.{key} {get(key)} != embedding_length / head_count ({d // n_head}); "
                                  "heads of another width than d_model / n_head are not supported")
    if "tokenizer.ggml.tokens" in meta:
        vocab = len(meta["tokenizer.ggml.tokens"])
    else:
        vocab = int(get("vocab_size", tensors["token_embd.weight"].shape[-1]))
    try:
        settings = _arch_settings(arch, get, tensors.__contains__, d // n_head)
        if arch == "t5":
            n_dec = int(get("decoder_block_count", need("block_count")))
            settings["n_decoder_layer"] = n_dec if n_dec != need("block_count") else None
        if arch == "llama":
            settings["rope_scaling"] = _rope_scaling(meta, tensors.get("rope_freqs.weight"), d // n_head,
                                                     settings["rope_theta"])
        return ModelConfig(
            name=name or str(meta.get("general.name", f"gguf-{arch}")).lower().replace(" ", "-"),
            vocab_size=vocab, n_layer=need("block_count"), n_head=n_head,
            n_kv_head=need("attention.head_count_kv") if get("attention.head_count_kv") else None, d_model=d,
            d_ff=need("feed_forward_length"),
            max_seq_len=int(get("context_length", 2048)), tie_embeddings=_tied(tensors), **settings)
    except ValueError as e:
        raise CheckpointError(f"GGUF metadata describes an invalid model: {e}") from None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K weight (out, in) or bias (out,).

    The converter applies w.reshape(n_head, 2, hd/2, ...).swapaxes(1, 2): within each head, rows become the
    interleaved pairs (0, hd/2), (1, hd/2+1), ... We reshape as (n_head, hd/2, 2, ...) and swap back.
    """
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _ours(arch: str, cfg: ModelConfig, name: str, w: np.ndarray, undo_rope_permutation: bool
          ) -> list[tuple[str, np.ndarray]] | None:
    """GGUF tensor `name` holding `w` (dequantized, numpy order) -> [(our name, array)], None if unknown."""
    part, _, kind = name.rpartition(".")
    if part in _TOP_NAMES:
        return [(f"{_TOP_NAMES[part]}.{kind}", w)]
    m = re.fullmatch(r"(enc|dec)\.blk\.(\d+)\.(\w+)", part)
    if arch == "t5" and m and m.group(3) in _T5_BLOCK:
        return [(f"{'encoder' if m.group(1) == 'enc' else 'decoder'}.{m.group(2)}.{_T5_BLOCK[m.group(3)]}.{kind}", w)]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", part)
    if m is None or kind not in ("weight", "bias") or arch == "t5":
        return None
    part = m.group(2)
    names = _BLOCK_NAMES["falcon_two_norms" if arch == "falcon" and cfg.block == "parallel" else arch]
    if part == "attn_qkv":  # [all q; all k; all v] rows
        q, kv = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        pairs = [(f"attn.{n}_proj", x) for n, x in zip("qkv", np.split(w, [q, q + kv]))]
    elif part in _EXPERTS and arch == "llama":  # (n_experts, out, in)
        pairs = [(f"mlp.experts.{e}.{_EXPERTS[part]}", w[e]) for e in range(w.shape[0])]
    elif part in names:
        pairs = [(names[part], w)]
    else:
        return None
    if arch == "llama" and undo_rope_permutation:  # separate or fused (--fuse-qkv), q and k rows are permuted
        heads = {"attn.q_proj": cfg.n_head, "attn.k_proj": cfg.kv_heads}
        pairs = [(n, unpermute_qk(x, heads[n]) if n in heads else x) for n, x in pairs]
    return [(f"blocks.{m.group(1)}.{n}.{kind}", x) for n, x in pairs]


@dataclass(frozen=True)
class GGUFMatrix:
    """A matrix (out, in) held as its GGUF tensor's stored rows: `data` is the tensor's bytes as (stored rows,
    bytes per row) (a view into the memory map, nothing copied), `rows` which of them make the matrix, in our
    order (None: all, as stored), `ggml_type` the tensor's GGMLQuantizationType."""

    data: np.ndarray
    ggml_type: Any
    shape: tuple[int, int]
    rows: np.ndarray | None


def stored_matrices(arch: str, cfg: ModelConfig, t: Any, undo_rope_permutation: bool = True
                    ) -> list[tuple[str, GGUFMatrix]]:
    """GGUF tensor `t` (2-D or more) as our matrices, each a row selection of the stored bytes: `_ours` maps the
    row numbers as it maps the values. [] when `_ours` does not know it. Writing each matrix's rows back to
    its `rows` restores the stored tensor (serve/export_gguf.py)."""
    shape = tuple(int(s) for s in reversed(t.shape))  # (..., out, in)
    data = np.asarray(t.data).view(np.uint8).reshape(int(np.prod(shape[:-1])), -1)
    index = np.arange(data.shape[0]).reshape(shape[:-1])
    out = []
    for name, rows in _ours(arch, cfg, t.name, index, undo_rope_permutation) or ():
        rows = rows.reshape(-1)
        kept = None if np.array_equal(rows, np.arange(data.shape[0])) else rows
        out.append((name, GGUFMatrix(data, t.tensor_type, (int(rows.size), shape[-1]), kept)))
    return out


def load_gguf(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              *, undo_rope_permutation: bool = True, keep_quantized: bool = False) -> tuple[CausalLM, dict]:
    """Load a GGUF file of one of `ARCHITECTURES`, dequantized, as a CausalLM in eval mode.

    Returns (model, metadata): metadata holds the scalar and short-array GGUF keys (`general.*`,
    `tokenizer.chat_template`, `tokenizer.ggml.eos_token_id`, ...; the token list and merges are left out)
    plus "path". The model's config is named after the file ("SmolLM2-135M-Instruct.Q4_1.gguf" ->
    "smollm2-135m-instruct"). `undo_rope_permutation=False` exists only to demonstrate the trap in tests.

    keep_quantized: the embedding, head and projections are not dequantized: they stay on the meta device and
    `model.gguf_matrices` maps their names to `GGUFMatrix` (tied embeddings: one object under both names). The
    model then runs only on the serving engine (serve/file_weights.py). T5, which runs outside it, ignores this.
    """
    from gguf.quants import dequantize

    reader = read_gguf(path)
    meta = gguf_metadata(path, reader=reader)  # decoded once per file: the tokenizer reuses it
    cfg = config_from_gguf(meta, {t.name: t for t in reader.tensors}, name=_name_from_path(path))
    arch = meta["general.architecture"]
    keep_quantized = keep_quantized and arch != "t5"
    sd: dict[str, Tensor] = {}
    kept: dict[str, GGUFMatrix] = {}
    unknown: list[str] = []
    for t in reader.tensors:
        if t.name == "rope_freqs.weight" and arch == "llama":  # folded into cfg.rope_scaling
            continue
        if keep_quantized and len(t.shape) >= 2:
            mats = stored_matrices(arch, cfg, t, undo_rope_permutation)
            if mats and all(n.endswith(SERVED_MATRICES) for n, _ in mats):
                for name, m in mats:
                    kept[name] = m
                    sd[name] = torch.empty(m.shape, device="meta")
                continue
        try:
            w = dequantize(t.data, t.tensor_type)  # (out, in) for matrices: GGUF's shape reversed
        except NotImplementedError as e:
            raise CheckpointError(f"{path}: tensor {t.name!r} uses quantization {t.tensor_type.name}, which "
                                  f"gguf.quants cannot dequantize ({e})") from None
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))
        ours = _ours(arch, cfg, t.name, w, undo_rope_permutation)
        if ours is None:
            unknown.append(t.name)
        for name, x in ours or ():
            sd[name] = torch.empty(x.shape, dtype=torch.float32)  # one copy out of the (read-only) memory map
            sd[name].numpy()[...] = x
    if unknown:
        raise CheckpointError(f"{path}: tensor(s) {unknown[:5]} are not part of the {arch} architecture this "
                              "loader knows; checkpoint of another architecture?")
    if cfg.tie_embeddings and "embed.tok.weight" in sd:
        sd["head.lm_head.weight"] = sd["embed.tok.weight"]
        if "embed.tok.weight" in kept:
            kept["head.lm_head.weight"] = kept["embed.tok.weight"]
    if cfg.is_encoder_decoder:  # every layer of a T5 stack holds (borrows) its first layer's bias table
        for stack, n in (("encoder", cfg.n_layer), ("decoder", cfg.decoder_layers)):
            if f"{stack}.0.rel.weight" in sd:
                sd.update({f"{stack}.{i}.rel.weight": sd[f"{stack}.0.rel.weight"] for i in range(1, n)})
    model = model_from_state_dict(cfg, sd, device=device, dtype=dtype, where=f"GGUF file {str(path)!r}")
    if keep_quantized:
        model.gguf_matrices = kept
    return model, {"path": str(path), **{k: v for k, v in meta.items()
                                         if not (isinstance(v, list) and len(v) > _MAX_META_ARRAY)}}


__all__ = ["ARCHITECTURES", "GGUFMatrix", "SERVED_MATRICES", "load_gguf", "config_from_gguf", "stored_matrices",
           "unpermute_qk"]
