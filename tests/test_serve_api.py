"""The OpenAI-compatible server as a real process on loopback, driven by the official `openai` client, the
`cerebras-cloud-sdk` client and raw HTTP: features, error envelopes, metrics, load with client disconnects.

Most tests use a tiny random Llama with SmolLM2's tokenizer (fast); `assets` tests use the real model."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from serve_helpers import have_smollm2, run_server, tiny_model_dir

pytestmark = pytest.mark.skipif(not have_smollm2(), reason="needs the SmolLM2 tokenizer (make setup)")
openai = pytest.importorskip("openai")

KEY = "sk-test-123"
MSG = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    with run_server(tiny_model_dir(tmp_path_factory.getbasetemp()), tmp, "--api-key", KEY, "--target", "wse3") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


# ---- features through the openai client ---------------------------------------------------------------------
@pytest.mark.slow
def test_chat_usage_time_info_headers_projection(client):
    raw = client.chat.completions.with_raw_response.create(model="tiny-chat", messages=MSG,
                                                           max_completion_tokens=8, seed=1)
    for h in ("x-ratelimit-limit-requests-day", "x-ratelimit-remaining-requests-day",
              "x-ratelimit-reset-requests-day", "x-ratelimit-limit-tokens-minute",
              "x-ratelimit-remaining-tokens-minute", "x-ratelimit-reset-tokens-minute"):
        assert h in raw.headers, h
    r = raw.parse()
    assert r.object == "chat.completion" and r.model == "tiny-chat" and r.system_fingerprint
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    ti = r.model_extra["time_info"]
    assert set(ti) == {"queue_time", "prompt_time", "completion_time", "total_time", "created"}
    assert ti["total_time"] == pytest.approx(ti["queue_time"] + ti["prompt_time"] + ti["completion_time"])
    proj = r.model_extra["wafer_projection"]
    assert proj["kind"] == "projection" and proj["target"] == "wse3"
    assert proj["decode_tokens_per_s_per_user"] > 0 and proj["users_at_full_speed"] >= 1


def test_seed_reproducible_and_n_fanout(client):
    a = client.chat.completions.create(model="tiny-chat", messages=MSG, max_completion_tokens=10, seed=42,
                                       temperature=1.0)
    b = client.chat.completions.create(model="tiny-chat", messages=MSG, max_completion_tokens=10, seed=42,
                                       temperature=1.0)
    assert a.choices[0].message.content == b.choices[0].message.content
    r = client.chat.completions.create(model="tiny-chat", messages=MSG, max_completion_tokens=6, n=3, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    assert len({c.message.content for c in r.choices}) > 1  # choice i uses seed + i


def test_stop_sequence_never_emitted(client):
    full = client.chat.completions.create(model="tiny-chat", messages=MSG, max_completion_tokens=16, seed=9,
                                          temperature=0).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.chat.completions.create(model="tiny-chat", messages=MSG, max_completion_tokens=16, seed=9,
                                         temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index(stop)]


def test_streaming_usage_in_final_chunk(client):
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=MSG, max_completion_tokens=6,
                                                 stream=True, stream_options={"include_usage": True}, seed=2))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-2].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert "time_info" in last.model_extra and all("time_info" not in c.model_extra for c in chunks[:-1])
    # without include_usage, usage and time_info ride on the final chunk
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=MSG, max_completion_tokens=4,
                                                 stream=True, seed=2))
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].model_extra["time_info"]["total_time"] > 0


def test_logprobs(client):
    r = client.chat.completions.create(model="tiny-chat", messages=MSG, max_completion_tokens=5, logprobs=True,
                                       top_logprobs=3, seed=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == 5 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lp)
    assert "".join(t.token for t in lp) == r.choices[0].message.content


def test_completions_endpoint(client):
    r = client.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=5, seed=1, logprobs=2,
                                  echo=True)
    c = r.choices[0]
    assert r.object == "text_completion" and c.text.startswith("Once upon a time")
    assert len(c.logprobs.tokens) == 5 and all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    assert r.usage.prompt_tokens == 4 and "time_info" in r.model_extra
    r = client.completions.create(model="tiny-chat", prompt=[[1, 2, 3], [4, 5]], max_tokens=3, n=2)
    assert len(r.choices) == 4 and r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="tiny-chat", prompt="Hi", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 4 and "".join(c.choices[0].text for c in chunks[:-1])


def test_models_and_projection_assumptions(client, srv):
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny-chat"]
    status, card = srv.get("/v1/models/tiny-chat", KEY)
    assert status == 200 and card["max_model_len"] == 512
    p = card["wafer_projection"]
    assert p["kind"] == "projection" and p["assumptions"]["clock_hz"] > 0 and "note" in p
    assert srv.get("/v1/tcp_warming")[0] == 200


def test_cerebras_sdk(srv):
    sdk = pytest.importorskip("cerebras.cloud.sdk")
    c = sdk.Cerebras(api_key=KEY, base_url=srv.base, max_retries=0)  # sends GET /v1/tcp_warming first
    r = c.chat.completions.create(model="tiny-chat", messages=MSG, max_completion_tokens=5, seed=1)
    assert r.usage.completion_tokens == 5 and r.time_info.total_time > 0
    chunks = list(c.chat.completions.create(model="tiny-chat", messages=MSG, max_completion_tokens=5, stream=True))
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].time_info.completion_time >= 0
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = c.chat.completions.create(model="tiny-chat", messages=MSG, max_completion_tokens=20,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "s", "schema": schema, "strict": True}})
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    with pytest.raises(sdk.AuthenticationError):
        sdk.Cerebras(api_key="wrong", base_url=srv.base, max_retries=0).chat.completions.create(
            model="tiny-chat", messages=MSG, max_completion_tokens=2)


# ---- errors --------------------------------------------------------------------------------------------------
def _err(srv, body, key=KEY, path="/v1/chat/completions"):
    status, data, _ = srv.post(path, body, key)
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}, data
    return status, data["error"]


def test_errors_have_envelope_and_status(srv):
    ok = {"model": "tiny-chat", "messages": MSG, "max_completion_tokens": 2}
    assert _err(srv, ok, key=None)[0] == 401
    assert _err(srv, ok, key="nope")[1]["code"] == "invalid_api_key"
    s, e = _err(srv, {**ok, "model": "gpt-9"})
    assert s == 404 and e["code"] == "model_not_found" and e["param"] == "model"
    s, e = _err(srv, b'{"model": "tiny-chat", "messages": [')
    assert s == 400 and e["code"] == "invalid_json"
    s, e = _err(srv, b"[1, 2]")
    assert s == 400
    for bad, param in (({"temperature": "hot"}, "temperature"), ({"temperature": 3.5}, "temperature"),
                       ({"n": 17}, "n"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
                       ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"messages": []}, "messages"),
                       ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
                       ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
                       ({"stream": "yes"}, "stream"), ({"top_logprobs": 3}, "top_logprobs"),
                       ({"logit_bias": {"999999": 1}}, "logit_bias"),
                       ({"response_format": {"type": "xml"}}, "response_format.type"),
                       ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
                       ({"response_format": {"type": "json_schema", "json_schema": {
                           "name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema")):
        s, e = _err(srv, {**ok, **bad})
        assert s == 400 and e["param"] == param and e["type"] == "invalid_request_error", (bad, e)
        assert "validation" not in e["message"].lower() or "loc" not in e["message"], e
    s, e = _err(srv, {**ok, "messages": [{"role": "user", "content": "word " * 600}]})
    assert s == 400 and e["code"] == "context_length_exceeded"
    s, e = _err(srv, {**ok, "max_completion_tokens": 500})
    assert s == 400 and e["code"] == "context_length_exceeded" and e["param"] == "max_completion_tokens"
    s, e = _err(srv, {"model": "tiny-chat", "prompt": [1, 2, 10**9]}, path="/v1/completions")
    assert s == 400 and e["param"] == "prompt"
    assert _err(srv, ok, path="/v1/nowhere")[0] == 404
    # the server is still fine
    assert srv.post("/v1/chat/completions", ok, KEY)[0] == 200


def test_metrics_exposition(srv):
    body = {"model": "tiny-chat", "messages": MSG, "max_completion_tokens": 2}
    assert srv.post("/v1/chat/completions", body, KEY)[0] == 200  # (so that it holds alone: -k metrics)
    status, text = srv.get("/metrics")
    assert status == 200
    for name in ("wsc_requests_total{", "wsc_prompt_tokens_total", "wsc_generation_tokens_total",
                 "wsc_num_requests_waiting", "wsc_kv_blocks_used", "wsc_time_to_first_token_seconds_bucket",
                 "wsc_inter_token_latency_seconds_count", "# TYPE wsc_time_to_first_token_seconds histogram"):
        assert name in text, name
    ttft_count = next(ln for ln in text.splitlines() if ln.startswith("wsc_time_to_first_token_seconds_count"))
    assert int(ttft_count.split()[1]) > 0


def test_prefix_cache_reuses_a_shared_system_prompt(client, srv):
    """A second request with the same long system prompt finds its full blocks (16 positions each) in the
    cache: usage says how many prompt tokens, /metrics counts them, and the answer (same seed) is the same."""
    system = "You answer questions for the prefix cache test. " * 12
    kw = dict(model="tiny-chat", max_completion_tokens=6, seed=5, temperature=1.0,
              messages=[{"role": "system", "content": system}, {"role": "user", "content": "Say something."}])
    cold = client.chat.completions.create(**kw)
    warm = client.chat.completions.create(**kw)
    n = cold.usage.prompt_tokens
    assert n > 100 and cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert warm.choices[0].message.content == cold.choices[0].message.content
    text = srv.get("/metrics")[1]
    value = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("wsc_prefix_cache")}
    assert value["wsc_prefix_cache_hits_total"] >= (n - 1) // 16 * 16
    assert value["wsc_prefix_cache_queries_total"] >= 2 * n
    assert 0 < value["wsc_prefix_cache_hit_rate"] <= 1


# ---- load ----------------------------------------------------------------------------------------------------
def test_64_concurrent_streams_with_disconnects(srv):
    """64 streams at once on loopback, about a third dropped mid-stream; every finished one is complete, the
    server stays up and every KV block comes back."""
    httpx = pytest.importorskip("httpx")
    rng = random.Random(0)
    plan = [(i, rng.random() < 0.35) for i in range(64)]
    results: dict[int, str] = {}

    def user(i: int, drop: bool) -> None:
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": f"user {i}"}], "stream": True,
                "max_completion_tokens": 24, "seed": i, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", srv.base + "/v1/chat/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                n = 0
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        n += 1
                        if drop and n >= 3:
                            results[i] = "dropped"
                            return  # closing the stream disconnects
                        if line == "data: [DONE]":
                            results[i] = "done"
        except httpx.HTTPError as e:
            results[i] = f"error {e!r}"

    threads = [threading.Thread(target=user, args=p) for p in plan]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert time.monotonic() - t0 < 180
    assert all(results.get(i) == ("dropped" if d else "done") for i, d in plan), results
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = srv.get("/health")[1]["engine"]
        if stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats.get("waiting", 0) == 0:
            break
        time.sleep(0.2)
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0, stats
    from waferscale.serve import kernels

    # the C kernels' vector path, or why not (this tiny model takes torch's), as the first line says
    assert stats["kernel_path"] == "off (fast_linear off: torch)", stats
    assert f"C kernels: {stats['kernel_path']})" in srv.output()
    status, text = srv.get("/metrics")
    assert "wsc_kv_blocks_used 0" in text
    assert srv.post("/v1/chat/completions", {"model": "tiny-chat", "messages": MSG, "max_completion_tokens": 2},
                    KEY)[0] == 200


def test_client_timeout_aborts_a_non_streaming_request(srv):
    """The official client gives up on a non-streaming request (timeout, no retry): the server notices at once,
    aborts its sequences (the engine frees them), counts it as 499 and keeps serving."""
    before = srv.get("/health")[1]["engine"]
    impatient = openai.OpenAI(base_url=srv.base + "/v1", api_key=KEY, max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):  # 8 x 400 tokens: seconds of decoding on the tiny model
        impatient.chat.completions.create(model="tiny-chat", messages=MSG, n=8, max_completion_tokens=400, seed=0)
    gave_up = time.monotonic()
    while (stats := srv.get("/health")[1]["engine"])["running"] and time.monotonic() - gave_up < 30:
        time.sleep(0.02)
    freed_s = time.monotonic() - gave_up
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0, stats
    assert stats["requests_aborted"] - before["requests_aborted"] == 8, (before, stats)
    assert stats["requests_finished"] == before["requests_finished"], (before, stats)
    assert freed_s < 2.0, freed_s
    assert 'wsc_requests_total{endpoint="/v1/chat/completions",status="499"} 1' in srv.get("/metrics")[1]
    assert srv.post("/v1/chat/completions", {"model": "tiny-chat", "messages": MSG, "max_completion_tokens": 2},
                    KEY)[0] == 200


def test_guard_refuses_before_the_routes():
    """The guard (a pure ASGI middleware) in process: a wrong key is 401 with www-authenticate, a generation
    over the rate limit is 429 and counted, other API answers carry the rate-limit headers."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from waferscale.serve.openai.app import create_app
    from waferscale.serve.openai.routes import RateLimiter

    async def nothing() -> None:
        pass

    idle = SimpleNamespace(start=nothing, stop=nothing, stats=dict)  # no request reaches the engine here
    app = create_app(None, idle, None, model_id="m", api_key=KEY, rate_limits=RateLimiter(requests_per_day=0))
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/v1/chat/completions", json={}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        r = c.get("/v1/nowhere", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 404 and r.headers["x-ratelimit-remaining-requests-day"] == "0"
        assert 'wsc_requests_total{endpoint="/v1/chat/completions",status="429"} 1' in c.get("/metrics").text


# ---- the real model ------------------------------------------------------------------------------------------
@pytest.mark.assets
@pytest.mark.slow
def test_real_model_paris_and_schema(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real")
    with run_server("smollm2-135m-instruct", tmp) as s:
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=300)
        r = c.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_completion_tokens=30,
                                      messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content
        from waferscale.serve import kernels

        path = s.get("/health")[1]["engine"]["kernel_path"]  # the C kernels' vector path, as the first line says
        assert path == kernels.path() and kernels.available() and f"C kernels: {path})" in s.output()
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                   "country": {"type": "string", "maxLength": 40},
                                                   "population_millions": {"type": "number"}},
                  "required": ["city", "country", "population_millions"], "additionalProperties": False}
        r = c.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_completion_tokens=80,
                                      messages=[{"role": "user", "content": "Describe the capital of France."}],
                                      response_format={"type": "json_schema", "json_schema": {
                                          "name": "city", "schema": schema, "strict": True}})
        from serve_helpers import validate

        assert r.choices[0].finish_reason == "stop"
        validate(json.loads(r.choices[0].message.content), schema)
