"""GGUF files of the families llama.cpp defines (gptneox, falcon, mpt; llama for Mistral and Mixtral; t5),
written from tiny random transformers models the way llama.cpp's converter writes them (tests/gguf_helpers.py):

* llama.cpp itself (llama-cpp-python, where installed) loads each file and its logits agree with transformers:
  the file is what llama.cpp expects, metadata, names and layouts;
* `load_gguf` reads it back as the config the model was built from and gives logits within 1e-4 of transformers;
* `wsc generate --model file.gguf` decodes greedily as transformers does; an architecture we lack is one
  `error:` line naming it and the supported ones (exit 2).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import wsc_main
from gguf_helpers import (EOS, VOCAB, write_byte_bpe_vocab_gguf, write_gguf_like_llama_cpp,
                          write_sentencepiece_vocab_gguf)
from hf_helpers import max_diff, perturbed
from waferscale.errors import CheckpointError
from waferscale.models import hf
from waferscale.models.config import ModelConfig
from waferscale.models.gguf import ARCHITECTURES, load_gguf
from waferscale.models.registry import PRESETS

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

T = 40  # prompt tokens of the logit comparisons (within every config's max_seq_len)


def _cfg(family: str, **kw) -> ModelConfig:
    base = dict(name=f"t-{family}", family=family, vocab_size=VOCAB, n_layer=2, n_head=4, d_model=32, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


_NEOX = dict(activation="gelu", position="rotary", rotary_dim=2, d_ff=128, block="parallel", tie_embeddings=False)
_FALCON = dict(activation="gelu", position="rotary", d_ff=128, attn_bias=False, mlp_bias=False)
_LLAMA_LIKE = dict(n_kv_head=2, norm="rmsnorm", activation="swiglu", position="rotary", tie_embeddings=False,
                   attn_bias=False, mlp_bias=False)
CASES = {
    "gpt_neox-parallel": _cfg("gpt_neox", **_NEOX),
    "gpt_neox-sequential": _cfg("gpt_neox", **{**_NEOX, "block": "sequential"}),
    "falcon-7b-like": _cfg("falcon", **_FALCON, n_kv_head=1, block="parallel_shared_norm"),
    "falcon-40b-like": _cfg("falcon", **_FALCON, n_kv_head=2, block="parallel"),
    "mpt": _cfg("mpt", n_head=6, d_model=48, d_ff=192, activation="gelu", position="alibi", norm_bias=False,
                attn_bias=False, mlp_bias=False),
    # a window no longer than the prompt: llama.cpp's Mistral files carry none (see test_mistral_window_...)
    "mistral": _cfg("mistral", **_LLAMA_LIKE, d_ff=48, sliding_window=64),
    "mixtral": _cfg("mixtral", **_LLAMA_LIKE, d_ff=64, n_experts=4, experts_per_token=2),
}
# What a GGUF file does not carry: Falcon's converter writes a context of 2048; llama.cpp's Mistral is a llama
# without the window; the router's training loss weight is no inference setting.
LOST = {"falcon-7b-like": dict(max_seq_len=2048), "falcon-40b-like": dict(max_seq_len=2048),
        "mistral": dict(family="llama", sliding_window=None), "mixtral": dict(router_aux_loss_coef=0.0)}
# llama.cpp's GELU rounds its input to float16 and reads the result from a float16 table (ggml's GGML_GELU_FP16):
# logits of these tiny GELU models move by 2e-3 to 3.4e-3 (of about 5) against transformers' exact GELU. The
# SwiGLU models agree to float32 rounding (5e-6).
LLAMA_CPP_TOL = {"gelu": 5e-3, "swiglu": 1e-4}


def _hf_model(cfg: ModelConfig, seed: int = 0):
    """A transformers model of `cfg`'s architecture, random weights of std 0.2 (norm weights around 1)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**hf.config_to_hf(cfg))).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = p.ndim == 1 and any(s in name for s in ("ln", "norm")) and name.endswith("weight")
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if is_norm else 0.0))
    return model


def _gguf(theirs, tmp_path: Path, name: str, qtype=gguf.GGMLQuantizationType.F32, fuse_qkv: bool = False) -> Path:
    theirs.save_pretrained(tmp_path / name)
    return write_gguf_like_llama_cpp(tmp_path / name, tmp_path / f"{name}.{qtype.name}.gguf", qtype, fuse_qkv)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))


def _hf_logits(theirs) -> np.ndarray:
    with torch.no_grad():
        return theirs(_ids()).logits[0].numpy()


def _llama_cpp():
    try:
        return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (bench/serve_llamacpp.py "
                                   "says how to build its wheel)")
    except (OSError, RuntimeError) as e:  # installed without its library (llama_cpp/lib, or $LLAMA_CPP_LIB_PATH)
        pytest.skip(f"llama-cpp-python cannot load its llama.cpp library: {e}")


def _llama_cpp_logits(path: Path) -> np.ndarray:
    """Every position's logits from llama.cpp on `path`, float32 KV cache, no flash attention."""
    llama_cpp = _llama_cpp()
    f32 = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=64, n_batch=64, n_threads=1, type_k=f32,
                          type_v=f32, flash_attn=False, verbose=False)
    try:
        llm.eval(_ids()[0].tolist())
        return np.array(llm.scores[:T])
    finally:
        llm.close()


@pytest.mark.parametrize("case", CASES)
def test_load_gguf_matches_transformers(case: str, tmp_path: Path) -> None:
    cfg = CASES[case]
    theirs = _hf_model(cfg)
    ours, meta = load_gguf(_gguf(theirs, tmp_path, case))
    assert meta["general.architecture"] == {"gpt_neox": "gptneox", "falcon": "falcon", "mpt": "mpt"}.get(
        cfg.family, "llama")
    assert ours.config == cfg.replace(name=case, **LOST.get(case, {}))
    with torch.no_grad():
        assert max_diff(ours(_ids())[0], torch.from_numpy(_hf_logits(theirs))) < 1e-4


@pytest.mark.parametrize("case", CASES)
def test_llama_cpp_reads_the_file_as_transformers_computes(case: str, tmp_path: Path) -> None:
    cfg = CASES[case]
    theirs = _hf_model(cfg)
    got = _llama_cpp_logits(_gguf(theirs, tmp_path, case))
    want = _hf_logits(theirs)
    assert np.abs(got - want).max() < LLAMA_CPP_TOL[cfg.activation], case


@pytest.mark.parametrize("case, qtype", [("gpt_neox-parallel", "Q8_0"), ("mixtral", "Q8_0"), ("mixtral", "Q4_0")])
def test_quantized_file_matches_llama_cpp_on_the_same_file(case: str, qtype: str, tmp_path: Path) -> None:
    """Quantized q/k/v matrices (fused) and expert stacks are dequantized and split as llama.cpp reads them (Q8_0
    as the converter writes it; Q4_0 as llama-quantize does). llama.cpp also rounds activations to 8 bits in its
    quantized products, so the two differ by up to 0.19 on these models (logits of about 5), while quantization
    moves both by 0.09 to 4 from the float model (Mixtral's routing flips, alike in both)."""
    theirs = _hf_model(CASES[case])
    path = _gguf(theirs, tmp_path, case, getattr(gguf.GGMLQuantizationType, qtype))
    ours, _ = load_gguf(path)
    with torch.no_grad():
        mine = ours(_ids())[0].numpy()
    at_llama_cpp = _llama_cpp_logits(path)
    assert np.abs(mine - at_llama_cpp).max() < 0.3
    assert (mine.argmax(-1) == at_llama_cpp.argmax(-1)).mean() >= 0.9


def test_llama_fused_qkv(tmp_path: Path) -> None:
    """convert_hf_to_gguf.py --fuse-qkv stores a llama's (permuted) q, k and v as one attn_qkv matrix."""
    theirs = _hf_model(CASES["mixtral"])
    path = _gguf(theirs, tmp_path, "mixtral-fused", fuse_qkv=True)
    assert "blk.0.attn_qkv.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    ours, _ = load_gguf(path)
    want = _hf_logits(theirs)
    with torch.no_grad():
        assert np.abs(ours(_ids())[0].numpy() - want).max() < 1e-4
    assert np.abs(_llama_cpp_logits(path) - want).max() < LLAMA_CPP_TOL["swiglu"]


def test_mistral_window_is_not_in_llama_cpp_files(tmp_path: Path) -> None:
    """llama.cpp's converter writes Mistral as `llama` without its sliding window and llama.cpp attends to the
    whole context: with a window shorter than the prompt, the loaded model computes what llama.cpp computes."""
    cfg = CASES["mistral"].replace(sliding_window=8)
    path = _gguf(_hf_model(cfg), tmp_path, "mistral-window-8")
    ours, _ = load_gguf(path)
    assert ours.config.family == "llama" and ours.config.sliding_window is None
    with torch.no_grad():
        mine = ours(_ids())[0].numpy()
    assert np.abs(mine - _llama_cpp_logits(path)).max() < 1e-4


def _ascii_only_head(theirs) -> None:
    """Zero the LM head rows of the byte tokens outside printable ASCII and of end-of-text, so that greedy decoding
    writes whole characters and all max_new_tokens of them (the other tokens' logits are random, some positive)."""
    with torch.no_grad():
        head = theirs.get_output_embeddings().weight
        for i in [*range(0, 32), *range(127, 256), EOS]:
            head[i] = 0.0


@pytest.mark.parametrize("case", ["gpt_neox-parallel", "falcon-40b-like", "mpt", "mixtral"])
def test_wsc_generate_on_a_family_gguf(case: str, tmp_path: Path, capsys) -> None:
    from waferscale.data.tokenizer import tokenizer_from_gguf

    theirs = _hf_model(CASES[case])
    _ascii_only_head(theirs)
    path = _gguf(theirs, tmp_path, case)
    prompt = "the cat"
    ids = tokenizer_from_gguf(path).encode(prompt)
    with torch.no_grad():
        out = theirs.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=EOS)
    out = out[0, len(ids):].tolist()
    assert len(out) == 8 and EOS not in out
    expected = prompt + tokenizer_from_gguf(path).decode(out)
    r = wsc_main(capsys, "generate", "--model", str(path), "--prompt", prompt, "--max_new_tokens", "8", "--temperature",
                 "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == expected


# ---- tokenizers: llama.cpp's SentencePiece vocabulary ('llama': Llama 2, Mistral, Mixtral files) and byte-level
# BPE ('gpt2') with each family's pre-tokenizer, encoded as llama.cpp tokenizes

# spaces, newlines, characters outside a small vocabulary (bytes), digits and punctuation runs
EDGE_TEXTS = ["Hello world", " two  spaces\n\nnewline", "  leading", "trailing  ", "", "\n", "café 😀 x", "ÿ\x00",
              "12345 67 $+<=>^~|` a,b;;c!? 3.14159 don't I'll", "tab\there"]


def _check_tokenizer(path: Path, with_control_tokens: list[str]) -> None:
    """`tokenizer_from_gguf(path)` gives plain text (a held-out passage, 100 slices of it, EDGE_TEXTS) back from
    its ids, and encodes it and `with_control_tokens` as llama.cpp tokenizes them."""
    from waferscale.data.corpus import held_out_shakespeare_passage
    from waferscale.data.tokenizer import tokenizer_from_gguf

    tok = tokenizer_from_gguf(path)
    passage = held_out_shakespeare_passage(2000)
    rng = np.random.default_rng(0)
    plain = [passage, *EDGE_TEXTS, *(passage[i:i + rng.integers(1, 80)] for i in rng.integers(0, len(passage), 100))]
    for text in plain:
        assert tok.decode(tok.encode(text)) == text
    llm = _llama_cpp().Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for text in [*plain, *with_control_tokens]:
            assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), text
    finally:
        llm.close()


def _corpus() -> str:
    from waferscale.data.corpus import shakespeare_files

    return shakespeare_files()[0].read_text()[:100_000]


def test_sentencepiece_vocabulary_encodes_as_llama_cpp(tmp_path: Path) -> None:
    _check_tokenizer(write_sentencepiece_vocab_gguf(tmp_path / "spm.gguf", _corpus()), ["[INST] what[INST]is"])


# "mpt": MPT's files and GPT-NeoX / Pythia's (MPT uses the GPT-NeoX-20B tokenizer); "falcon": Falcon's
@pytest.mark.parametrize("pre", ["gpt-2", "mpt", "falcon"])
def test_byte_level_vocabulary_encodes_as_llama_cpp(pre: str, tmp_path: Path) -> None:
    _check_tokenizer(write_byte_bpe_vocab_gguf(tmp_path / f"{pre}.gguf", _corpus(), pre), ["a<|endoftext|>b"])


# ---- T5 (llama.cpp's `t5`: encoder and decoder stacks, each with its first layer's relative bias table) -------

# v1.0 (ReLU, tied head) and v1.1 / FLAN (gated GELU, untied), heads of 12 apart from d_model / n_head = 8. The
# converter maps tensors with the encoder's layer count, so both stacks have the same depth, as published T5s do.
T5_CASES = {"t5": PRESETS["t5-tiny"].replace(d_kv=12, vocab_size=VOCAB),
            "flan-t5": PRESETS["flan-t5-tiny"].replace(d_kv=12, vocab_size=VOCAB)}


def _t5_gguf(cfg: ModelConfig, tmp_path: Path, name: str, ascii_only: bool = False):
    """(transformers' T5ForConditionalGeneration of a perturbed `cfg`, its GGUF written as the converter does)."""
    ours = perturbed(cfg)
    if ascii_only:
        with torch.no_grad():
            ours.head.lm_head.weight[[*range(0, 32), *range(127, 256), EOS]] = 0.0
    hf.save_hf_dir(ours, tmp_path / name)
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / name).eval()
    return theirs, write_gguf_like_llama_cpp(tmp_path / name, tmp_path / f"{name}.gguf")


@pytest.mark.parametrize("case", T5_CASES)
def test_t5_gguf_matches_transformers_and_llama_cpp(case: str, tmp_path: Path) -> None:
    """Ours: within 1e-4 of transformers. llama.cpp: T5 v1.1's logits within 0.5% of their range (its float16
    GELU table: 0.066 of 25 measured); v1.0's are d_model**0.5 times transformers' (llama.cpp leaves out the scale
    that a tied T5 head applies to the decoder's output), exactly that to 1e-4."""
    cfg = T5_CASES[case]
    theirs, path = _t5_gguf(cfg, tmp_path, case)
    ours, meta = load_gguf(path)
    assert meta["general.architecture"] == "t5" and ours.config == cfg.replace(name=case)
    x = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = theirs(input_ids=x, decoder_input_ids=y).logits[0].numpy()
        assert np.abs(ours(x, y)[0].numpy() - want).max() < 1e-4
    llama_cpp = _llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=64, n_batch=64, n_threads=1, type_k=0,
                          type_v=0, flash_attn=False, verbose=False)
    try:
        llm._batch.set_batch(x[0].tolist(), n_past=0, logits_all=False)  # llama_encode, then decode y
        llm._ctx.encode(llm._batch)
        llm.eval(y[0].tolist())
        got = np.array(llm.scores[:y.shape[1]])
    finally:
        llm.close()
    if cfg.tie_embeddings:
        assert np.abs(got * cfg.d_model ** -0.5 - want).max() < 1e-4
    else:
        assert np.abs(got - want).max() < 5e-3 * np.abs(want).max()


def test_wsc_generate_on_a_t5_gguf(tmp_path: Path, capsys) -> None:
    from waferscale.data.tokenizer import tokenizer_from_gguf

    theirs, path = _t5_gguf(T5_CASES["flan-t5"], tmp_path, "flan-t5", ascii_only=True)
    tok = tokenizer_from_gguf(path)
    prompt = "the cat"
    assert tok.encode(prompt, add_special_tokens=True) == tok.encode(prompt) + [EOS]  # (the file's add_eos_token)
    with torch.no_grad():
        out = theirs.generate(input_ids=torch.tensor([tok.encode(prompt) + [EOS]]), max_new_tokens=8,
                              do_sample=False, decoder_start_token_id=0, eos_token_id=EOS)[0, 1:].tolist()
    assert len(out) == 8 and EOS not in out
    r = wsc_main(capsys, "generate", "--model", str(path), "--prompt", prompt, "--max_new_tokens", "8", "--temperature",
                 "0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.rstrip("\n") == tok.decode(out)


@pytest.mark.parametrize("arch, why", [("gptj", "neither converts nor runs it"),
                                       ("bert", "without the masked-LM head"), ("bloom", "")])
def test_unsupported_architecture_is_one_error_line(arch: str, why: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=f"architecture '{arch}' is not supported.*{why}.*; supported: llama"):
        load_gguf(path)
    r = wsc_main(capsys, "generate", "--model", str(path), "--prompt", "x")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert f"'{arch}'" in lines[0] and all(a in lines[0] for a in ARCHITECTURES)
