"""BERT's pretraining examples (Devlin et al. 2019, as Google's create_pretraining_data makes them): sentence pairs
[CLS] A [SEP] B [SEP] for the next-sentence objective, masked for the masked-LM one.

Segments are fixed token spans of the token stream, not sentences: an example of T tokens reads a window of
n = T - 3 tokens (the loader's), A is its first a tokens (a drawn uniformly in [1, n - 1]) and B the next n - a:
half of the time the window's own continuation of A, otherwise n - a tokens from a start drawn uniformly over the
stream (a random segment; it coincides with the continuation only by chance, which Google's rule of drawing from
another document excludes). Every example fills its T tokens, so none is padded. Token types are 0 over
[CLS] A [SEP] and 1 over B [SEP]; the next-sentence label is 1 where B is random and 0 where it continues A
(transformers' next_sentence_label). Masking (`Masker`) never chooses [CLS] or [SEP].

What the executors carry is one (B, T) input and one (B, T) target per batch, so the pair rides in them:
  inputs   token id + type * vocab_size (the model's), which the encoder's embedding splits back (`EncoderEmbedding`)
  targets  the masked-LM labels, except at [CLS] (a position the masked LM never predicts), which holds the
           next-sentence label (`BERT.loss` reads it there)
Draws are pure functions of (seed, stream, batch index), so a resumed run makes exactly the examples the
uninterrupted one would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from waferscale.data.loader import BatchLoader
from waferscale.data.masking import EVAL_STREAM, TRAIN_STREAM, Masker
from waferscale.data.tokenizer import CharTokenizer, Tokenizer
from waferscale.errors import DataError

__all__ = ["PairBatches", "SentencePairs", "pair_token_ids", "tokenizer_with_pair_tokens"]

_PAIRS = 1  # a fourth entry in the draw's key: the pairs' draws differ from the masker's (seed, stream, k)


def pair_token_ids(tok: Tokenizer) -> tuple[int, int] | None:
    """([CLS], [SEP]) ids of the tokenizer, None if it lacks either."""
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    return None if cls_id is None or sep_id is None else (cls_id, sep_id)


def tokenizer_with_pair_tokens(tok: Tokenizer) -> Tokenizer:
    """`tok` if it has [CLS] and [SEP]; a character tokenizer gains them; any other must bring its own."""
    if pair_token_ids(tok) is not None:
        return tok
    if isinstance(tok, CharTokenizer):
        return tok.with_pair_tokens()
    raise DataError(f"the tokenizer ({tok!r}) has no [CLS] and [SEP] tokens, which BERT's next-sentence objective "
                    "needs; use BERT's WordPiece vocabulary or 'char'")


@dataclass(frozen=True)
class SentencePairs:
    """Windows (B, >= T - 3) of a token stream -> masked sentence-pair examples (inputs, targets), both (B, T)."""

    cls_id: int
    sep_id: int
    vocab_size: int  # the model's: token types ride in the inputs as type * vocab_size
    masker: Masker
    seq_len: int  # T

    def __post_init__(self) -> None:
        if self.seq_len < 5:
            raise DataError(f"sentence pairs need at least 5 tokens ([CLS] A [SEP] B [SEP]), got {self.seq_len}")
        if {self.cls_id, self.sep_id} - set(self.masker.special_ids):
            raise DataError("the sentence pairs' masker must never choose [CLS] or [SEP] (special_ids)")

    def make(self, windows: Tensor, tokens: np.ndarray, k: int, stream: int = TRAIN_STREAM) -> tuple[Tensor, Tensor]:
        """Draw k of `stream`: examples from `windows` (B, >= T - 3), random segments from `tokens` (1-D)."""
        T = self.seq_len
        n = T - 3
        w = windows.numpy()[:, :n]
        B = w.shape[0]
        if w.shape[1] < n or len(tokens) < n:
            raise DataError(f"sentence pairs of {T} tokens read windows of {n} tokens, got {w.shape[1]} "
                            f"(and a stream of {len(tokens)})")
        rng = np.random.default_rng([self.masker.seed, stream, k, _PAIRS])
        a = rng.integers(1, n, size=B)  # A's length; B has n - a tokens
        is_random = rng.random(B) < 0.5
        starts = rng.integers(0, len(tokens) - n + 1, size=B)
        ids = np.empty((B, T), dtype=np.int64)
        types = np.zeros((B, T), dtype=np.int64)
        for b in range(B):
            second = tokens[starts[b]:starts[b] + n - a[b]] if is_random[b] else w[b, a[b]:]
            ids[b] = np.concatenate(([self.cls_id], w[b, :a[b]], [self.sep_id], second, [self.sep_id]))
            types[b, a[b] + 2:] = 1
        inputs, labels = self.masker.mask(torch.from_numpy(ids), k, stream)
        labels[:, 0] = torch.from_numpy(is_random.astype(np.int64))
        return inputs + self.vocab_size * torch.from_numpy(types), labels

    def eval_batches(self, batches: list[tuple[Tensor, Tensor]], tokens: np.ndarray) -> list[tuple[Tensor, Tensor]]:
        """Fixed examples from evaluation windows (random segments from `tokens`): the same at every evaluation."""
        return [self.make(x, tokens, i, EVAL_STREAM) for i, (x, _) in enumerate(batches)]

    def state(self) -> dict[str, Any]:
        return {"cls_id": self.cls_id, "sep_id": self.sep_id, "vocab_size": self.vocab_size, "seq_len": self.seq_len}


class PairBatches:
    """A `BatchLoader` of windows whose batch k is sentence-pair draw k: the loader's iterator and its resumable
    state, with the pairs' and masking's settings checked on resume."""

    def __init__(self, loader: BatchLoader, pairs: SentencePairs) -> None:
        if loader.seq_len < pairs.seq_len - 3:
            raise DataError(f"sentence pairs of {pairs.seq_len} tokens read windows of {pairs.seq_len - 3}; the "
                            f"loader makes {loader.seq_len}")
        self.loader, self.pairs = loader, pairs

    def __iter__(self) -> PairBatches:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        k = self.loader.step
        x, _ = next(self.loader)
        return self.pairs.make(x, self.loader.tokens, k)

    def state_dict(self) -> dict[str, Any]:
        return {**self.loader.state_dict(), "masking": self.pairs.masker.state(), "sentence_pairs": self.pairs.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("masking", "sentence_pairs"):
            saved = state.get(key) if isinstance(state, dict) else None
            if saved is not None and saved != mine[key]:
                raise DataError(f"cannot resume the sentence-pair batches: their {key} settings were {saved}, now "
                                f"{mine[key]}; restore the original seed and tokenizer, or start from step 0")
        self.loader.load_state_dict(state)
