"""Model Zoo's HDF5 data: what `wsc data_preprocess` writes (checked against Model Zoo's documented layout with
h5py directly), files written the way Model Zoo's preprocessing writes them (gzip, chunks of one example), Model
Zoo's token-corpus format, the readers' batches (shuffle, seed, drop_last, sharding, prefetch, resumption) and
`wsc run` on an HDF5 directory (two systems streaming = one resident, exact resume)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import yaml

from conftest import tiny_params
from waferscale.cli.main import main
from waferscale.data import load_tokenizer
from waferscale.data.hdf5 import HDF5Batches, HDF5Examples, hdf5_eval_batches, short_batch_rows, validate_hdf5
from waferscale.data.masking import IGNORE_INDEX
from waferscale.data.preprocess import preprocess
from waferscale.errors import ConfigError, DataError
from waferscale.params import params_from_dict
from waferscale.zoo.runner import RunOptions, check_hdf5_split, run

MSL = 16


@pytest.fixture
def h5dir(corpus: Path, tmp_path: Path) -> Path:
    out = tmp_path / "h5"
    preprocess([str(corpus)], out, max_seq_length=MSL, examples_per_file=100, progress=False)
    return out


def _modelzoo_file(path: Path, data: np.ndarray) -> None:
    """One file as Model Zoo's preprocessing writes it: `data` int32 [n, 3, msl], one example per gzip chunk,
    attribute n_examples."""
    with h5py.File(path, "w") as h:
        h.attrs["n_examples"] = data.shape[0]
        h.create_dataset("data", data=data, dtype="i4", chunks=(1, 3, data.shape[2]), compression="gzip")


def _rows(n: int, msl: int = MSL, vocab: int = 50, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(n, msl + 1), dtype=np.int32)
    mask = np.ones((n, msl), dtype=np.int32)
    mask[-1, msl // 2:] = 0  # the last example padded, as a short final piece is
    return np.stack([ids[:, :-1], mask, ids[:, 1:]], axis=1)


# ---- the writer, checked by the layout -------------------------------------------------------------------------

def test_preprocess_writes_the_modelzoo_layout(corpus: Path, h5dir: Path) -> None:
    files = sorted(h5dir.glob("*.h5"))
    blocks = []
    for f in files:  # independently of our reader: h5py and the documented layout
        with h5py.File(f, "r") as h:
            data = h["data"][()]
            assert h["data"].dtype == np.int32 and data.ndim == 3 and data.shape[1:] == (3, MSL)
            assert int(h.attrs["n_examples"]) == data.shape[0] <= 100
        blocks.append(data)
    data = np.concatenate(blocks)
    ids, mask, labels = data[:, 0], data[:, 1], data[:, 2]
    full = mask.all(axis=1)
    assert full[:-1].all() and set(np.unique(mask)) <= {0, 1}
    assert (ids[:, 1:][mask[:, 1:] == 1] == labels[:, :-1][mask[:, 1:] == 1]).all()  # labels: the next token
    # the packed stream: each example is msl + 1 tokens (inputs, then the last label); the documents in order
    tok = load_tokenizer(h5dir)  # the tokenizer written beside the files
    text = (corpus / "a.txt").read_text() + "".join(json.loads(ln)["text"] for ln in
                                                    (corpus / "b.jsonl").read_text().splitlines())
    stream = np.asarray(tok.encode(text), dtype=np.int32)
    pieces = np.concatenate([np.concatenate([ids[i], labels[i, -1:]]) for i in np.nonzero(full)[0]])
    assert (pieces == stream[:len(pieces)]).all()
    meta = json.loads((h5dir / "data_params.json").read_text())
    assert meta["features"] == ["input_ids", "attention_mask", "labels"]
    assert meta["post-process"]["n_examples"] == len(data) and meta["processing"]["max_seq_length"] == MSL
    # our reader gives the same rows, memory-mapped (stored contiguous)
    ex = HDF5Examples(h5dir)
    assert ex.n == len(data) and ex.msl == MSL and all(ex.memory_mapped)
    assert (ex.rows(np.arange(ex.n)) == data).all()


def test_reader_reads_modelzoo_written_files(tmp_path: Path) -> None:
    d = tmp_path / "mz"
    d.mkdir()
    a, b = _rows(5, seed=1), _rows(4, seed=2)
    _modelzoo_file(d / "output_chunk_0_0_0_0.h5", a)
    _modelzoo_file(d / "output_chunk_0_0_0_1.h5", b)
    ex = HDF5Examples(d)
    assert ex.n == 9 and not any(ex.memory_mapped)  # gzip chunks: read through h5py
    assert (ex.rows(np.array([8, 0, 5, 5])) == np.stack([b[3], a[0], b[0], b[0]])).all()
    x, y = hdf5_eval_batches(ex, 9)[0]
    assert (x.numpy() == np.concatenate([a, b])[:, 0]).all()
    assert (y[8, MSL // 2:] == IGNORE_INDEX).all() and (y[0].numpy() == a[0, 2]).all()  # padding is not scored
    # a data_params.json naming another row order is followed
    (d / "data_params.json").write_text(json.dumps({"features": ["labels", "input_ids", "attention_mask"]}))
    assert (HDF5Examples(d).rows(np.array([0]))[0] == a[0][[1, 2, 0]]).all()


def test_corpus_format(tmp_path: Path) -> None:
    """Model Zoo's map reader also takes a rank-1 token corpus, cut into sequences at run time (one extra token
    read: the last label), across file boundaries."""
    d = tmp_path / "corpus"
    d.mkdir()
    tokens = np.arange(23, dtype=np.int32)
    for name, piece in (("a.h5", tokens[:10]), ("b.h5", tokens[10:])):
        with h5py.File(d / name, "w") as h:
            h.create_dataset("data", data=piece, chunks=(5,), compression="gzip")
    with pytest.raises(DataError, match="set train_input.max_sequence_length"):
        HDF5Examples(d)
    ex = HDF5Examples(d, 4)
    assert ex.n == 5 and ex.msl == 4  # (23 - 1) // 4
    rows = ex.rows(np.array([2, 0]))
    assert rows[0].tolist() == [[8, 9, 10, 11], [1, 1, 1, 1], [9, 10, 11, 12]]  # spans a.h5 and b.h5
    assert rows[1, 0].tolist() == [0, 1, 2, 3] and rows[1, 2].tolist() == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="set data_processor: GptHDF5MapDataProcessor"):
        HDF5Batches(ex, 2, processor="GptHDF5DataProcessor")


def test_validation_errors(tmp_path: Path, h5dir: Path) -> None:
    validate_hdf5([str(h5dir)], MSL, vocab_size=64)
    with pytest.raises(DataError, match="sequences of 16 tokens but max_sequence_length is 32"):
        validate_hdf5([str(h5dir)], 32, vocab_size=64)
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        validate_hdf5([str(h5dir)], MSL, vocab_size=3)
    with pytest.raises(DataError, match="does not exist"):
        validate_hdf5([str(tmp_path / "nope")], MSL, vocab_size=64)
    (tmp_path / "bad").mkdir()
    with h5py.File(tmp_path / "bad" / "a.h5", "w") as h:
        h.create_dataset("data", data=np.zeros((4, 2, 8), dtype=np.int32))
    with pytest.raises(DataError, match=r"'data' has shape \[4, 2, 8\]"):
        HDF5Examples(tmp_path / "bad")
    d = tiny_params(h5dir, tmp_path / "m")
    d["train_input"]["data_processor"] = "GptHDF5MapDataProcesor"
    with pytest.raises(ConfigError, match="not supported; supported: GptHDF5MapDataProcessor, GptHDF5DataProcessor"):
        params_from_dict(d, "p.yaml")


# ---- batches ------------------------------------------------------------------------------------------------

def _ids(loader: HDF5Batches, k: int) -> list[int]:
    return loader.global_ids(k).tolist()


def test_epochs_shuffle_and_drop_last(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    _modelzoo_file(d / "a.h5", _rows(10))
    ex = HDF5Examples(d)
    carry = HDF5Batches(ex, 4, processor="GptHDF5MapDataProcessor")  # drop_last: leftovers open the next epoch
    assert [_ids(carry, k) for k in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    drop = HDF5Batches(ex, 4, processor="GptHDF5DataProcessor")  # drop_last: torch's, per epoch
    assert [_ids(drop, k) for k in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    short = HDF5Batches(ex, 4, drop_last=False)
    assert [_ids(short, k) for k in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]
    assert short_batch_rows(10, 4, False) == 2 and next(iter(short))[0].shape == (4, MSL)
    inp = SimpleNamespace(drop_last=False, batch_size=4, micro_batch_size=2)
    check_hdf5_split(ex, inp, 1)  # the short batch of 2 is one micro-batch of 2
    with pytest.raises(ConfigError, match="last batch of 2 of the 10 examples"):
        check_hdf5_split(ex, inp, 2)  # 1 row per system: no micro-batch of 2
    s1, s2 = (HDF5Batches(ex, 4, shuffle=True, seed=7) for _ in range(2))
    first = [_ids(s1, k) for k in range(5)]
    assert first == [_ids(s2, k) for k in range(5)]  # the seed decides
    assert sorted(sum(first, [])[:10]) == list(range(10)) and sum(first, [])[:10] != list(range(10))
    assert first != [_ids(HDF5Batches(ex, 4, shuffle=True, seed=8), k) for k in range(5)]
    ahead = HDF5Batches(ex, 4, shuffle=True, seed=7, num_workers=3)  # prefetch across epoch boundaries
    assert [next(ahead)[0].tolist() for _ in range(8)] == [s1.batch(k)[0].tolist() for k in range(8)]
    ahead.close()
    with pytest.raises(DataError, match="fewer than one batch"):
        HDF5Batches(ex, 12, processor="GptHDF5DataProcessor")


def test_sharding_prefetch_and_resume(h5dir: Path) -> None:
    ex = HDF5Examples(h5dir)
    whole = HDF5Batches(ex, 4, shuffle=True, seed=3)
    shards = [HDF5Batches(ex, 4, shuffle=True, seed=3, rank=r, world_size=2) for r in range(2)]
    for k in range(3):
        x, y = whole.batch(k)
        parts = [s.batch(k) for s in shards]
        assert (x == np.concatenate([p[0] for p in parts])).all() and (y == np.concatenate([p[1] for p in parts])).all()
    ahead = HDF5Batches(ex, 4, shuffle=True, seed=3, num_workers=2)
    for k in range(5):
        assert (next(ahead)[0] == whole.batch(k)[0]).all()
    ahead.close()
    a = HDF5Batches(ex, 4, shuffle=True, seed=3)
    for _ in range(4):
        next(a)
    state = json.loads(json.dumps(a.state_dict()))
    b = HDF5Batches(ex, 4, shuffle=True, seed=3, rank=1, world_size=2)  # resume on another world size
    b.load_state_dict(state)
    assert (next(b)[0] == next(a)[0][2:]).all()
    with pytest.raises(DataError, match="seed: saved 3, now 4"):
        HDF5Batches(ex, 4, shuffle=True, seed=4).load_state_dict(state)


# ---- the commands ----------------------------------------------------------------------------------------------

def test_data_preprocess_command(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "pre.yaml"  # a Model Zoo preprocessing config; the flags win over it
    cfg.write_text(yaml.safe_dump({"setup": {"data": {"source": str(corpus), "type": "local"},
                                             "output_dir": str(tmp_path / "out")},
                                   "processing": {"max_seq_length": 64, "use_ftfy": True}}))
    assert main(["data_preprocess", "--config", str(cfg), "--max_seq_length", "8", "--compression", "gzip",
                 "--no_progress"]) == 0
    said = capsys.readouterr()
    assert "examples of 8 tokens" in said.out
    assert said.err == "ignored: processing.use_ftfy (not read by wsc data_preprocess)\n"
    with h5py.File(next((tmp_path / "out").glob("*.h5")), "r") as h:
        assert h["data"].shape[1:] == (3, 8) and h["data"].compression == "gzip"
    for argv, message in [(["--input", str(tmp_path / "missing.txt"), "--output_dir", str(tmp_path / "o2")],
                           "does not exist"),
                          (["--input", str(corpus), "--output_dir", str(tmp_path / "out")], "exists and is not empty"),
                          (["--output_dir", str(tmp_path / "o3")], "give --input")]:
        assert main(["data_preprocess", "--no_progress", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "o2").exists()


def _losses(model_dir: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (model_dir / "metrics.jsonl").read_text().splitlines()]


def test_wsc_run_on_hdf5_two_systems_and_exact_resume(h5dir: Path, tmp_path: Path) -> None:
    d = tiny_params(h5dir, tmp_path / "unused", checkpoint_steps=2)
    d["train_input"].update(data_processor="GptHDF5MapDataProcessor", max_sequence_length=MSL, num_workers=1)
    d["runconfig"]["max_steps"] = 4
    d["eval_input"] = {"data_dir": [str(h5dir)], "batch_size": 4, "data_processor": "GptHDF5MapDataProcessor"}
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(d))
    s = run(params_from_dict(d, "p.yaml"), RunOptions(model_dir=tmp_path / "one", mode="train_and_eval",
                                                      execution="resident", progress=False), out=io.StringIO())
    assert s["seq_len"] == MSL and s["eval_batches"] == 2 and (tmp_path / "one" / "tokenizer").is_dir()
    no_eval = {k: v for k, v in d.items() if k != "eval_input"}
    with pytest.raises(ConfigError, match="no held-out split; give eval_input"):
        run(params_from_dict(no_eval, "p.yaml"), RunOptions(model_dir=tmp_path / "one", mode="eval", progress=False),
            out=io.StringIO())
    assert main(["run", "-p", str(p), "-o", str(tmp_path / "two"), "--num_csx", "2", "--execution", "streaming",
                 "--no_progress"]) == 0
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["executor"] == "swarmx"
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    for num_steps in (2, None):  # stop at the checkpoint of step 2, then resume: the same batches, the same losses
        run(params_from_dict(d, "p.yaml"), RunOptions(model_dir=tmp_path / "resumed", num_steps=num_steps,
                                                      execution="resident", progress=False), out=io.StringIO())
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "one")
