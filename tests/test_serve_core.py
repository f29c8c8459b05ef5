"""The engine in its own process (serve/core.py): the same tokens as the engine in this process, requests the
engine refuses fail their stream with the engine's error, an abandoned stream frees its KV blocks, a model
that cannot load is a clear error, and closing leaves no process behind."""

from __future__ import annotations

import asyncio
import time

import pytest
from serve_helpers import tiny_model_dir

from waferscale.errors import UserError
from waferscale.serve.core import CoreClient
from waferscale.serve.engine import Engine, RequestTooLong, SamplingParams
from waferscale.serve.structured import Grammar


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("core"))


async def _collect(client, rid, prompt, params):
    toks, last = [], None
    async for o in client.generate(rid, prompt, params):
        toks += o.new_token_ids
        last = o
    return toks, last


@pytest.mark.slow
def test_core_matches_in_process_and_frees_blocks(model_dir) -> None:
    prompts = [[1, 2, 3, 4, 5], list(range(100, 140)), [7]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
    engine = Engine.from_pretrained(str(model_dir))
    want = engine.generate(prompts, [greedy, greedy, seeded])
    tok = engine.tokenizer
    client = CoreClient(str(model_dir))
    proc = client._proc
    try:
        async def main():
            await client.start()
            got = await asyncio.gather(*(_collect(client, f"r{i}", p, s) for i, (p, s) in
                                         enumerate(zip(prompts, [greedy, greedy, seeded]))))
            assert [t for t, _ in got] == want
            assert got[0][1].finished and got[0][1].finish_reason == "length"
            # refused by the engine's limits, before anything streams
            with pytest.raises(RequestTooLong):
                await _collect(client, "long", [1] * 500, SamplingParams(max_tokens=100))
            with pytest.raises(ValueError, match="empty"):
                await _collect(client, "empty", [], greedy)
            # a grammar crosses as data; the engine builds its state
            toks, last = await _collect(client, "json", [1, 2, 3], SamplingParams(
                temperature=0, max_tokens=40, grammar=Grammar('start: "yes" | "no"\n')))
            assert last.finished and tok.decode(toks) in ("yes", "no")
            # a consumer that leaves early aborts its request: the blocks come back
            gen = client.generate("gone", [1, 2, 3], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
            await gen.__anext__()
            await gen.aclose()
            deadline = time.monotonic() + 30
            while client.stats()["kv_blocks_used"] or client.stats()["running"]:
                assert time.monotonic() < deadline, client.stats()
                await asyncio.sleep(0.05)
            await client.stop()

        asyncio.run(main())
    finally:
        client.close()
    assert not proc.is_alive()


def test_core_reports_a_model_that_cannot_load(tmp_path) -> None:
    with pytest.raises(UserError, match="no such model file or directory"):
        CoreClient(str(tmp_path / "missing.gguf"))


@pytest.mark.slow
def test_server_whose_engine_process_dies_says_so_and_stays_up(tmp_path) -> None:
    """`wsc serve` with its engine process killed: /health answers 503 with the reason, a generation gets the
    OpenAI error envelope with 503, and the API process itself keeps answering."""
    import os
    import signal

    from serve_helpers import run_server

    with run_server(tiny_model_dir(tmp_path), tmp_path) as srv:
        code, body, _ = srv.post("/v1/completions", {"model": "tiny-chat", "prompt": "Hi", "max_tokens": 3})
        assert code == 200, body
        kids = [int(k) for t in os.listdir(f"/proc/{srv.proc.pid}/task")
                for k in open(f"/proc/{srv.proc.pid}/task/{t}/children").read().split()]
        assert kids, "the server has no engine process"
        for k in kids:
            os.kill(k, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (h := srv.get("/health"))[0] != 503:
            assert time.monotonic() < deadline, h
            time.sleep(0.1)
        assert h[1]["status"] == "error" and "engine process stopped" in h[1]["error"]
        code, body, _ = srv.post("/v1/completions", {"model": "tiny-chat", "prompt": "Hi", "max_tokens": 3})
        assert code == 503 and body["error"]["type"] == "server_error", body
        assert "engine" in body["error"]["message"]
        assert srv.get("/v1/models")[0] == 200 and srv.proc.poll() is None
