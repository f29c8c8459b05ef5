"""The C decode kernels (serve/kernels.py) against torch, and the runner's single-stream C path against the
plain forward and `generate`: same logits within float tolerance, same greedy tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from generate_reference import generate
from waferscale.models import from_name
from waferscale.models.layers import rope_cos_sin
from waferscale.serve import kernels
from waferscale.serve.model_runner import BatchSpec, ModelRunner
from waferscale.serve.engine import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"C kernels: {kernels.unavailable_reason()}")


@pytest.fixture(autouse=True)
def _one_thread_after():
    yield
    kernels.set_threads(1)


@pytest.mark.parametrize("rows,out,n", [(1, 5, 37), (1, 960, 576), (3, 130, 64), (4, 3000, 48), (5, 131, 37),
                                        (7, 6, 15), (16, 1000, 576), (18, 577, 1536), (32, 77, 300), (33, 50, 20),
                                        (100, 300, 64), (300, 1000, 576)])
def test_linear_bias_residual_and_threads(rows: int, out: int, n: int) -> None:
    torch.manual_seed(0)
    x, w, b, r = torch.randn(rows, n), torch.randn(out, n), torch.randn(out), torch.randn(rows, out)
    tol = 1e-5 if n < 100 else 2e-4  # float32 sums of hundreds of products, in different orders
    wp = kernels.pack(w)
    torch.testing.assert_close(kernels.linear(x, wp, out), F.linear(x, w), rtol=1e-5, atol=tol)
    torch.testing.assert_close(kernels.linear(x, wp, out, b, r), r + F.linear(x, w, b), rtol=1e-5, atol=tol)
    kernels.set_threads(1)
    one = [kernels.linear(x, wp, out, b, r) for _ in range(3)]
    assert kernels.set_threads(2) == 2
    two = [kernels.linear(x, wp, out, b, r) for _ in range(20)]  # shared or not, whichever it picks: same bits
    assert all(torch.equal(t, one[0]) for t in one + two)
    # batch invariance: each row alone gives the same bits as in the batch
    assert all(torch.equal(kernels.linear(x[i:i + 1], wp, out, b, r[i:i + 1])[0], one[0][i]) for i in range(rows))


def test_norm_swiglu_argmax() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(3, 576) * 4, torch.randn(576)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-5)
    gu = torch.randn(2, 2 * 1539) * 8
    torch.testing.assert_close(kernels.silu_mul(gu, 1539), F.silu(gu[:, :1539]) * gu[:, 1539:], rtol=1e-5,
                               atol=1e-5)
    for n in (1, 7, 16, 33, 49152):
        v = torch.randn(n)
        v[n // 2] = v[n // 3] = v.max() + 1  # a tie: the first one wins
        assert kernels.argmax(v) == int(v.argmax())
    v = torch.randn(100)
    v[[40, 70]] = float("nan")
    assert kernels.argmax(v) == 40
    assert kernels.argmax(torch.full((50,), -float("inf"))) == 0


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("S", [1, 17, 100])
def test_decode_attention_matches_sdpa(S: int, threads: int, kv_dtype: torch.dtype) -> None:
    """rope in place, k/v written to the last slot, GQA attention over the contiguous slots (at 2 threads and
    100 positions the query heads are shared out among the threads). A float16 cache gets the new k and v
    rounded to nearest, as torch rounds them, and attention reads its values widened."""
    torch.manual_seed(0)
    kernels.set_threads(threads)
    nh, nkv, hd, slot0 = 6, 2, 32, 40
    cache = torch.randn(2 * nkv, 256, hd).to(kv_dtype)
    qkv = torch.randn(1, (nh + 2 * nkv) * hd)
    cos, sin = rope_cos_sin(1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd), S - 1, 1)
    sin_signed = sin[0] * torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])
    x = qkv[0].view(nh + 2 * nkv, hd).clone()  # reference: HF rotate_half layout
    rot = x[:nh + nkv]
    x[:nh + nkv] = rot * cos[0] + torch.cat([-rot[:, hd // 2:], rot[:, :hd // 2]], -1) * sin[0]
    want_cache = cache.clone()
    want_cache[:, slot0 + S - 1] = x[nh:].to(kv_dtype)
    kv = want_cache[:, slot0:slot0 + S].unsqueeze(0).float()
    want = F.scaled_dot_product_attention(x[:nh].view(1, nh, 1, hd), kv[:, :nkv], kv[:, nkv:], enable_gqa=True)
    got = kernels.decode_attention(qkv, cos[0].contiguous(), sin_signed.contiguous(), cache, slot0, S, nh, nkv)
    torch.testing.assert_close(got, want.reshape(1, nh * hd), rtol=1e-5, atol=1e-5)
    tol = 0 if kv_dtype == torch.float16 else 1e-5  # (float16: the same rounding, so the same bits)
    torch.testing.assert_close(cache, want_cache, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_batch_over_block_tables(threads: int, kv_dtype: torch.dtype) -> None:
    """Several sequences over a paged cache (scattered, out-of-order blocks): each row equals SDPA over its
    gathered slots, and equals the single-sequence kernel bit for bit (batch invariance); a float16 cache
    as in test_decode_attention_matches_sdpa."""
    torch.manual_seed(1)
    kernels.set_threads(threads)
    nh, nkv, hd, bs, T = 6, 2, 32, 4, 64
    cos_t, sin_t = rope_cos_sin(1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd), 0, T)
    sin_s = sin_t * torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])
    cache = torch.randn(2 * nkv, 40 * bs, hd).to(kv_dtype)
    lens = [1, 9, 23, 4, 16, 45]  # each token sits at position len - 1 (45: alone, its heads are shared out)
    perm = torch.randperm(40).tolist()
    tables, k = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[k:k + nb])
        k += nb
    N = len(lens) + 2  # two rows that are not decode rows (left alone)
    rows = torch.tensor([0, 2, 3, 5, 6, 7])
    qkv = torch.randn(N, (nh + 2 * nkv) * hd)
    width = max(len(t) for t in tables)
    tab = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    pos = torch.tensor([n - 1 for n in lens])
    want_cache, qkv0 = cache.clone(), qkv.clone()
    y = torch.full((N, nh * hd), 7.0)
    kernels.decode_attention_batch(qkv, rows, pos, cos_t, sin_s, cache, tab, bs, nh, nkv, y)
    for i, (r, n, t) in enumerate(zip(rows.tolist(), lens, tables)):
        x = qkv0[r].view(nh + 2 * nkv, hd).clone()
        rot = x[:nh + nkv]
        x[:nh + nkv] = rot * cos_t[n - 1] + torch.cat([-rot[:, hd // 2:], rot[:, :hd // 2]], -1) * sin_t[n - 1]
        slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(n)])
        want_cache[:, slots[-1]] = x[nh:].to(kv_dtype)
        kv = want_cache[:, slots].unsqueeze(0).float()
        want = F.scaled_dot_product_attention(x[:nh].view(1, nh, 1, hd), kv[:, :nkv], kv[:, nkv:], enable_gqa=True)
        torch.testing.assert_close(y[r], want.reshape(nh * hd), rtol=1e-5, atol=1e-5)
        # the same sequence alone, its blocks copied to consecutive slots: the same bits
        c1 = want_cache[:, slots].clone()
        one = kernels.decode_attention(qkv0[r:r + 1].clone(), cos_t[n - 1].contiguous(), sin_s[n - 1].contiguous(),
                                       c1, 0, n, nh, nkv)
        assert torch.equal(one[0], y[r])
    tol = 0 if kv_dtype == torch.float16 else 1e-5
    torch.testing.assert_close(cache, want_cache, rtol=tol, atol=tol)
    assert torch.equal(y[[1, 4]], torch.full((2, nh * hd), 7.0))  # other rows untouched


@pytest.fixture(scope="module")
def llama16() -> torch.nn.Module:
    """A tiny Llama whose head_dim (16) takes the C attention path."""
    torch.manual_seed(0)
    return from_name("llama-tiny", d_model=64, d_ff=160, max_seq_len=128, attn_bias=True).eval()


def test_runner_single_stream_c_path_matches_the_model(llama16) -> None:
    seq = list(range(30, 60))
    want = llama16(torch.tensor([seq]))[0]  # (T, V)
    r = ModelRunner(llama16, 0, 2, num_blocks=16, block_size=4, has_embed=True, has_head=True, fast_linear=True)
    assert r.c_kernels and r.c_attention
    table = [3, 4, 5, 6, 7, 8, 9, 10]  # consecutive: decode attends to a view of the cache
    got = [r.run(BatchSpec(seq[:12], [(0, 12, table, True)]))[0]]
    for p in range(12, 30):
        got.append(r.run(BatchSpec([seq[p]], [(p, 1, table, True)]))[0])
    torch.testing.assert_close(torch.stack(got), want[11:], rtol=1e-4, atol=1e-4)


def test_engine_greedy_with_c_kernels_matches_generate(llama16) -> None:
    class Tok:
        vocab_size, eos_id = 256, None

        def decode(self, ids: list[int]) -> str:
            return "".join(chr(65 + i % 26) for i in ids)

    prompts = [[1, 2, 3, 4, 5], list(range(20, 45)), [9]]
    ref = [list(generate(llama16, p, 40, temperature=0)) for p in prompts]
    for threads in (1, 2):
        e = Engine(llama16, Tok(), block_size=4, num_blocks=64, fast_linear=True, decode_threads=threads)
        assert e.c_kernels
        alone = [e.generate([p], SamplingParams(temperature=0, max_tokens=40))[0] for p in prompts]
        together = e.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
        assert alone == ref and together == ref


def test_engine_mixed_steps_all_paths_match_generate(llama16) -> None:
    """A long prompt (a chunk of PREFILL_MIN_ROWS tokens or more, serve/csrc/attention.c: attended in blocks in
    the one-call C stack, beside the decode rows) arriving while short ones decode, and short prompts arriving
    mid-decode (prefill rows attending one by one): the same greedy tokens as the plain forward, and every
    block back at the end."""

    class Tok:
        vocab_size, eos_id = 256, None

        def decode(self, ids: list[int]) -> str:
            return "".join(chr(65 + i % 26) for i in ids)

    short = [[1, 2, 3], list(range(30, 50))]
    long = [(7 * i) % 250 + 1 for i in range(94)]
    late = [[5, 6], [8, 9, 10, 11]]
    n = 24
    ref = {tuple(p): list(generate(llama16, p, n, temperature=0)) for p in short + [long] + late}
    e = Engine(llama16, Tok(), block_size=4, num_blocks=128, fast_linear=True, decode_threads=2)
    sp = SamplingParams(temperature=0, max_tokens=n)
    got: dict[str, list[int]] = {}
    for i, p in enumerate(short):
        e.add_request(f"s{i}", p, sp)
    for k in range(60):
        if k == 3:
            e.add_request("long", long, sp)
        if k == 6:
            for i, p in enumerate(late):
                e.add_request(f"l{i}", p, sp)
        for o in e.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if k > 6 and not e.has_unfinished():
            break
    assert got["long"] == ref[tuple(long)]
    for i, p in enumerate(short):
        assert got[f"s{i}"] == ref[tuple(p)]
    for i, p in enumerate(late):
        assert got[f"l{i}"] == ref[tuple(p)]
    assert e.stats()["kv_blocks_used"] == 0


def test_decoding_gives_the_same_bits_alone_or_batched(llama16) -> None:
    """Batch invariance: a sequence's logprobs (every decode step) are the same floats alone and among other
    sequences of other lengths (C projections: one FMA chain per output whatever the rows; attention: the same
    code for one sequence or many)."""

    class Tok:
        vocab_size, eos_id = 256, None

        def decode(self, ids: list[int]) -> str:
            return "".join(chr(65 + i % 26) for i in ids)

        def id_to_token(self, i: int) -> str:
            return chr(65 + i % 26)

    e = Engine(llama16, Tok(), block_size=4, num_blocks=128, fast_linear=True, decode_threads=2)
    sp = SamplingParams(temperature=0, max_tokens=20, logprobs=True, top_logprobs=3)

    def run(prompts: list[list[int]]) -> list[list[float]]:
        ids = [f"q{i}-{len(prompts)}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            e.add_request(rid, p, sp)
        lps: dict[str, list[float]] = {rid: [] for rid in ids}
        while e.has_unfinished():
            for o in e.step():
                for ent in o.logprobs or []:
                    lps[o.request_id] += [ent["logprob"]] + [t["logprob"] for t in ent["top_logprobs"]]
        return [lps[r] for r in ids]

    a = [3, 1, 4, 1, 5, 9, 2, 6]
    alone = run([a])[0]
    together = run([list(range(40, 70)), a, [7, 7], list(range(10, 21))])[1]
    assert len(alone) == 20 * 4 and alone == together
