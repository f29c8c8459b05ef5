"""Benchmark: `wsc data_preprocess` (waferscale.data.preprocess) on the builtin Shakespeare corpus against its peer,
the same job written directly: the same tokenizer object's batch encode (`tokenizers`' Rust encoder for a BPE
tokenizer; a numpy lookup table for the character tokenizer), numpy packing into [n, 3, msl] examples and plain
h5py files of the same layout. Both write the same bytes (checked); figures are characters/s over the whole job
(reading the corpus, tokenizing, packing, writing), the median of the repeats, run alternately.

    python bench/data_preprocess.py [--tokenizer smollm2] [--max_seq_length 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

from waferscale.data import CharTokenizer, load_tokenizer, read_documents
from waferscale.data.preprocess import preprocess


def peer(docs: list[str], tok, out: Path, msl: int, per_file: int) -> None:
    """The hand-written pipeline: encode everything, pack, write files of `per_file` examples."""
    if isinstance(tok, CharTokenizer):  # one id per character: a lookup table over code points
        table = np.zeros(max(map(ord, tok.chars)) + 1, dtype=np.int32)
        table[[ord(c) for c in tok.chars]] = np.arange(len(tok.chars), dtype=np.int32)
        ids = [table[np.frombuffer(d.encode("utf-32-le"), dtype=np.uint32)] for d in docs]
    else:
        ids = [np.asarray(e.ids, dtype=np.int32) for e in tok.tk.encode_batch(docs, add_special_tokens=False)]
    if tok.eos_id is not None:
        eos = np.array([tok.eos_id], dtype=np.int32)
        ids = [a for d in ids for a in (d, eos)]
    stream = np.concatenate(ids)
    k = len(stream) // (msl + 1)
    pieces = stream[:k * (msl + 1)].reshape(k, msl + 1)
    data = np.stack([pieces[:, :-1], np.ones((k, msl), dtype=np.int32), pieces[:, 1:]], axis=1)
    rest = stream[k * (msl + 1):]
    if len(rest) >= 10:  # the padded last piece, as the command writes it
        pad = tok.eos_id if tok.eos_id is not None else 0
        row = np.full((1, 3, msl), pad, dtype=np.int32)
        n = len(rest) - 1
        row[0, 0, :n], row[0, 2, :n], row[0, 1] = rest[:-1], rest[1:], 0
        row[0, 1, :n] = 1
        data = np.concatenate([data, row])
    out.mkdir()
    for f, i in enumerate(range(0, len(data), per_file)):
        with h5py.File(out / f"output_chunk_{f:05d}.h5", "w") as h:
            h.attrs["n_examples"] = len(data[i:i + per_file])
            h.create_dataset("data", data=data[i:i + per_file], dtype="i4")


def same_data(a: Path, b: Path) -> bool:
    fa, fb = sorted(a.glob("*.h5")), sorted(b.glob("*.h5"))
    if [f.name for f in fa] != [f.name for f in fb]:
        return False
    for x, y in zip(fa, fb):
        with h5py.File(x, "r") as hx, h5py.File(y, "r") as hy:
            if not np.array_equal(hx["data"][()], hy["data"][()]):
                return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="smollm2", help="char or a tokenizer spec (default: smollm2, BPE)")
    ap.add_argument("--max_seq_length", type=int, default=2048)
    ap.add_argument("--examples_per_file", type=int, default=50_000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    docs = read_documents("shakespeare")
    chars = sum(map(len, docs))
    tok = load_tokenizer(a.tokenizer, text_for_char="".join(docs) if a.tokenizer == "char" else None)
    ours_s, peer_s = [], []
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.repeats):
            t0 = time.perf_counter()
            docs_r = read_documents("shakespeare")  # the peer reads the corpus too
            peer(docs_r, tok, Path(d) / f"peer{r}", a.max_seq_length, a.examples_per_file)
            peer_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            preprocess(["shakespeare"], Path(d) / f"ours{r}", tokenizer=a.tokenizer, max_seq_length=a.max_seq_length,
                       examples_per_file=a.examples_per_file, progress=False)
            ours_s.append(time.perf_counter() - t0)
        same = same_data(Path(d) / "ours0", Path(d) / "peer0")
    ours, theirs = chars / statistics.median(ours_s), chars / statistics.median(peer_s)
    print(f"corpus: shakespeare, {chars:,} characters; tokenizer {a.tokenizer} ({tok.vocab_size} ids); "
          f"max_seq_length {a.max_seq_length}; same examples written: {same}")
    print(f"wsc data_preprocess: {ours / 1e6:6.2f} M chars/s  "
          f"(median of {a.repeats}: {statistics.median(ours_s):.2f} s)")
    print(f"peer (tokenizers/numpy + h5py): {theirs / 1e6:6.2f} M chars/s  ({statistics.median(peer_s):.2f} s)")
    print(f"ratio ours / peer: {ours / theirs:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
