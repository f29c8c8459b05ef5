"""The masked-LM objective's inputs: BERT's dynamic masking (Devlin et al. 2019; RoBERTa's dynamic draw).

Of each sequence's T tokens, round(0.15 T) positions are chosen uniformly (a fixed count per sequence, as BERT's
own data generation does; Model Zoo's masked_lm_prob sets the 0.15 and max_predictions_per_seq caps the count);
of the chosen, 80% read the tokenizer's mask token, 10% a random token and 10% the token itself. The labels are
the original tokens at the chosen positions and -100 (ignored by the loss) elsewhere. Every sequence has the same
number of labels, so the loss's mean over a batch equals the mean of its micro-batches' and systems' means:
resident, streaming and SwarmX runs train the same loss under any split.

Draws are pure functions of (seed, batch index): batch k gets a new mask each time the loader makes it, and a
resumed run makes exactly the masks the uninterrupted one would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from waferscale.data.loader import BatchLoader
from waferscale.data.tokenizer import CharTokenizer, Tokenizer
from waferscale.data.tokenizer.hf import MASK_TOKENS
from waferscale.errors import DataError

__all__ = ["IGNORE_INDEX", "MaskedBatches", "Masker", "tokenizer_with_mask"]

IGNORE_INDEX = -100  # a label the loss ignores (lm_loss's ignore_index, transformers' convention)
TRAIN_STREAM, EVAL_STREAM = 0, 1  # separate streams of draws for training batches and evaluation batches


def tokenizer_with_mask(tok: Tokenizer) -> Tokenizer:
    """`tok` if it has a mask token; a character tokenizer gains "[MASK]"; any other must bring its own."""
    if tok.mask_id is not None:
        return tok
    if isinstance(tok, CharTokenizer):
        return tok.with_mask_token()
    raise DataError(f"the tokenizer ({tok!r}) has no mask token ({' or '.join(MASK_TOKENS)}, or mask_token in "
                    "tokenizer_config.json), which masked-LM training needs; use the encoder's own tokenizer "
                    "or 'char'")


@dataclass(frozen=True)
class Masker:
    """Masks (B, T) token ids: (inputs, labels). `vocab_size`: the tokenizer's (random replacements are ids it
    can produce)."""

    mask_id: int
    vocab_size: int
    seed: int
    probability: float = 0.15
    mask_fraction: float = 0.8  # of the chosen positions: the mask token
    random_fraction: float = 0.1  # of the chosen positions: a random token (the rest keep theirs)
    max_predictions: int | None = None  # at most this many chosen positions per sequence (None: no cap)
    special_ids: tuple[int, ...] = ()  # tokens never chosen (sentence pairs' [CLS] and [SEP])

    def __post_init__(self) -> None:
        if not 0.0 < self.probability <= 1.0:
            raise DataError(f"masked-LM probability must be in (0, 1], got {self.probability}")
        if not 0 <= self.mask_id < self.vocab_size:
            raise DataError(f"mask token id {self.mask_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.max_predictions is not None and self.max_predictions < 1:
            raise DataError(f"max_predictions_per_seq must be at least 1, got {self.max_predictions}")

    def per_sequence(self, T: int) -> int:
        n = max(1, int(self.probability * T + 0.5))
        return n if self.max_predictions is None else min(n, self.max_predictions)

    def mask(self, x: Tensor, k: int, stream: int = TRAIN_STREAM) -> tuple[Tensor, Tensor]:
        """Draw k of `stream` applied to x (B, T) int64 -> (masked inputs, labels), both (B, T) int64."""
        rng = np.random.default_rng([self.seed, stream, k])
        ids = x.numpy()
        B, T = ids.shape
        keys = rng.random((B, T))
        if self.special_ids:  # specials sort after every other position (keys are < 1), so they are never chosen
            keys[np.isin(ids, self.special_ids)] = 2.0
        order = keys.argsort(axis=1)[:, :self.per_sequence(T)]
        chosen = np.zeros((B, T), dtype=bool)
        np.put_along_axis(chosen, order, True, axis=1)
        u = rng.random((B, T))
        replacement = rng.integers(0, self.vocab_size, size=(B, T))
        inputs = ids.copy()
        inputs[chosen & (u < self.mask_fraction)] = self.mask_id
        random = chosen & (u >= self.mask_fraction) & (u < self.mask_fraction + self.random_fraction)
        inputs[random] = replacement[random]
        labels = np.where(chosen, ids, IGNORE_INDEX)
        return torch.from_numpy(inputs), torch.from_numpy(labels)

    def eval_batches(self, batches: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        """Fixed masks for evaluation batches (x, next tokens): the same at every evaluation of the run."""
        return [self.mask(x, i, EVAL_STREAM) for i, (x, _) in enumerate(batches)]

    def state(self) -> dict[str, Any]:
        cap = {} if self.max_predictions is None else {"max_predictions": self.max_predictions}
        specials = {"special_ids": list(self.special_ids)} if self.special_ids else {}
        return {"seed": self.seed, "probability": self.probability, "mask_id": self.mask_id,
                "vocab_size": self.vocab_size, **cap, **specials}


class MaskedBatches:
    """A `BatchLoader` whose batch k is (masked inputs, labels) of its windows, draw k: the loader's iterator
    and its resumable state, with the masking settings checked on resume."""

    def __init__(self, loader: BatchLoader, masker: Masker) -> None:
        self.loader, self.masker = loader, masker

    def __iter__(self) -> MaskedBatches:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        k = self.loader.step
        x, _ = next(self.loader)
        return self.masker.mask(x, k)

    def state_dict(self) -> dict[str, Any]:
        return {**self.loader.state_dict(), "masking": self.masker.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("masking") if isinstance(state, dict) else None
        if saved is not None and saved != self.masker.state():
            raise DataError(f"cannot resume the masked-LM batches: they were masked with {saved}, now "
                            f"{self.masker.state()}; restore the original seed and tokenizer, or start from step 0")
        self.loader.load_state_dict(state)
