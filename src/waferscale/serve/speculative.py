"""Prompt-lookup (n-gram) speculative decoding in the serving engine, as vLLM's `ngram` method.

Before a step, each decoding sequence that speculates looks up the last n tokens of its text (prompt + output,
n from `prompt_lookup_max` down to `prompt_lookup_min`) at their most recent earlier occurrence and drafts the
K tokens that followed there (`NgramProposer`). The scheduler feeds the sequence's last token and its drafts as
one chunk of K + 1 positions over its paged KV (like a small prefill chunk, batched with other sequences'
decodes); the runner returns logits for all K + 1 of them, and `verify` turns them into tokens:

- greedy: the drafts are accepted while each equals the target's argmax at its position, and the target's own
  token follows the last accepted one, so the text is exactly what decoding one token at a time gives;
- sampled: draft d (a deterministic draft: q = one-hot at d) is accepted with probability p(d), p being the
  target distribution after the request's penalties, bias, temperature, top-k and top-p; on rejection the token
  is drawn from p with d removed and renormalised, and the round ends. Each emitted token then has law p,
  exactly (Leviathan et al. 2023, with q one-hot). When every draft is accepted, one more token is drawn from
  the last position.

The KV written at rejected positions is not rolled back by copying: the sequence's computed length stops at its
last accepted token, so those slots are overwritten by the next step's tokens before any query reads them.
Requests with structured output (a grammar or a logits processor whose state follows the generated ids) do
not speculate.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch
from torch import Tensor

from waferscale.errors import ConfigError
from waferscale.serve.sampling import RequestSampler, argmax_rows

__all__ = ["METHODS", "NgramProposer", "NgramSpeculation", "speculation", "verify"]

METHODS = ("ngram",)
DEFAULT_LOOKUP = 5  # vLLM's default for both prompt_lookup_min and prompt_lookup_max


@dataclass(frozen=True)
class NgramSpeculation:
    """How the engine speculates: `k` drafted tokens per step, looked up from n-grams of `min_n`..`max_n`."""

    k: int
    max_n: int = DEFAULT_LOOKUP
    min_n: int = DEFAULT_LOOKUP

    def __post_init__(self) -> None:
        for flag, v in (("--num_speculative_tokens", self.k), ("--prompt_lookup_max", self.max_n),
                        ("--prompt_lookup_min", self.min_n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{flag} must be an integer >= 1, got {v!r}")
        if self.min_n > self.max_n:
            raise ConfigError(f"--prompt_lookup_min ({self.min_n}) must not exceed --prompt_lookup_max "
                              f"({self.max_n})")


def speculation(method: str | None, k: int | None, max_n: int | None = None,
                min_n: int | None = None) -> NgramSpeculation | None:
    """`wsc serve` / `wsc generate`'s flags as a NgramSpeculation (None without --speculative); ConfigError on an
    unknown method, a missing or bad K, or a lookup flag without --speculative. As in vLLM, one lookup bound
    given alone sets both, and neither given means 5."""
    if method is None:
        given = [f for f, v in (("--num_speculative_tokens", k), ("--prompt_lookup_max", max_n),
                                ("--prompt_lookup_min", min_n)) if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} need(s) --speculative ngram")
        return None
    if method not in METHODS:
        hint = " (a draft model is projected on the wafer by wsc compile --speculative draft)" \
            if method == "draft" else ""
        raise ConfigError(f"--speculative must be one of {', '.join(METHODS)}, got {method!r}{hint}")
    if k is None:
        raise ConfigError("--speculative ngram needs --num_speculative_tokens K (tokens drafted per step, >= 1)")
    if max_n is None and min_n is None:
        max_n = min_n = DEFAULT_LOOKUP
    return NgramSpeculation(k, max_n if max_n is not None else min_n, min_n if min_n is not None else max_n)


class NgramProposer:
    """One sequence's tokens as int32 bytes, so that the n-gram lookup is one `bytearray.rfind` (C) per n."""

    def __init__(self, spec: NgramSpeculation, token_ids: list[int]) -> None:
        self.spec = spec
        self.buf = bytearray(array.array("i", token_ids).tobytes())

    def extend(self, token_ids: list[int]) -> None:
        self.buf += array.array("i", token_ids).tobytes()

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram
        (n in [min_n, max_n]); [] when none occurs."""
        buf, sp = self.buf, self.spec
        L = len(buf) // 4
        if k < 1:
            return []
        for n in range(min(sp.max_n, L - 1), sp.min_n - 1, -1):
            pat = bytes(buf[4 * (L - n):])
            end = 4 * (L - 1)  # the match must end before the last token, so that a token follows it
            pos = buf.rfind(pat, 0, end)
            while pos >= 0 and pos % 4:  # a match that straddles token boundaries: look further back
                pos = buf.rfind(pat, 0, pos + len(pat) - 1)
            if pos >= 0:
                t = pos // 4 + n
                return array.array("i", bytes(buf[4 * t:4 * min(L, t + k)])).tolist()
        return []


def verify(sampler: RequestSampler, logits: Tensor, drafts: list[int], history: list[int],
           vocab_limit: int | None) -> tuple[list[int], int]:
    """logits: (len(drafts) + 1, V) raw logits of the positions that verify `drafts` (row j predicts the token
    drafted as drafts[j]; the last row the token after them). history: the ids generated before them. Returns
    (the tokens to emit: the accepted drafts and the target's own next token, the number of drafts accepted)."""
    p = sampler.p
    if p.plain_greedy:  # one batched argmax over every row
        target = argmax_rows(logits, vocab_limit)
        m = 0
        while m < len(drafts) and drafts[m] == target[m]:
            m += 1
        return drafts[:m] + [target[m]], m
    out: list[int] = []
    for j, d in enumerate(drafts):
        x = sampler.process(logits[j], history + out)
        if p.greedy:
            t = int(x.argmax())
            out.append(t)
            if t != d:
                return out, j
            continue
        probs = sampler.probs(x)
        if float(torch.rand((), generator=sampler.generator)) < float(probs[d]):
            out.append(d)
            continue
        probs[d] = 0.0  # the residual max(p - q, 0) of a one-hot draft q, renormalised by multinomial
        out.append(int(torch.multinomial(probs, 1, generator=sampler.generator)))
        return out, j
    out.append(sampler.sample(sampler.process(logits[len(drafts)], history + out)))  # every draft accepted
    return out, len(drafts)
