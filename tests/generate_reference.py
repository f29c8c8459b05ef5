"""The reference the serving engine is judged against: the model's own forward over a contiguous KV cache, one
sequence, prompt once then one token a step, sampled by serve/sampling.py's `RequestSampler` (the one home of
temperature / top-k / top-p). No paging, no batching, no C kernels."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from waferscale.models.layers import CausalLM
from waferscale.serve.sampling import RequestSampler, SamplingParams


@torch.no_grad()
def generate(model: CausalLM, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_ids: set[int] | None = None, vocab_limit: int | None = None) -> Iterator[int]:
    """Yield new token ids one at a time; stops at a stop id (not yielded), the limit or the context.

    vocab_limit: sample only ids below it (a model's vocabulary is often padded past its tokenizer's).
    """
    cfg = model.config
    assert prompt and len(prompt) < cfg.max_seq_len, (len(prompt), cfg.max_seq_len)
    device = model.head.lm_head.weight.device
    total = min(len(prompt) + max_new_tokens, cfg.max_seq_len)
    model.eval()
    caches = model.make_kv_caches(1, total, device=device)
    sampler = RequestSampler(SamplingParams(temperature=temperature, top_k=top_k or 0,
                                            top_p=1.0 if top_p is None else top_p, seed=seed), [], vocab_limit)
    logits = model(torch.tensor([prompt], device=device), 0, caches)[0, -1]  # (V,)
    out: list[int] = []
    for pos in range(len(prompt), total):
        t = sampler.sample(sampler.process(logits.cpu(), out))
        if stop_ids and t in stop_ids:
            return
        out.append(t)
        yield t
        if pos + 1 < total:
            logits = model(torch.tensor([[t]], device=device), pos, caches)[0, -1]
