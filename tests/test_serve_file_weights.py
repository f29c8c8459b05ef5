"""A model served in its file's own precision (serve/file_weights.py, models/gguf.py keep_quantized,
serve/export_gguf.py): the same greedy tokens as the same weights dequantized to float32, for every format the
kernels run, decode and prefill, one sequence and a batch; `--dtype` requantizing at load; `wsc export --format
gguf` read back identically; bad input as one error line.

The token comparisons run the kernels' float path (`quant.set_int8_activations(False)`: each weight dequantized
exactly, summed in float32, so only the summation order differs from the float32 path). By default the Q8_0,
Q4_0 and Q4_1 products round the activations per block of 32 to integers and sum in integers (csrc/quant.c
says how): that changes the arithmetic itself, so greedy tokens may part after a while; the assets test bounds
what it costs, the perplexity of the real SmolLM2 Q4_1 file on the held-out Shakespeare passage moving by less
than 1 %.

The tiny GGUFs are written as llama.cpp's converter writes them (tests/gguf_helpers.py) from a random Llama of
d_model 256 and d_ff 512, so that every input size holds whole blocks of every format (256 weights for Q4_K
and Q6_K)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import wsc
from gguf_helpers import VOCAB, write_gguf_like_llama_cpp
from waferscale.errors import ConfigError
from waferscale.models import hf
from waferscale.models.config import ModelConfig
from waferscale.models.gguf import GGUFMatrix, load_gguf
from waferscale.serve.file_weights import served_weights
from waferscale.serve.llm import LLM, SamplingParams
from waferscale.serve import quant
from waferscale.serve.quant import QTYPES, block_shape, dequantize

import gguf  # noqa: E402  (a dependency of waferscale itself)
Q = gguf.GGMLQuantizationType

CFG = ModelConfig(name="t-llama", family="llama", vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, d_model=256,
                  d_ff=512, max_seq_len=128, norm="rmsnorm", activation="swiglu", position="rotary",
                  tie_embeddings=True, attn_bias=False, mlp_bias=False)
PROMPTS = [[5, 72, 101, 108, 108, 111, 32, 119] * 3, [84, 104, 101, 32, 99, 97, 116]]  # 24 and 7 tokens
NEW = 10


class _Tok:
    """Token ids only (the engine's detokenizer needs decode)."""
    eos_id = None
    vocab_size = VOCAB

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i % 90) for i in ids)


def _model(seed: int = 0) -> torch.nn.Module:
    from waferscale.models import build

    torch.manual_seed(seed)
    model = build(CFG, device="cpu").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.ndim > 1 else 0.02) + (1.0 if p.ndim == 1 else 0.0))
    return model


@pytest.fixture
def float_path():
    was = quant.set_int8_activations(False)
    yield
    quant.set_int8_activations(was)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "t-llama"
    hf.save_hf_dir(_model(), d)
    return d


def _file(hf_dir: Path, qtype, tmp: Path) -> Path:
    return write_gguf_like_llama_cpp(hf_dir, tmp / f"t-llama.{qtype.name}.gguf", qtype)


def _greedy(model, batched: bool, **kw) -> list[list[int]]:
    """Greedy tokens of PROMPTS through the serving engine: both prompts in one batch (prefill chunks beside
    decode rows, then batched decode), or one after the other (single-stream decode). The KV cache is float32
    unless kw says otherwise (auto would keep a file-precision model's in float16), so that a comparison with
    the float32 path differs in the weights' arithmetic only."""
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    kw.setdefault("kv_cache_dtype", "fp32")
    with LLM(model, _Tok(), max_num_seqs=2, max_model_len=64, **kw) as llm:
        if batched:
            return [c.token_ids for c in llm.generate(PROMPTS, params)]
        return [llm.generate([p], params)[0].token_ids for p in PROMPTS]


def _dequantized_copy(model, qweights) -> torch.nn.Module:
    """A float32 model holding what the QWeights hold (the fp32 path's weights)."""
    ref = _model()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name in qweights:
                p.copy_(dequantize(qweights[name]))
            else:
                p.copy_(dict(model.named_parameters())[name])
    return ref


@pytest.mark.slow
def test_native_q4_1_gives_the_greedy_tokens_of_its_dequantized_weights(hf_dir: Path, tmp_path: Path,
                                                                         float_path) -> None:
    path = _file(hf_dir, Q.Q4_1, tmp_path)
    native, _ = load_gguf(path, keep_quantized=True)
    dense, _ = load_gguf(path)
    assert native.embed.tok.weight.is_meta and native.blocks[0].attn.q_proj.weight.is_meta  # no float copy
    assert native.gguf_matrices["head.lm_head.weight"] is native.gguf_matrices["embed.tok.weight"]
    qw = served_weights(native)
    assert {w.qtype for w in qw.values()} == {"q4_1"} and qw["head.lm_head.weight"] is qw["embed.tok.weight"]
    floats = dict(dense.named_parameters(remove_duplicate=False))
    for name, w in qw.items():  # the Q/K un-permutation as a row gather on the bytes: the same matrices
        torch.testing.assert_close(dequantize(w), floats[name], rtol=0, atol=0)
    expected = _greedy(dense, batched=False)
    assert _greedy(native, batched=False) == expected
    assert _greedy(native, batched=True) == expected
    assert _greedy(native, batched=True, stages=2) == expected  # the file's blocks in two stage processes


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_each_format_runs_as_its_dequantized_weights(qtype: str, float_path) -> None:
    """Every matrix in `qtype` (gguf's quantization where it has one, random blocks of valid scale for the
    k-quants it cannot write) gives the greedy tokens of the float32 path over the same values."""
    model = _model()
    ggml = Q[QTYPES[qtype]]
    rng = np.random.default_rng(0)
    mats = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.ndim == 2 and name != "head.lm_head.weight":
            a = p.detach().numpy()
            data = gguf.quants.quantize(a, ggml) if qtype not in ("q4_k", "q6_k") else _k_blocks(qtype, a.shape, rng)
            mats[name] = GGUFMatrix(np.ascontiguousarray(data).view(np.uint8).reshape(a.shape[0], -1), ggml,
                                    a.shape, None)
    mats["head.lm_head.weight"] = mats["embed.tok.weight"]
    model.gguf_matrices = mats
    qw = served_weights(model)
    assert {w.qtype for w in qw.values()} == {qtype}
    assert _greedy(model, batched=True) == _greedy(_dequantized_copy(model, qw), batched=True)


def _k_blocks(qtype: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K rows whose float16 super-block scales are set to keep weights within about +-2."""
    per, size = block_shape(qtype)
    blocks = rng.integers(0, 256, (shape[0], shape[1] // per, size), dtype=np.uint8)
    if qtype == "q4_k":  # d, dmin, then 12 bytes of 6-bit scales and 128 of 4-bit weights
        blocks[..., 0:4] = np.array([0.002, 0.002], dtype=np.float16).view(np.uint8)
    else:  # 128 + 64 bytes of 6-bit weights, 16 int8 scales, then d
        blocks[..., 208:210] = np.array([0.0005], dtype=np.float16).view(np.uint8)
    return blocks.reshape(shape[0], -1)


@pytest.mark.parametrize("dtype", ["bf16", "q8_0"])
def test_dtype_requantizes_at_load(dtype: str, hf_dir: Path, tmp_path: Path, float_path) -> None:
    path = _file(hf_dir, Q.Q4_1, tmp_path)
    native, _ = load_gguf(path, keep_quantized=True)
    qw = served_weights(native, dtype)
    assert {w.qtype for w in qw.values()} == {dtype}
    assert _greedy(native, batched=True, dtype=dtype) == _greedy(_dequantized_copy(native, qw), batched=True)


@pytest.mark.slow
def test_export_reads_back_identically_and_the_cli_uses_the_file_precision(hf_dir: Path, tmp_path: Path) -> None:
    src = _file(hf_dir, Q.Q4_1, tmp_path)
    out = tmp_path / "t-llama.Q8_0.gguf"
    r = wsc("export", "--model", str(src), "--format", "gguf", "--dtype", "q8_0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    exported, meta = load_gguf(out, keep_quantized=True)
    source, src_meta = load_gguf(src, keep_quantized=True)
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert {k: v for k, v in meta.items() if k not in ("path", "general.file_type")} == {
        k: v for k, v in src_meta.items() if k not in ("path", "general.file_type")}  # tokenizer included
    back, made = served_weights(exported), served_weights(source, "q8_0")
    assert back.keys() == made.keys()
    assert all(back[n].qtype == "q8_0" and torch.equal(back[n].data, made[n].data) for n in made)
    # the command line runs the file's own precision by default: the tokens of the engine on the native model
    from waferscale.data import load_tokenizer

    tok = load_tokenizer(str(src))
    with LLM(source, tok, max_model_len=32) as llm:
        expected = llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=6))[0].text
    r = wsc("generate", "--model", str(src), "--prompt", "the cat", "--max_new_tokens", "6", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == "the cat" + expected


def _one_error_line(r, *needles: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert all(n in lines[0] for n in needles), lines[0]


@pytest.mark.slow
def test_bad_input_is_one_error_line(hf_dir: Path, tmp_path: Path) -> None:
    q5 = _file(hf_dir, Q.Q5_0, tmp_path)  # a type the kernels do not run: named, the supported ones listed
    with pytest.raises(ConfigError, match="Q5_0"):
        served_weights(load_gguf(q5, keep_quantized=True)[0])
    _one_error_line(wsc("generate", "--model", str(q5), "--prompt", "x"), "Q5_0", *QTYPES.values(), "--dtype")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(_file(hf_dir, Q.Q8_0, tmp_path).read_bytes()[:-100_000])
    _one_error_line(wsc("export", "--model", str(truncated), "--format", "gguf", "--out", str(tmp_path / "o.gguf")),
                    "truncated.gguf")
    assert not (tmp_path / "o.gguf").exists()


def test_a_dtype_that_cannot_hold_the_matrices_is_refused() -> None:
    from waferscale.models import build

    odd = build(CFG.replace(d_model=48, d_ff=96), device="cpu")  # 48 inputs: no whole 32-weight blocks
    with pytest.raises(ConfigError, match="--dtype q4_0 cannot hold .*a multiple of 32 is needed"):
        served_weights(odd, "q4_0")
    with pytest.raises(ConfigError, match="--dtype 'q5_k' is not one of"):
        served_weights(odd, "q5_k")


def _perplexity(model, ids: list[int], **runner_kw) -> float:
    """Perplexity of `ids` under `model` run by the serving runner: one prefill chunk, every row's logits."""
    from waferscale.serve.model_runner import BatchSpec, ModelRunner

    bs = 16
    blocks = -(-len(ids) // bs)
    runner = ModelRunner(model, 0, model.config.n_layer, num_blocks=blocks, block_size=bs, has_embed=True,
                         has_head=True, **runner_kw)
    n = len(ids) - 1
    logits = runner.run(BatchSpec(ids[:-1], [(0, n, list(range(blocks)), n)]))
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).exp())


@pytest.mark.assets
def test_int8_activations_move_smollm2_perplexity_by_under_one_percent() -> None:
    from waferscale.data.corpus import held_out_shakespeare_passage
    from waferscale.data import load_tokenizer
    from waferscale.models.pretrained import load_pretrained

    name = "smollm2-135m-instruct"
    ids = load_tokenizer(name).encode(held_out_shakespeare_passage(2000))
    native = load_pretrained(name, keep_quantized=True)
    assert quant.set_int8_activations() or not quant.kernels.available()  # the default: int8 activations
    ppl = _perplexity(native, ids, qweights=served_weights(native))
    dense = _perplexity(load_pretrained(name), ids)
    assert abs(ppl / dense - 1) < 0.01, (ppl, dense)


@pytest.mark.slow
def test_kv_cache_dtype(hf_dir: Path, tmp_path: Path) -> None:
    """auto: a float16 cache for matrices narrower than float32 (llama.cpp's default), the weights' float32
    otherwise, a GGUF's F32 tensors included; fp32 / fp16 as named. A float16 cache gives the same greedy tokens batched as one sequence at a
    time (the C kernels' decode, single and batched, and the prefill's SDPA read the same rounded values), and
    on this model the same as a float32 cache."""
    from waferscale.serve.kv import kv_cache_dtype

    native, _ = load_gguf(_file(hf_dir, Q.Q4_1, tmp_path), keep_quantized=True)
    f32, _ = load_gguf(_file(hf_dir, Q.F32, tmp_path), keep_quantized=True)
    for model, choice, want in ((native, "auto", torch.float16), (native, "fp32", torch.float32),
                                (f32, "auto", torch.float32), (_model(), "auto", torch.float32),
                                (_model(), "fp16", torch.float16)):
        with LLM(model, _Tok(), max_model_len=32, kv_cache_dtype=choice) as llm:
            assert llm.engine.kv_dtype == want and llm.engine._runner.kv.kv.dtype == want, choice
            assert llm.engine.stats()["kv_cache_dtype"] == str(want).removeprefix("torch.")  # (/health shows it)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp32, fp16, got 'fp8'"):
        kv_cache_dtype("fp8", torch.float32, False)
    half = _greedy(native, batched=False, kv_cache_dtype="fp16")
    assert _greedy(native, batched=True, kv_cache_dtype="fp16") == half
    assert _greedy(native, batched=True, kv_cache_dtype="fp16", stages=2) == half
    assert _greedy(native, batched=True) == half  # (float32 cache)


@pytest.mark.slow
def test_kv_cache_dtype_flag(hf_dir: Path, tmp_path: Path) -> None:
    src = _file(hf_dir, Q.Q4_1, tmp_path)
    from waferscale.data import load_tokenizer

    native, _ = load_gguf(src, keep_quantized=True)
    with LLM(native, load_tokenizer(str(src)), max_model_len=32, kv_cache_dtype="fp32") as llm:
        expected = llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=6))[0].text
    r = wsc("generate", "--model", str(src), "--prompt", "the cat", "--max_new_tokens", "6", "--temperature", "0",
            "--kv-cache-dtype", "fp32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == "the cat" + expected
    r = wsc("generate", "--model", str(src), "--prompt", "x", "--kv-cache-dtype", "fp8")
    assert r.returncode == 2 and "--kv-cache-dtype" in r.stderr and "'fp8'" in r.stderr, r.stderr


@pytest.mark.assets
def test_float16_kv_cache_moves_smollm2_perplexity_by_under_a_tenth_of_a_percent() -> None:
    """What a float16 KV cache (auto's choice for a GGUF, as llama.cpp's) costs: the real SmolLM2 Q4_1 file's
    perplexity on the held-out Shakespeare passage, its KV in float16 against float32 (measured: +0.016 %). Its
    greedy text can still part where the top two logits nearly tie (of 16 chat prompts' 128-token answers, one
    parted at its first token, whose top logits were 0.003 apart)."""
    from waferscale.data.corpus import held_out_shakespeare_passage
    from waferscale.data import load_tokenizer
    from waferscale.models.pretrained import load_pretrained

    name = "smollm2-135m-instruct"
    ids = load_tokenizer(name).encode(held_out_shakespeare_passage(2000))
    native = load_pretrained(name, keep_quantized=True)
    qw = served_weights(native)
    full = _perplexity(native, ids, qweights=qw, kv_dtype=torch.float32)
    half = _perplexity(native, ids, qweights=qw, kv_dtype=torch.float16)
    assert half != full and abs(half / full - 1) < 0.001, (half, full)
