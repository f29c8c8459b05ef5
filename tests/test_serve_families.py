"""Serving the decoder families: GPT-J (interleaved partial rotary, one norm for parallel attention + MLP, a head
bias), GPT-NeoX (partial rotary, parallel blocks with two norms), Falcon (multi-query and grouped attention,
parallel blocks), MPT (ALiBi, bias-free LayerNorm), Mistral (sliding-window attention in the paged cache, its
blocks outside the window freed) and Mixtral (routed experts).

Each is a tiny random transformers model, saved and loaded through our Hugging Face loader, then served: greedy
tokens equal transformers' generate(do_sample=False), one request at a time and several in flight, through the
torch path and the C kernels; one model through the real HTTP server with the openai client."""

from __future__ import annotations

import math

import pytest
import torch

from serve_helpers import have_smollm2, run_server
from waferscale.data.tokenizer import CharTokenizer
from waferscale.models import hf
from waferscale.models.config import ModelConfig
from waferscale.serve import kernels
from waferscale.serve.engine import Engine, SamplingParams
from waferscale.serve.model_runner import check_servable

transformers = pytest.importorskip("transformers")

VOCAB = 97


def _cfg(family: str, **kw) -> ModelConfig:
    # head_dim 16: the C decode attention's (hd % 16 == 0) runs too
    base = dict(name=f"serve-{family}", family=family, vocab_size=VOCAB, n_layer=2, n_head=4, d_model=64,
                max_seq_len=128)
    return ModelConfig(**{**base, **kw})


FAMILIES = {
    "gptj": _cfg("gptj", activation="gelu_tanh", position="rotary", rotary_dim=8, rotary_interleaved=True,
                 block="parallel_shared_norm", tie_embeddings=False, attn_bias=False, lm_head_bias=True),
    "gpt_neox": _cfg("gpt_neox", activation="gelu", position="rotary", rotary_dim=4, d_ff=128, block="parallel",
                     tie_embeddings=False),
    "falcon-mqa": _cfg("falcon", activation="gelu", position="rotary", d_ff=128, attn_bias=False, mlp_bias=False,
                       n_kv_head=1, block="parallel_shared_norm"),
    "falcon-gqa": _cfg("falcon", activation="gelu", position="rotary", d_ff=128, attn_bias=False, mlp_bias=False,
                       n_kv_head=2, block="parallel"),
    # 6 heads: ALiBi's slopes for a head count that is not a power of two
    "mpt": _cfg("mpt", n_head=6, d_model=96, d_ff=384, activation="gelu", position="alibi", norm_bias=False,
                attn_bias=False, mlp_bias=False),
    # a window of 8 positions, far shorter than the generations
    "mistral": _cfg("mistral", n_kv_head=2, d_ff=96, norm="rmsnorm", activation="swiglu", position="rotary",
                    sliding_window=8, tie_embeddings=False, attn_bias=False, mlp_bias=False),
    "mixtral": _cfg("mixtral", n_kv_head=2, d_ff=48, norm="rmsnorm", activation="swiglu", position="rotary",
                    tie_embeddings=False, attn_bias=False, mlp_bias=False, n_experts=4, experts_per_token=2),
}
PROMPTS = [[5, 17, 3, 88, 41], list(range(30, 47)), [9], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
NEW = 24
PATHS = ["torch", "c"]


@pytest.fixture(scope="module")
def tok() -> CharTokenizer:
    return CharTokenizer([chr(0x100 + i) for i in range(VOCAB)])  # every model id is a token: no vocab limit


_MODELS: dict[str, tuple] = {}


def _models(key: str, tmp_path_factory) -> tuple:
    """(transformers model, ours loaded from its saved directory through models.hf), built once per module."""
    if key not in _MODELS:
        cfg = FAMILIES[key]
        torch.manual_seed(0)
        theirs = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**hf.config_to_hf(cfg))).float().eval()
        with torch.no_grad():
            for name, p in theirs.named_parameters():
                is_norm = p.ndim == 1 and any(s in name for s in ("ln", "norm")) and name.endswith("weight")
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if is_norm else 0.0))
        theirs.generation_config.eos_token_id = None  # greedy to the end, as ignore_eos
        theirs.generation_config.pad_token_id = 0
        d = tmp_path_factory.mktemp(key)
        theirs.save_pretrained(d)
        ours = hf.load_hf_dir(d)
        assert ours.config == cfg
        _MODELS[key] = theirs, ours
    return _MODELS[key]


def _reference(theirs, prompts: list[list[int]], new: int) -> list[list[int]]:
    with torch.no_grad():
        return [theirs.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new, min_new_tokens=new)[0, len(p):]
                .tolist() for p in prompts]


def _engine(model, tok, path: str, **kw) -> Engine:
    if path == "c" and not kernels.available():
        pytest.skip(f"the C kernels cannot build here: {kernels.unavailable_reason()}")
    kw = {"block_size": 4, "num_blocks": 96, "max_num_batched_tokens": 16, "fast_linear": path == "c", **kw}
    return Engine(model, tok, **kw)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("key", sorted(FAMILIES))
def test_greedy_equals_transformers(key: str, path: str, tok, tmp_path_factory) -> None:
    """One request at a time, then all at once (continuous batching, chunked prefill): transformers' tokens."""
    theirs, ours = _models(key, tmp_path_factory)
    want = _reference(theirs, PROMPTS, NEW)
    e = _engine(ours, tok, path)
    assert e.c_kernels == (path == "c")
    alone = [e.generate([p], GREEDY)[0] for p in PROMPTS]
    together = e.generate(PROMPTS, GREEDY)
    assert alone == want, key
    assert together == want, key
    assert e.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("path", PATHS)
def test_sliding_window_frees_blocks_outside_it(path: str, tok, tmp_path_factory) -> None:
    """A 100-token generation with a window of 8 over blocks of 4: each sequence holds at most
    ceil(8 / 4) + 1 blocks once decoding (its prompt chunk at most a chunk more), its tokens still transformers';
    three such sequences together run in a pool too small to hold their full caches."""
    theirs, ours = _models("mistral", tmp_path_factory)
    window, bs, new = ours.config.sliding_window, 4, 100
    prompts = [PROMPTS[0], PROMPTS[3], [7, 8]]
    want = _reference(theirs, prompts, new)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    e = _engine(ours, tok, path, block_size=bs)
    e.add_request("long", prompts[0], params)
    alloc = e._schedulers[0].allocator
    held, got = [], []
    while e.has_unfinished():
        for o in e.step():
            got += o.new_token_ids
        if "long" in alloc.tables:
            held.append(alloc.held("long"))
    assert got == want[0]
    assert max(held[1:]) <= math.ceil(window / bs) + 1 < math.ceil((len(prompts[0]) + new) / bs)
    # a pool of 8 blocks (32 positions) serves the 105-position request: its window and a chunk fit
    assert _engine(ours, tok, path, block_size=bs, num_blocks=8).generate([prompts[0]], params) == [want[0]]
    full = math.ceil((max(map(len, prompts)) + new) / bs)  # blocks one full cache would take
    e = _engine(ours, tok, path, block_size=bs, num_blocks=2 * full)
    assert e.generate(prompts, params) == want
    assert e.stats()["num_preemptions"] == 0 and e.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("key", ["mistral", "mixtral"])
@pytest.mark.slow
def test_pipelined_stages(key: str, path: str, tok, tmp_path_factory) -> None:
    """Two stage processes, each over its layers and its own KV (the window's blocks freed per stage group)."""
    theirs, ours = _models(key, tmp_path_factory)
    with _engine(ours, tok, path, stages=2) as e:
        assert e.generate(PROMPTS, GREEDY) == _reference(theirs, PROMPTS, NEW)


@pytest.mark.parametrize("path", PATHS)
def test_moe_decode_reads_only_the_routed_experts(path: str, tok, tmp_path_factory, capsys) -> None:
    """Single-stream decode of Mixtral reads, per token, every matrix but the experts plus the 2 routed experts
    of 4 in each layer: the active parameters' matrices (in the C kernels' panels, whose outputs are padded to
    16), half the experts' bytes fewer than all."""
    _, ours = _models("mixtral", tmp_path_factory)
    cfg = ours.config
    e = _engine(ours, tok, path)
    assert (e._runner.stack is not None) == (path == "c")  # one C call for every layer, experts included
    e.generate([PROMPTS[1]], GREEDY)
    st = e.stats()
    assert (f"2 of 4 experts per token: {st['active_weight_bytes'] / 1e6:.1f} MB of weights read per decode token "
            f"of one sequence, of {st['total_weight_bytes'] / 1e6:.1f} MB") in capsys.readouterr().err
    expert = 4 * 3 * cfg.d_model * cfg.ffn_dim  # float32 bytes of one SwiGLU expert
    assert st["total_weight_bytes"] - st["active_weight_bytes"] == cfg.n_layer * 2 * expert
    assert st["decode_weight_bytes_per_token"] == st["active_weight_bytes"]
    # the matrices one token multiplies with: the active parameters less the embeddings and norms
    matrices = cfg.num_active_params - cfg.vocab_size * cfg.d_model - (2 * cfg.n_layer + 1) * cfg.d_model
    pad = 0 if path == "torch" else cfg.n_layer * (16 - cfg.n_experts) * cfg.d_model + (-VOCAB % 16) * cfg.d_model
    assert st["active_weight_bytes"] == 4 * (matrices + pad)
    # a batch reads each chosen expert once for all its rows: fewer bytes per token than one at a time
    e.generate(PROMPTS, GREEDY)
    assert e.stats()["decode_weight_bytes_per_token"] < st["active_weight_bytes"]


def test_c_stack_runs_the_window_and_alibi_decode(tok, tmp_path_factory) -> None:
    """Mistral's single-stream decode goes through the one-call C layer stack (with its window), and the C
    attention kernels take ALiBi (MPT) and the window directly: equal to the torch path's attention."""
    _, ours = _models("mistral", tmp_path_factory)
    e = _engine(ours, tok, "c")
    assert e._runner.stack is not None
    torch.manual_seed(0)
    nh, nkv, hd, S, slots = 6, 2, 16, 37, 64
    cache = torch.randn(2 * nkv, slots, hd)
    slopes = torch.rand(nh) * 0.5
    for threads, window, alibi in [(t, w, a) for t in (1, 2) for w, a in [(8, False), (0, True), (5, True)]]:
        kernels.set_threads(threads)  # (2 threads, 37 positions: the query heads are shared out)
        qkv = torch.randn(1, (nh + 2 * nkv) * hd)
        c = cache.clone()
        got = kernels.decode_attention(qkv.clone(), None, None, c, 3, S, nh, nkv, window,
                                       slopes if alibi else None)
        lo = max(0, S - window) if window else 0
        q = qkv[0, :nh * hd].view(1, nh, 1, hd)
        k, v = c[:nkv, 3 + lo:3 + S], c[nkv:, 3 + lo:3 + S]
        bias = slopes[:, None, None] * torch.arange(lo - S + 1, 1).float() if alibi else None
        want = torch.nn.functional.scaled_dot_product_attention(q, k[None], v[None], attn_mask=bias,
                                                                enable_gqa=True).reshape(1, nh * hd)
        assert (got - want).abs().max() < 1e-5, (threads, window, alibi)


def test_still_unsupported_is_refused_by_name() -> None:
    from waferscale.errors import ConfigError
    from waferscale.models.registry import config_from_name

    with pytest.raises(ConfigError, match="no encoder"):
        check_servable(config_from_name("bert-tiny"))


@pytest.mark.skipif(not have_smollm2(), reason="needs the SmolLM2 tokenizer (make setup)")
@pytest.mark.slow
def test_http_server_serves_a_mixture_of_experts(tmp_path) -> None:
    """`wsc serve` on a Mixtral directory (SmolLM2's tokenizer): the openai client's greedy completion of a
    token-id prompt is transformers' generation, and /health and /metrics report the decode's weight bytes per
    token."""
    openai = pytest.importorskip("openai")
    from waferscale.data import load_tokenizer

    cfg = FAMILIES["mixtral"].replace(name="serve-moe", vocab_size=49152)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**hf.config_to_hf(cfg))).float().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.2)
    theirs.generation_config.eos_token_id = None
    theirs.generation_config.pad_token_id = 0
    d = tmp_path / "serve-moe"
    tok = load_tokenizer("smollm2-135m-instruct")
    theirs.save_pretrained(tmp_path / "hf")
    hf.save_hf_dir(hf.load_hf_dir(tmp_path / "hf"), d, tokenizer=tok)  # (with the tokenizer's files)
    prompt = [504, 3458, 282, 4649, 314]
    want = _reference(theirs, [prompt], 12)[0]
    with run_server(d, tmp_path) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.completions.create(model="serve-moe", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 12
        assert r.choices[0].text == tok.decode(want)
        engine = srv.get("/health")[1]["engine"]
        metrics = dict(line.rsplit(" ", 1) for line in srv.get("/metrics")[1].splitlines()
                       if line.startswith("wsc_") and "{" not in line)
    assert 0 < engine["decode_weight_bytes_per_token"] < engine["total_weight_bytes"]
    assert int(metrics["wsc_decode_tokens_total"]) == engine["decode_tokens"] > 0
    assert float(metrics["wsc_decode_weight_bytes_total"]) / engine["decode_tokens"] == pytest.approx(
        float(metrics["wsc_decode_weight_bytes_per_token"]))
    assert float(metrics["wsc_active_weight_bytes"]) < float(metrics["wsc_total_weight_bytes"])


def test_moe_decodes_to_the_same_bits_alone_and_batched(tok, tmp_path_factory) -> None:
    """On the C kernels a lone Mixtral sequence decodes through the one-call layer stack and a batch through the
    per-layer path; both route in C and sum the experts in the same order, so the log-probabilities agree
    exactly. (Every prompt is prefilled whole in one step, alone and together: a prompt chunked differently
    would have some positions rotated by torch and others by C, which round differently; so no prefix caching,
    which would find the prompts of the second pass cached and prefill only their last tokens.)"""
    _, ours = _models("mixtral", tmp_path_factory)
    e = _engine(ours, tok, "c", max_num_batched_tokens=64, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)

    def logprobs(prompts: list[list[int]]) -> list[list[float]]:
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, params)
        out: dict[str, list[float]] = {f"r{i}": [] for i in range(len(prompts))}
        while e.has_unfinished():
            for o in e.step():
                out[o.request_id] += [entry["logprob"] for entry in o.logprobs or []]
        return list(out.values())

    alone = [logprobs([p])[0] for p in PROMPTS]
    assert logprobs(PROMPTS) == alone
