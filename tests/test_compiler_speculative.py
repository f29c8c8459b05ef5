"""Speculative decoding in the projection (compiler/speculative.py, `wsc compile --speculative`)."""

from __future__ import annotations

import json

import pytest

from conftest import wsc_main
from waferscale.compiler.capture import capture_zoo
from waferscale.compiler.compile import compile_model
from waferscale.compiler.sensitivity import sensitivity
from waferscale.compiler.speculative import Speculation, speculation
from waferscale.errors import ConfigError

MESH = dict(pes=(64, 64), context_len=64)  # gpt-tiny, the draft, reads 64 tokens


@pytest.fixture(scope="module")
def mini():
    return capture_zoo("gpt-mini")


def _spec(mini, method="draft", k=4, a=0.0, **kw):
    draft = "gpt-tiny" if method == "draft" else None
    return compile_model(graph=mini, **MESH, **kw, speculative=Speculation(method, k, a, draft))


def test_tokens_per_round():
    assert Speculation("ngram", 4, 0.0).tokens_per_round == 1
    assert Speculation("ngram", 1, 0.5).tokens_per_round == pytest.approx(1.5)
    assert Speculation("ngram", 3, 0.8).tokens_per_round == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert Speculation("ngram", 64, 0.999).tokens_per_round == pytest.approx(65, rel=0.05)


def test_draft_shares_the_mesh_and_a_round_adds_up(mini):
    plan = _spec(mini, a=0.0)
    s = plan.projection["speculative"]
    rows = s["draft_rows"]
    assert rows >= 1 and plan.fabric["rows"] == 64 - rows and plan.fabric["cols"] == 64  # the target: the rest
    assert s["round_s"] == pytest.approx(4 * s["draft_s_per_token"] + s["verify_s"] + s["ids_handoff_s"])
    assert s["verify_s"] > plan.projection["decode_latency_s_per_token"]  # 5 tokens cost more than 1
    # a = 0: one token per round of K drafts + a 5-token verification, slower than decoding plainly
    assert s["expected_tokens_per_round"] == 1
    assert s["tokens_per_s_per_user"] < s["plain_decode_tokens_per_s_per_user"]
    assert s["plain_decode_tokens_per_s_per_user"] == plan.projection["decode_tokens_per_s_per_user"]
    alone = compile_model(graph=mini, **MESH, users=1)  # no draft: the whole mesh, the best layout
    assert s["plain_decode_alone_tokens_per_s_per_user"] == alone.projection["decode_tokens_per_s_per_user"]
    assert s["speedup_vs_alone"] == pytest.approx(s["tokens_per_s_per_user"] / alone.projection[
        "decode_tokens_per_s_per_user"])
    assert plan.projection.get("layout", "pipelined") == "pipelined"
    assert plan.workload["users"] == 1 and any(d.startswith("speculative decoding: draft gpt-tiny")
                                               for d in plan.decisions)


def test_high_acceptance_and_many_drafts_beat_plain_decode(mini):
    for method in ("draft", "ngram"):
        s = _spec(mini, method, k=8, a=0.99).projection["speculative"]
        assert s["tokens_per_s_per_user"] > s["plain_decode_tokens_per_s_per_user"], method
    ngram = _spec(mini, "ngram", k=8, a=0.99).projection["speculative"]
    assert ngram["draft_s_per_token"] == 0 and "draft_rows" not in ngram


def test_more_acceptance_is_faster(mini):
    rates = [_spec(mini, a=a).projection["speculative"]["tokens_per_s_per_user"] for a in (0.0, 0.5, 0.9)]
    assert rates[0] < rates[1] < rates[2]


@pytest.mark.parametrize("args, match", [
    (("draft", 4, 1.0, "gpt-tiny"), "acceptance"), (("draft", 4, -0.1, "gpt-tiny"), "acceptance"),
    (("draft", 0, 0.5, "gpt-tiny"), "num_speculative_tokens"), (("draft", 4, 0.5, None), "--draft_model"),
    (("ngram", 4, 0.5, "gpt-tiny"), "no draft model"), (("medusa", 4, 0.5, None), "--speculative must be")])
def test_bad_speculation(args, match):
    with pytest.raises(ConfigError, match=match):
        Speculation(*args)


@pytest.mark.slow
def test_bad_requests(mini):
    with pytest.raises(ConfigError, match="need.*--speculative"):
        speculation(None, "gpt-tiny", None, None)
    with pytest.raises(ConfigError, match="--acceptance"):
        speculation("ngram", None, 4, None)
    with pytest.raises(ConfigError, match="reads at most 64 tokens"):
        compile_model(graph=mini, pes=(64, 64), speculative=Speculation("draft", 4, 0.5, "gpt-tiny"))
    with pytest.raises(ConfigError, match="vocabulary"):
        compile_model(model="gpt3-125m", speculative=Speculation("draft", 4, 0.5, "gpt-tiny"))
    with pytest.raises(ConfigError, match="not smaller"):
        compile_model(graph=capture_zoo("gpt-tiny"), **MESH, speculative=Speculation("draft", 4, 0.5, "gpt-mini"))
    with pytest.raises(ConfigError, match="--layout pipelined"):
        compile_model(graph=mini, **MESH, layout="model_parallel", speculative=Speculation("ngram", 4, 0.5))
    with pytest.raises(ConfigError, match="inference"):
        compile_model(graph=mini, **MESH, mode="train", speculative=Speculation("ngram", 4, 0.5))
    with pytest.raises(ConfigError, match="do not fit together"):  # 8B's band leaves too little for 70B
        compile_model(model="llama3.1-70b", systems=4, speculative=Speculation("draft", 4, 0.8, "llama3.1-8b"))


@pytest.mark.slow
def test_sensitivity_reports_the_speculative_rate(mini):
    req = dict(graph=mini, **MESH, speculative=Speculation("draft", 4, 0.8, "gpt-tiny"))
    s = sensitivity(req, compile_model(**req))
    assert "speculative_tokens_per_s_per_user" in s["figures"]
    clock = next(r for r in s["rows"] if r["name"] == "clock_hz")  # draft and target on the wafer: all cycles
    assert clock["plus"]["speculative_tokens_per_s_per_user"] == pytest.approx(10, abs=0.5)
    ngram = dict(req, speculative=Speculation("ngram", 4, 0.8))  # its ids cross the I/O, whose latency is fixed
    s = sensitivity(ngram, compile_model(**ngram))
    clock = next(r for r in s["rows"] if r["name"] == "clock_hz")
    assert 0 < clock["plus"]["speculative_tokens_per_s_per_user"] < 10


def test_cli(capsys):
    base = ("compile", "--model", "gpt-mini", "--pes", "64x64", "--context_len", "64")
    r = wsc_main(capsys, *base, "--speculative", "draft", "--draft_model", "gpt-tiny", "--num_speculative_tokens",
                 "4", "--acceptance", "0.8", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["speculative"]
    assert s["method"] == "draft" and s["num_speculative_tokens"] == 4 and s["acceptance"] == 0.8
    r = wsc_main(capsys, *base, "--speculative", "ngram", "--num_speculative_tokens", "4", "--acceptance", "0.8")
    assert r.returncode == 0 and "speculative" in r.stdout and "ngram" in r.stdout, r.stderr
    for bad in (("--speculative", "draft", "--num_speculative_tokens", "4", "--acceptance", "0.8"),
                ("--speculative", "ngram", "--num_speculative_tokens", "0", "--acceptance", "0.8"),
                ("--speculative", "ngram", "--num_speculative_tokens", "4", "--acceptance", "1"),
                ("--draft_model", "gpt-tiny",)):
        r = wsc_main(capsys, *base, *bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (bad, r.stderr)
