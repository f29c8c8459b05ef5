"""Tokenize a corpus once into a memory-mapped token file with a train/val split, cached by content hash.

Layout of one cache entry, `cache_dir/tokens-<key[:16]>/`:
    tokens.bin   the whole document-ordered token stream, raw little-endian uint16 (vocab <= 65536) or uint32
    meta.json    key, dtype, n_tokens, n_train, n_val, tokenizer fingerprint, build seconds (written last)
The train split is tokens[:n_train] and the validation split the last val_fraction, tokens[n_train:].
An entry is built in a temporary directory and renamed into place, so a crash never leaves a half-written entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from waferscale.data.tokenizer import Tokenizer
from waferscale.errors import DataError
from waferscale.util.files import atomic_dir

__all__ = ["FORMAT_VERSION", "TokenSplits", "build_token_splits", "load_token_splits", "token_cache_key"]

FORMAT_VERSION = 1
_TOKENS_FILE = "tokens.bin"
_META_FILE = "meta.json"
_CHUNK_CHARS = 1 << 20  # tokenize in groups of documents of about this many characters (progress granularity)


@dataclass
class TokenSplits:
    """Memory-mapped train and validation token streams (1-D, uint16 or uint32) of one cache entry."""

    train: np.ndarray
    val: np.ndarray
    path: Path  # the cache entry directory
    key: str  # hex sha256 of (documents, tokenizer fingerprint, eos/val settings, format version)
    meta: dict[str, Any] = field(default_factory=dict)
    from_cache: bool = False  # True when an existing entry was reused without tokenizing

    @property
    def n_tokens(self) -> int:
        return len(self.train) + len(self.val)


def token_cache_key(documents: list[str], tokenizer: Tokenizer, val_fraction: float,
                    eos_between_docs: bool = True) -> str:
    """Hex sha256 over everything that decides the token files' bytes."""
    h = hashlib.sha256()
    header = {
        "format": FORMAT_VERSION,
        "tokenizer": tokenizer.fingerprint(),
        "eos_id": tokenizer.eos_id if eos_between_docs else None,
        "val_fraction": repr(float(val_fraction)),
        "n_docs": len(documents),
    }
    h.update(json.dumps(header, sort_keys=True).encode())
    for doc in documents:
        data = doc.encode("utf-8", errors="surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def build_token_splits(documents: list[str], tokenizer: Tokenizer, cache_dir: Path | str, val_fraction: float = 0.05,
                       eos_between_docs: bool = True, progress: bool = True) -> TokenSplits:
    """Tokenize `documents` (in order) into `cache_dir`, or reuse the entry built from the same inputs.

    With `eos_between_docs`, `tokenizer.eos_id` follows every document (nothing is inserted when the
    tokenizer has no eos). The last `val_fraction` of the stream is the validation split.
    """
    if not documents:
        raise DataError("no documents to tokenize")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cache_dir = Path(cache_dir).expanduser()
    key = token_cache_key(documents, tokenizer, val_fraction, eos_between_docs)
    entry = cache_dir / f"tokens-{key[:16]}"

    if entry.is_dir():
        try:
            splits = load_token_splits(entry)
        except DataError:
            splits = None  # stale or damaged entry: rebuild it
        if splits is not None and splits.key == key:
            splits.from_cache = True
            return splits
        shutil.rmtree(entry)  # damaged, or a 64-bit prefix collision (vanishingly rare): never serve wrong tokens

    writing = False
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with atomic_dir(entry) as tmp:  # (another process's copy of the same entry, finished first, is kept)
            writing = True
            meta = _tokenize_to(tmp, documents, tokenizer, val_fraction, eos_between_docs, progress)
            meta["key"] = key
            (tmp / _META_FILE).write_text(json.dumps(meta, indent=2))
    except OSError as e:
        if writing:
            raise
        raise DataError(f"cannot write the token cache in {cache_dir}: {e.strerror}") from e
    return load_token_splits(entry)


def _tokenize_to(tmp: Path, documents: list[str], tokenizer: Tokenizer, val_fraction: float, eos_between_docs: bool,
                 progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    start = time.perf_counter()
    dtype = np.dtype("<u2") if tokenizer.vocab_size <= 1 << 16 else np.dtype("<u4")
    eos = tokenizer.eos_id if eos_between_docs else None
    total_chars = sum(len(d) for d in documents)
    n_tokens = 0
    min_batch = os.cpu_count() or 1  # give the parallel encoder enough documents per call

    with open(tmp / _TOKENS_FILE, "wb") as f, tqdm(
        total=total_chars, unit="char", unit_scale=True, desc="tokenizing", disable=not progress
    ) as bar:
        i = 0
        while i < len(documents):
            j, chars = i, 0
            while j < len(documents) and (chars < _CHUNK_CHARS or j - i < min_batch):
                chars += len(documents[j])
                j += 1
            pieces = []
            for ids in tokenizer.encode_batch(documents[i:j]):
                pieces.append(np.asarray(ids, dtype=np.int64))
                if eos is not None:
                    pieces.append(np.array([eos], dtype=np.int64))
            chunk = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
            lo, hi = (int(chunk.min()), int(chunk.max())) if chunk.size else (0, 0)
            if lo < 0 or hi >= tokenizer.vocab_size:
                raise DataError(f"tokenizer emitted id {lo if lo < 0 else hi}, outside [0, vocab_size="
                                f"{tokenizer.vocab_size}); the tokenizer is inconsistent")
            f.write(chunk.astype(dtype).tobytes())
            n_tokens += chunk.size
            bar.update(chars)
            i = j

    n_val = int(n_tokens * val_fraction)
    n_train = n_tokens - n_val
    if n_val == 0 or n_train == 0:
        raise DataError(f"corpus has {n_tokens} tokens: val_fraction={val_fraction} leaves an empty "
                        f"{'validation' if n_val == 0 else 'training'} split; use more text or another val_fraction")
    return {
        "format": FORMAT_VERSION,
        "dtype": dtype.str,
        "n_tokens": n_tokens,
        "n_train": n_train,
        "n_val": n_val,
        "n_docs": len(documents),
        "n_chars": total_chars,
        "val_fraction": val_fraction,
        "eos_id": eos,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": type(tokenizer).__name__,
        "tokenizer_fingerprint": tokenizer.fingerprint(),
        "seconds": round(time.perf_counter() - start, 3),
    }


def load_token_splits(path: Path | str) -> TokenSplits:
    """Open an existing cache entry directory (read-only memmaps)."""
    path = Path(path)
    try:
        meta = json.loads((path / _META_FILE).read_text())
        dtype = np.dtype(meta["dtype"])
        n_train, n_val = int(meta["n_train"]), int(meta["n_val"])
        key = str(meta["key"])
        version = meta["format"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a complete token cache entry ({e})") from e
    if version != FORMAT_VERSION:
        raise DataError(f"{path}: token cache format {version}, expected {FORMAT_VERSION}; delete it to rebuild")
    file = path / _TOKENS_FILE
    expected = (n_train + n_val) * dtype.itemsize
    size = file.stat().st_size if file.is_file() else -1
    if size != expected or n_train <= 0 or n_val <= 0:
        raise DataError(f"{file}: {size} bytes, expected {expected}; delete {path} to rebuild")
    train = np.memmap(file, dtype=dtype, mode="r", shape=(n_train,))
    val = np.memmap(file, dtype=dtype, mode="r", offset=n_train * dtype.itemsize, shape=(n_val,))
    return TokenSplits(train=train, val=val, path=path, key=key, meta=meta)
