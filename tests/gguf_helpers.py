"""A GGUF file written from a saved Hugging Face directory the way llama.cpp's convert_hf_to_gguf.py writes one,
for the architectures the zoo loads: the converter's metadata keys (its `set_gguf_parameters` for each model
class), its tensor renames (the `gguf` package's `TensorNameMap`, which the converter itself uses) and its
tensor rewrites (`modify_tensors`): the Llama Q/K rotary permutation, Mixtral's experts stacked per layer,
GPT-NeoX's per-head and Falcon's per-group q/k/v runs reordered to [all q; all k; all v], T5's shared
embedding kept once. Tensor types follow its `prepare_tensors` for `--outtype f32` / `q8_0`: 1-D tensors, norms
and the router stay F32, rows that Q8_0 cannot hold fall back to F16.

The tokenizer is a GPT-2 byte-level BPE (the 256 byte symbols, a few merges and an end-of-text token), enough for
llama.cpp to load the file and for `wsc generate` to encode a prompt; `VOCAB` is its size.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

MERGES = ["Ġ t", "h e", "Ġ a", "i n"]
EOS = 256 + len(MERGES)  # "<|endoftext|>", a control token
VOCAB = EOS + 1


def byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order: the token of each single byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _neox_qkv(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """GPTNeoXModel.modify_tensors: per-head [q, k, v] rows -> [all q; all k; all v]."""
    per_head = t.reshape(n_head, 3, -1, *t.shape[1:])
    return torch.cat([per_head[:, i].reshape(-1, *t.shape[1:]) for i in range(3)])


def _falcon_qkv(t: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    """FalconModel.modify_tensors: per-group [queries, k, v] rows -> [all q; all k; all v]."""
    hd = t.shape[0] // (n_head + 2 * n_head_kv)
    qkv = t.view(n_head_kv, n_head // n_head_kv + 2, hd, -1)
    q, k, v = (qkv[:, :-2], qkv[:, [-2]], qkv[:, [-1]])
    return torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)]).reshape_as(t)


def _metadata(w: gguf.GGUFWriter, hp: dict, mt: str, n_layer: int) -> None:
    if mt in ("llama", "mistral", "mixtral"):  # TextModel.set_gguf_parameters + LlamaModel's
        rope = hp.get("rope_parameters") or {}
        w.add_context_length(hp["max_position_embeddings"])
        w.add_embedding_length(hp["hidden_size"])
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_head_count(hp["num_attention_heads"])
        w.add_head_count_kv(hp["num_key_value_heads"])
        w.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta")))
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        if "num_local_experts" in hp:
            w.add_expert_count(hp["num_local_experts"])
            w.add_expert_used_count(hp["num_experts_per_tok"])
        if hp.get("head_dim") is not None:
            w.add_key_length(hp["head_dim"])
            w.add_value_length(hp["head_dim"])
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
    elif mt == "gpt_neox":
        w.add_context_length(hp["max_position_embeddings"])
        w.add_embedding_length(hp["hidden_size"])
        w.add_feed_forward_length(hp["intermediate_size"])
        # published Pythia configs say rotary_pct; transformers 5 saves it as rope_parameters.partial_rotary_factor
        pct = hp.get("rotary_pct", (hp.get("rope_parameters") or {}).get("partial_rotary_factor"))
        w.add_rope_dimension_count(int(pct * (hp["hidden_size"] // hp["num_attention_heads"])))
        w.add_head_count(hp["num_attention_heads"])
        w.add_parallel_residual(hp.get("use_parallel_residual", True))
        w.add_layer_norm_eps(hp["layer_norm_eps"])
    elif mt == "falcon":
        w.add_context_length(2048)  # not in config.json
        w.add_tensor_data_layout("jploski")
        w.add_embedding_length(hp["hidden_size"])
        w.add_feed_forward_length(4 * hp["hidden_size"])
        w.add_head_count(hp["num_attention_heads"])
        w.add_head_count_kv(hp.get("num_kv_heads") or 1)
        w.add_layer_norm_eps(hp["layer_norm_epsilon"])
    elif mt == "mpt":
        attn = hp["attn_config"]
        w.add_context_length(hp["max_seq_len"])
        w.add_embedding_length(hp["d_model"])
        w.add_feed_forward_length(4 * hp["d_model"])
        w.add_head_count(hp["n_heads"])
        if attn.get("kv_n_heads"):
            w.add_head_count_kv(attn["kv_n_heads"])
        w.add_layer_norm_eps(1e-5)
        if attn["clip_qkv"] is not None:
            w.add_clamp_kqv(attn["clip_qkv"])
        w.add_max_alibi_bias(attn["alibi_bias_max"] if attn["alibi"] else 0.0)
    elif mt == "t5":  # T5Model.set_gguf_parameters
        w.add_context_length(hp.get("n_positions", 512))
        w.add_embedding_length(hp["d_model"])
        w.add_feed_forward_length(hp["d_ff"])
        if hp.get("num_decoder_layers") is not None:
            w.add_decoder_block_count(hp["num_decoder_layers"])
        w.add_head_count(hp["num_heads"])
        w.add_key_length(hp["d_kv"])
        w.add_value_length(hp["d_kv"])
        w.add_layer_norm_eps(hp["layer_norm_epsilon"])
        w.add_relative_attn_buckets_count(hp["relative_attention_num_buckets"])
        w.add_layer_norm_rms_eps(hp["layer_norm_epsilon"])
        w.add_decoder_start_token_id(hp["decoder_start_token_id"])
    else:
        raise ValueError(f"no converter for model type {mt!r}")
    w.add_block_count(n_layer)


def _tensors(sd: dict[str, torch.Tensor], hp: dict, mt: str) -> list[tuple[str, torch.Tensor]]:
    """modify_tensors of the model's converter class, before the rename: (HF-style name, tensor)."""
    out = []
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in sd.items():
        if mt in ("llama", "mistral", "mixtral"):
            n_head, n_kv = hp["num_attention_heads"], hp["num_key_value_heads"]
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                t = _permute(t, n_head)
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                t = _permute(t, n_kv)
            if ".block_sparse_moe.experts." in name:  # model.layers.{bid}.block_sparse_moe.experts.{x}.{w}.weight
                parts = name.split(".")
                experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = t
                continue
        elif mt == "gpt_neox" and ".attention.query_key_value." in name:
            t = _neox_qkv(t, hp["num_attention_heads"])
        elif mt == "falcon" and "query_key_value" in name:
            t = _falcon_qkv(t, hp["num_attention_heads"], hp.get("num_kv_heads") or 1)
        elif mt == "t5" and name in ("decoder.embed_tokens.weight", "encoder.embed_tokens.weight", "shared.weight"):
            if any(n == "shared.weight" for n, _ in out):  # the first of the three is the token embedding
                continue
            name = "shared.weight"
        out.append((name, t))
    for (bid, wid), by_expert in sorted(experts.items()):
        out.append((f"layers.{bid}.feed_forward.experts.{wid}.weight",
                    torch.stack([by_expert[x] for x in range(len(by_expert))])))
    return out


def _fuse_qkv(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """--fuse-qkv (TextModel.modify_tensors): each layer's attn_q, attn_k, attn_v (as permuted) -> attn_qkv."""
    parts = {n: t for n, t in named if n.rsplit(".", 2)[1] in ("attn_q", "attn_k", "attn_v")}
    out = [(n, t) for n, t in named if n not in parts]
    for n in [n for n in parts if ".attn_q." in n]:
        out.append((n.replace(".attn_q.", ".attn_qkv."),
                    torch.cat([parts[n.replace(".attn_q.", f".attn_{x}.")] for x in "qkv"])))
    return out


def write_gguf_like_llama_cpp(hf_dir: Path, path: Path,
                              qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                              fuse_qkv: bool = False) -> Path:
    """convert_hf_to_gguf.py `hf_dir` --outfile `path` --outtype f32 (or q8_0, with `qtype` Q8_0) [--fuse-qkv,
    which fuses the separate q, k, v of the architectures whose GGUF tensors include attn_qkv: llama's]. Another
    `qtype` (Q4_0, ...) quantizes the same matrices, as llama-quantize would from the f32 file."""
    hp = json.loads((Path(hf_dir) / "config.json").read_text())
    mt = hp["model_type"]
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "mixtral": gguf.MODEL_ARCH.LLAMA,
            "gpt_neox": gguf.MODEL_ARCH.GPTNEOX, "falcon": gguf.MODEL_ARCH.FALCON, "mpt": gguf.MODEL_ARCH.MPT,
            "t5": gguf.MODEL_ARCH.T5}[mt]
    n_layer = hp.get("num_hidden_layers") or hp.get("n_layers") or hp["num_layers"]
    names = gguf.get_tensor_name_map(arch, n_layer)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(Path(hf_dir).name)
    _metadata(w, hp, mt, n_layer)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == gguf.GGMLQuantizationType.F32
                    else gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([*byte_symbols(), *(m.replace(" ", "") for m in MERGES), "<|endoftext|>"])
    w.add_token_types([gguf.TokenType.NORMAL] * EOS + [gguf.TokenType.CONTROL])
    w.add_token_merges(MERGES)
    w.add_eos_token_id(EOS)
    if mt == "t5":  # T5Model.set_vocab: an input ends in </s>
        w.add_add_bos_token(False)
        w.add_add_eos_token(True)
    named = []
    for name, t in _tensors(load_file(str(Path(hf_dir) / "model.safetensors")), hp, mt):
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"cannot map tensor {name!r}")
        named.append((new_name, t))
    for new_name, t in _fuse_qkv(named) if fuse_qkv else named:
        data = t.float().numpy()
        kind = qtype
        if data.ndim <= 1 or new_name.endswith("_norm.weight") or ".ffn_gate_inp." in new_name:
            kind = gguf.GGMLQuantizationType.F32
        elif kind != gguf.GGMLQuantizationType.F32 and data.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
            kind = gguf.GGMLQuantizationType.F16  # the converter's fallback for rows its blocks cannot hold
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(new_name, data)
        elif kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(new_name, data.astype(np.float16))
        else:
            w.add_tensor(new_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_sentencepiece_vocab_gguf(path: Path, text: str, vocab_size: int = 600) -> Path:
    """A vocabulary-only GGUF holding a SentencePiece vocabulary as the converter's `_set_vocab_sentencepiece`
    writes Llama's and Mistral's (tokenizer model 'llama', scores, token types), in their layout: <unk>, <s>,
    </s>, the 256 byte tokens <0xXX>, then the pieces by rank with score -rank, here learnt from `text` by the
    `tokenizers` SentencePiece-BPE trainer, and a control token [INST] last."""
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer(add_prefix_space=True)
    trainer.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, show_progress=False)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, *[gguf.TokenType.BYTE] * 256]
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(sorted(trainer.get_vocab(), key=trainer.get_vocab().get)):
        if piece not in tokens:
            tokens.append(piece)
            types.append(gguf.TokenType.NORMAL)
            scores.append(-float(rank))
    tokens.append("[INST]")
    types.append(gguf.TokenType.CONTROL)
    scores.append(0.0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_byte_bpe_vocab_gguf(path: Path, text: str, pre: str, vocab_size: int = 600) -> Path:
    """A vocabulary-only GGUF holding a byte-level BPE vocabulary ('gpt2', as the converter's `_set_vocab_gpt2`
    writes GPT-NeoX's, Falcon's and MPT's) learnt from `text` by the `tokenizers` byte-level trainer, with
    `tokenizer.ggml.pre` = `pre` (how llama.cpp splits text before the merges) and an end-of-text control token."""
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator([text], vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                special_tokens=["<|endoftext|>"])
    model = json.loads(trainer._tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    w = gguf.GGUFWriter(str(path), "gptneox")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == "<|endoftext|>" else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
