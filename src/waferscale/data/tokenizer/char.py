"""`CharTokenizer`: one id per character, for tiny experiments (vocabulary = the characters of the text), and
optionally one mask token (a string such as "[MASK]", the id after the characters) for masked-LM encoders."""

from __future__ import annotations

import json

import numpy as np

from waferscale.data.tokenizer.base import Tokenizer
from waferscale.errors import DataError

__all__ = ["CharTokenizer"]


class CharTokenizer(Tokenizer):
    def __init__(self, chars: list[str] | str, mask_token: str | None = None):
        chars = list(chars)
        if not chars:
            raise DataError("character tokenizer needs a non-empty vocabulary (got no characters)")
        if any(len(c) != 1 for c in chars):
            raise DataError("character tokenizer vocabulary must hold single characters")
        if len(set(chars)) != len(chars):
            raise DataError("character tokenizer vocabulary has duplicate characters")
        if mask_token is not None and len(mask_token) < 2:  # one character would shadow a character of the text
            raise DataError(f"character tokenizer mask token must be longer than one character, got {mask_token!r}")
        self.chars, self.mask_token_str = chars, mask_token
        self.mask_id = len(chars) if mask_token is not None else None
        self.vocab_size = len(chars) + (mask_token is not None)
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
        return self if self.mask_id is not None else CharTokenizer(self.chars, mask_token)

    def encode(self, text: str) -> list[int]:
        if self.mask_id is None:
            return self._encode_chars(text)
        ids: list[int] = []
        for n, piece in enumerate(text.split(self.mask_token_str)):  # each occurrence of the mask token is its id
            ids += ([self.mask_id] if n else []) + self._encode_chars(piece)
        return ids

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
        if token_id == self.mask_id:
            return self.mask_token_str
        return self.chars[token_id] if 0 <= token_id < len(self.chars) else None

    def token_to_id(self, token: str) -> int | None:
        return self.mask_id if token == self.mask_token_str else self.stoi.get(token)

    def _tokenizer_json(self) -> str:
        mask = {"mask_token": self.mask_token_str} if self.mask_token_str is not None else {}
        return json.dumps({"type": "char", "version": 1, "vocab": self.chars, **mask}, ensure_ascii=False)

    @classmethod
    def from_json(cls, data: dict, source: str = "<json>") -> CharTokenizer:
        vocab = data.get("vocab")
        if not isinstance(vocab, list) or not all(isinstance(c, str) for c in vocab):
            raise DataError(f"{source}: a char tokenizer file needs 'vocab': a list of single characters")
        mask = data.get("mask_token")
        if mask is not None and not isinstance(mask, str):
            raise DataError(f"{source}: a char tokenizer's 'mask_token' must be a string, got {mask!r}")
        return cls(vocab, mask)

