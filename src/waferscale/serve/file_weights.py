"""The matrices the serving engine runs, in the precision `--dtype` asks for: `served_weights(model, dtype)`.

A GGUF loaded with `keep_quantized` (models/gguf.py) holds its embedding, head and projections as the file's
stored rows (`model.gguf_matrices`); each becomes a `QWeight` of the file's own type with one copy of its bytes
(the Q/K rotary un-permutation a row gather on them), never a float32 matrix. `dtype` other than "auto"
requantizes: a matrix already of that type is kept as it is, any other is dequantized and quantized again
(GGUF's rounding, as llama-quantize --allow-requantize); "auto" runs a float16 matrix in float32, which holds
it exactly. A model loaded in float (a Hugging Face directory, a checkpoint) runs dense with "auto" and "fp32"
(the packed float32 path), and is quantized at load otherwise. One QWeight serves every name of a tied matrix
(embedding and head).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from waferscale.errors import ConfigError
from waferscale.models.gguf import SERVED_MATRICES, GGUFMatrix
from waferscale.serve.quant import QTYPES, REQUANTIZABLE, QWeight, block_shape, from_gguf, qtype_of, quantize

DTYPES = ("auto", *REQUANTIZABLE)  # --dtype's choices


def _dequantized(name: str, m: GGUFMatrix) -> torch.Tensor:
    """The float32 matrix (out, in) of `m`'s rows."""
    from gguf.quants import dequantize

    data = m.data if m.rows is None else m.data[m.rows]
    try:
        w = dequantize(data, m.ggml_type)
    except NotImplementedError:
        raise ConfigError(f"{name}: the gguf package cannot dequantize type {m.ggml_type.name}, so it cannot be "
                          "requantized either") from None
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(m.shape))


def _requantized(name: str, w: torch.Tensor, dtype: str) -> QWeight:
    per = block_shape(dtype)[0]
    if w.shape[1] % per:
        raise ConfigError(f"--dtype {dtype} cannot hold {name}: its rows of {w.shape[1]} weights are not whole "
                          f"blocks of {per} (a multiple of {per} is needed); pick another --dtype")
    return quantize(w, dtype)


def _from_file(name: str, m: GGUFMatrix, dtype: str) -> QWeight:
    qtype = qtype_of(m.ggml_type)
    if dtype not in ("auto", qtype):
        return _requantized(name, _dequantized(name, m), dtype)
    if m.ggml_type.name == "F16":  # (the kernels have no float16: float32 holds every float16 exactly)
        return _requantized(name, _dequantized(name, m), "fp32")
    if qtype is None:
        raise ConfigError(f"{name} is stored as {m.ggml_type.name}, which the serving kernels do not run; they run "
                          f"{', '.join(QTYPES.values())}: pass --dtype ({', '.join(REQUANTIZABLE)}) to requantize "
                          "it at load")
    w = from_gguf(m.data, m.ggml_type, (m.data.shape[0], m.shape[1]))
    return w if m.rows is None else w.rows(m.rows)


def served_weights(model: nn.Module, dtype: str = "auto") -> dict[str, QWeight]:
    """{parameter name: QWeight} of the matrices to run in `dtype` (one of DTYPES); {} when the model runs dense
    (loaded in float, dtype "auto" or "fp32"). ConfigError for a type the kernels do not run (named, with the
    supported ones) or a matrix `dtype` cannot hold."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    kept: dict[str, GGUFMatrix] | None = getattr(model, "gguf_matrices", None)
    if kept is None and dtype in ("auto", "fp32"):
        return {}
    sources = kept if kept is not None else {
        n: p for n, p in model.named_parameters(remove_duplicate=False) if n.endswith(SERVED_MATRICES)}
    made: dict[int, QWeight] = {}  # by source object: a tied matrix is made once
    out = {}
    for name, src in sources.items():
        if id(src) not in made:
            made[id(src)] = (_from_file(name, src, dtype) if kept is not None
                             else _requantized(name, src.detach().float(), dtype))
        out[name] = made[id(src)]
    return out


__all__ = ["DTYPES", "served_weights"]
