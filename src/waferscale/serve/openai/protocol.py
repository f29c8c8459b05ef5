"""OpenAI / Cerebras wire types: request models (pydantic, strict types, unknown fields ignored), the error
envelope, and small builders for response objects.

Every validation failure becomes `APIError(400, ..., param="a.b")`; nothing here knows about the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from waferscale.serve.sampling import MAX_STOP_SEQUENCES as MAX_STOP, MAX_TOP_LOGPROBS  # as OpenAI and Cerebras

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "parse_request", "MAX_N", "MAX_STOP",
           "MAX_TOP_LOGPROBS"]

MAX_N = 16  # choices per request (each one is a sequence in the engine)


class APIError(Exception):
    """An error the client caused or must know about, rendered as the OpenAI envelope with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1 is not a string; unknown fields are ignored (clients send extras)
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: a response_format of type 'json_schema' needs a 'json_schema' object")
        return self

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.json_schema is not None:
            d["json_schema"] = {"name": self.json_schema.name, "schema": self.json_schema.schema_,
                                "strict": self.json_schema.strict}
        return d


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self


class _Sampling(_Strict):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension, used by benchmarks

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not k.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        return v


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)  # deprecated alias
    min_completion_tokens: int | None = Field(default=None, ge=0)
    min_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice: names function {self.tool_choice.function.name!r}, which is not "
                                 f"in tools ({', '.join(names) or 'none given'})")
        if self.tool_choice in ("required",) and not self.tools:
            raise ValueError("tool_choice: 'required' needs a non-empty 'tools' list")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def min_new(self) -> int:
        return self.min_completion_tokens or self.min_tokens or 0


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    min_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @property
    def max_new(self) -> int | None:
        return self.max_tokens

    @property
    def min_new(self) -> int:
        return self.min_tokens or 0


def _param_path(loc: tuple[Any, ...]) -> str:
    """pydantic's loc ('messages', 0, 'content', 'str') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("function-", "list[", "dict[", "literal[", "union[", "tagged-union[")) or \
                str(part) in ("str", "int", "float", "bool", "NamedToolChoice", "none", "list"):
            continue  # union-member tags add nothing for the user
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


def parse_request(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; APIError(400) naming the first bad field, without pydantic's dump."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        # prefer an error that is not a union-branch mismatch of a type we also accept
        first = min(errs, key=lambda er: (er["type"].endswith("_type") and len(errs) > 1, 0))
        param = _param_path(tuple(first["loc"]))
        msg = first["msg"].removeprefix("Value error, ")
        head, sep, rest = msg.partition(": ")
        if sep and head.replace("_", "").isalpha() and first["type"] == "value_error":  # "field: message"
            param = f"{param}.{head}" if param != "body" else head
            msg = rest
        if first["type"] == "missing":
            msg = f"'{param}' is required"
        elif first["type"] == "extra_forbidden":
            msg = f"unknown field '{param}'"
        else:
            msg = f"invalid '{param}': {msg}"
            if first["type"].endswith("_type") or first["type"].startswith(("literal", "enum")):
                got = repr(first.get("input"))
                msg += f" (got {got if len(got) <= 60 else got[:57] + '...'})"
        raise APIError(400, msg, param=param, code="invalid_value" if param != "body" else None) from None


def time_info(queue: float, prompt: float, completion: float, created: float) -> dict[str, float]:
    """Cerebras' time_info: seconds spent queued, on the prompt (prefill) and on the completion (decode)."""
    return {"queue_time": queue, "prompt_time": prompt, "completion_time": completion,
            "total_time": queue + prompt + completion, "created": created}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, drafted: int | None = None,
          accepted: int = 0) -> dict[str, Any]:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens whose KV came from the prefix cache.
    With speculative decoding (drafted not None), completion_tokens_details: the drafted tokens the model
    accepted and rejected (OpenAI's names for predicted outputs) and draft_acceptance_rate, accepted / drafted
    (null when nothing was drafted)."""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens,
         "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if drafted is not None:
        u["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted,
                                          "draft_acceptance_rate": accepted / drafted if drafted else None}
    return u
