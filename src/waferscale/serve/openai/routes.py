"""Endpoint handlers: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, /v1/tcp_warming.

A request is validated (protocol.py), turned into token ids and `SamplingParams` (one per choice: `n` fans
out into n engine sequences), run on the `AsyncEngine`, and answered as one JSON object or as SSE chunks.
A client that goes away cancels its sequences, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from waferscale.serve import structured as st
from waferscale.serve.engine import EngineDead, RequestTooLong, SamplingParams
from waferscale.serve.openai.metrics import Metrics
from waferscale.serve.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                              NamedToolChoice, parse_request, time_info, usage)

__all__ = ["ServerState", "router"]

router = APIRouter()


@dataclass
class RateLimiter:
    """Fixed windows: requests per UTC day and tokens per minute. Headers as Cerebras sends them."""

    requests_per_day: int = 1_000_000
    tokens_per_minute: int = 100_000_000
    _day: int = -1
    _minute: int = -1
    requests: int = 0
    tokens: int = 0

    def _roll(self) -> float:
        """Start new windows if the day or the minute changed; returns the time now."""
        t = time.time()
        day, minute = int(t // 86400), int(t // 60)
        if day != self._day:
            self._day, self.requests = day, 0
        if minute != self._minute:
            self._minute, self.tokens = minute, 0
        return t

    def admit(self) -> bool:
        self._roll()
        if self.requests >= self.requests_per_day or self.tokens >= self.tokens_per_minute:
            return False
        self.requests += 1
        return True

    def add_tokens(self, n: int) -> None:
        self._roll()
        self.tokens += n

    def headers(self) -> dict[str, str]:
        t = self._roll()
        return {"x-ratelimit-limit-requests-day": str(self.requests_per_day),
                "x-ratelimit-remaining-requests-day": str(max(0, self.requests_per_day - self.requests)),
                "x-ratelimit-reset-requests-day": f"{86400 - t % 86400:.2f}s",
                "x-ratelimit-limit-tokens-minute": str(self.tokens_per_minute),
                "x-ratelimit-remaining-tokens-minute": str(max(0, self.tokens_per_minute - self.tokens)),
                "x-ratelimit-reset-tokens-minute": f"{60 - t % 60:.2f}s"}


@dataclass
class ServerState:
    engine: Any                       # waferscale.serve.engine.Engine: max_model_len, stats()
    aengine: Any                      # AsyncEngine wrapping it
    tokenizer: Any                    # HFTokenizer
    model_id: str
    aliases: set[str] = field(default_factory=set)
    api_key: str | None = None
    projection: dict[str, Any] | None = None  # compiler plan_json for --target, or None
    limits: RateLimiter = field(default_factory=RateLimiter)
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics | None = None

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def fingerprint(self) -> str:
        return "fp_" + hashlib.sha256(f"waferscale:{self.model_id}".encode()).hexdigest()[:10]


def _state(request: Request) -> ServerState:
    return request.app.state.wsc


# ---- models, health, metrics --------------------------------------------------------------------------------
def _model_card(s: ServerState, detail: bool = False) -> dict[str, Any]:
    card: dict[str, Any] = {"id": s.model_id, "object": "model", "created": s.created, "owned_by": "waferscale"}
    if detail:
        card["max_model_len"] = s.max_model_len
        if s.projection is not None:
            p = s.projection
            card["wafer_projection"] = {
                "kind": "projection", "target": p["target"], "systems": p["systems"],
                "strategy": p["strategy"], "decode_tokens_per_s_per_user": p["decode_tokens_per_s_per_user"],
                "time_to_first_token_s": p["time_to_first_token_s"],
                "aggregate_decode_tokens_per_s": p["aggregate_decode_tokens_per_s"],
                "users_at_full_speed": p["users_in_flight"], "workload": p["workload"],
                "bottleneck": p["bottleneck"], "assumptions": p["assumptions"], "why": p.get("why", []),
                "plan_fingerprint": p["fingerprint"],
                "note": "computed by the waferscale compiler's cost model for this model on the target; "
                        "not a measurement"}
    return card


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(_state(request))]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    s = _state(request)
    _check_model(s, model_id, param="model_id")
    return _model_card(s, detail=True)


@router.get("/v1/tcp_warming")
async def tcp_warming() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/health")
async def health(request: Request) -> Any:
    s = _state(request)
    why = s.aengine.unhealthy()
    if why is not None:  # the engine (process) is gone: this server cannot answer generations
        return JSONResponse({"status": "error", "model": s.model_id, "error": why}, status_code=503)
    return {"status": "ok", "model": s.model_id, "engine": s.aengine.stats()}


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    s = _state(request)
    return PlainTextResponse(s.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


# ---- shared request plumbing --------------------------------------------------------------------------------
def _check_model(s: ServerState, model: str | None, param: str = "model") -> None:
    if model is None or model == s.model_id or model in s.aliases:
        return
    raise APIError(404, f"The model '{model}' does not exist or you do not have access to it. "
                        f"This server serves '{s.model_id}' (GET /v1/models).",
                   type="invalid_request_error", param=param, code="model_not_found")


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request ({e}). The body must be a JSON "
                            "object.", code="invalid_json") from None


def _budget(s: ServerState, prompt_len: int, max_new: int | None, param: str) -> int:
    """max new tokens for this prompt; 400 context_length_exceeded when prompt (+ max_new) does not fit."""
    limit = s.max_model_len
    if prompt_len >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt has "
                            f"{prompt_len} tokens. Please shorten the prompt.", param="messages"
                       if param == "max_completion_tokens" else "prompt", code="context_length_exceeded")
    if max_new is not None and prompt_len + max_new > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{prompt_len + max_new} tokens ({prompt_len} in the prompt, {max_new} for the "
                            f"completion). Please reduce the prompt or {param}.", param=param,
                       code="context_length_exceeded")
    return max_new if max_new is not None else limit - prompt_len


def _sampling(req: Any, max_new: int, *, logprobs: bool, top_logprobs: int, seed_offset: int,
              grammar: Any = None) -> SamplingParams:
    """Engine SamplingParams for one choice; choice i of a seeded request uses seed + i."""
    return SamplingParams(
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p), top_k=req.top_k or 0,
        seed=None if req.seed is None else req.seed + seed_offset, max_tokens=max_new,
        min_tokens=min(req.min_new, max_new), stop=list(req.stop or []), ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        logit_bias={int(k): float(v) for k, v in (req.logit_bias or {}).items()},
        logprobs=logprobs, top_logprobs=top_logprobs, grammar=grammar)


@dataclass
class _Choice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    draft_tokens: int | None = None  # speculative decoding (None: the request did not speculate)
    accepted_tokens: int = 0
    queue: float = 0.0
    prompt: float = 0.0
    completion: float = 0.0
    first_token_t: float | None = None
    last_token_t: float | None = None


class _FanOut:
    """Runs the n sequences of one request concurrently and merges their outputs into one queue.

    `events()` yields (choice index, EngineOutput). Leaving the iterator early (client gone) cancels every
    sequence; the engine's generate() aborts on cancellation, which frees the KV blocks.
    """

    def __init__(self, s: ServerState, base_id: str, jobs: list[tuple[list[int], SamplingParams]], t0: float,
                 n_per_prompt: int):
        self.s, self.base_id, self.jobs, self.t0, self.n_per_prompt = s, base_id, jobs, t0, n_per_prompt
        self.q: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.choices = [_Choice(i) for i in range(len(jobs))]

    async def _run(self, i: int, prompt: list[int], params: SamplingParams) -> None:
        try:
            async for out in self.s.aengine.generate(f"{self.base_id}-{i}", prompt, params):
                await self.q.put((i, out, None))
            await self.q.put((i, None, None))
        except Exception as e:  # forwarded to the handler, which turns it into an error answer
            await self.q.put((i, None, e))

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._run(i, p, sp)) for i, (p, sp) in enumerate(self.jobs)]

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        live = len(self.tasks)
        m = self.s.metrics
        try:
            while live:
                i, out, err = await self.q.get()
                if err is not None:
                    raise err
                if out is None:
                    live -= 1
                    continue
                c = self.choices[i]
                t = time.perf_counter()
                k = len(out.new_token_ids)
                if k:
                    if c.first_token_t is None:
                        c.first_token_t = t
                        m.observe(m.ttft, t - self.t0)
                        if k > 1:
                            m.observe(m.itl, 0.0, k - 1)
                    else:
                        m.observe(m.itl, (t - c.last_token_t) / k, k)
                    c.last_token_t = t
                c.text += out.new_text
                c.prompt_tokens, c.completion_tokens = out.prompt_tokens, out.completion_tokens
                c.queue, c.prompt, c.completion = out.queue_time_s, out.prompt_time_s, out.completion_time_s
                c.draft_tokens, c.accepted_tokens = out.draft_tokens, out.accepted_tokens or 0
                if out.logprobs:
                    c.logprobs.extend(out.logprobs)
                if out.finished:
                    c.finish_reason = out.finish_reason or "stop"
                    c.cached_tokens = out.cached_tokens
                    m.tokens(out.prompt_tokens, out.completion_tokens)
                    self.s.limits.add_tokens(out.prompt_tokens + out.completion_tokens)
                    m.observe(m.e2e, t - self.t0)
                yield i, out
        finally:
            await self.close()

    async def close(self) -> None:
        pending = [t for t in self.tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            self.s.metrics.aborted += len(pending)
            await asyncio.gather(*pending, return_exceptions=True)

    def totals(self, created: float) -> tuple[dict[str, int], dict[str, float]]:
        """usage (a prompt counted once however many choices share it, with its first choice's cached tokens)
        and Cerebras time_info."""
        cs = self.choices
        prompt = sum(len(p) for p, _ in self.jobs[::self.n_per_prompt])
        comp = sum(c.completion_tokens for c in cs)
        cached = sum(c.cached_tokens for c in cs[::self.n_per_prompt])
        ti = time_info(max((c.queue for c in cs), default=0.0), max((c.prompt for c in cs), default=0.0),
                       max((c.completion for c in cs), default=0.0), created)
        spec = [c for c in cs if c.draft_tokens is not None]
        drafted = sum(c.draft_tokens for c in spec) if spec else None
        return usage(prompt, comp, cached, drafted, sum(c.accepted_tokens for c in spec)), ti


def _engine_error(e: Exception) -> APIError:
    if isinstance(e, EngineDead):
        return APIError(503, f"the engine is unavailable: {e}; restart the server", type="server_error")
    if isinstance(e, RequestTooLong):
        return APIError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"internal error while generating: {type(e).__name__}: {e}", type="server_error")


async def _start(fan: _FanOut) -> AsyncIterator[tuple[int, Any]]:
    """Start the sequences and wait for the first output, so that an engine refusal is still an HTTP error;
    returns the iterator of every event, that first one included."""
    fan.start()
    it = fan.events().__aiter__()
    try:
        first = [await it.__anext__()]
    except StopAsyncIteration:
        first = []
    except Exception as e:
        await fan.close()
        raise _engine_error(e) from e

    async def replay() -> AsyncIterator[tuple[int, Any]]:
        for ev in first:
            yield ev
        async for ev in it:
            yield ev

    return replay()


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects. The body has been read, so the next ASGI message is the disconnect
    (or, once the answer is sent, the server's end of the request)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _drain(request: Request, fan: _FanOut, it: AsyncIterator) -> None:
    """Run a non-streaming request to completion. If the client goes away meanwhile, its sequences are aborted
    (the engine frees them at once) and the request ends as 499, nginx's "client closed request": nobody reads
    the answer, /metrics counts it."""

    async def consume() -> None:
        async for _ in it:
            pass

    consumer, gone = asyncio.create_task(consume()), asyncio.create_task(_client_gone(request))
    try:
        await asyncio.wait((consumer, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (consumer, gone):
            t.cancel()  # a no-op on the one that finished
        await asyncio.gather(consumer, gone, return_exceptions=True)
        await fan.close()  # cancelling the consumer leaves the events iterator open: abort its sequences here
    if consumer.cancelled():
        raise APIError(499, "the client closed the request before the answer was ready", code="client_closed")
    if consumer.exception() is not None:
        e = consumer.exception()
        raise _engine_error(e) from e


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _event_stream(fan: _FanOut, chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """`chunks` as server-sent events, then [DONE]. An error once the headers are gone is reported in-band, as
    OpenAI does; the sequences end with the stream."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield _sse(chunk)
        except Exception as e:
            yield _sse(_engine_error(e).body())
        finally:
            await fan.close()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


def _projection_for(s: ServerState, prompt_tokens: int, completion_tokens: int) -> dict[str, Any] | None:
    """The wafer projection extension field: what this answer would take on the --target system."""
    p = s.projection
    if p is None:
        return None
    decode = p["decode_tokens_per_s_per_user"]
    ttft = p["time_to_first_token_s"] * prompt_tokens / max(1, p["prompt_len"])
    return {"kind": "projection", "target": p["target"], "systems": p["systems"],
            "decode_tokens_per_s_per_user": decode, "time_to_first_token_s": ttft,
            "users_at_full_speed": p["users_in_flight"],
            "aggregate_decode_tokens_per_s": p["aggregate_decode_tokens_per_s"],
            "total_time_s": ttft + completion_tokens / decode if decode else None,
            "prefill_tokens_per_s": p["prefill_tokens_per_s"],
            "note": f"projection from the compiler's cost model, not a measurement; assumptions: "
                    f"GET /v1/models/{s.model_id}"}


# ---- chat ---------------------------------------------------------------------------------------------------
@dataclass
class _ChatPlan:
    """What a chat request asks of the engine: the rendered prompt's ids, the completion budget, the tools in
    play (none when tool_choice is "none"), and the grammar that constrains the answer (None: free text)."""

    prompt: list[int]
    max_new: int
    tools: list[st.ToolSpec]
    tool_choice: Any  # "auto" | "required" | "none" | {"type": "function", "function": {"name": ...}}
    grammar: Any = None
    free_text: bool = False  # tools offered with "auto": the grammar allows plain text or a call

    @property
    def hold_all(self) -> bool:
        """Constrained to tool calls: a stream sends them parsed, at the end."""
        return bool(self.tools) and self.tool_choice != "auto"


def _chat_plan(s: ServerState, req: ChatCompletionRequest) -> _ChatPlan:
    """Request -> prompt (the chat template over the messages and tools) and grammar; APIError 400 for
    messages the template cannot render, a prompt over the context, or a schema the grammar cannot take."""
    tools = [st.ToolSpec(t.function.name, t.function.description, t.function.parameters, bool(t.function.strict))
             for t in req.tools or []]
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, NamedToolChoice):
        choice = {"type": "function", "function": {"name": choice.function.name}}
    active_tools = tools if choice != "none" else []
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        text = s.tokenizer.apply_chat_template(st.prepare_messages(messages, active_tools),
                                               add_generation_prompt=True)
    except Exception as e:  # DataError from the template: a message the template cannot render
        raise APIError(400, f"could not render the messages with the chat template: {e}", param="messages") from e
    prompt = s.tokenizer.encode(text)
    max_new = _budget(s, len(prompt), req.max_new, "max_completion_tokens")

    grammar, gparam, free_text = None, None, False
    try:
        if active_tools and choice != "auto":
            grammar, gparam = st.tool_grammar(active_tools, choice, req.parallel_tool_calls), "tools"
        elif req.response_format is not None and req.response_format.type != "text":
            grammar = st.response_format_grammar(req.response_format.to_dict())
            gparam = "response_format.json_schema.schema" if req.response_format.type == "json_schema" \
                else "response_format"
        elif active_tools:
            grammar, gparam = st.tool_grammar(active_tools, "auto", req.parallel_tool_calls), "tools"
            free_text = True
        if grammar is not None:
            st.check_grammar(grammar, s.tokenizer, gparam)
    except st.StructuredError as e:
        raise APIError(400, str(e), param=e.param or gparam) from None
    except ValueError as e:
        raise APIError(400, f"invalid schema: {e}", param=gparam) from None
    return _ChatPlan(prompt, max_new, active_tools, choice, grammar, free_text)


def _chat_jobs(req: ChatCompletionRequest, plan: _ChatPlan) -> list[tuple[list[int], SamplingParams]]:
    """One engine sequence per choice (`n`), each with its own grammar state and seed + i."""
    g = None if plan.grammar is None else st.Grammar(plan.grammar, max_tokens=plan.max_new, free_text=plan.free_text)
    return [(plan.prompt, _sampling(req, plan.max_new, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
                                    seed_offset=i, grammar=g)) for i in range(req.n)]


def _chat_message(req: ChatCompletionRequest, plan: _ChatPlan, c: _Choice) -> tuple[dict[str, Any], str]:
    """The final assistant message of a choice, tool calls parsed out, and its finish reason."""
    msg: dict[str, Any] = {"role": "assistant", "content": c.text}
    reason = c.finish_reason or "stop"
    if plan.tools:
        content, calls = st.parse_tool_calls(c.text, plan.tools)
        if calls:
            msg["content"], msg["tool_calls"] = content, calls if req.parallel_tool_calls else calls[:1]
            if reason in ("stop", "length"):  # complete calls; an unfinished trailing block is dropped
                reason = "tool_calls"
    return msg, reason


def _chat_logprobs(req: ChatCompletionRequest, entries: list[dict]) -> dict[str, Any] | None:
    """The engine's entries are OpenAI `content` items already (`sampling.logprob_entry`, top_logprobs of them)."""
    return {"content": entries} if req.logprobs else None


def _with_totals(s: ServerState, fan: _FanOut, created: float, body: dict[str, Any]) -> dict[str, Any]:
    """body + usage, time_info and (with --target) the wafer projection of this answer."""
    u, ti = fan.totals(created)
    body.update(usage=u, time_info=ti)
    proj = _projection_for(s, u["prompt_tokens"], u["completion_tokens"])
    if proj:
        body["wafer_projection"] = proj
    return body


async def _chat_response(request: Request, s: ServerState, req: ChatCompletionRequest, plan: _ChatPlan,
                         fan: _FanOut, events: AsyncIterator, base: dict[str, Any], created: float) -> JSONResponse:
    """The non-streaming answer: every choice run to completion, one chat.completion object."""
    await _drain(request, fan, events)
    choices = []
    for c in fan.choices:
        msg, reason = _chat_message(req, plan, c)
        choices.append({"index": c.index, "message": msg, "finish_reason": reason,
                        "logprobs": _chat_logprobs(req, c.logprobs)})
    return JSONResponse(_with_totals(s, fan, created, {**base, "object": "chat.completion", "choices": choices}))


async def _chat_chunks(s: ServerState, req: ChatCompletionRequest, plan: _ChatPlan, fan: _FanOut,
                       events: AsyncIterator, base: dict[str, Any], created: float) -> AsyncIterator[dict[str, Any]]:
    """The streaming answer's chunks: a role chunk per choice, then text deltas as they come. A reply that is
    (or, with tools on "auto", starts like) a tool call is held and sent parsed when its choice finishes.
    Usage goes on the last choice's final chunk, or with stream_options.include_usage on a chunk of its own."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    chunk = {**base, "object": "chat.completion.chunk"}
    mode = ["hold" if plan.hold_all else ("probe" if plan.tools else "text") for _ in fan.choices]
    sent = [0] * len(fan.choices)  # characters of c.text already sent
    lp_sent = [0] * len(fan.choices)
    for c in fan.choices:
        yield {**chunk, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]}
    async for i, out in events:
        c = fan.choices[i]
        if mode[i] == "probe":  # tools offered, auto: a reply starting with '<' is a tool call
            head = c.text.lstrip()
            if head:
                mode[i] = "hold" if head.startswith("<") else "text"
        delta: dict[str, Any] = {}
        if mode[i] == "text" and len(c.text) > sent[i]:
            delta["content"] = c.text[sent[i]:]
            sent[i] = len(c.text)
        logprobs = None
        if req.logprobs and len(c.logprobs) > lp_sent[i] and mode[i] == "text":
            logprobs = _chat_logprobs(req, c.logprobs[lp_sent[i]:])
            lp_sent[i] = len(c.logprobs)
        reason = None
        if out.finished:
            msg, reason = _chat_message(req, plan, c)
            if mode[i] != "text":
                if msg.get("tool_calls"):
                    if msg.get("content"):
                        yield {**chunk, "choices": [{"index": i, "delta": {"content": msg["content"]},
                                                     "logprobs": None, "finish_reason": None}]}
                    delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(msg["tool_calls"])]
                elif c.text[sent[i]:]:
                    delta["content"] = c.text[sent[i]:]
                sent[i] = len(c.text)
                if req.logprobs and len(c.logprobs) > lp_sent[i]:
                    logprobs = _chat_logprobs(req, c.logprobs[lp_sent[i]:])
        if delta or reason or logprobs:
            last = {**chunk, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
            if reason and all(x.finish_reason for x in fan.choices) and not include_usage:
                _with_totals(s, fan, created, last)
            yield last
    if include_usage:
        yield _with_totals(s, fan, created, {**chunk, "choices": []})


async def _begin(request: Request, cls: type) -> tuple[ServerState, float, float, Any]:
    """(state, start time, creation time, the parsed request) for a generation route; the model and the
    logit_bias are checked (APIError otherwise)."""
    s = _state(request)
    t0, created = time.perf_counter(), time.time()
    req = parse_request(cls, await _json_body(request))
    _check_model(s, req.model)
    for k in (req.logit_bias or {}):
        if not 0 <= int(k) < s.tokenizer.vocab_size:
            raise APIError(400, f"logit_bias names token id {k}, outside the vocabulary [0, "
                                f"{s.tokenizer.vocab_size})", param="logit_bias")
    return s, t0, created, req


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    s, t0, created, req = await _begin(request, ChatCompletionRequest)
    plan = _chat_plan(s, req)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    fan = _FanOut(s, rid, _chat_jobs(req, plan), t0, req.n)
    base = {"id": rid, "created": int(created), "model": s.model_id, "system_fingerprint": s.fingerprint}
    events = await _start(fan)
    if not req.stream:
        return await _chat_response(request, s, req, plan, fan, events, base, created)
    return _event_stream(fan, _chat_chunks(s, req, plan, fan, events, base, created))


# ---- completions --------------------------------------------------------------------------------------------
def _prompts(s: ServerState, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [s.tokenizer.encode(p)]
    if not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        out = [list(p)]
    elif all(isinstance(x, str) for x in p):
        out = [s.tokenizer.encode(x) for x in p]
    else:
        out = [list(x) for x in p]
    for ids in out:
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < s.tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, "
                                f"{s.tokenizer.vocab_size})", param="prompt")
    return out


def _legacy_logprobs(entries: list[dict], k: int, offset0: int) -> dict[str, Any]:
    tokens, lps, tops, offs = [], [], [], []
    off = offset0
    for e in entries:
        tokens.append(e["token"])
        lps.append(e["logprob"])
        tops.append({t["token"]: t["logprob"] for t in (e.get("top_logprobs") or [])[:k]})
        offs.append(off)
        off += len(e["token"])
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    s, t0, created, req = await _begin(request, CompletionRequest)
    if req.suffix:
        raise APIError(400, "suffix is not supported by this model", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    prompts = _prompts(s, req)
    if len(prompts) * req.n > 64:
        raise APIError(400, f"{len(prompts)} prompts x n={req.n} is more than 64 sequences", param="prompt")
    budgets = [_budget(s, len(p), req.max_new, "max_tokens") for p in prompts]
    k = req.logprobs
    jobs = [(p, _sampling(req, b, logprobs=k is not None, top_logprobs=k or 0, seed_offset=i))
            for p, b in zip(prompts, budgets) for i in range(req.n)]
    rid = f"cmpl-{uuid.uuid4().hex}"
    fan = _FanOut(s, rid, jobs, t0, req.n)
    base = {"id": rid, "object": "text_completion", "created": int(created), "model": s.model_id,
            "system_fingerprint": s.fingerprint}
    echo = [s.tokenizer.decode(p) if req.echo else "" for p in prompts for _ in range(req.n)]  # per choice
    events = await _start(fan)

    if not req.stream:
        await _drain(request, fan, events)
        choices = [{"index": c.index, "text": echo[c.index] + c.text, "finish_reason": c.finish_reason,
                    "logprobs": _legacy_logprobs(c.logprobs, k, len(echo[c.index])) if k is not None else None}
                   for c in fan.choices]
        return JSONResponse(_with_totals(s, fan, created, {**base, "choices": choices}))

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def chunks() -> AsyncIterator[dict[str, Any]]:
        sent = [0] * len(fan.choices)
        lp_sent = [0] * len(fan.choices)
        if req.echo:
            for c in fan.choices:
                yield {**base, "choices": [{"index": c.index, "text": echo[c.index], "logprobs": None,
                                            "finish_reason": None}]}
        async for i, out in events:
            c = fan.choices[i]
            piece = c.text[sent[i]:]
            sent[i] = len(c.text)
            lps = None
            if k is not None and len(c.logprobs) > lp_sent[i]:
                lps = _legacy_logprobs(c.logprobs[lp_sent[i]:], k, 0)
                lp_sent[i] = len(c.logprobs)
            if piece or out.finished or lps:
                chunk = {**base, "choices": [{"index": i, "text": piece, "logprobs": lps,
                                              "finish_reason": c.finish_reason if out.finished else None}]}
                if out.finished and all(x.finish_reason for x in fan.choices) and not include_usage:
                    u, ti = fan.totals(created)
                    chunk.update(usage=u, time_info=ti)
                yield chunk
        if include_usage:
            u, ti = fan.totals(created)
            yield {**base, "choices": [], "usage": u, "time_info": ti}

    return _event_stream(fan, chunks())
