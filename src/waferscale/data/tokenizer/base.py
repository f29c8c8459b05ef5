"""The tokenizer interface every tokenizer implements (`Tokenizer`), and its chat-template rendering."""

from __future__ import annotations

import functools
import hashlib
import json
from abc import ABC, abstractmethod
from datetime import datetime
from pathlib import Path
from typing import Any

from waferscale.errors import DataError
from waferscale.util.files import atomic_write_text

__all__ = ["CONFIG_FILE", "TOKENIZER_FILE", "Tokenizer", "check_vocab_fits"]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


class Tokenizer(ABC):
    """Base class. Subclasses set the attributes and implement `encode`/`decode`/`_tokenizer_json`.

    Ids are ints in [0, vocab_size). `eos_id`/`bos_id`/`mask_id` are None when the vocabulary has no such token
    (the mask token is what a masked-LM encoder reads in place of the tokens it predicts).
    """

    vocab_size: int
    eos_id: int | None = None
    bos_id: int | None = None
    mask_id: int | None = None
    chat_template: str | None = None

    # ---- text <-> ids -------------------------------------------------------------------------------------
    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; add_special_tokens: with those the tokenizer's own post-processor adds (a
        Hugging Face tokenizer's template, e.g. T5's trailing `</s>`; none for most decoders' tokenizers)."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text for `ids`. Ids outside [0, vocab_size) are skipped, as Hugging Face `tokenizers` does (a model
        whose embedding is padded past the tokenizer's vocabulary can sample them); mask such logits when
        sampling if they must never appear."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts; subclasses override this with a faster (parallel / vectorized) path."""
        return [self.encode(t) for t in texts]

    @abstractmethod
    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id; None if out of range."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry; None if absent."""

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.id_to_token(self.eos_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.id_to_token(self.bos_id)

    @property
    def mask_token(self) -> str | None:
        return None if self.mask_id is None else self.id_to_token(self.mask_id)

    # ---- chat ---------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the tokenizer's Jinja chat template.

        Same conventions as Hugging Face: sandboxed Jinja, trim_blocks/lstrip_blocks, `raise_exception`,
        `strftime_now`, a non-escaping `tojson`, and `bos_token`/`eos_token` in the context. Extra keyword
        arguments (e.g. `tools`) are passed to the template.
        """
        if not self.chat_template:
            raise DataError(f"{type(self).__name__} has no chat template; use a tokenizer that ships one "
                            "(e.g. 'smollm2') or put a 'chat_template' entry in tokenizer_config.json")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise DataError("chat messages must be a list of dicts like {'role': 'user', 'content': 'hi'}")
        import jinja2

        template = _compile_chat_template(self.chat_template)
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kw}
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise DataError(f"chat template rejected the messages: {e}") from e

    # ---- persistence / identity ---------------------------------------------------------------------------
    def save(self, directory: Path | str) -> None:
        """Write `tokenizer.json` (+ `tokenizer_config.json` when there is a template or bos/eos/mask) into
        `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(directory / TOKENIZER_FILE, self._tokenizer_json())
        config: dict[str, Any] = {}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        for which, token_id in (("eos", self.eos_id), ("bos", self.bos_id), ("mask", self.mask_id)):
            if token_id is not None:
                config[f"{which}_token"], config[f"{which}_token_id"] = self.id_to_token(token_id), token_id
        if config:
            atomic_write_text(directory / CONFIG_FILE, json.dumps(config, indent=2, ensure_ascii=False))

    @abstractmethod
    def _tokenizer_json(self) -> str:
        """This tokenizer as a Hugging Face tokenizer.json (what `save` writes)."""

    def fingerprint(self) -> str:
        """Hex sha256 of everything that decides the ids: the serialized vocabulary, merges and pre-tokenizer."""
        return hashlib.sha256(self._tokenizer_json().encode("utf-8")).hexdigest()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eos_id={self.eos_id}, bos_id={self.bos_id})"


def check_vocab_fits(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """DataError unless every id the tokenizer can emit is a valid row of a `model_vocab_size` embedding."""
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                        f"{model_vocab_size}; set model vocab_size >= {tokenizer.vocab_size} or use the model's own "
                        "tokenizer")


@functools.lru_cache(maxsize=8)
def _compile_chat_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"chat template is not valid Jinja (line {e.lineno}): {e.message}") from e

