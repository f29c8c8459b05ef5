"""T5's span-corruption objective (Raffel et al. 2020, section 3.1.4): the encoder reads a text with some spans
replaced by one sentinel each, the decoder writes the dropped spans, each after its sentinel.

Of a window of `tokens_length` tokens, round(noise_density * length) are noise, in round(noise / mean span length)
spans; span and gap lengths are random segmentations (T5's `random_spans_noise_mask`). The inputs are the kept
tokens with the i-th noise span replaced by sentinel i (<extra_id_i>, counting down from the top of the vocabulary)
and EOS appended; the targets are sentinel i followed by span i, for every span, then EOS. `tokens_length` is what
T5's `compute_input_and_target_lengths` gives for the encoder's input length, so every example's inputs and
targets have exactly inputs_length and targets_length tokens (512 -> 568 tokens read, 114 targets).

The model reads one packed row per example, what the executors' (B, T) batches carry: the inputs, then the
decoder's inputs (the targets shifted right after the decoder start token); the labels are -100 over the inputs,
then the targets. Draws are pure functions of (seed, stream, batch index, row), so a resumed run corrupts exactly
as the uninterrupted one would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from waferscale.data.loader import BatchLoader
from waferscale.data.masking import IGNORE_INDEX
from waferscale.data.tokenizer import CharTokenizer, Tokenizer
from waferscale.errors import DataError

__all__ = ["SpanCorruptor", "SpanCorruptedBatches", "compute_input_and_target_lengths", "random_spans_noise_mask",
           "sentinel_ids", "tokenizer_with_sentinels"]

_TRAIN, _EVAL = 0, 1
T5_EXTRA_IDS = 100  # sentinels T5's vocabulary has


def _lengths_for(tokens_length: int, noise_density: float, mean_span: float) -> tuple[int, int]:
    noise = int(round(tokens_length * noise_density))
    spans = int(round(noise / mean_span))
    return tokens_length - noise + spans + 1, noise + spans + 1  # (+1: EOS)


def compute_input_and_target_lengths(inputs_length: int, noise_density: float = 0.15,
                                     mean_noise_span_length: float = 3.0) -> tuple[int, int]:
    """(tokens to read, targets length) for encoder inputs of `inputs_length` tokens: the longest window whose
    corruption fits (T5's rule, with its adjustment at noise density 0.5)."""
    tokens_length = inputs_length
    while _lengths_for(tokens_length + 1, noise_density, mean_noise_span_length)[0] <= inputs_length:
        tokens_length += 1
    inputs, targets = _lengths_for(tokens_length, noise_density, mean_noise_span_length)
    if noise_density == 0.5 and targets > inputs:
        tokens_length, targets = tokens_length - 1, targets - 1
    return tokens_length, targets


def random_spans_noise_mask(length: int, noise_density: float, mean_noise_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
    """(length,) bool, True on noise: alternating kept and noise spans, starting with a kept one."""
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    kept = length - noise
    spans = max(int(round(min(noise, kept) / mean_noise_span_length)), 1)

    def segment(n_items: int, n_segments: int) -> np.ndarray:
        """Random lengths >= 1 of n_segments consecutive segments of n_items."""
        first = np.arange(n_items - 1) < n_segments - 1
        rng.shuffle(first)
        return np.bincount(np.cumsum(np.concatenate(([0], first))), minlength=n_segments)

    interleaved = np.stack([segment(kept, spans), segment(noise, spans)], axis=1).reshape(-1)
    starts = np.zeros(length, dtype=np.int64)
    starts[np.cumsum(interleaved)[:-1]] = 1
    return np.cumsum(starts) % 2 == 1


def sentinel_ids(tok: Tokenizer) -> list[int]:
    """The tokenizer's sentinels <extra_id_0>, <extra_id_1>, ... (as many as it has), by id."""
    out = []
    while (i := tok.token_to_id(f"<extra_id_{len(out)}>")) is not None:
        out.append(i)
    return out


def tokenizer_with_sentinels(tok: Tokenizer, extra_ids: int = T5_EXTRA_IDS) -> Tokenizer:
    """`tok` if it has T5's sentinels and an EOS; a character tokenizer gains "</s>" and `extra_ids` sentinels
    (the top ids, <extra_id_0> highest); any other must bring its own."""
    if sentinel_ids(tok) and tok.eos_id is not None:
        return tok
    if isinstance(tok, CharTokenizer):
        return tok.with_sentinels(extra_ids)
    raise DataError(f"the tokenizer ({tok!r}) lacks T5's sentinel tokens <extra_id_0>, <extra_id_1>, ... or an EOS "
                    "token, which span corruption needs; use a T5 tokenizer or 'char'")


@dataclass(frozen=True)
class SpanCorruptor:
    """Corrupts windows (B, tokens_length) of token ids into packed (inputs, labels) rows of
    inputs_length + targets_length tokens."""

    sentinels: tuple[int, ...]  # <extra_id_0>, <extra_id_1>, ... ids
    eos_id: int
    decoder_start_id: int
    inputs_length: int
    seed: int
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0

    def __post_init__(self) -> None:
        if not 0.0 < self.noise_density < 1.0:
            raise DataError(f"span corruption noise_density must be in (0, 1), got {self.noise_density}")
        if self.mean_noise_span_length < 1.0:
            raise DataError(f"span corruption mean_noise_span_length must be >= 1, got {self.mean_noise_span_length}")
        if self.inputs_length < 4:
            raise DataError(f"span corruption needs inputs of at least 4 tokens, got {self.inputs_length}")
        n = self.tokens_length
        noise = min(max(int(round(n * self.noise_density)), 1), n - 1)
        spans = max(int(round(min(noise, n - noise) / self.mean_noise_span_length)), 1)
        if spans > len(self.sentinels):
            raise DataError(f"span corruption of {n} tokens makes {spans} noise spans, but the tokenizer has "
                            f"{len(self.sentinels)} sentinel tokens (<extra_id_N>)")

    @property
    def tokens_length(self) -> int:
        """Tokens each example reads."""
        return compute_input_and_target_lengths(self.inputs_length, self.noise_density, self.mean_noise_span_length)[0]

    @property
    def targets_length(self) -> int:
        return compute_input_and_target_lengths(self.inputs_length, self.noise_density, self.mean_noise_span_length)[1]

    def _spans_to_sentinels(self, ids: np.ndarray, spans: np.ndarray) -> np.ndarray:
        """`ids` with the i-th run of True in `spans` replaced by sentinel i (one token per run)."""
        first = spans & ~np.concatenate(([False], spans[:-1]))
        sentinel = np.asarray(self.sentinels)[np.maximum(np.cumsum(first) - 1, 0)]
        return np.where(first, sentinel, ids)[first | ~spans]

    def _row(self, ids: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of one window: the noise spans become sentinels in the inputs; the targets are the
        noise spans, the kept spans becoming the sentinels (so span i follows sentinel i); EOS ends both."""
        noise = random_spans_noise_mask(len(ids), self.noise_density, self.mean_noise_span_length, rng)
        eos = [self.eos_id]
        return (np.concatenate((self._spans_to_sentinels(ids, noise), eos)),
                np.concatenate((self._spans_to_sentinels(ids, ~noise), eos)))

    def corrupt(self, x: Tensor, k: int, stream: int = _TRAIN) -> tuple[Tensor, Tensor]:
        """Draw k of `stream` applied to windows x (B, tokens_length) -> packed (inputs, labels), both
        (B, inputs_length + targets_length) int64."""
        B, n = x.shape
        if n != self.tokens_length:
            raise DataError(f"span corruption reads windows of {self.tokens_length} tokens, got {n}")
        L, T = self.inputs_length, self.targets_length
        packed = np.empty((B, L + T), dtype=np.int64)
        labels = np.full((B, L + T), IGNORE_INDEX, dtype=np.int64)
        ids = x.numpy()
        for b in range(B):
            inputs, targets = self._row(ids[b], np.random.default_rng([self.seed, stream, k, b]))
            assert len(inputs) == L and len(targets) == T, (len(inputs), len(targets))
            packed[b, :L] = inputs
            packed[b, L] = self.decoder_start_id
            packed[b, L + 1:] = targets[:-1]
            labels[b, L:] = targets
        return torch.from_numpy(packed), torch.from_numpy(labels)

    def eval_batches(self, batches: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        """Fixed corruption of evaluation windows: the same at every evaluation of the run."""
        return [self.corrupt(x, i, _EVAL) for i, (x, _) in enumerate(batches)]

    def state(self) -> dict[str, Any]:
        return {"seed": self.seed, "noise_density": self.noise_density, "inputs_length": self.inputs_length,
                "mean_noise_span_length": self.mean_noise_span_length, "eos_id": self.eos_id,
                "sentinel_0": self.sentinels[0], "decoder_start_id": self.decoder_start_id}


class SpanCorruptedBatches:
    """A `BatchLoader` over windows of `tokens_length` whose batch k is its corruption draw k: the loader's
    iterator and resumable state, with the corruption settings checked on resume."""

    def __init__(self, loader: BatchLoader, corruptor: SpanCorruptor) -> None:
        if loader.seq_len != corruptor.tokens_length:
            raise DataError(f"span corruption reads windows of {corruptor.tokens_length} tokens; the loader makes "
                            f"{loader.seq_len}")
        self.loader, self.corruptor = loader, corruptor

    def __iter__(self) -> SpanCorruptedBatches:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        k = self.loader.step
        x, _ = next(self.loader)
        return self.corruptor.corrupt(x, k)

    def state_dict(self) -> dict[str, Any]:
        return {**self.loader.state_dict(), "span_corruption": self.corruptor.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("span_corruption") if isinstance(state, dict) else None
        if saved is not None and saved != self.corruptor.state():
            raise DataError(f"cannot resume the span-corrupted batches: they were made with {saved}, now "
                            f"{self.corruptor.state()}; restore the original seed and tokenizer, or start from step 0")
        self.loader.load_state_dict(state)
