"""Structured output and tool calling by grammar-constrained decoding (llguidance).

`response_format` (json_object / json_schema) and `tools` + `tool_choice` become one llguidance grammar per
request; `Constraint.logits_processor` is the engine's hook `(generated ids, (V,) logits) -> masked logits`:
each call feeds the ids generated since the last call to an `llguidance.LLMatcher` and sets every logit the
grammar forbids to -inf. When the grammar is complete only the end-of-sequence token stays allowed, so an
output that ends with finish_reason "stop" always parses (and validates against the schema).

Tools follow the Hermes / Qwen convention, since SmolLM2's chat template has no tool block of its own:
the function signatures go into the system prompt inside `<tools></tools>`, the model answers with
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, and `parse_tool_calls` turns those into
OpenAI `tool_calls`. tool_choice "required" / a named function constrain the output to such blocks; "auto"
constrains it to "free text not starting with '<'" or tool-call blocks, so arguments are valid JSON either way.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["StructuredError", "Constraint", "ToolSpec", "ll_tokenizer", "response_format_grammar",
           "calls_schema", "tool_grammar", "check_grammar", "render_tools_prompt", "prepare_messages",
           "parse_tool_calls", "TOOL_CALL_OPEN", "TOOL_CALL_CLOSE"]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# Compact, fixed separators: a small model cannot loop on whitespace, and outputs look like json.dumps().
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredError(ValueError):
    """A response_format / tools request we cannot turn into a grammar. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    """One OpenAI function tool: name, JSON-schema parameters, strict flag."""

    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool = False

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


# ---- tokenizer bridge ---------------------------------------------------------------------------------------
_LL_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4)
def _ll_tokenizer_cached(tokenizer_json: str, n_vocab: int, eos_id: int) -> Any:
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos_id)


def ll_tokenizer(tokenizer: Any) -> Any:
    """The llguidance tokenizer for a waferscale HFTokenizer (built once per tokenizer, ~0.3 s)."""
    if not hasattr(tokenizer, "tk") or tokenizer.eos_id is None:
        raise StructuredError("structured output needs a Hugging Face BPE tokenizer with an end-of-sequence token")
    with _LL_LOCK:
        return _ll_tokenizer_cached(tokenizer.tk.to_str(), tokenizer.vocab_size, tokenizer.eos_id)


# ---- grammars -----------------------------------------------------------------------------------------------
def _with_options(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}


def response_format_grammar(response_format: dict[str, Any] | None) -> str | None:
    """llguidance grammar for an OpenAI `response_format`, or None for plain text.

    {"type": "text"} -> None; {"type": "json_object"} -> any JSON object; {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}} -> JSON valid against `schema`.
    """
    import llguidance

    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_with_options({"type": "object"}))
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict):
            raise StructuredError("response_format.json_schema must be an object {name, schema, strict}",
                                  "response_format.json_schema")
        name = js.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise StructuredError("response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'",
                                  "response_format.json_schema.name")
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise StructuredError("response_format.json_schema.schema must be a JSON Schema object",
                                  "response_format.json_schema.schema")
        return llguidance.LLMatcher.grammar_from_json_schema(_with_options(schema))
    raise StructuredError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "response_format.type")


# Keywords whose values are data, not schemas (a "$ref" in them is not a reference), and keywords whose values
# map names to schemas (a property may be called "const" or "$ref").
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rewrite_refs(schema: Any, root: str, moved: dict[tuple[str, str], str]) -> Any:
    """A copy of one tool's `schema` whose local `$ref`s point into the combined schema's `$defs`: to
    `moved[("$defs" or "definitions", name)]` for a definition of the tool's, else under `root` (its
    parameters)."""
    if isinstance(schema, list):
        return [_rewrite_refs(x, root, moved) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            segs = [s.replace("~1", "/").replace("~0", "~") for s in v[2:].split("/")] if v != "#" else []
            if len(segs) >= 2 and (segs[0], segs[1]) in moved:
                out[k] = _pointer(["$defs", moved[(segs[0], segs[1])], *segs[2:]])
            else:
                out[k] = _pointer(["$defs", root, *segs])
        elif k in _DATA_KEYWORDS or k == "$ref":  # data; a URL or an anchor: llguidance judges it
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _rewrite_refs(sub, root, moved) for name, sub in v.items()}
        else:
            out[k] = _rewrite_refs(v, root, moved)
    return out


def _pointer(segments: list[str]) -> str:
    """The `$ref` of a JSON pointer made of `segments` ('~' and '/' escaped)."""
    return "#" + "".join("/" + s.replace("~", "~0").replace("/", "~1") for s in segments)


def calls_schema(tools: list[ToolSpec]) -> dict[str, Any]:
    """Schema of one call object {"name": N, "arguments": <N's parameters>} of any of `tools`.

    A parameters schema's local references (`#/$defs/City`, pydantic's nested models) resolve from its own
    root, which is no longer the root once it sits inside the call object. So every tool's parameters and its
    `$defs` / `definitions` move to the `$defs` of the combined schema (a name taken by an earlier tool gets a
    suffix: two tools may each define a different `City`) and its `$ref`s are rewritten to point there.
    """
    defs: dict[str, Any] = {}

    def claim(base: str) -> str:
        name, k = base, 2
        while name in defs:
            name, k = f"{base}_{k}", k + 1
        defs[name] = None
        return name

    calls = []
    for t in tools:
        params = dict(t.parameters)
        own: dict[tuple[str, str], Any] = {}
        for kw in ("$defs", "definitions"):
            sub = params.pop(kw, {})
            if not isinstance(sub, dict):
                raise StructuredError(f"tool {t.name!r}: parameters.{kw} must be an object mapping names to "
                                      "schemas", "tools")
            own.update({(kw, name): s for name, s in sub.items()})
        root = claim(t.name)
        moved = {key: claim(key[1]) for key in own}
        defs[root] = _rewrite_refs(params, root, moved)
        for key, name in moved.items():
            defs[name] = _rewrite_refs(own[key], root, moved)
        calls.append({"type": "object", "properties": {"name": {"const": t.name},
                                                       "arguments": {"$ref": _pointer(["$defs", root])}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    return {**({"anyOf": calls} if len(calls) > 1 else calls[0]), "$defs": defs}


def tool_grammar(tools: list[ToolSpec], tool_choice: Any, parallel_tool_calls: bool) -> str | None:
    """Lark grammar (llguidance dialect, `%json` for the arguments) for the tool-call part of an answer.

    tool_choice "none" -> None (no tools offered); "auto" -> free text that does not start with '<', or
    tool-call blocks; "required" -> one (or, with parallel_tool_calls, several) tool-call blocks;
    {"type": "function", "function": {"name": N}} -> exactly one call of N.
    """
    import llguidance

    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen = [t for t in tools if t.name == name]
        allow_text, many = False, False
    else:
        chosen, allow_text, many = tools, tool_choice == "auto", parallel_tool_calls
    schema = _with_options(calls_schema(chosen))
    start = 'calls | TEXT | ""' if allow_text else "calls"
    rules = [f"start: {start}",
             f'calls: {"call+" if many else "call"}',
             f'call: "{TOOL_CALL_OPEN}\\n" %json {json.dumps(schema)} "\\n{TOOL_CALL_CLOSE}" "\\n"?']
    if allow_text:
        rules.append(r"TEXT: /[^<](.|\n)*/")
    return llguidance.LLMatcher.grammar_from_lark("\n".join(rules) + "\n")


def check_grammar(grammar: str, tokenizer: Any, param: str) -> None:
    """StructuredError (naming `param`) when llguidance rejects the grammar, e.g. an invalid JSON schema."""
    import llguidance

    try:
        err = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    except ValueError as e:
        err = str(e)
    if err:
        raise StructuredError(f"invalid schema for constrained decoding: {err.splitlines()[0][:300]}", param)


@functools.lru_cache(maxsize=4)
def _closer_ids(tokenizer_json: str, vocab: int) -> np.ndarray:
    """Ids of tokens made only of JSON closers (`"`, `}`, `]`, `,`, spaces): the ones that end a value."""
    from tokenizers import Tokenizer as _TK

    tk = _TK.from_str(tokenizer_json)
    ids = [i for i in range(vocab)
           if (t := tk.decode([i])).strip() and set(t) <= set('"}],') | {" "} and len(t) <= 4]
    return np.array(ids, dtype=np.int64)


@dataclass(frozen=True)
class Grammar:
    """A constrained-decoding request as plain data (it crosses to the engine's process): the grammar and the
    Constraint's options. The engine builds the Constraint, with its own tokenizer, when the request arrives."""

    grammar: str
    max_tokens: int | None = None
    free_text: bool = False

    def constraint(self, tokenizer: Any) -> Constraint:
        return Constraint(self.grammar, tokenizer, max_tokens=self.max_tokens, free_text=self.free_text)


class Constraint:
    """One sequence's grammar state. `logits_processor` is handed to the engine in SamplingParams.

    A small model can get stuck inside a constrained value (a number of endless 1s, the same call again and
    again). So the processor *closes*: once the token budget is nearly spent (`max_tokens` given), after the
    same token 8 times in a row, or when a tool call repeats an earlier one, it keeps only allowed tokens that
    end a value (quotes, brackets, commas, end of sequence) whenever there are any. The answer then still
    parses and validates, where a plain mask would be cut off by max_tokens mid-value.
    """

    REPEAT = 8

    def __init__(self, grammar: str, tokenizer: Any, *, max_tokens: int | None = None, free_text: bool = False):
        import llguidance

        self.tokenizer = tokenizer
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise StructuredError(f"invalid grammar: {self.matcher.get_error().splitlines()[0][:300]}")
        self.consumed = 0
        self.vocab = tokenizer.vocab_size
        self.eos_id = tokenizer.eos_id
        self.max_tokens = max_tokens
        self.reserve = min(32, max(4, max_tokens // 4)) if max_tokens else 0  # tokens kept for closing
        self.closing = False
        self._closers: np.ndarray | None = None
        self.free_text = free_text  # tool_choice auto: a plain-text answer is never steered

    def _closer_mask(self) -> np.ndarray:
        if self._closers is None:
            ids = _closer_ids(self.tokenizer.tk.to_str(), self.vocab)
            m = np.zeros(self.vocab, dtype=bool)
            m[ids] = True
            m[self.eos_id] = True
            self._closers = m
        return self._closers

    def _should_close(self, generated: list[int]) -> bool:
        if self.free_text and not self.tokenizer.decode(generated[:4]).lstrip().startswith("<"):
            return False
        if self.max_tokens is not None and self.max_tokens - len(generated) <= self.reserve:
            return True
        tail = generated[-self.REPEAT:]
        if len(tail) == self.REPEAT and len(set(tail)) == 1:
            return True
        if generated and TOOL_CALL_CLOSE[-2:] in self.tokenizer.decode(generated[-2:]):
            calls = _CALL_RE.findall(self.tokenizer.decode(generated))
            if len(calls) != len(set(calls)):
                return True
        return False

    def _close(self, generated: list[int], allowed: np.ndarray) -> np.ndarray:
        """The allowed tokens that end the answer soonest: end of sequence; else, inside a JSON string, a
        closing quote; else a closing bracket; else a comma; else (a forced key, a first digit) all allowed."""
        if allowed[self.eos_id]:
            out = np.zeros_like(allowed)
            out[self.eos_id] = True
            return out
        cand = allowed & self._closer_mask()
        if not cand.any():
            return allowed
        ids = np.flatnonzero(cand)
        texts = {int(i): self.tokenizer.decode([int(i)]) for i in ids}
        text = self.tokenizer.decode(generated)
        in_string = len(re.findall(r'(?<!\\)"', text)) % 2 == 1
        q = lambda t: t.count('"')  # noqa: E731
        tiers = ([lambda t: t.lstrip().startswith('"') and q(t) == 1 and "," not in t,
                  lambda t: t.lstrip().startswith('"') and q(t) == 1] if in_string else []) + \
            [lambda t: q(t) == 0 and "," not in t, lambda t: q(t) == 0, lambda t: q(t) % 2 == 0, lambda t: True]
        for keep in tiers:
            chosen = [i for i, t in texts.items() if keep(t)]
            if chosen:
                out = np.zeros_like(allowed)
                out[chosen] = True
                return out
        return allowed

    def logits_processor(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        """(ids generated so far, (V,) logits) -> logits with every forbidden token at -inf. V may exceed the
        tokenizer's vocabulary (padded embeddings); those extra ids are always forbidden."""
        m = self.matcher
        new = generated[self.consumed:]
        if new and not m.is_error():
            m.consume_tokens([int(t) for t in new])
        self.consumed = len(generated)
        if m.is_error():  # cannot happen when the engine honours the mask; end the answer rather than derail
            allowed = np.zeros(self.vocab, dtype=bool)
            allowed[self.eos_id] = True
        else:
            bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)
            if self.closing or self._should_close(generated):
                self.closing = True
                allowed = self._close(generated, allowed)
        mask = torch.full((logits.shape[-1],), True)
        mask[: self.vocab] = torch.from_numpy(~allowed)
        return logits.masked_fill(mask.to(logits.device), float("-inf"))


# ---- chat messages with tools -------------------------------------------------------------------------------
def render_tools_prompt(tools: list[ToolSpec]) -> str:
    """Hermes / Qwen-style tool instructions, appended to the system prompt."""
    sigs = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{sigs}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n"
            f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_CLOSE}')


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def prepare_messages(messages: list[dict[str, Any]], tools: list[ToolSpec] | None) -> list[dict[str, str]]:
    """OpenAI messages -> plain {"role", "content"} dicts the ChatML template renders.

    Content parts are joined; an assistant's `tool_calls` become `<tool_call>` blocks in its content; a
    `tool` message becomes a user turn holding `<tool_response>...</tool_response>` (Qwen's convention); the
    tool instructions join the system prompt (a system turn is added when there is none).
    """
    out: list[dict[str, str]] = []
    for m in messages:
        role, text = m["role"], _text_of(m.get("content"))
        if role == "developer":
            role = "system"
        if role == "assistant" and m.get("tool_calls"):
            blocks = []
            for c in m["tool_calls"]:
                fn = c.get("function", {})
                args = fn.get("arguments", "{}")
                try:
                    args_obj = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    args_obj = args
                blocks.append(f"{TOOL_CALL_OPEN}\n" + json.dumps({"name": fn.get("name"), "arguments": args_obj},
                                                                 ensure_ascii=False) + f"\n{TOOL_CALL_CLOSE}")
            text = "\n".join([text, *blocks] if text else blocks)
        if role == "tool":
            resp = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1]["content"] += "\n" + resp  # several results of one parallel call: one turn
                continue
            role, text = "user", resp
        out.append({"role": role, "content": text})
    if tools:
        instructions = render_tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{instructions}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.S)


def parse_tool_calls(text: str, tools: list[ToolSpec]) -> tuple[str | None, list[dict[str, Any]]]:
    """Split an answer into (content, OpenAI tool_calls). A block whose JSON does not parse, or names an
    unknown function, is left in the content; the arguments come back as a JSON string, as OpenAI sends them."""
    names = {t.name for t in tools}
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    seen: set[str] = set()
    pos = 0
    for mt in _CALL_RE.finditer(text):
        try:
            obj = json.loads(mt.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        kept.append(text[pos:mt.start()])
        pos = mt.end()
        key = json.dumps([obj["name"], args], sort_keys=True)
        if key in seen:  # a small model repeating itself: one call is enough
            continue
        seen.add(key)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    rest = text[pos:]
    cut = rest.rfind(TOOL_CALL_OPEN)
    if calls and cut >= 0 and TOOL_CALL_CLOSE not in rest[cut:]:  # an unfinished block cut off by max_tokens
        rest = rest[:cut]
    kept.append(rest)
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else content, calls
