"""`wsc data_preprocess` (the role of `cszoo data_preprocess` for pretraining): text -> Model Zoo's HDF5 layout.

Documents (the builtin Shakespeare corpus, .txt files, .jsonl files with a "text" field, directories of them; see
`waferscale.data.corpus`) are tokenized in order and packed as Model Zoo's pretraining preprocessing packs them
(`pack_sequences: true`): each document followed by the tokenizer's EOS (when it has one), the stream cut into
non-overlapping pieces of max_seq_length + 1 tokens, each piece an example

    input_ids = piece[:-1], labels = piece[1:], attention_mask (the loss mask) = 1

and the last piece, when it holds at least `min_sequence_len` tokens, padded with the pad id (the EOS, else 0) and
attention_mask 0 on the padding. Examples go to `output_chunk_<iiiii>.h5` files of `examples_per_file` rows: dataset
`data`, int32 [n, 3, max_seq_length], attribute `n_examples`; stored contiguous (the reader memory-maps it) or
chunked (1, 3, msl) with gzip, Model Zoo's storage. Beside them: `data_params.json` (Model Zoo's summary: features,
the settings, "post-process" counts) and the tokenizer (`tokenizer.json`), which a run on the directory uses.
Everything is written in a temporary directory renamed into place at the end: a failure leaves no partial dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from waferscale.errors import ConfigError, DataError
from waferscale.util.files import atomic_dir

__all__ = ["add_flags", "cmd_data_preprocess", "preprocess"]

_CHUNK_CHARS = 1 << 20  # tokenize documents in groups of about this many characters (progress granularity)
DEFAULTS: dict[str, Any] = {"input": None, "output_dir": None, "tokenizer": "char", "max_seq_length": 2048,
                            "examples_per_file": 50_000, "min_sequence_len": 10, "compression": None}


class _Writer:
    """Accumulates examples and writes each full file of `per_file` rows (and the rest at `close`)."""

    def __init__(self, out: Path, msl: int, per_file: int, compression: str | None) -> None:
        self.out, self.msl, self.per_file, self.compression = out, msl, per_file, compression
        self.rows: list[np.ndarray] = []
        self.n_rows = self.files = self.total = 0

    def add(self, block: np.ndarray) -> None:
        self.rows.append(block)
        self.n_rows += len(block)
        while self.n_rows >= self.per_file:
            allrows = np.concatenate(self.rows)
            self._write(allrows[:self.per_file])
            rest = allrows[self.per_file:]
            self.rows, self.n_rows = ([rest] if len(rest) else []), len(rest)

    def _write(self, data: np.ndarray) -> None:
        import h5py

        path = self.out / f"output_chunk_{self.files:05d}.h5"  # zero-padded: sorted = written order
        with h5py.File(path, "w") as h:
            h.attrs["n_examples"] = len(data)
            if self.compression:
                h.create_dataset("data", data=data, dtype="i4", chunks=(1, 3, self.msl), compression=self.compression)
            else:
                h.create_dataset("data", data=data, dtype="i4")
        self.files += 1
        self.total += len(data)

    def close(self) -> None:
        if self.n_rows:
            self._write(np.concatenate(self.rows))
            self.rows, self.n_rows = [], 0


def _pieces(stream: np.ndarray, msl: int) -> tuple[np.ndarray, np.ndarray]:
    """Full examples [k, 3, msl] cut from the start of `stream` (pieces of msl + 1 tokens), and the leftover."""
    k = len(stream) // (msl + 1)
    pieces = stream[:k * (msl + 1)].reshape(k, msl + 1)
    block = np.stack([pieces[:, :-1], np.ones((k, msl), dtype=np.int32), pieces[:, 1:]], axis=1)
    return block, stream[k * (msl + 1):]


def preprocess(inputs: list[str], output_dir: str | Path, tokenizer: str = "char", max_seq_length: int = 2048,
               examples_per_file: int = 50_000, min_sequence_len: int = 10, compression: str | None = None,
               progress: bool = True) -> dict[str, Any]:
    """Write the HDF5 dataset of `inputs` to `output_dir` (which must not exist or be empty); returns the
    data_params.json summary."""
    from tqdm.auto import tqdm

    from waferscale.data.corpus import read_documents
    from waferscale.data.tokenizer import load_tokenizer

    if max_seq_length < 1 or examples_per_file < 1 or min_sequence_len < 2:
        raise ConfigError(f"--max_seq_length ({max_seq_length}) and --examples_per_file ({examples_per_file}) must "
                          f"be positive and --min_sequence_len ({min_sequence_len}) at least 2")
    if compression not in (None, "gzip", "lzf"):
        raise ConfigError(f"--compression must be none, gzip or lzf, got {compression!r}")
    out = Path(output_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"output directory {out} exists and is not empty; give a new directory")
    docs = read_documents(inputs)
    tok = load_tokenizer(tokenizer, text_for_char="".join(docs) if tokenizer == "char" else None)
    eos, pad = tok.eos_id, (tok.eos_id if tok.eos_id is not None else 0)
    start = time.perf_counter()
    total_chars = sum(len(d) for d in docs)
    stats = {"num_tokens": 0, "num_pad_tokens": 0, "loss_valid_tokens": 0, "raw_chars_count": total_chars,
             "processed_files": len(docs)}
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp, tqdm(total=total_chars, unit="char", unit_scale=True, desc="data_preprocess",
                                      disable=not progress) as bar:
        writer = _Writer(tmp, max_seq_length, examples_per_file, compression)
        carry = np.zeros(0, dtype=np.int32)
        min_batch = os.cpu_count() or 1  # give the parallel encoder enough documents per call
        i = 0
        while i < len(docs):
            j, chars = i, 0
            while j < len(docs) and (chars < _CHUNK_CHARS or j - i < min_batch):
                chars += len(docs[j])
                j += 1
            parts = [carry]
            for ids in tok.encode_batch(docs[i:j]):
                parts.append(np.asarray(ids, dtype=np.int32))
                if eos is not None:
                    parts.append(np.array([eos], dtype=np.int32))
            block, carry = _pieces(np.concatenate(parts), max_seq_length)
            if len(block):
                writer.add(block)
            bar.update(chars)
            i = j
        if len(carry) >= min_sequence_len:  # the last piece, padded (Model Zoo drops shorter ones)
            n = len(carry) - 1
            row = np.full((1, 3, max_seq_length), pad, dtype=np.int32)
            row[0, 0, :n], row[0, 2, :n] = carry[:-1], carry[1:]
            row[0, 1] = 0
            row[0, 1, :n] = 1
            stats["num_pad_tokens"] = max_seq_length - n
            writer.add(row)
        writer.close()
        if writer.total == 0:
            raise DataError(f"{', '.join(inputs)}: {stats['raw_chars_count']} characters make no example of "
                            f"max_seq_length {max_seq_length}; use more text or a shorter --max_seq_length")
        stats["n_examples"] = writer.total
        stats["num_tokens"] = writer.total * max_seq_length
        stats["loss_valid_tokens"] = stats["num_tokens"] - stats["num_pad_tokens"]
        tok.save(tmp)
        summary = {"features": ["input_ids", "attention_mask", "labels"],
                   "setup": {"input": list(inputs), "output_dir": str(out), "mode": "pretraining"},
                   "processing": {"tokenizer": str(tokenizer), "vocab_size": tok.vocab_size, "eos_id": eos,
                                  "pad_id": pad, "max_seq_length": max_seq_length, "min_sequence_len": min_sequence_len,
                                  "examples_per_file": examples_per_file, "compression": compression,
                                  "pack_sequences": True},
                   "post-process": {**stats, "n_files": writer.files,
                                    "seconds": round(time.perf_counter() - start, 3)}}
        (tmp / "data_params.json").write_text(json.dumps(summary, indent=2))
    return summary


# ---- the command ---------------------------------------------------------------------------------------------

def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="a Model Zoo preprocessing YAML: setup.input_dir (or "
                   "setup.data.source), setup.output_dir, processing.max_seq_length, processing.huggingface_tokenizer "
                   "(or tokenizer); the flags below win over it")
    p.add_argument("--input", action="append", default=None, help="'shakespeare', a .txt/.jsonl file or a directory "
                   "of them (repeat for several)")
    p.add_argument("--output_dir", default=None, help="new directory for the .h5 files")
    p.add_argument("--tokenizer", default=None, help="'char' (built from the text; default), a tokenizer.json, a "
                   "directory holding one, a .gguf or an asset name (smollm2)")
    p.add_argument("--max_seq_length", type=int, default=None, help="tokens per example (default 2048)")
    p.add_argument("--examples_per_file", type=int, default=None, help="rows per .h5 file (default 50000)")
    p.add_argument("--min_sequence_len", type=int, default=None, help="shortest last piece kept, padded (default 10)")
    p.add_argument("--compression", default=None, choices=["none", "gzip", "lzf"],
                   help="none (default: contiguous, memory-mapped when read) or gzip (Model Zoo's storage)")
    p.add_argument("--no_progress", action="store_true")


def _from_config(path: str) -> dict[str, Any]:
    """The settings a Model Zoo preprocessing YAML gives (the keys `add_flags` names)."""
    import yaml

    try:
        cfg = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: cannot read YAML ({e})") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"--config {path}: expected a mapping with setup/processing sections")
    setup, processing = cfg.get("setup") or {}, cfg.get("processing") or {}
    if (cfg.get("dataset") or {}).get("pack_sequences", True) is not True:
        raise ConfigError(f"--config {path}: dataset.pack_sequences false is not supported (documents are packed)")
    source = setup.get("input_dir") or (setup.get("data") or {}).get("source")
    out: dict[str, Any] = {"input": [source] if isinstance(source, str) else source,
                           "output_dir": setup.get("output_dir"), "max_seq_length": processing.get("max_seq_length"),
                           "tokenizer": processing.get("huggingface_tokenizer") or processing.get("tokenizer"),
                           "min_sequence_len": processing.get("min_sequence_len")}
    used = {"setup.input_dir", "setup.data.source", "setup.data.type", "setup.output_dir", "processing.max_seq_length",
            "processing.huggingface_tokenizer", "processing.tokenizer", "processing.min_sequence_len",
            "dataset.pack_sequences"}
    for key in _leaf_keys(cfg):
        if key not in used:
            print(f"ignored: {key} (not read by wsc data_preprocess)", file=sys.stderr)
    return {k: v for k, v in out.items() if v is not None}


def _leaf_keys(d: dict[str, Any], prefix: str = "") -> list[str]:
    return [k for key, v in d.items()
            for k in (_leaf_keys(v, f"{prefix}{key}.") if isinstance(v, dict) else [f"{prefix}{key}"])]


def cmd_data_preprocess(a: argparse.Namespace) -> int:
    settings = dict(DEFAULTS)
    if a.config:
        settings.update(_from_config(a.config))
    settings.update({k: getattr(a, k) for k in DEFAULTS if getattr(a, k) is not None})
    if settings["compression"] == "none":
        settings["compression"] = None
    if not settings["input"] or not settings["output_dir"]:
        raise ConfigError("give --input (or setup.input_dir in --config) and --output_dir (or setup.output_dir)")
    s = preprocess(settings.pop("input"), settings.pop("output_dir"), progress=not a.no_progress, **settings)
    post = s["post-process"]
    print(f"wrote {post['n_examples']:,} examples of {s['processing']['max_seq_length']} tokens in {post['n_files']} "
          f"file(s) to {s['setup']['output_dir']} ({post['raw_chars_count'] / post['seconds']:,.0f} chars/s)")
    return 0
