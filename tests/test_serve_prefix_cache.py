"""Automatic prefix caching (serve/kv.py, scheduler.py): the allocator's sharing, reference counts and LRU
eviction by hand; through the engine on a tiny random Llama, the same tokens with caching on and off (greedy
and seeded sampling, the C kernels and the torch path, a request joining one that still runs, a conversation's
history, eviction and preemption in a small pool, two pipeline stages)."""

from __future__ import annotations

import dataclasses
import random
import string

import pytest
import torch

from waferscale.data.tokenizer import CharTokenizer
from waferscale.models import ModelConfig, build
from waferscale.serve.engine import Engine, SamplingParams
from waferscale.serve.kv import BlockAllocator, block_hash
from waferscale.serve.scheduler import Scheduler, SchedulerOutput, Sequence

BS = 4  # positions per KV block in these tests


def chain(blocks: list[list[int]]) -> list[bytes]:
    hs: list[bytes] = []
    for toks in blocks:
        hs.append(block_hash(hs[-1] if hs else None, toks))
    return hs


def test_allocator_shares_counts_references_and_evicts_only_free_blocks_lru_tail_first() -> None:
    a = BlockAllocator(6, 2, prefix_caching=True)
    hs = chain([[1, 2], [3, 4], [5, 6]])
    assert chain([[1, 2], [3, 5]])[0] == hs[0] and chain([[1, 2], [3, 5]])[1] != hs[1]
    assert chain([[9, 2], [3, 4]])[1] != hs[1]  # the same tokens after another prefix: another block
    t = a.allocate("x", 6)
    for b, h in zip(t, hs):
        a.cache(b, h)
    assert a.lookup(hs) == t and a.lookup([hs[0], chain([[1, 2], [0, 0]])[1], hs[2]]) == t[:1]
    assert a.can_allocate("y", 6, t[:2]) and not a.can_allocate("y", 16, t[:2])
    a.share("y", t[:2])
    assert a.num_used == 3  # a shared block counts once
    a.free("x")  # t[0], t[1] stay in use by y; t[2] is free and still cached
    assert (a.num_used, a.num_free, a.num_cached) == (2, 4, 3)
    z = a.allocate("z", 6)  # never-cached free blocks go first: nothing is evicted
    assert t[2] not in z and a.lookup(hs) == t
    a.free("z")
    a.allocate("w", 8)  # the 3 uncached free blocks and, under pressure, the one free cached block
    assert a.lookup(hs) == t[:2] and a.num_free == 0
    with pytest.raises(RuntimeError, match="KV cache full"):
        a.allocate("v", 2)  # the blocks y holds are never evicted
    a.free("w")
    a.free("y")  # y's tail block enters the LRU order first: it goes first
    assert a.num_used == 0
    a.allocate("u", 10)  # 4 uncached + 1 evicted
    assert a.lookup(hs) == t[:1]


def executed(s: Scheduler, out: SchedulerOutput) -> None:
    """What the engine tells the scheduler after a step ran (the sampled tokens aside)."""
    s.cache_computed(out)
    s.update(out)


def test_admission_reuses_cached_blocks_but_always_computes_the_last_token() -> None:
    s = Scheduler(BlockAllocator(32, BS, prefix_caching=True), max_num_batched_tokens=64)
    first = Sequence("a", list(range(1, 13)), max_tokens=1)  # 12 tokens: 3 full blocks
    s.add(first)
    executed(s, s.schedule())
    s.finish(first)
    for rid, prompt, start in (("b", list(range(1, 13)), 8), ("c", list(range(1, 14)), 12),
                               ("d", list(range(1, 10)) + [99, 98], 8), ("e", [5] + list(range(2, 13)), 0)):
        seq = Sequence(rid, prompt, max_tokens=1)
        s.add(seq)
        out = s.schedule()
        (chunk,) = out.chunks
        assert (chunk.start, chunk.num_tokens, chunk.sample) == (start, len(prompt) - start, True), rid
        assert seq.num_cached_tokens == start
        executed(s, out)
        s.finish(seq)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (12 + 12 + 13 + 11 + 12, 8 + 12 + 8)
    assert s.allocator.num_used == 0


# ---- through the engine ---------------------------------------------------------------------------------------
CFG = ModelConfig(name="prefix-tiny", family="llama", vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                  d_ff=128, max_seq_len=256, norm="rmsnorm", activation="swiglu", position="rotary", attn_bias=False,
                  mlp_bias=False, tie_embeddings=False)


@pytest.fixture(scope="module")
def tok() -> CharTokenizer:
    return CharTokenizer(list(string.ascii_letters + string.digits + " .,"))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build(CFG, device="cpu").eval()


def make_engine(model, tok, caching: bool, **kw) -> Engine:
    kw = {"block_size": BS, "num_blocks": 96, "max_num_batched_tokens": 16, **kw}
    return Engine(model, tok, enable_prefix_caching=caching, **kw)


def drain(e: Engine, outs: dict[str, list]) -> None:
    while e.has_unfinished():
        for o in e.step():
            outs.setdefault(o.request_id, []).append(o)


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def scenario(e: Engine) -> dict[str, tuple[list[int], int]]:
    """Requests sharing a system prompt: one after another, one joining a request that still decodes, one
    continuing a conversation (its prompt holds the earlier answer), greedy and sampled. Returns each
    request's (tokens, cached prompt tokens)."""
    rng = random.Random(1)
    system = [rng.randrange(1, 60) for _ in range(37)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs: dict[str, list] = {}
    e.add_request("a", system + [3, 4, 5], greedy)
    e.add_request("s", system + [6], SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True))
    drain(e, outs)
    e.add_request("b", system + [9, 9], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while not outs.get("b"):  # b has its first token: its prompt's blocks are computed, and it keeps decoding
        for o in e.step():
            outs.setdefault(o.request_id, []).append(o)
    e.add_request("c", system + [9, 9, 1], greedy)
    e.add_request("t", system + [9, 9, 1], SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))
    drain(e, outs)
    e.add_request("d", system + [3, 4, 5] + tokens(outs["a"]) + [8, 8, 8], greedy)
    drain(e, outs)
    return {rid: (tokens(o), o[-1].cached_tokens) for rid, o in outs.items()}


@pytest.mark.parametrize("fast_linear", [False, True])
def test_same_tokens_with_caching_on_and_off(model, tok, fast_linear: bool) -> None:
    off_e, on_e = make_engine(model, tok, False, fast_linear=fast_linear), make_engine(model, tok, True,
                                                                                      fast_linear=fast_linear)
    off, on = scenario(off_e), scenario(on_e)
    assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
    assert all(len(v[0]) in (12, 30) for v in on.values())
    assert {k: v[1] for k, v in off.items()} == dict.fromkeys(off, 0)
    full = 36  # the system prompt's 37 tokens hold 9 full blocks
    assert on["a"][1] == 0 and on["b"][1] == full and on["c"][1] == on["t"][1] == 36
    # the conversation's history, generated tokens included: a's KV holds its prompt and all but its last token
    assert on["d"][1] == (40 + 11) // BS * BS
    st = on_e.stats()
    assert st["prefix_cache_hits"] == sum(v[1] for v in on.values())
    assert st["prefix_cache_queries"] == 40 + 38 + 39 + 40 + 40 + 55 and st["kv_blocks_used"] == 0
    assert st["kv_blocks_cached"] > 0 and off_e.stats()["kv_blocks_cached"] == 0
    assert off_e.stats()["prefix_cache_queries"] == 0


def test_running_requests_share_blocks_that_are_never_evicted(model, tok) -> None:
    """A pool of 24 blocks: a and b share a 24-token prefix (6 blocks) while c and d, with other prompts,
    need the rest; under that pressure requests are preempted and cached blocks evicted, never the shared
    blocks in use, and the tokens are those of the engine without caching."""
    rng = random.Random(2)
    shared = [rng.randrange(1, 60) for _ in range(24)]
    reqs = {"a": shared + [1, 2], "b": shared + [3], "c": [rng.randrange(1, 60) for _ in range(30)],
            "d": [rng.randrange(1, 60) for _ in range(20)]}
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = {}
    for caching in (False, True):
        e = make_engine(model, tok, caching, num_blocks=24)
        outs: dict[str, list] = {}
        e.add_request("a", reqs["a"], sp)
        while not outs.get("a"):
            for o in e.step():
                outs.setdefault(o.request_id, []).append(o)
        alloc = e._schedulers[0].allocator
        for rid in "bcd":
            e.add_request(rid, reqs[rid], sp)
        held = alloc.tables["a"][:6]
        while e.has_unfinished():
            if caching and "a" in alloc.tables and "b" in alloc.tables:
                assert alloc.tables["b"][:6] == alloc.tables["a"][:6] == held  # shared, in place
                assert alloc.lookup(chain([shared[i:i + BS] for i in range(0, 24, BS)])) == held
            for o in e.step():
                outs.setdefault(o.request_id, []).append(o)
        got[caching] = {rid: tokens(o) for rid, o in outs.items()}
        assert e.stats()["num_preemptions"] > 0 and e.stats()["kv_blocks_used"] == 0
    assert got[True] == got[False]


def test_evicted_blocks_are_recomputed(model, tok) -> None:
    """In a 20-block pool, three 40-token prompts evict each other's cached blocks; the first, asked again, is
    found only in part (or not at all) and recomputed: the same tokens as without caching."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 60) for _ in range(40)] for _ in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got, cached = {}, {}
    for caching in (False, True):
        e = make_engine(model, tok, caching, num_blocks=20)
        outs: dict[str, list] = {}
        for i, p in enumerate([*prompts, prompts[0], prompts[0]]):
            e.add_request(f"r{i}", p, sp)
            drain(e, outs)
        got[caching] = [tokens(outs[f"r{i}"]) for i in range(5)]
        cached[caching] = [outs[f"r{i}"][-1].cached_tokens for i in range(5)]
    assert got[True] == got[False] and got[True][0] == got[True][3] == got[True][4]
    assert cached[True][3] < 36 and cached[True][4] == 36  # evicted, recomputed, then found whole


def test_two_pipeline_stages_hit_the_cache_of_their_group(model, tok) -> None:
    rng = random.Random(4)
    system = [rng.randrange(1, 60) for _ in range(30)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = []
    for caching, stages in ((False, 1), (True, 2)):
        with make_engine(model, tok, caching, stages=stages) as e:
            outs: dict[str, list] = {}
            for i in range(4):  # one at a time: each goes to the idle group that holds the prefix
                e.add_request(f"r{i}", system + [i + 1], sp)
                drain(e, outs)
            results.append(([tokens(outs[f"r{i}"]) for i in range(4)], [outs[f"r{i}"][-1].cached_tokens
                                                                            for i in range(4)]))
    assert results[1][0] == results[0][0]
    assert results[1][1] == [0, 28, 28, 28]


def test_sliding_window_models_serve_without_the_cache(tok) -> None:
    torch.manual_seed(0)
    m = build(dataclasses.replace(CFG, name="window-tiny", sliding_window=8), device="cpu").eval()
    e = make_engine(m, tok, True)
    assert e.stats()["prefix_caching"] is False


@pytest.mark.parametrize("flag, on", [((), True), (("--no-enable-prefix-caching",), False)])
def test_wsc_serve_flag_reaches_the_engine(monkeypatch, flag: tuple[str, ...], on: bool) -> None:
    import waferscale.serve.server as server
    from waferscale.cli.main import main

    got: dict = {}
    monkeypatch.setattr(server, "serve", lambda **kw: got.update(kw))
    assert main(["serve", *flag]) == 0
    assert got["engine_kw"]["enable_prefix_caching"] is on


def test_speculation_with_caching_gives_the_tokens_of_neither(model, tok) -> None:
    """Prompt-lookup speculation's accepted drafts complete blocks too: those get cached after the engine has
    accepted them. Speculating with caching on gives the greedy tokens of the plain engine without caching
    (sampled ones keep their distribution, not their random stream: tests/test_serve_speculative.py)."""
    from waferscale.serve.speculative import NgramSpeculation

    plain = scenario(make_engine(model, tok, False))
    e = make_engine(model, tok, True, speculative=NgramSpeculation(3, max_n=3, min_n=1))
    spec = scenario(e)
    assert {k: spec[k][0] for k in "abcd"} == {k: plain[k][0] for k in "abcd"}
    st = e.stats()
    assert st["spec_accepted_tokens"] > 0 and st["prefix_cache_hits"] > 0 and st["kv_blocks_used"] == 0
