"""T5's span corruption: T5's lengths, the noise mask's statistics, inputs and targets that put the text back
together, sentinels from the top of the vocabulary, fresh and reproducible draws, exact resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from waferscale.data import BatchLoader, load_tokenizer
from waferscale.data.span_corruption import (SpanCorruptedBatches, SpanCorruptor, compute_input_and_target_lengths,
                                             random_spans_noise_mask, sentinel_ids, tokenizer_with_sentinels)
from waferscale.data.tokenizer import CharTokenizer
from waferscale.errors import DataError

TOK = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .").with_sentinels(100)


def _corruptor(inputs_length: int = 64, seed: int = 0) -> SpanCorruptor:
    return SpanCorruptor(tuple(sentinel_ids(TOK)), TOK.eos_id, 0, inputs_length, seed=seed)


def test_lengths_are_t5s() -> None:
    # T5's pre-training setting: 568 tokens corrupt to 512 inputs and 114 targets (Model Zoo's tgt_max_sequence_length)
    assert compute_input_and_target_lengths(512, 0.15, 3.0) == (568, 114)
    assert compute_input_and_target_lengths(32) == (34, 8)
    c = _corruptor(512)
    assert (c.tokens_length, c.targets_length) == (568, 114)


def test_noise_mask_statistics() -> None:
    rng = np.random.default_rng(0)
    masks = np.stack([random_spans_noise_mask(568, 0.15, 3.0, rng) for _ in range(200)])
    assert (masks.sum(1) == round(568 * 0.15)).all()  # a fixed count per example
    assert not masks[:, 0].any() and masks[:, -1].all()  # kept span first, noise span last
    starts = masks & ~np.concatenate((np.zeros((200, 1), bool), masks[:, :-1]), axis=1)
    assert (starts.sum(1) == round(85 / 3)).all()  # 28 spans of mean length 85 / 28
    assert len({m.tobytes() for m in masks}) == 200  # and they differ


def test_inputs_and_targets_put_the_text_back_together() -> None:
    c = _corruptor(64)
    x = torch.randint(0, 28, (3, c.tokens_length), generator=torch.Generator().manual_seed(0))
    packed, labels = c.corrupt(x, 5)
    L, T = c.inputs_length, c.targets_length
    assert packed.shape == labels.shape == (3, L + T)
    assert (labels[:, :L] == -100).all()
    assert (packed[:, L] == 0).all() and torch.equal(packed[:, L + 1:], labels[:, L:-1])  # decoder inputs: shifted
    sentinel_of = {s: k for k, s in enumerate(sentinel_ids(TOK))}
    for b in range(3):
        inputs, targets = packed[b, :L].tolist(), labels[b, L:].tolist()
        assert inputs[-1] == targets[-1] == TOK.eos_id
        spans: dict[int, list[int]] = {}
        for t in targets[:-1]:  # sentinel k, then span k
            if t in sentinel_of:
                k = sentinel_of[t]
                spans[k] = []
            else:
                spans[k].append(t)
        assert sorted(spans) == list(range(len(spans))) and all(spans.values())
        text = [t for s in inputs[:-1] for t in (spans[sentinel_of[s]] if s in sentinel_of else [s])]
        assert text == x[b].tolist()
    assert sentinel_ids(TOK)[0] == TOK.vocab_size - 1  # <extra_id_0> is the top id, the next ones count down
    assert sentinel_ids(TOK)[1] == TOK.vocab_size - 2


def test_draws_are_fresh_per_batch_and_reproducible() -> None:
    c = _corruptor()
    x = torch.randint(0, 28, (2, c.tokens_length), generator=torch.Generator().manual_seed(0))
    assert torch.equal(c.corrupt(x, 3)[0], _corruptor().corrupt(x, 3)[0])
    assert not torch.equal(c.corrupt(x, 3)[0], c.corrupt(x, 4)[0])
    assert not torch.equal(c.corrupt(x, 3)[0], _corruptor(seed=1).corrupt(x, 3)[0])


def test_batches_resume_exactly() -> None:
    c = _corruptor()
    tokens = np.random.default_rng(0).integers(0, 28, 5000)

    def loader() -> SpanCorruptedBatches:
        return SpanCorruptedBatches(BatchLoader(tokens, 4, c.tokens_length, seed=1), c)

    once = loader()
    batches = [next(once) for _ in range(4)]
    twice = loader()
    next(twice), next(twice)
    resumed = loader()
    resumed.load_state_dict(twice.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(batches[2], next(resumed)))
    other = SpanCorruptedBatches(BatchLoader(tokens, 4, c.tokens_length, seed=1), _corruptor(seed=9))
    with pytest.raises(DataError, match="cannot resume the span-corrupted batches"):
        other.load_state_dict(twice.state_dict())


def test_char_tokenizer_sentinels_round_trip(tmp_path: Path) -> None:
    ids = TOK.encode("ab<extra_id_1>c</s>")
    assert ids == [TOK.token_to_id("a"), TOK.token_to_id("b"), TOK.vocab_size - 2, TOK.token_to_id("c"), TOK.eos_id]
    assert TOK.decode(ids) == "ab<extra_id_1>c</s>"
    TOK.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.fingerprint() == TOK.fingerprint() and sentinel_ids(again) == sentinel_ids(TOK)
    assert again.eos_id == TOK.eos_id
    plain = CharTokenizer.from_text("abc")
    assert tokenizer_with_sentinels(plain).token_to_id("<extra_id_99>") == 3 + 1  # after the characters and EOS
    assert plain.fingerprint() == CharTokenizer(["a", "b", "c"]).fingerprint()  # a plain vocabulary is unchanged


def test_too_few_sentinels_are_refused() -> None:
    with pytest.raises(DataError, match="makes 28 noise spans, but the tokenizer has 3 sentinel tokens"):
        SpanCorruptor(tuple(sentinel_ids(TOK))[:3], TOK.eos_id, 0, 512, seed=0)
    with pytest.raises(DataError, match="noise_density"):
        SpanCorruptor(tuple(sentinel_ids(TOK)), TOK.eos_id, 0, 64, seed=0, noise_density=1.5)
