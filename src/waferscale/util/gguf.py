"""GGUF files, read with the `gguf` library: the one place that opens them and decodes their metadata.

Opening indexes every metadata value, and a 49k-token vocabulary with its merges makes that the slow part
(seconds), so the decoded metadata is kept, keyed by path, size and modification time: in memory for the last
few files (a model and its tokenizer loaded from one GGUF file parse it once) and on disk as JSON under the
cache directory (a later process reads it back in a fraction of the time).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from waferscale.errors import CheckpointError, UserError
from waferscale.util.files import atomic_write_text
from waferscale.util.paths import cache_dir

__all__ = ["gguf_metadata", "read_gguf"]

_KEEP = 2  # files whose decoded metadata stays cached
_cache: OrderedDict[tuple[str, int, int], dict[str, Any]] = OrderedDict()
_lock = threading.Lock()


def read_gguf(path: str | os.PathLike, error: type[UserError] = CheckpointError) -> Any:
    """Open `path` as a `gguf.GGUFReader` (metadata and tensors memory-mapped, nothing copied); `error` (naming
    the file) if it is missing or not readable GGUF."""
    import gguf

    p = Path(path)
    if not p.is_file():
        raise error(f"{p}: no such GGUF file")
    try:
        return gguf.GGUFReader(str(p))
    except (ValueError, OSError, IndexError, KeyError) as e:  # bad magic, empty, truncated, duplicate key
        raise error(f"{p}: not a readable GGUF file ({e})") from None


def gguf_metadata(path: str | os.PathLike, *, reader: Any = None,
                  error: type[UserError] = CheckpointError) -> dict[str, Any]:
    """The key/value metadata of the GGUF file at `path` as Python values (arrays as lists), without the
    reader's own `GGUF.*` header fields.

    Pass the `reader` already open on `path` to decode from it instead of opening the file again. A field
    the library cannot decode (e.g. invalid UTF-8) is left out. The dict is shared with later calls for the
    same unchanged file: treat it as read-only.
    """
    p = Path(path).expanduser().resolve()
    try:
        st = p.stat()
    except OSError as e:
        raise error(f"{p}: cannot read GGUF file ({e.strerror})") from None
    key = (str(p), st.st_size, st.st_mtime_ns)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    on_disk = cache_dir() / "gguf-metadata" / (hashlib.sha256(repr(key).encode()).hexdigest()[:24] + ".json")
    try:
        meta: dict[str, Any] = json.loads(on_disk.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = _decode(reader if reader is not None else read_gguf(p, error))
        try:
            on_disk.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(on_disk, json.dumps(meta))
        except (OSError, TypeError, ValueError):  # a read-only cache or a value JSON cannot hold: no disk copy
            pass
    with _lock:
        _cache[key] = meta
        while len(_cache) > _KEEP:
            _cache.popitem(last=False)
    return meta


def _decode(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            meta[name] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError):
            continue
    return meta
