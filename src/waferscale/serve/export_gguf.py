"""`wsc export --format gguf [--dtype D]`: a GGUF file written from a GGUF file, its matrices in `D`.

Metadata and tokenizer are copied from the source (general.file_type set to D's). Each matrix the serving
engine runs (embedding, head, projections) is requantized to D as the engine does at load
(serve/file_weights.py's `served_weights`) and written back in the source's own layout: the rows `_ours`
mapped out of each stored tensor (llama's Q/K rotary permutation, a fused attn_qkv, an experts' stack) are put
back where they were, so the file is llama.cpp's. Every other tensor (norms, biases, rope frequencies) is
copied byte for byte; with D "auto" every tensor is. The file is written beside its destination and renamed
into place when complete.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from waferscale.errors import ConfigError
from waferscale.models.gguf import load_gguf, stored_matrices
from waferscale.serve.file_weights import served_weights
from waferscale.serve.quant import QTYPES
from waferscale.util.files import atomic_path
from waferscale.util.gguf import read_gguf

# --dtype -> llama.cpp's general.file_type (llama.h's LLAMA_FTYPE_*)
FILE_TYPES = {"fp32": "ALL_F32", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0",
              "q4_1": "MOSTLY_Q4_1"}


def _bytes(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A stored tensor's data as uint8 of its byte shape: numpy `shape` (GGUF's reversed) with the innermost
    axis in bytes."""
    return np.ascontiguousarray(a).view(np.uint8).reshape(*shape[:-1], -1)


def export_gguf(src: str | os.PathLike, out: str | os.PathLike, dtype: str = "auto") -> dict[str, int]:
    """Write `src` (a GGUF file) to `out` with its matrices in `dtype`. Returns {"tensors", "requantized",
    "bytes"} (tensors written, of which requantized, tensor bytes)."""
    import gguf

    src, out = Path(src), Path(out)
    if src.suffix != ".gguf" or not src.is_file():
        raise ConfigError(f"wsc export --format gguf writes a GGUF from a GGUF file (requantized with --dtype); "
                          f"{str(src)!r} is not a .gguf file")
    if src.resolve() == out.resolve():
        raise ConfigError(f"--out {out} is the source file: give another path")
    model, meta = load_gguf(src, keep_quantized=True)
    kept = getattr(model, "gguf_matrices", None)
    if kept is None and dtype != "auto":
        raise ConfigError(f"--dtype {dtype}: {meta['general.architecture']} files are exported as they are "
                          "(its matrices do not run on the serving engine): pass --dtype auto")
    qweights = served_weights(model, dtype) if dtype != "auto" else {}
    reader = read_gguf(src)
    arch = str(meta["general.architecture"])
    stats = {"tensors": 0, "requantized": 0, "bytes": 0}
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch=arch)
        for f in reader.fields.values():
            if f.name.startswith("GGUF.") or f.name == "general.architecture" or (
                    f.name == "general.file_type" and dtype != "auto"):
                continue
            vtype = gguf.GGUFValueType(f.types[0])
            sub = gguf.GGUFValueType(f.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
        if dtype != "auto":
            w.add_file_type(gguf.LlamaFileType[FILE_TYPES[dtype]])
        for t in reader.tensors:
            shape = tuple(int(s) for s in reversed(t.shape))  # numpy order: (..., out, in)
            mats = stored_matrices(arch, model.config, t) if qweights and len(shape) >= 2 else []
            if mats and all(name in qweights for name, _ in mats):
                first = qweights[mats[0][0]]
                stored = np.empty((mats[0][1].data.shape[0], first.data.shape[1]), dtype=np.uint8)
                for name, m in mats:  # each matrix's rows back where the file stores them
                    stored[slice(None) if m.rows is None else m.rows] = qweights[name].data.numpy()
                data, kind = stored.reshape(*shape[:-1], -1), gguf.GGMLQuantizationType[QTYPES[first.qtype]]
                stats["requantized"] += 1
            else:
                data, kind = _bytes(t.data, shape), t.tensor_type
            w.add_tensor(t.name, data, raw_dtype=kind)
            stats["tensors"] += 1
            stats["bytes"] += data.nbytes
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return stats


__all__ = ["FILE_TYPES", "export_gguf"]
