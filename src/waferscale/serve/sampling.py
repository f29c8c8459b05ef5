"""Per-request sampling: penalties, logit bias, the structured-output hook, temperature / top-k / top-p with a
per-request `torch.Generator`, logprobs; and the incremental detokenizer that withholds stop strings. The one
home of sampling: `wsc serve` and `wsc generate` (serve/llm.py) both draw through `RequestSampler`.

A request's random stream is its own generator (seeded from `seed`, else from the OS), drawn only for that
request's rows, so a seeded request samples the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from waferscale.serve import kernels

MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # the one greedy rule: temperature 0 (as vLLM, anything below 1e-5) takes the argmax


@dataclass
class SamplingParams:
    """How one request samples. Validated here (ValueError naming the field); the server checks first."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # at most 4; never emitted
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # continuations: the server and LLM fan them out (seed + i); the engine runs one per request
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    # structured-output hook: (generated ids, (V,) float32 logits) -> masked logits; called before sampling
    logits_processor: Callable[[list[int], Tensor], Tensor] | None = None
    # or, as plain data that can cross processes: a structured.Grammar, built by the engine into the hook
    grammar: Any = None

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> None:
            raise ValueError(f"SamplingParams.{name}: {msg}")

        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad("top_k", f"must be >= 0 (0 turns it off), got {self.top_k}")
        if self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if len(self.stop) > MAX_STOP_SEQUENCES:
            bad("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(self.stop)}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", f"must be a positive integer, got {self.n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that looks at or changes the logits row: the batched argmax fast path."""
        return (self.greedy and not self.logprobs and self.logits_processor is None and self.grammar is None
                and not self.logit_bias and not self.presence_penalty and not self.frequency_penalty and self.min_tokens == 0)


class RequestSampler:
    """Samples the tokens of one request, row by row. Holds its generator and its banned-until-min ids."""

    def __init__(self, params: SamplingParams, eos_ids: list[int], vocab_limit: int | None) -> None:
        self.p = params
        self.eos_ids = sorted(set(eos_ids) | set(params.stop_token_ids))
        self.vocab_limit = vocab_limit
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else int(torch.seed()) & (2**63 - 1))

    def process(self, logits: Tensor, output_ids: list[int]) -> Tensor:
        """(V,) raw logits -> (V,) float32 logits that sampling draws from (bias, penalties, min_tokens, hook)."""
        p = self.p
        x = logits.float().clone()
        V = x.shape[-1]
        if self.vocab_limit is not None and self.vocab_limit < V:
            x[self.vocab_limit:] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor([i for i in p.logit_bias if 0 <= i < V], dtype=torch.long)
            if ids.numel():
                x.index_add_(0, ids, torch.tensor([float(p.logit_bias[int(i)]) for i in ids]))
        if output_ids and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=V)[:V].float()
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if len(output_ids) < p.min_tokens and self.eos_ids:
            x[[i for i in self.eos_ids if i < V]] = float("-inf")
        if p.logits_processor is not None:
            x = p.logits_processor(list(output_ids), x)
        return x

    def sample(self, x: Tensor) -> int:
        """(V,) processed logits -> one token id."""
        if self.p.greedy:
            return int(x.argmax())
        return int(torch.multinomial(self.probs(x), 1, generator=self.generator))

    def probs(self, x: Tensor) -> Tensor:
        """(V,) processed logits -> (V,) the distribution a non-greedy request draws from (temperature, top-k,
        top-p)."""
        p = self.p
        x = x / p.temperature
        if p.top_k and p.top_k < x.shape[-1]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = x.sort(descending=True)
            probs = sorted_x.softmax(-1)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
            x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
        return x.softmax(-1)


def argmax_rows(logits: Tensor, vocab_limit: int | None = None) -> list[int]:
    """(B, V) logits -> each row's argmax over the ids below `vocab_limit`."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.stride(-1) == 1 and \
            kernels.available():
        return kernels.argmax_rows(logits, vocab_limit)  # one C pass over each row (torch's argmax: ~5x slower)
    return logits[:, :vocab_limit].argmax(-1).tolist()


def sample_rows(logits: Tensor, rows: list[tuple[RequestSampler, list[int]]],
                vocab_limit: int | None = None) -> list[tuple[int, Tensor | None]]:
    """(B, V) raw logits, one (sampler, generated ids) per row -> [(token id, (V,) log-softmax or None)].

    Plain greedy rows share one batched argmax (over ids below `vocab_limit`); every other row is processed
    and sampled on its own, with its own generator.
    """
    out: list[tuple[int, Tensor | None]] = [(0, None)] * len(rows)
    fast = [i for i, (s, _) in enumerate(rows) if s.p.plain_greedy]
    if fast:
        tokens = argmax_rows(logits[fast] if len(fast) < len(rows) else logits, vocab_limit)
        for i, t in zip(fast, tokens):
            out[i] = (t, None)
    for i, (s, ids) in enumerate(rows):
        if s.p.plain_greedy:
            continue
        tok = s.sample(s.process(logits[i], ids))
        out[i] = (tok, torch.log_softmax(logits[i, :vocab_limit].float(), -1) if s.p.logprobs else None)
    return out


# ---- logprobs ------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenBytes:
    """id -> (text, utf-8 bytes) of one token, as OpenAI logprobs report it. Byte-level BPE tokens map back
    through GPT-2's byte alphabet; special tokens and other tokenizers use their text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        decoder = getattr(getattr(tokenizer, "tk", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw = None
        if self.byte_level:
            piece = self.tok.id_to_token(token_id)
            dec = _byte_decoder()
            if piece is not None and all(ch in dec for ch in piece):
                raw = bytes(dec[ch] for ch in piece)
        if raw is None:
            raw = self.tok.decode([token_id]).encode("utf-8")
        hit = (raw.decode("utf-8", errors="replace"), list(raw))
        self._cache[token_id] = hit
        return hit


def logprob_entry(token_bytes: TokenBytes, token_id: int, logprobs: Tensor, top: int) -> dict:
    """One OpenAI logprobs `content` item for a sampled token: its logprob and the `top` most likely."""
    text, raw = token_bytes(token_id)
    entry: dict[str, Any] = {"token": text, "logprob": float(logprobs[token_id]), "bytes": raw, "top_logprobs": []}
    if top:
        vals, ids = torch.topk(logprobs, top)
        for v, i in zip(vals.tolist(), ids.tolist()):
            t, b = token_bytes(i)
            entry["top_logprobs"].append({"token": t, "logprob": float(v), "bytes": b})
    return entry


# ---- incremental detokenization with stop strings ------------------------------------------------------

class Detokenizer:
    """Turns a growing list of token ids into text deltas; finds stop strings, which it never emits.

    Decodes only a short window (ids[prefix:]) per token, so the cost per token is constant, and emits what
    the newest tokens add to the window's text. The window starts on the prompt's last `PROMPT_CONTEXT` tokens:
    a SentencePiece decoder (Llama 2, Mistral, T5: pieces like "▁the") drops the space of the first token it
    decodes, so the first generated word decoded alone would lose its space; after the prompt's tail it keeps
    it, and the deltas add up to decode(prompt + generated) minus decode(prompt), as vLLM's incremental
    detokenizer does. A trailing U+FFFD (an incomplete UTF-8 sequence split across byte-level or byte-fallback
    tokens) waits for the next token. Text that could be the start of a stop string is withheld until it is
    resolved either way.
    """

    PROMPT_CONTEXT = 5  # one token carries the space; a few (vLLM takes 5) also cover byte pieces of a character

    def __init__(self, tokenizer: Any, stop: list[str], prompt_ids: Sequence[int] = ()) -> None:
        self.tok = tokenizer
        self.stop = list(stop)
        self.max_stop = max((len(s) for s in stop), default=0)
        self.ids: list[int] = list(prompt_ids[-self.PROMPT_CONTEXT:])  # the prompt's tail, then generated ids
        self.prefix = 0  # ids[prefix:read] decode to text already appended (or to the prompt's tail)
        self.read = len(self.ids)
        self.text = ""  # all generated text decoded so far (sent + withheld)
        self.sent = 0  # len of text already emitted

    def add(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Append one token; returns (text to emit now, hit a stop string)."""
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        new_text = self.tok.decode(self.ids[self.prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
        if not self.stop:
            return self._emit(len(self.text)), False
        if check_stop:
            start = max(0, self.sent - self.max_stop + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                delta = self.text[self.sent:cut] if cut > self.sent else ""
                self.text, self.sent = self.text[:cut], max(self.sent, cut)
                return delta, True
        return self._emit(len(self.text) - self._held()), False

    def _held(self) -> int:
        """Length of the longest tail of unsent text that is a proper prefix of a stop string."""
        tail = self.text[self.sent:]
        for n in range(min(len(tail), self.max_stop - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stop):
                return n
        return 0

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self.text[self.sent:upto]
        self.sent = upto
        return delta

    def flush(self) -> str:
        """At the end (length / eos / abort): everything still withheld, including an unfinished character."""
        rest = self.tok.decode(self.ids[self.prefix:])
        done = self.tok.decode(self.ids[self.prefix:self.read])
        if len(rest) > len(done):
            self.text += rest[len(done):]
            self.prefix = self.read = len(self.ids)
        return self._emit(len(self.text))
