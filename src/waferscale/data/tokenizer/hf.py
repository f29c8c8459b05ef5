"""`HFTokenizer`: a Hugging Face `tokenizers.Tokenizer` (BPE, WordPiece, ...) from `tokenizer.json`, with
bos/eos/mask and the chat template from `tokenizer_config.json` (or `chat_template.jinja`) beside it; without a
configured mask token, the vocabulary's "[MASK]" (BERT's) or "<mask>" (RoBERTa's) is the mask token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from waferscale.data.tokenizer.base import CONFIG_FILE, TOKENIZER_FILE, Tokenizer
from waferscale.errors import DataError

__all__ = ["HFTokenizer", "MASK_TOKENS"]

MASK_TOKENS = ("[MASK]", "<mask>")  # BERT's WordPiece and RoBERTa's byte-level BPE mask tokens


class HFTokenizer(Tokenizer):
    def __init__(self, tokenizer: Any, eos_id: int | None = None, bos_id: int | None = None,
                 chat_template: str | None = None, mask_id: int | None = None) -> None:
        self.tk = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        if mask_id is None:
            mask_id = next((i for t in MASK_TOKENS if (i := tokenizer.token_to_id(t)) is not None), None)
        for name, value in (("eos_id", eos_id), ("bos_id", bos_id), ("mask_id", mask_id)):
            if value is not None and not 0 <= value < self.vocab_size:
                raise DataError(f"{name}={value} is outside the tokenizer vocabulary [0, {self.vocab_size})")
        self.eos_id, self.bos_id, self.mask_id, self.chat_template = eos_id, bos_id, mask_id, chat_template

    @classmethod
    def from_file(cls, path: Path | str) -> HFTokenizer:
        """Load `tokenizer.json`, or a directory holding it; `tokenizer_config.json` beside it adds
        `chat_template` and the bos/eos/mask tokens."""
        from tokenizers import Tokenizer as _TK

        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"no {TOKENIZER_FILE} at {path}")
        try:
            tk = _TK.from_file(str(file))
        except Exception as e:  # tokenizers raises a plain Exception on bad JSON / unknown model
            raise DataError(f"{file}: not a Hugging Face tokenizer.json ({e})") from e
        config = _read_tokenizer_config(file.parent / CONFIG_FILE)
        eos_id = _special_id(tk, config, "eos", file.parent)
        bos_id = _special_id(tk, config, "bos", file.parent)
        mask_id = _special_id(tk, config, "mask", file.parent)
        template = config.get("chat_template")
        if isinstance(template, list):  # HF allows [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (file.parent / "chat_template.jinja").is_file():
            template = (file.parent / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(tk, eos_id=eos_id, bos_id=bos_id, chat_template=template, mask_id=mask_id)

    @classmethod
    def from_wordpiece_vocab(cls, path: Path | str, lowercase: bool) -> HFTokenizer:
        """BERT's tokenizer over a WordPiece vocab.txt (one token a line): BERT's normalizer (lowercasing as
        `lowercase` says) and pre-tokenizer, "##" continuations, and its bracketed tokens ([MASK], ...) special."""
        from tokenizers import Tokenizer as _TK
        from tokenizers import decoders, models, normalizers, pre_tokenizers

        try:
            tk = _TK(models.WordPiece.from_file(str(path), unk_token="[UNK]"))
        except Exception as e:  # tokenizers raises a plain Exception on an unreadable vocabulary
            raise DataError(f"{path}: not a WordPiece vocabulary ({e})") from e
        if tk.token_to_id("[UNK]") is None:
            raise DataError(f"{path}: not a WordPiece vocabulary (one token a line, with BERT's [UNK])")
        tk.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tk.decoder = decoders.WordPiece()
        tk.add_special_tokens([t for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
                               if tk.token_to_id(t) is not None])
        return cls(tk)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids for `text`. No BOS/EOS is added (add_special_tokens=False) unless asked; special-token strings
        such as "<|im_start|>" inside `text` still encode as their single id."""
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Parallel (Rust threads) encode of many texts."""
        return [e.ids for e in self.tk.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        n = self.vocab_size
        ids = [i for i in map(int, ids) if 0 <= i < n]  # out-of-vocabulary ids are skipped (see Tokenizer.decode)
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tk.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def _tokenizer_json(self) -> str:
        return self.tk.to_str()


def _read_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read tokenizer config ({e})") from e
    if not isinstance(config, dict):
        raise DataError(f"{path}: expected a JSON object")
    return config


def _special_id(tk: Any, config: dict, which: str, where: Path) -> int | None:
    """Resolve `<which>_token` (a string or {"content": ...}) or `<which>_token_id` from a tokenizer config."""
    if isinstance(config.get(f"{which}_token_id"), int):
        return config[f"{which}_token_id"]
    token = config.get(f"{which}_token")
    if isinstance(token, dict):
        token = token.get("content")
    if not token:
        return None
    token_id = tk.token_to_id(token)
    if token_id is None:
        raise DataError(f"{where / CONFIG_FILE}: {which}_token {token!r} is not in the tokenizer vocabulary")
    return token_id
