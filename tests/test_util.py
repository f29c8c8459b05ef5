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
