"""`CharTokenizer`: one id per character, for tiny experiments (vocabulary = the characters of the text), and
optionally special tokens after the characters: a mask token (a string such as "[MASK]", the id after the
characters) for masked-LM encoders; for T5's span corruption an EOS token ("</s>") and `extra_ids` sentinels
<extra_id_0>, <extra_id_1>, ... counting down from the top of the vocabulary, as T5's vocabulary has them; for
BERT's sentence pairs "[CLS]" and "[SEP]" (after the mask and EOS tokens)."""

from __future__ import annotations

import json
import re

import numpy as np

from waferscale.data.tokenizer.base import Tokenizer
from waferscale.errors import DataError

__all__ = ["CharTokenizer"]


class CharTokenizer(Tokenizer):
    def __init__(self, chars: list[str] | str, mask_token: str | None = None, eos_token: str | None = None,
                 extra_ids: int = 0, pair_tokens: bool = False):
        chars = list(chars)
        if not chars:
            raise DataError("character tokenizer needs a non-empty vocabulary (got no characters)")
        if any(len(c) != 1 for c in chars):
            raise DataError("character tokenizer vocabulary must hold single characters")
        if len(set(chars)) != len(chars):
            raise DataError("character tokenizer vocabulary has duplicate characters")
        if mask_token is not None and len(mask_token) < 2:  # one character would shadow a character of the text
            raise DataError(f"character tokenizer mask token must be longer than one character, got {mask_token!r}")
        if eos_token is not None and len(eos_token) < 2:
            raise DataError(f"character tokenizer EOS token must be longer than one character, got {eos_token!r}")
        if extra_ids < 0:
            raise DataError(f"character tokenizer extra_ids must be >= 0, got {extra_ids}")
        self.chars, self.mask_token_str, self.eos_token_str, self.extra_ids = chars, mask_token, eos_token, extra_ids
        self.pair_tokens = pair_tokens
        self.mask_id = len(chars) if mask_token is not None else None
        self.eos_id = len(chars) + (mask_token is not None) if eos_token is not None else None
        n = len(chars) + (mask_token is not None) + (eos_token is not None)
        self.vocab_size = n + 2 * pair_tokens + extra_ids
        self.specials = {t: i for t, i in ((mask_token, self.mask_id), (eos_token, self.eos_id)) if t is not None}
        if pair_tokens:
            self.specials.update({"[CLS]": n, "[SEP]": n + 1})
        self.specials.update({f"<extra_id_{k}>": self.vocab_size - 1 - k for k in range(extra_ids)})
        self._split = re.compile("(" + "|".join(map(re.escape, self.specials)) + ")") if self.specials else None
        self.stoi = {c: i for i, c in enumerate(chars)}
        # Vectorized encode: code point -> id lookup table (-1 for unknown).
        cps = np.array([ord(c) for c in chars], dtype=np.int64)
        self._lut = np.full(int(cps.max()) + 1, -1, dtype=np.int64)
        self._lut[cps] = np.arange(len(chars))

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        if not text:
            raise DataError("cannot build a character tokenizer from empty text")
        return cls(sorted(set(text)))

    def with_mask_token(self, mask_token: str = "[MASK]") -> CharTokenizer:
        """This vocabulary plus a mask token (itself if it has one already)."""
        return self if self.mask_id is not None else CharTokenizer(self.chars, mask_token, self.eos_token_str,
                                                                   self.extra_ids, self.pair_tokens)

    def with_pair_tokens(self) -> CharTokenizer:
        """This vocabulary plus "[CLS]" and "[SEP]" (itself if it has them), what BERT's sentence pairs read."""
        return self if self.pair_tokens else CharTokenizer(self.chars, self.mask_token_str, self.eos_token_str,
                                                           self.extra_ids, pair_tokens=True)

    def with_sentinels(self, extra_ids: int, eos_token: str = "</s>") -> CharTokenizer:
        """This vocabulary plus an EOS token (if it has none) and `extra_ids` sentinels (if it has none)."""
        return CharTokenizer(self.chars, self.mask_token_str, self.eos_token_str or eos_token,
                             self.extra_ids or extra_ids, self.pair_tokens)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """add_special_tokens: the char format's post-processor, "$A <eos>" when it declares an eos token (the
        inputs of the encoder-decoders it serves end so, as T5's tokenizer has it)."""
        if self._split is None:
            ids = self._encode_chars(text)
        else:
            ids = []
            for n, piece in enumerate(self._split.split(text)):  # odd pieces: a special token, which is its id
                ids += [self.specials[piece]] if n % 2 else self._encode_chars(piece)
        return ids + [self.eos_id] if add_special_tokens and self.eos_id is not None else ids

    def _encode_chars(self, text: str) -> list[int]:
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        ids = np.full(cps.shape, -1, dtype=np.int64)
        known = cps < len(self._lut)
        ids[known] = self._lut[cps[known]]
        if (ids < 0).any():
            pos = int(np.argmax(ids < 0))
            ch = text[pos]
            raise DataError(f"character {ch!r} (U+{ord(ch):04X}) at position {pos} is not in the character "
                            f"tokenizer's vocabulary of {self.vocab_size} characters; build the tokenizer from text "
                            "that includes it")
        return ids.tolist()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        out = []
        for n, t in enumerate(texts):
            try:
                out.append(self.encode(t))
            except DataError as e:
                raise DataError(f"text {n} of the batch: {e}") from None
        return out

    def decode(self, ids: list[int]) -> str:
        return "".join(t for t in map(self.id_to_token, map(int, ids)) if t is not None)

    def id_to_token(self, token_id: int) -> str | None:
        if 0 <= token_id < len(self.chars):
            return self.chars[token_id]
        return next((t for t, i in self.specials.items() if i == token_id), None)

    def token_to_id(self, token: str) -> int | None:
        return self.specials.get(token, self.stoi.get(token))

    def _tokenizer_json(self) -> str:
        extra = {k: v for k, v in (("mask_token", self.mask_token_str), ("eos_token", self.eos_token_str),
                                   ("extra_ids", self.extra_ids or None), ("pair_tokens", self.pair_tokens or None))
                 if v is not None}
        return json.dumps({"type": "char", "version": 1, "vocab": self.chars, **extra}, ensure_ascii=False)

    @classmethod
    def from_json(cls, data: dict, source: str = "<json>") -> CharTokenizer:
        vocab = data.get("vocab")
        if not isinstance(vocab, list) or not all(isinstance(c, str) for c in vocab):
            raise DataError(f"{source}: a char tokenizer file needs 'vocab': a list of single characters")
        mask, eos, extra = data.get("mask_token"), data.get("eos_token"), data.get("extra_ids", 0)
        pair = data.get("pair_tokens", False)
        for key, value in (("mask_token", mask), ("eos_token", eos)):
            if value is not None and not isinstance(value, str):
                raise DataError(f"{source}: a char tokenizer's {key!r} must be a string, got {value!r}")
        if not isinstance(extra, int):
            raise DataError(f"{source}: a char tokenizer's 'extra_ids' must be an integer, got {extra!r}")
        if not isinstance(pair, bool):
            raise DataError(f"{source}: a char tokenizer's 'pair_tokens' must be true or false, got {pair!r}")
        return cls(vocab, mask, eos, extra, pair)

