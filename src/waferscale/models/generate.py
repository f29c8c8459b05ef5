"""Autoregressive sampling with a KV cache: prefill the prompt once, then one token per step."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from waferscale.models.layers import CausalLM


def sample_next(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> Tensor:
    """logits (B, V) -> token ids (B,). temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: CausalLM, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_ids: set[int] | None = None, vocab_limit: int | None = None) -> Iterator[int]:
    """Yield new token ids one at a time (for streaming); stops at a stop id (not yielded) or the limit.

    vocab_limit: sample only ids below it (a model's vocabulary is often padded past its tokenizer's).
    """
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    cfg = model.config
    device = model.head.lm_head.weight.device
    total = min(len(prompt) + max_new_tokens, cfg.max_seq_len)
    if len(prompt) >= cfg.max_seq_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; this model's context is {cfg.max_seq_len}")
    model.eval()
    caches = model.make_kv_caches(1, total, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed())
    logits = model(torch.tensor([prompt], device=device), 0, caches)[:, -1]  # (1, V)
    pos = len(prompt)
    while pos < total:
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = float("-inf")
        tok = sample_next(logits, temperature, top_k, top_p, gen)
        t = int(tok)
        if stop_ids and t in stop_ids:
            return
        yield t
        if pos + 1 >= total:
            return
        logits = model(tok.view(1, 1), pos, caches)[:, -1]
        pos += 1
