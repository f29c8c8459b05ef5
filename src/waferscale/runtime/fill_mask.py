"""Fill-mask: what an encoder (BERT, RoBERTa) does where a decoder generates. The prompt's mask tokens ("[MASK]",
RoBERTa's "<mask>": the tokenizer's) are each replaced by the model's most likely token there, from one pass over
the whole prompt: the top sequence of transformers' fill-mask pipeline (`wsc generate` on an encoder)."""

from __future__ import annotations

import torch

from waferscale.data import HFTokenizer, Tokenizer
from waferscale.errors import ConfigError
from waferscale.models.layers import CausalLM

__all__ = ["fill_mask"]


@torch.no_grad()
def fill_mask(model: CausalLM, tok: Tokenizer, prompt: str) -> str:
    """`prompt` with every mask token replaced by `model`'s top prediction at its position.

    A Hugging Face tokenizer adds its special tokens ([CLS] ... [SEP], <s> ... </s>) as the pipeline's does, and
    the answer is decoded without them. ConfigError: no mask token in the prompt, or a prompt longer than the
    model's positions."""
    if tok.mask_id is None:
        raise ConfigError("this tokenizer has no mask token ([MASK] or <mask>), so there is nothing to fill; use the "
                          "encoder's own tokenizer")
    hf = isinstance(tok, HFTokenizer)
    ids = tok.encode(prompt, add_special_tokens=True) if hf else tok.encode(prompt)
    where = [i for i, t in enumerate(ids) if t == tok.mask_id]
    if not where:
        raise ConfigError(f"the prompt has no mask token {tok.mask_token!r}: an encoder fills in the prompt's "
                          f"{tok.mask_token} tokens, e.g. --prompt \"Paris is the {tok.mask_token} of France.\"")
    if len(ids) > model.config.max_seq_len:
        raise ConfigError(f"the prompt is {len(ids)} tokens, more than the model's {model.config.max_seq_len} "
                          f"positions; shorten it")
    x = torch.tensor([ids], device=next(model.parameters()).device)
    best = model(x)[0, where].argmax(-1).tolist()
    filled = list(ids)
    for i, t in zip(where, best):
        filled[i] = t
    return tok.decode(filled, skip_special_tokens=True) if hf else tok.decode(filled)
