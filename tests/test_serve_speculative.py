"""Prompt-lookup speculative decoding (serve/speculative.py): the n-gram proposer, rejection sampling that keeps
the target distribution (chi-square over a seeded stream), the engine's output unchanged by speculation (greedy,
with stop strings, stop tokens, max_tokens, logprobs and penalties while several tokens are accepted in one
step), and the server's flags, usage and /metrics through the openai client."""

from __future__ import annotations


import pytest
import torch

from waferscale.errors import ConfigError
from waferscale.serve.engine import Engine, SamplingParams
from waferscale.serve.kv import BlockAllocator
from waferscale.serve.sampling import RequestSampler
from waferscale.serve.scheduler import Scheduler, Sequence
from waferscale.serve.speculative import NgramProposer, NgramSpeculation, speculation, verify
from test_serve_engine import llama, run, tok  # noqa: F401  (the tiny model, tokenizer and run loop: one home)

# repetitive prompts: the random tiny model falls into loops the proposer finds, so drafts get accepted
PROMPTS = [[1, 2, 3, 4, 5] * 3, [7, 8] * 6, list(range(20, 30)) * 2, [9, 10, 11]]


def test_proposer_takes_the_longest_most_recent_ngram_on_token_boundaries() -> None:
    p = NgramProposer(NgramSpeculation(3, max_n=3, min_n=1), [5, 6, 7, 1, 5, 6, 8, 9, 5, 6])
    assert p.propose(3) == [8, 9, 5]  # "5 6" last occurred before "8 9"; n=3 ("9 5 6") never did
    p.extend([7])
    assert p.propose(2) == [1, 5]  # now "5 6 7" (n=3) matches at the start
    assert NgramProposer(NgramSpeculation(2, 1, 1), [1, 2, 3]).propose(2) == []
    # 2**24 then 0 holds the bytes of token 256 straddling a boundary: only the aligned match counts
    assert NgramProposer(NgramSpeculation(2, 1, 1), [2**24, 0, 9, 256]).propose(2) == []
    assert NgramProposer(NgramSpeculation(2, 1, 1), [256, 42, 2**24, 0, 9, 256]).propose(2) == [42, 2**24]


def test_flags_are_checked() -> None:
    assert speculation(None, None) is None
    assert speculation("ngram", 4) == NgramSpeculation(4, 5, 5)
    assert speculation("ngram", 4, max_n=3) == NgramSpeculation(4, 3, 3)
    for args, msg in ((("ngram", 0), "integer >= 1"), (("ngram", -2), "integer >= 1"), (("eagle", 3), "one of ngram"),
                      (("ngram", None), "needs --num_speculative_tokens"), ((None, 3), r"need\(s\) --speculative"),
                      (("ngram", 3, 2, 4), "must not exceed")):
        with pytest.raises(ConfigError, match=msg):
            speculation(*args)


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Two drafted tokens over a 6-token vocabulary, temperature, top-k and a frequency penalty (so the second
    position's distribution depends on the accepted first): the first emitted token has the law of the target's
    first position, and after an accepted first draft the second has that of the second position. Chi-square
    at the 0.1 % level over a fixed seed: deterministic, and it fails if a draft's acceptance or the residual is
    wrong (e.g. sampling the residual without removing the draft moves p(d) by about 0.1 here)."""
    torch.manual_seed(1)
    logits = torch.randn(3, 6) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5, frequency_penalty=0.7, seed=123)
    sampler = RequestSampler(params, [], None)
    drafts, history, n = [2, 4], [4], 6000
    first = torch.zeros(6)
    second = torch.zeros(6)
    for _ in range(n):
        toks, _ = verify(sampler, logits, drafts, history, None)
        first[toks[0]] += 1
        if toks[0] == drafts[0]:
            second[toks[1]] += 1
    p1 = sampler.probs(sampler.process(logits[0], history))
    p2 = sampler.probs(sampler.process(logits[1], history + [drafts[0]]))
    for counts, p in ((first, p1), (second, p2)):
        keep = p * counts.sum() >= 5  # (top-k leaves one token impossible: it must never be drawn)
        assert counts[~keep].sum() <= 0.001 * counts.sum()
        expected = p[keep] * counts.sum()
        chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
        dof = int(keep.sum()) - 1
        p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))
        assert p_value > 1e-3, (counts, expected, chi2)


def chi2_p_value(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's chi-square test of `counts` against the law `p` (bins expecting fewer than 5 merged into one)."""
    n = counts.sum()
    keep = p * n >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([p[keep] * n, (p[~keep].sum() * n).view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2), chi2 / 2))


def test_engine_sampling_with_speculation_keeps_the_model_distribution(llama, tok) -> None:
    """Through the engine: 1,500 seeded requests of 3 tokens after a prompt ending in the model's own greedy loop
    (so the drafts, copied from the loop, are often accepted and sometimes not). The laws of the 2nd and 3rd
    tokens (verified against one and two drafts) are computed exactly from the plain forward, summing over the
    tokens before them; chi-square at the 0.1 % level, fixed seeds."""
    params = dict(temperature=0.8, top_k=4, max_tokens=3)
    probe = Engine(llama, tok, block_size=4, num_blocks=128).generate([PROMPTS[0]], SamplingParams(
        temperature=0, max_tokens=20))[0]
    prompt = PROMPTS[0] + probe
    ref = RequestSampler(SamplingParams(**params), [], tok.vocab_size)

    @torch.no_grad()
    def law(prefix: list[int], history: list[int]) -> torch.Tensor:
        return ref.probs(ref.process(llama(torch.tensor([prefix]))[0, -1], history))

    p1 = law(prompt, [])
    p2, p3 = torch.zeros_like(p1), torch.zeros_like(p1)
    for t1 in p1.nonzero().flatten().tolist():
        q2 = law(prompt + [t1], [t1])
        p2 += p1[t1] * q2
        for t2 in q2.nonzero().flatten().tolist():
            p3 += p1[t1] * q2[t2] * law(prompt + [t1, t2], [t1, t2])
    n = 1500
    e = Engine(llama, tok, block_size=4, num_blocks=1024, max_num_batched_tokens=4096,
               speculative=NgramSpeculation(2, max_n=3, min_n=1))
    outs = e.generate([prompt] * n, [SamplingParams(**params, seed=i) for i in range(n)])
    st = e.stats()
    assert 0.2 * st["spec_draft_tokens"] < st["spec_accepted_tokens"] < 0.9 * st["spec_draft_tokens"]
    for pos, p in ((1, p2), (2, p3)):
        counts = torch.bincount(torch.tensor([o[pos] for o in outs]), minlength=len(p)).float()
        assert chi2_p_value(counts, p) > 1e-3, (pos, counts, p * n)


def test_engine_output_is_unchanged_by_speculation(llama, tok) -> None:
    """Concurrent requests, greedy: plain, with logprobs, a stop string and a stop token (checked from the 12th
    token on: min_tokens, so that they end the request inside a step that accepted drafts), a frequency penalty,
    and a max_tokens reached inside such a step. With speculation every request gives the same tokens, text,
    finish reason and logprobs, steps emit several tokens at once, and the KV blocks all come back."""
    base = dict(temperature=0, max_tokens=30)
    probe = Engine(llama, tok, block_size=4, num_blocks=128).generate([PROMPTS[0]], SamplingParams(**base))[0]
    spec = NgramSpeculation(4, max_n=3, min_n=1)

    def stop_token(t: int) -> SamplingParams:  # (min_tokens bans t at first, which changes the greedy path)
        return SamplingParams(**base, min_tokens=12, stop_token_ids=[t])

    def ends_inside_a_step(t: int) -> bool:  # the step that samples t emits accepted drafts before it
        e = Engine(llama, tok, block_size=4, num_blocks=128, speculative=spec)
        last = run(e, {"t": (PROMPTS[3], stop_token(t))})["t"][-1]
        return last.finish_reason == "stop" and len(last.new_token_ids) > 0

    stop_tok = next(t for t in range(tok.vocab_size) if ends_inside_a_step(t))
    reqs = {"plain": (PROMPTS[0], SamplingParams(**base)),
            "logprobs": (PROMPTS[1], SamplingParams(**base, logprobs=True, top_logprobs=2)),
            "stop": (PROMPTS[0], SamplingParams(**base, min_tokens=12, stop=[tok.decode(probe[:2])])),
            "stop_tok": (PROMPTS[3], stop_token(stop_tok)),
            "penalty": (PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, frequency_penalty=0.5)),
            "length": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=13))}
    outs = {}
    for sp in (None, spec):
        e = Engine(llama, tok, block_size=4, num_blocks=128, max_num_batched_tokens=32, speculative=sp)
        outs[sp] = run(e, reqs)
        assert e.stats()["kv_blocks_used"] == 0
    ref, got = outs[None], outs[spec]
    for rid in reqs:
        assert [t for o in got[rid] for t in o.new_token_ids] == [t for o in ref[rid] for t in o.new_token_ids], rid
        assert "".join(o.new_text for o in got[rid]) == "".join(o.new_text for o in ref[rid]), rid
        assert got[rid][-1].finish_reason == ref[rid][-1].finish_reason, rid
        assert ref[rid][-1].draft_tokens is None and got[rid][-1].draft_tokens is not None
    assert [ref[r][-1].finish_reason for r in ("stop", "stop_tok", "length")] == ["stop", "stop", "length"]
    assert 12 <= ref["stop"][-1].completion_tokens < 30 and 12 <= ref["stop_tok"][-1].completion_tokens < 30
    lp_ref = [e["logprob"] for o in ref["logprobs"] for e in o.logprobs]
    lp_got = [e["logprob"] for o in got["logprobs"] for e in o.logprobs]
    assert lp_got == pytest.approx(lp_ref, abs=1e-4) and len(lp_got) == 30
    for rid in ("plain", "logprobs", "stop", "stop_tok", "length"):  # (the penalty breaks the loops drafts need)
        assert any(len(o.new_token_ids) > 1 for o in got[rid]), rid
    last = got["plain"][-1]
    assert 0 < last.accepted_tokens <= last.draft_tokens


def test_speculation_through_pipeline_stages(llama, tok) -> None:
    """Two stages (worker processes): the verified positions' logits come back from the last stage."""
    sp = SamplingParams(temperature=0, max_tokens=30)
    ref = Engine(llama, tok, block_size=4, num_blocks=128).generate(PROMPTS, sp)
    with Engine(llama, tok, block_size=4, num_blocks=128, stages=2, speculative=NgramSpeculation(4, 3, 1)) as e:
        assert e.generate(PROMPTS, sp) == ref
        assert e.stats()["spec_accepted_tokens"] > 0


def test_sampled_speculation_is_seeded_and_structured_output_does_not_speculate(llama, tok) -> None:
    e = Engine(llama, tok, block_size=4, num_blocks=128, speculative=NgramSpeculation(3, 2, 1))
    sp = SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=20)
    a, b = e.generate([PROMPTS[1], PROMPTS[1]], sp)
    assert a == b and len(a) == 20
    assert e.stats()["spec_draft_tokens"] > 0
    hook = SamplingParams(temperature=0, max_tokens=10, logits_processor=lambda ids, x: x)
    out = run(e, {"g": (PROMPTS[0], hook)})["g"]
    assert out[-1].draft_tokens is None and all(len(o.new_token_ids) <= 1 for o in out)


def test_scheduler_fits_drafts_to_the_budget_and_the_free_blocks() -> None:
    """Drafts ride along with a decode only while the token budget leaves one token for every later running
    sequence, and never take a block another sequence would be preempted for; the accepted ones count as
    computed."""
    s = Scheduler(BlockAllocator(32, 4), max_num_batched_tokens=16)
    seqs = [Sequence(f"s{i}", [1, 2, 3], 10) for i in range(3)]
    for q in seqs:
        s.add(q)
    s.update(s.schedule())  # the three prompts
    for q in seqs:
        q.output_ids.append(4)
        q.draft_ids = [5, 6, 7, 8]
    s.max_num_batched_tokens = 5
    out = s.schedule()
    assert [len(c.drafts) for c in out.chunks] == [2, 0, 0] and out.num_tokens == 5
    assert out.chunks[0].token_ids() == [4, 5, 6] and [c.num_logits for c in out.chunks] == [3, 1, 1]
    out.chunks[0].accepted = 1
    s.update(out)
    assert [q.num_computed for q in seqs] == [5, 4, 4] and all(not q.draft_ids for q in seqs)

    s = Scheduler(BlockAllocator(2, 4), max_num_batched_tokens=16)
    a, b = Sequence("a", [1, 2, 3], 4), Sequence("b", [1, 2, 3], 4)
    s.add(a)
    s.add(b)
    s.update(s.schedule())
    a.output_ids.append(4)
    a.draft_ids = [5, 6]  # would need a third block
    b.output_ids.append(4)
    out = s.schedule()
    assert not out.preempted and [len(c.drafts) for c in out.chunks] == [0, 0]


# ---- the server ---------------------------------------------------------------------------------------------
def test_serve_and_generate_refuse_bad_speculation_flags(capsys) -> None:
    from waferscale.cli.main import main

    for cmd in (["serve", "--model", "nowhere"], ["generate", "--model", "nowhere", "--prompt", "hi"]):
        for args in (["--speculative", "ngram", "--num_speculative_tokens", "0"],
                     ["--speculative", "medusa", "--num-speculative-tokens", "2"]):
            assert main([*cmd, *args]) == 2
            err = capsys.readouterr().err
            assert err.startswith("error: --") and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_server_speculates_with_the_same_text(tmp_path_factory) -> None:
    from serve_helpers import have_smollm2, run_server, tiny_model_dir

    if not have_smollm2():
        pytest.skip("needs the SmolLM2 tokenizer (make setup)")
    openai = pytest.importorskip("openai")
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp())
    prompt = "one two three four one two three four one two three four one two"
    e = Engine.from_pretrained(str(model_dir), block_size=16, num_blocks=64)
    want = e.tokenizer.decode(e.generate([e.tokenizer.encode(prompt)], SamplingParams(temperature=0,
                                                                                       max_tokens=24))[0])
    with run_server(model_dir, tmp_path_factory.mktemp("spec"), "--speculative", "ngram",
                    "--num_speculative_tokens", "3", "--prompt_lookup_max", "3", "--prompt_lookup_min", "1") as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == want
        d = r.usage.completion_tokens_details
        drafted = d.accepted_prediction_tokens + d.rejected_prediction_tokens
        assert drafted > 0 and d.model_extra["draft_acceptance_rate"] == pytest.approx(
            d.accepted_prediction_tokens / drafted)
        chunks = list(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        sd = chunks[-1].usage.completion_tokens_details
        assert sd.accepted_prediction_tokens == d.accepted_prediction_tokens  # (greedy: the same drafts)
        drafted *= 2
        metrics = srv.get("/metrics")[1]
        got = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
               if line.startswith("wsc_spec_decode")}
        assert got["wsc_spec_decode_num_draft_tokens_total"] == drafted
        assert got["wsc_spec_decode_num_accepted_tokens_total"] == 2 * d.accepted_prediction_tokens
