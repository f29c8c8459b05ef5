"""Atomic file writes: nothing half-written on failure.

Every writer here puts its bytes in a temporary name in the target's own directory (same file system, so the
final `os.replace` is atomic) and renames it over the target only once the write has finished. On any
failure the temporary is removed and the target is left as it was. Temporary names start with a dot and
hold the process id and a random token, so concurrent writers (threads or processes) never share one.
`atomic_path` serves writers that need a file name (safetensors `save_file`, matplotlib `savefig`, h5py).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["atomic_dir", "atomic_path", "atomic_write_bytes", "atomic_write_json", "atomic_write_text"]


def _temp_beside(path: Path, suffix: str = "") -> Path:
    """A fresh hidden name in `path`'s directory: `.{name}.{pid}-{random}.tmp{suffix}`."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp{suffix}")


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = False, mode: int = 0o666) -> Path:
    """Write `data` to `path` atomically; with `fsync` the bytes reach the disk before the rename.

    The file gets `mode` less the umask, from its creation on (0o600: readable by its owner only, as a file
    holding a secret must be); the default is what an ordinary `open(path, "wb")` gives. Returns `path`.
    """
    path = Path(path)
    tmp = _temp_beside(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8", fsync: bool = False,
                      mode: int = 0o666) -> Path:
    """Write `text` (encoded with `encoding`) to `path` atomically. Returns `path`."""
    return atomic_write_bytes(path, text.encode(encoding), fsync=fsync, mode=mode)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, fsync: bool = False, mode: int = 0o666,
                      **json_kw: Any) -> Path:
    """Write `json.dumps(obj, **json_kw)` to `path` atomically (UTF-8). Returns `path`."""
    return atomic_write_text(path, json.dumps(obj, **json_kw), fsync=fsync, mode=mode)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary file name beside `path`, renamed over `path` when the block ends without error.

    The name keeps `path`'s suffix (writers such as `savefig` pick the format from it) and does not exist
    yet: the caller's writer creates it. On an exception the temporary is removed and `path` is not touched
    (a block that writes nothing raises FileNotFoundError at the rename).
    """
    path = Path(path)
    tmp = _temp_beside(path, path.suffix)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists() or tmp.is_symlink():
            _remove(tmp)


def _rename_unless_present(tmp: Path, path: Path) -> None:
    """Rename `tmp` to `path` (replacing an empty directory); keep an existing non-empty `path` (first wins)."""
    try:
        os.rename(tmp, path)
    except OSError:
        if not path.is_dir():  # anything but "another writer finished the same directory first"
            raise


@contextmanager
def atomic_dir(path: str | os.PathLike, *, install: Callable[[Path, Path], None] | None = None) -> Iterator[Path]:
    """Yield a new empty directory beside `path`; when the block ends without error it is put in place.

    By default it is renamed to `path`; if `path` is by then a non-empty directory (another process wrote
    the same thing first) that one is kept and ours dropped. `install(tmp, path)` replaces that rule (e.g.
    merge file by file into an existing directory). Whatever remains of the temporary is removed on exit,
    so a failure leaves `path` as it was. The directory gets the mode of an ordinary `mkdir`.
    """
    path = Path(path)
    tmp = _temp_beside(path)
    os.mkdir(tmp)
    try:
        yield tmp
        (install or _rename_unless_present)(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
