"""Model Zoo's HDF5 datasets: the `.h5` files its preprocessing writes, read as `GptHDF5MapDataProcessor` and
`GptHDF5DataProcessor` read them.

Layout (Model Zoo's "sample" format, what `cszoo data_preprocess` and `wsc data_preprocess` write): a directory
of `*.h5` files, read in sorted file-name order, each holding

    data               int32 [n, 3, msl]: per example the rows input_ids, attention_mask, labels
                       (labels[t] is the token after input_ids[t]; attention_mask is the loss mask: 1 where the
                       label is scored, 0 on padding), typically chunked (1, 3, msl) and gzip-compressed
    attrs n_examples   n (the iterable reader sums it per file)

(or, in the rank-1 'corpus' format the map reader also takes, `data` = the documents' tokens concatenated, cut
into sequences of max_sequence_length at run time), and optionally a `data_params.json` beside them whose
"features" list names the three rows (the order above when absent). Files are opened with h5py; a dataset stored
contiguous and uncompressed (what `wsc data_preprocess` writes) is memory-mapped, any other is read by h5py one
batch of rows at a time: nothing loads the whole set.

Batches: batch k is a pure function of (files, batch_size, shuffle, shuffle_seed, drop_last, k), as the token
loader's (`waferscale.data.loader`): the examples are taken epoch by epoch, in file order or, with `shuffle`, in
the permutation `default_rng([shuffle_seed, epoch])` draws. How an epoch ends is `drop_last`:

    map processor, drop_last true (Model Zoo's default): the rows left over at the end of an epoch open the next
        batch, followed by the next epoch's first rows (no example is skipped; Model Zoo's map-style sampler)
    iterable processor, drop_last true: the incomplete last batch of each epoch is dropped (torch's DataLoader)
    drop_last false (either): the last batch of each epoch is short, holding the rows left over
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from waferscale.data.loader import StepBatches, resume_step
from waferscale.data.masking import IGNORE_INDEX
from waferscale.errors import ConfigError, DataError

__all__ = ["FEATURES", "HDF5_PROCESSORS", "HDF5Batches", "HDF5Examples", "TEXT_PROCESSORS", "check_data_processor",
           "h5_files", "hdf5_eval_batches", "is_hdf5_dir", "short_batch_rows", "validate_hdf5"]

MAP, ITERABLE = "GptHDF5MapDataProcessor", "GptHDF5DataProcessor"
HDF5_PROCESSORS = (MAP, ITERABLE)
# Model Zoo processors whose role the token-stream loader plays on text (the objective follows the model family)
TEXT_PROCESSORS = ("BertCSVDynamicMaskDataProcessor", "T5DynamicDataProcessor")
FEATURES = ("input_ids", "attention_mask", "labels")
_VOCAB_SAMPLE_ROWS = 64  # rows per file the cheap validation reads for the vocabulary check


def check_data_processor(name: str | None) -> None:
    """ConfigError unless `name` is None or a processor this project reads data for."""
    if name is not None and name not in HDF5_PROCESSORS + TEXT_PROCESSORS:
        raise ConfigError(f"data_processor {name!r} is not supported; supported: {', '.join(HDF5_PROCESSORS)} (HDF5 "
                          f"from Model Zoo's or `wsc data_preprocess`'s preprocessing) and "
                          f"{', '.join(TEXT_PROCESSORS)} (text, read by the token-stream loader)")


def h5_files(data_dir: str | Path | list[str | Path]) -> list[Path]:
    """The `*.h5` files of one directory or a list of them (not recursive), sorted by path, as Model Zoo lists
    them. DataError for a missing directory or none found."""
    dirs = [data_dir] if isinstance(data_dir, (str, Path)) else list(data_dir)
    files: list[Path] = []
    for d in dirs:
        p = Path(d).expanduser()
        if not p.is_dir():
            raise DataError(f"HDF5 data_dir {str(d)!r} does not exist or is not a directory; give the directory "
                            "holding the .h5 files (e.g. what `wsc data_preprocess` wrote)")
        files.extend(p.glob("*.h5"))
    if not files:
        raise DataError(f"no *.h5 files in {', '.join(str(d) for d in dirs)}; preprocess text into it with "
                        "`wsc data_preprocess`")
    return sorted(files)


def is_hdf5_dir(data_dir: list[str]) -> bool:
    """True when every entry of `data_dir` is a directory holding `.h5` files (what the HDF5 readers read)."""
    return bool(data_dir) and all(Path(d).expanduser().is_dir() and any(Path(d).expanduser().glob("*.h5"))
                                  for d in data_dir)


def _feature_order(files: list[Path]) -> list[int]:
    """Row index of input_ids, attention_mask, labels: from a data_params.json "features" list beside the files."""
    order = list(FEATURES)
    for meta in sorted({f.parent / "data_params.json" for f in files}):
        if not meta.is_file():
            continue
        try:
            features = json.loads(meta.read_text()).get("features")
        except (OSError, ValueError, AttributeError) as e:
            raise DataError(f"{meta}: not readable JSON ({e})") from e
        if features is not None:
            if not isinstance(features, list) or not set(FEATURES) <= set(features) or len(features) != 3:
                raise DataError(f"{meta}: features {features!r} must name the three rows {', '.join(FEATURES)}")
            order = features
    return [order.index(name) for name in FEATURES]


class HDF5Examples:
    """Random access to the examples of a set of `.h5` files: `rows(ids)` -> int32 [len(ids), 3, msl] in the
    canonical feature order. Files open lazily (after a fork, each process opens its own handles).

    Files in Model Zoo's rank-1 'corpus' format (`data`: the documents' tokens, concatenated) are read as its map
    reader reads them, given `sequence_length`: example i is tokens[i * msl : (i + 1) * msl + 1] of the files in
    order, its inputs the first msl and its labels the last msl, every label scored."""

    def __init__(self, data_dir: str | Path | list[str | Path], sequence_length: int | None = None) -> None:
        import h5py

        self.files = h5_files(data_dir)
        shapes = []
        for f in self.files:
            try:
                with h5py.File(f, "r") as h:
                    if "data" not in h:
                        raise DataError(f"{f}: no 'data' dataset (has {', '.join(h.keys()) or 'nothing'}); Model "
                                        "Zoo's HDF5 files hold 'data' of shape [n, 3, max_seq_length]")
                    ds = h["data"]
                    shape, attr = ds.shape, h.attrs.get("n_examples")
                    if ds.dtype.kind not in "iu":
                        raise DataError(f"{f}: 'data' holds {ds.dtype}, expected integer token ids")
            except OSError as e:
                raise DataError(f"{f}: not a readable HDF5 file ({e})") from e
            if len(shape) != 1 and (len(shape) != 3 or shape[1] != 3):
                raise DataError(f"{f}: 'data' has shape {list(shape)}; Model Zoo's GPT data is [n, 3, msl] (input_ids, "
                                "attention_mask, labels) or the rank-1 token 'corpus'; preprocess the text with "
                                "`wsc data_preprocess`")
            if attr is not None and len(shape) == 3 and int(attr) != shape[0]:
                raise DataError(f"{f}: attribute n_examples={int(attr)} but 'data' holds {shape[0]} examples; the "
                                "file is damaged or was written incompletely")
            if shapes and (len(shape) == 1) != (len(shapes[0]) == 1):
                raise DataError(f"{f} and {self.files[0]} hold different formats (token corpus and samples); keep "
                                "one format per dataset")
            if shapes and len(shape) == 3 and shape[2] != shapes[0][2]:
                raise DataError(f"{f}: sequences of {shape[2]} tokens, but {self.files[0]} has {shapes[0][2]}; all "
                                "files of a dataset share one max_seq_length")
            shapes.append(shape)
        self.corpus = len(shapes[0]) == 1
        if self.corpus:
            if sequence_length is None:
                raise DataError(f"{self.files[0]} holds a rank-1 token corpus, which is cut into sequences of "
                                "max_sequence_length tokens: set train_input.max_sequence_length")
            self.msl = int(sequence_length)
            self.token_starts = np.concatenate([[0], np.cumsum([s[0] for s in shapes])])
            self.n = max(0, (int(self.token_starts[-1]) - 1) // self.msl)
            self.counts = np.array([], dtype=np.int64)
            self.order = list(range(3))
        else:
            self.msl = int(shapes[0][2])
            self.counts = np.array([s[0] for s in shapes], dtype=np.int64)
            self.n = int(self.counts.sum())
            self.order = _feature_order(self.files)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])
        if self.n == 0:
            raise DataError(f"the .h5 files in {', '.join(sorted({str(f.parent) for f in self.files}))} hold no "
                            "examples")
        self._local = threading.local()  # h5py handles per thread (prefetch workers) and per process

    def _sources(self) -> list[Any]:
        """Per file: a read-only np.memmap of `data` where it is contiguous and uncompressed, else the h5py dataset."""
        src = getattr(self._local, "sources", None)
        if src is None:
            import h5py

            src = []
            for f in self.files:
                h = h5py.File(f, "r")
                ds = h["data"]
                offset = ds.id.get_offset() if ds.chunks is None and ds.compression is None else None
                if offset is not None:
                    src.append(np.memmap(f, dtype=ds.dtype, mode="r", offset=offset, shape=ds.shape))
                    h.close()
                else:
                    src.append(ds)
            self._local.sources = src
        return src

    @property
    def memory_mapped(self) -> list[bool]:
        return [isinstance(s, np.memmap) for s in self._sources()]

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Examples `ids` (global indices in file order), int32 [len(ids), 3, msl], rows input_ids, mask, labels."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty((len(ids), 3, self.msl), dtype=np.int32)
        if self.corpus:
            for r, i in enumerate(ids):
                tokens = self._tokens(int(i) * self.msl, (int(i) + 1) * self.msl + 1)
                out[r, 0], out[r, 1], out[r, 2] = tokens[:-1], 1, tokens[1:]
            return out
        file_of = np.searchsorted(self.starts, ids, side="right") - 1
        sources = self._sources()
        for fi in np.unique(file_of):
            sel = np.nonzero(file_of == fi)[0]
            local = ids[sel] - self.starts[fi]
            uniq, inverse = np.unique(local, return_inverse=True)  # h5py reads increasing, distinct indices
            src = sources[fi]
            if isinstance(src, np.memmap):
                block = src[uniq]
            elif uniq[-1] - uniq[0] + 1 == len(uniq):  # one contiguous run: a slice reads whole chunks at once
                block = src[int(uniq[0]):int(uniq[-1]) + 1]
            else:
                block = src[uniq]
            out[sel] = block[inverse][:, self.order]
        return out


    def _tokens(self, lo: int, hi: int) -> np.ndarray:
        """Corpus tokens [lo, hi) of the files in order (a range may span two files or more)."""
        sources, parts = self._sources(), []
        first = int(np.searchsorted(self.token_starts, lo, side="right")) - 1
        for fi in range(first, len(self.files)):
            a, b = self.token_starts[fi], self.token_starts[fi + 1]
            if a >= hi:
                break
            parts.append(np.asarray(sources[fi][max(lo, a) - a:min(hi, b) - a]))
        return np.concatenate(parts)


def to_inputs_targets(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Model inputs and targets of int32 [b, 3, msl] rows: input_ids, and the labels where the loss mask is set
    (IGNORE_INDEX where it is 0: padding is not scored), both int64 [b, msl]."""
    x = torch.from_numpy(rows[:, 0].astype(np.int64))
    y = torch.from_numpy(np.where(rows[:, 1] != 0, rows[:, 2], IGNORE_INDEX).astype(np.int64))
    return x, y


@dataclass(eq=False, repr=False)
class HDF5Batches(StepBatches):
    """Infinite iterator of (x, y) LongTensors [rows // world_size, msl]: this rank's contiguous block of global
    batch k (see the module docstring for how batches are drawn). `num_workers` > 0 reads that many batches ahead
    on background threads (batch k is a pure function of k, so prefetching changes nothing but the timing).
    Resume by `load_state_dict` of a saved `state_dict()`, on any world size."""

    examples: HDF5Examples
    batch_size: int
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = True
    processor: str = MAP
    num_workers: int = 0
    rank: int = 0
    world_size: int = 1
    vocab_size: int | None = None  # when set, every batch's ids are checked against it

    def __post_init__(self) -> None:
        n, b = self.examples.n, self.batch_size
        if b <= 0:
            raise DataError(f"batch_size must be positive, got {b}")
        if self.processor not in HDF5_PROCESSORS:
            raise ConfigError(f"HDF5 processor must be one of {', '.join(HDF5_PROCESSORS)}, got {self.processor!r}")
        if self.world_size <= 0 or not 0 <= self.rank < self.world_size or b % self.world_size:
            raise DataError(f"need 0 <= rank < world_size and batch_size divisible by world_size, got rank="
                            f"{self.rank}, world_size={self.world_size}, batch_size={b}")
        self.carry = self.processor == MAP and self.drop_last  # the stream runs on across epochs
        if self.examples.corpus and self.processor == ITERABLE:
            raise ConfigError(f"{ITERABLE} reads examples [n, 3, msl]; {self.examples.files[0]} holds a rank-1 token "
                              f"corpus, which {MAP} reads: set data_processor: {MAP}")
        if not self.carry and self.drop_last and n < b:
            raise DataError(f"the dataset has {n} examples, fewer than one batch of {b}, and drop_last drops the "
                            "incomplete batch; lower batch_size, add data, or set drop_last: false")
        self.batches_per_epoch = n // b if self.drop_last else -(-n // b)
        self.step = 0
        self.seed = int(self.seed)
        self._perm: tuple[int, np.ndarray] | None = None
        self._pool = ThreadPoolExecutor(self.num_workers) if self.num_workers > 0 else None
        self._ahead: dict[int, Future] = {}

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.examples.n)
        cached = self._perm  # one read: a prefetch thread may replace it meanwhile
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.examples.n))
            self._perm = cached
        return cached[1]

    def global_ids(self, k: int) -> np.ndarray:
        """Example indices of global batch k."""
        n, b = self.examples.n, self.batch_size
        if self.carry:
            pos = k * b + np.arange(b)
            epochs = pos // n
            out = np.empty(b, dtype=np.int64)
            for e in np.unique(epochs):
                sel = epochs == e
                out[sel] = self._epoch_order(int(e))[pos[sel] % n]
            return out
        epoch, j = divmod(k, self.batches_per_epoch)
        return self._epoch_order(epoch)[j * b:min((j + 1) * b, n)]

    def _read(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.global_ids(k)
        share = len(ids) // self.world_size
        if share * self.world_size != len(ids):
            raise DataError(f"the short last batch of an epoch has {len(ids)} rows, which do not split over "
                            f"{self.world_size} systems; set drop_last: true or pick a batch_size that divides the "
                            f"{self.examples.n} examples")
        rows = self.examples.rows(ids[self.rank * share:(self.rank + 1) * share])
        if self.vocab_size is not None:
            check_vocab(rows, self.vocab_size, f"batch {k} of {self.examples.files[0].parent}")
        return to_inputs_targets(rows)

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of global batch k (does not move the iterator)."""
        if self._pool is None:
            return self._read(k)
        for j in range(k, k + self.num_workers + 1):  # keep num_workers batches in flight beyond k
            if j not in self._ahead:
                self._ahead[j] = self._pool.submit(self._read, j)
        for j in [j for j in self._ahead if j < k]:
            del self._ahead[j]
        return self._ahead.pop(k).result()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position and what decides the batches (rank/world_size/num_workers are not)."""
        return {"version": 1, "step": self.step, "format": "hdf5", "processor": self.processor, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "batch_size": self.batch_size,
                "seq_len": self.examples.msl, "n_examples": self.examples.n,
                "files": [f.name for f in self.examples.files]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state["step"]`; DataError if the state came from a loader that yields other batches."""
        self.step = resume_step(state, self.state_dict())
        self._ahead.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def short_batch_rows(n_examples: int, batch_size: int, drop_last: bool) -> int:
    """Rows of the short last batch of each epoch (drop_last false), 0 when every batch is full."""
    return 0 if drop_last else n_examples % batch_size


def check_vocab(rows: np.ndarray, vocab_size: int, where: str) -> None:
    """DataError if a token id of input_ids or of a scored label lies outside [0, vocab_size)."""
    ids = np.concatenate([rows[:, 0].ravel(), rows[:, 2][rows[:, 1] != 0]])
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise DataError(f"{where}: token id {bad} is outside the model's vocabulary [0, {vocab_size}); the data "
                        "was made with another tokenizer: raise model.vocab_size or preprocess with the model's "
                        "tokenizer")


def validate_hdf5(data_dir: list[str], max_sequence_length: int | None, vocab_size: int) -> HDF5Examples:
    """The cheap checks a run makes before building anything large: the directories hold readable `.h5` files in
    the sample layout, one max_seq_length that equals `max_sequence_length` (when given), and token ids (of the
    first rows of each file) below `vocab_size`. Returns the opened examples."""
    ex = HDF5Examples(data_dir, max_sequence_length)
    if max_sequence_length is not None and max_sequence_length != ex.msl:
        raise DataError(f"the HDF5 data in {', '.join(data_dir)} holds sequences of {ex.msl} tokens but "
                        f"max_sequence_length is {max_sequence_length}; set max_sequence_length: {ex.msl} (or "
                        "preprocess again with that --max_seq_length)")
    for fi, f in enumerate(ex.files):
        first = ex.starts[fi] + np.arange(min(int(ex.counts[fi]), _VOCAB_SAMPLE_ROWS))
        if len(first):
            check_vocab(ex.rows(first), vocab_size, str(f))
    return ex


def hdf5_eval_batches(examples: HDF5Examples, batch_size: int,
                      max_batches: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed evaluation batches: the examples in file order, up to `max_batches` batches (all when None); the
    last may have fewer rows. Every example is scored at most once."""
    n = examples.n if max_batches is None else min(examples.n, max_batches * batch_size)
    return [to_inputs_targets(examples.rows(np.arange(i, min(i + batch_size, n)))) for i in range(0, n, batch_size)]
