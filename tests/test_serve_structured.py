"""Structured output and tools: grammars, the logits processor, message rendering and tool-call parsing in
process; then json_schema / json_object / tool_choice end to end through a real server with the openai client.
A tiny random model is the hardest case for a grammar: whatever it emits must still parse and validate."""

from __future__ import annotations

import json
import random
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from serve_helpers import have_smollm2, run_server, tiny_model_dir, validate

pytestmark = pytest.mark.skipif(not have_smollm2(), reason="needs the SmolLM2 tokenizer (make setup)")
st = pytest.importorskip("waferscale.serve.structured")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "temp_c", "sunny", "kind", "tags"],
          "properties": {"city": {"type": "string", "maxLength": 16},
                         "temp_c": {"type": "integer", "minimum": -60, "maximum": 60},
                         "sunny": {"type": "boolean"}, "kind": {"enum": ["rain", "snow", "clear"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}}
WEATHER = st.ToolSpec("get_weather", "Weather in a city",
                      {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False})
ADD = st.ToolSpec("add", "Add two integers",
                  {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False})



# Tools from pydantic models with nested models: parameters with `$defs` and `$ref`s. No free keys (extra
# "forbid"): a random model would fill an open object with made-up keys until max_tokens.
class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    country: Literal["FR", "DE", "IT"]


class Trip(BaseModel):
    """A trip between two cities."""

    model_config = ConfigDict(extra="forbid")
    origin: City
    destination: City
    days: int = Field(ge=1, le=30)


class Node(BaseModel):
    """A tree: pydantic puts a recursive model in $defs and refers to it from the root."""

    model_config = ConfigDict(extra="forbid")
    label: str = Field(max_length=6)
    children: list[Node] = Field(max_length=2)


# A second tool with a different `City` of its own, draft-07 `definitions` and a pointer into its own root.
HOTEL = st.ToolSpec("book_hotel", "Book a hotel", {
    "type": "object", "additionalProperties": False, "required": ["city", "nights", "rooms", "stars"],
    "properties": {"city": {"$ref": "#/$defs/City"}, "nights": {"$ref": "#/definitions/Count"},
                   "rooms": {"$ref": "#/properties/nights"}, "stars": {"enum": [1, 2, 3]}},
    "$defs": {"City": {"type": "object", "additionalProperties": False, "required": ["zip"],
                       "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99}}}},
    "definitions": {"Count": {"type": "integer", "minimum": 1, "maximum": 9}}})


@pytest.fixture(scope="module")
def tok():
    from waferscale.data import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def sample(tok, grammar: str, seed: int, max_tokens: int = 120, **kw) -> tuple[str, bool]:
    """Drive a Constraint with random logits (a model that knows nothing): (text, ended with EOS)."""
    g = torch.Generator().manual_seed(seed)
    c = st.Constraint(grammar, tok, max_tokens=max_tokens, **kw)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = c.logits_processor(out, torch.randn(tok.vocab_size + 64, generator=g) * 3)
        assert torch.isinf(logits[tok.vocab_size:]).all()  # padded ids are never allowed
        t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        if t == tok.eos_id:
            return tok.decode(out), True
        out.append(t)
    return tok.decode(out), False


@pytest.mark.parametrize("seed", range(6))
def test_schema_outputs_validate_from_random_logits(tok, seed):
    text, ended = sample(tok, st.response_format_grammar({"type": "json_schema",
                                                          "json_schema": {"name": "w", "schema": SCHEMA}}), seed)
    assert ended, text
    validate(json.loads(text), SCHEMA)


def test_json_object_closes_within_budget(tok):
    # an unconstrained object from a random model would never end; the budget-aware closing ends it
    for seed in range(4):
        text, ended = sample(tok, st.response_format_grammar({"type": "json_object"}), seed, max_tokens=40)
        assert ended and isinstance(json.loads(text), dict), text


def test_tool_grammars(tok):
    for seed in range(3):
        text, ended = sample(tok, st.tool_grammar([WEATHER, ADD], "required", False), seed)
        content, calls = st.parse_tool_calls(text, [WEATHER, ADD])
        assert ended and len(calls) == 1 and not content, text
        fn = calls[0]["function"]
        validate(json.loads(fn["arguments"]), (WEATHER if fn["name"] == "get_weather" else ADD).parameters)
        text, _ = sample(tok, st.tool_grammar([WEATHER, ADD], {"type": "function", "function": {"name": "add"}},
                                              True), seed)
        _, calls = st.parse_tool_calls(text, [WEATHER, ADD])
        assert [c["function"]["name"] for c in calls] == ["add"]
    # auto: free text that does not start with '<' is never steered; '<' commits to a valid tool call
    g = st.tool_grammar([WEATHER], "auto", True)
    m = st.Constraint(g, tok)
    allowed = torch.isfinite(m.logits_processor([], torch.zeros(tok.vocab_size)))
    assert allowed.sum() > tok.vocab_size // 2 and allowed[tok.eos_id]
    assert not allowed[tok.encode("<b")[0]] if tok.encode("<b")[0] != tok.encode("<tool_call>")[0] else True


def test_tool_parameters_with_defs_and_refs(tok):
    """Each tool's references still resolve once its parameters sit inside the call object, with two different
    definitions named `City`: every call validates against its own tool's schema."""
    jsonschema = pytest.importorskip("jsonschema")
    tools = [st.ToolSpec("plan_trip", "", Trip.model_json_schema()), HOTEL,
             st.ToolSpec("tree", "", Node.model_json_schema())]
    called = set()
    for seed in range(4):  # seeds under which the random model calls each of the three tools
        text, ended = sample(tok, st.tool_grammar(tools, "required", False), seed, max_tokens=160)
        content, calls = st.parse_tool_calls(text, tools)
        assert ended and len(calls) == 1 and not content, text
        fn = calls[0]["function"]
        jsonschema.validate(json.loads(fn["arguments"]), next(t for t in tools if t.name == fn["name"]).parameters)
        called.add(fn["name"])
    assert called == {t.name for t in tools}


def test_invalid_schema_is_reported(tok):
    for bad in ({"type": "nonsense"}, {"type": "string", "pattern": "("}, {"$ref": "#/nowhere"}):
        g = st.response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": bad}})
        with pytest.raises(st.StructuredError) as e:
            st.check_grammar(g, tok, "response_format.json_schema.schema")
        assert e.value.param == "response_format.json_schema.schema"
    for bad in ({"$defs": ["City"]}, {"properties": {"a": {"$ref": "#/$defs/Missing"}}}):
        with pytest.raises(st.StructuredError) as e:
            st.check_grammar(st.tool_grammar([st.ToolSpec("f", "", bad)], "required", False), tok, "tools")
        assert e.value.param == "tools"
    with pytest.raises(st.StructuredError):
        st.response_format_grammar({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}})
    assert st.response_format_grammar({"type": "text"}) is None


def test_prepare_messages_and_parse_tool_calls():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo and Rome?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 3}'},
            {"role": "tool", "tool_call_id": "c2", "content": '{"temp_c": 19}'}]
    out = st.prepare_messages(msgs, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"].count("<tool_call>") == 2 and '"city": "Rome"' in out[2]["content"]
    assert out[3]["content"].count("<tool_response>") == 2
    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_w')
    content, calls = st.parse_tool_calls(text, [WEATHER])
    assert len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}  # deduplicated
    assert content.startswith("Sure.") and '"nope"' in content and "get_w" not in content.split("nope")[1]
    assert st.parse_tool_calls("no calls here", [WEATHER]) == ("no calls here", [])


# ---- through the server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(tmp_path_factory):
    openai = pytest.importorskip("openai")
    tmp = tmp_path_factory.mktemp("structured")
    with run_server(tiny_model_dir(tmp_path_factory.getbasetemp()), tmp) as s:
        yield openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.slow
def test_server_json_schema_and_object(client):
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Weather?"}],
                                       response_format=rf, max_completion_tokens=100, n=3, seed=11)
    for c in r.choices:
        assert c.finish_reason == "stop"
        validate(json.loads(c.message.content), SCHEMA)
    chunks = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "JSON!"}],
                                            response_format={"type": "json_object"}, max_completion_tokens=48,
                                            stream=True, seed=4)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


def test_server_tool_choice(client):
    tools = [WEATHER.to_openai(), ADD.to_openai()]
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    r = client.chat.completions.create(model="tiny-chat", messages=msgs, tools=tools, tool_choice="required",
                                       parallel_tool_calls=False, max_completion_tokens=80, seed=1)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    json.loads(c.message.tool_calls[0].function.arguments)
    r = client.chat.completions.create(model="tiny-chat", messages=msgs, tools=tools, max_completion_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "add"}}, seed=2)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and call.id.startswith("call_")
    validate(json.loads(call.function.arguments), ADD.parameters)
    # streamed: the call arrives as a tool_calls delta, finish_reason tool_calls
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=msgs, tools=tools, stream=True,
                                                 tool_choice="required", max_completion_tokens=80, seed=3))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name in ("add", "get_weather")
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    # the tool's result goes back in a later message; none: plain text, no tool calls
    follow = msgs + [{"role": "assistant", "content": None,
                      "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": "add", "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r = client.chat.completions.create(model="tiny-chat", messages=follow, tools=tools, tool_choice="none",
                                       max_completion_tokens=8, seed=4)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model="tiny-chat", messages=follow, tools=tools, tool_choice="auto",
                                       max_completion_tokens=60, seed=random.Random(0).randint(0, 99))
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    for tc in c.message.tool_calls or []:
        json.loads(tc.function.arguments)


@pytest.mark.assets
@pytest.mark.slow
def test_real_model_named_tool_call(tmp_path_factory):
    openai = pytest.importorskip("openai")
    with run_server("smollm2-135m-instruct", tmp_path_factory.mktemp("real-tools")) as s:
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=300)
        r = c.chat.completions.create(
            model="smollm2-135m-instruct", temperature=0, max_completion_tokens=60,
            messages=[{"role": "user", "content": "What's the weather in Paris?"}], tools=[WEATHER.to_openai()],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}


# ---- nested pydantic models through the client libraries users call -----------------------------------------
def _base_url(client) -> str:
    return str(client.base_url).rstrip("/")


def test_openai_pydantic_function_tool_and_bad_refs(client):
    openai = pytest.importorskip("openai")
    r = client.chat.completions.parse(model="tiny-chat", messages=[{"role": "user", "content": "Plan a trip."}],
                                      tools=[openai.pydantic_function_tool(Trip)], tool_choice="required",
                                      max_completion_tokens=150, seed=1)
    assert isinstance(r.choices[0].message.tool_calls[0].function.parsed_arguments, Trip)
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                       tools=[bad], tool_choice="required", max_completion_tokens=8)
    assert e.value.status_code == 400 and e.value.body["param"] == "tools" and "Missing" in e.value.body["message"]


def test_instructor_tools_mode(client):
    instructor = pytest.importorskip("instructor")
    ic = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    trip = ic.chat.completions.create(model="tiny-chat", response_model=Trip, max_retries=0, max_tokens=150,
                                      messages=[{"role": "user", "content": "Plan a trip."}], seed=2)
    assert isinstance(trip, Trip) and isinstance(trip.origin, City)


def test_langchain_bind_tools_and_structured_output(client):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model="tiny-chat", base_url=_base_url(client), api_key="none", max_retries=0,
                        max_tokens=150, seed=3, timeout=120)
    msg = llm.bind_tools([Trip], tool_choice="Trip").invoke("Plan a trip.")
    assert [c["name"] for c in msg.tool_calls] == ["Trip"]
    Trip.model_validate(msg.tool_calls[0]["args"])
    for method in ("function_calling", "json_schema"):
        assert isinstance(llm.with_structured_output(Trip, method=method).invoke("Plan a trip."), Trip)


@pytest.mark.slow
def test_litellm_tools(client, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its packaged copy: no fetch from the network
    litellm = pytest.importorskip("litellm")
    openai = pytest.importorskip("openai")
    r = litellm.completion(model="openai/tiny-chat", api_base=_base_url(client), api_key="none",
                           tools=[openai.pydantic_function_tool(Trip)], tool_choice="required", max_tokens=150,
                           messages=[{"role": "user", "content": "Plan a trip."}], seed=5, timeout=120)
    assert r.choices[0].finish_reason == "tool_calls"
    assert isinstance(Trip.model_validate_json(r.choices[0].message.tool_calls[0].function.arguments), Trip)
