"""`load_tokenizer(spec)`: the one entry point from a name or path to a tokenizer (the CLI's `--tokenizer`,
the params file's `tokenizer`, and the tokenizer of a pretrained model name or path)."""

from __future__ import annotations

import json
from pathlib import Path

from waferscale.data.tokenizer.base import TOKENIZER_FILE, Tokenizer
from waferscale.data.tokenizer.char import CharTokenizer
from waferscale.data.tokenizer.from_gguf import tokenizer_from_gguf
from waferscale.data.tokenizer.hf import HFTokenizer
from waferscale.errors import DataError
from waferscale.util.assets import asset_path, find_asset

__all__ = ["load_tokenizer"]


def load_tokenizer(spec: str | Path, text_for_char: str | None = None, lowercase: bool | None = None) -> Tokenizer:
    """Resolve a tokenizer spec.

    Accepted: "char" (built from `text_for_char`), an asset name ("smollm2", "smollm2-135m-instruct"),
    a `.gguf` file, a `tokenizer.json` (Hugging Face, or the char format written by `Tokenizer.save`),
    a directory holding a `tokenizer.json` (a HF model dir or one written by `Tokenizer.save`), or a WordPiece
    vocabulary `.txt` (BERT's vocab.txt, Model Zoo's vocab_file), which `lowercase` says whether to lowercase.
    """
    accepted = ("accepted: 'char', 'smollm2' / 'smollm2-135m-instruct', a .gguf file, a tokenizer.json, "
                "a directory containing tokenizer.json, or a WordPiece vocab .txt")
    s = str(spec)
    if s == "char":
        if not text_for_char:
            raise DataError("tokenizer 'char' is built from the training text, but no text was given")
        return CharTokenizer.from_text(text_for_char)
    if find_asset(s, "model") is not None:
        return tokenizer_from_gguf(asset_path(s, "model"))
    path = Path(s).expanduser()
    if path.is_dir():
        file = path / TOKENIZER_FILE
        if not file.is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return tokenizer_from_gguf(ggufs[0])
            raise DataError(f"directory {path} has no {TOKENIZER_FILE}; {accepted}")
        return _load_json_tokenizer(file)
    if path.is_file():
        if path.suffix == ".gguf":
            return tokenizer_from_gguf(path)
        if path.suffix == ".json":
            return _load_json_tokenizer(path)
        if path.suffix == ".txt":
            return HFTokenizer.from_wordpiece_vocab(path, lowercase=bool(lowercase))
        raise DataError(f"tokenizer file {path} is neither .json, .gguf nor .txt; {accepted}")
    raise DataError(f"tokenizer {s!r} is not a known name and no such file or directory exists; {accepted}")


def _load_json_tokenizer(file: Path) -> Tokenizer:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{file}: cannot read tokenizer JSON ({e})") from e
    if isinstance(data, dict) and data.get("type") == "char":
        return CharTokenizer.from_json(data, str(file))
    return HFTokenizer.from_file(file)

