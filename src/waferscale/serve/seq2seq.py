"""An encoder-decoder's generation (T5), on the one sampler (`serve/sampling.py`'s `RequestSampler`, as every
decoder's): the input is encoded once, the cross-attention keys and values computed once, and the decoder runs
token by token from its start token with its self-attention KV cache. The serving engine batches decoders only;
this is the same sampling, one sequence at a time."""

from __future__ import annotations

import torch
from torch import Tensor

from waferscale.serve.sampling import RequestSampler, SamplingParams

__all__ = ["generate_seq2seq"]


@torch.no_grad()
def generate_seq2seq(model: torch.nn.Module, input_ids: list[int] | Tensor, params: SamplingParams,
                     eos_ids: list[int] | None = None, vocab_limit: int | None = None) -> list[int]:
    """The new token ids for one input, sampled as `params` says (greedy at temperature 0), up to
    `params.max_tokens`; an eos id ends it (not returned) unless `params.ignore_eos`. vocab_limit: the
    tokenizer's vocabulary size, where the model's embedding is padded past it (T5's 32,128 rows for 32,100
    tokens): the ids above are never drawn, as the serving engine does."""
    if params.stop:
        raise ValueError("SamplingParams.stop: stop strings are for the serving engine's decoders; an "
                         "encoder-decoder stops at its EOS or stop_token_ids")
    cfg = model.config
    device = next(model.parameters()).device
    x = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if x.dim() != 1 and not (x.dim() == 2 and x.shape[0] == 1):
        raise ValueError(f"generate_seq2seq takes one input sequence, got ids of shape {tuple(x.shape)}")
    x = x.reshape(1, -1)
    sampler = RequestSampler(params, [] if params.ignore_eos else list(eos_ids or []), vocab_limit)
    enc = model.encode(x)
    cross = model.cross_kv(enc)
    caches = model.make_kv_caches(1, params.max_tokens, dtype=enc.dtype, device=device)
    token = torch.full((1, 1), cfg.pad_token_id, dtype=torch.long, device=device)  # T5's decoder start
    out: list[int] = []
    for pos in range(params.max_tokens):
        logits = model.decode(token, None, pos, caches, cross)[0, -1]
        nxt = sampler.sample(sampler.process(logits, out))
        if nxt in sampler.eos_ids:
            break
        out.append(nxt)
        token = torch.full((1, 1), nxt, dtype=torch.long, device=device)
    return out
