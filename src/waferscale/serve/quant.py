"""Weights in a file's own precision (fp32, bf16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K): GGUF's blocks held as bytes,
never a full float32 copy, and the products that read them.

A `QWeight` is one matrix (out, in) whose rows are GGUF's blocks for that output, back to back: row r of `data`
is the `row_bytes` bytes llama.cpp stores for output r. Rows are independent, so a row permutation (the Q/K
rotary un-permutation of a llama GGUF) is a row gather on the bytes.

`linear(x, w)` is y = x W^T (+ bias, + residual). With the C kernels (serve/kernels.py) it runs on `pack(w)`:
the same bytes moved once into panels of 16 outputs (csrc/quant.c; fp32 goes in the float panels). Q8_0, Q4_0,
Q4_1 and Q4_K by default write x as two int8 digits per block of 32 (about 16 bits) and sum in integers (faster;
x's rounding, max |x| / 64516 an element, is the price: `set_int8_activations`); otherwise, and for bf16 and
Q6_K, each weight is dequantized in registers exactly as `dequantize` computes it and summed in the float
panels' order, so the result has the same bits as the float32 product over `dequantize(w)` through the kernels.
Either way a row's result depends neither on the batch nor on the thread count. Without the kernels it
dequantizes W with the gguf package and runs torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from waferscale.errors import ConfigError
from waferscale.serve import kernels

# our name -> GGML's type name; the order is the --dtype choices' order
QTYPES: dict[str, str] = {"fp32": "F32", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1",
                          "q4_k": "Q4_K", "q6_k": "Q6_K"}
REQUANTIZABLE = ("fp32", "bf16", "q8_0", "q4_0", "q4_1")  # targets of `--dtype` (gguf.quants.quantize has these)


def _ggml(qtype: str):
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType[QTYPES[qtype]]


def qtype_of(ggml_type) -> str | None:
    """GGML's type (a GGMLQuantizationType) -> our name, None if the kernels do not run it."""
    for ours, name in QTYPES.items():
        if ggml_type.name == name:
            return ours
    return None


def block_shape(qtype: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of `qtype`."""
    from gguf import GGML_QUANT_SIZES
    return GGML_QUANT_SIZES[_ggml(qtype)]


@dataclass
class QWeight:
    qtype: str  # a key of QTYPES
    shape: tuple[int, int]  # (out, in)
    data: Tensor  # uint8 (out, row_bytes): each output's GGUF blocks
    packed: object = None  # the C kernels' own layout of `data`, when they repack it (serve/kernels.py)

    def __post_init__(self) -> None:
        per, size = block_shape(self.qtype)
        out, inp = self.shape
        if inp % per:
            raise ConfigError(f"a {self.qtype} matrix needs its input size to be a multiple of {per}, got {inp}")
        if tuple(self.data.shape) != (out, inp // per * size) or self.data.dtype != torch.uint8:
            raise ConfigError(f"{self.qtype} bytes of shape {tuple(self.data.shape)} ({self.data.dtype}) do not "
                              f"hold a ({out}, {inp}) matrix: expected uint8 ({out}, {inp // per * size})")

    @property
    def nbytes(self) -> int:
        """Bytes a product reads."""
        return self.data.numel()

    def kernel_panels(self) -> tuple[int, Tensor]:
        """(csrc/quant.c's QT_* code, the packed panels) for the C layer stack (serve/kernels.py's DecodeStack)."""
        return QTYPE_CODE[self.qtype], pack(self).packed

    def rows(self, index: Tensor | np.ndarray | list[int]) -> QWeight:
        """The rows `index` (a permutation or a slice of outputs), as their own QWeight."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return QWeight(self.qtype, (int(idx.numel()), self.shape[1]), self.data[idx].contiguous())


def from_gguf(data: np.ndarray, ggml_type, shape: tuple[int, int]) -> QWeight:
    """A GGUF tensor's bytes (`ReaderTensor.data`, any dtype; its `shape` reversed: (out, in)) as a QWeight; one
    copy of the bytes out of the read-only memory map. ConfigError naming the type for one the kernels do not run."""
    qtype = qtype_of(ggml_type)
    if qtype is None:
        raise ConfigError(f"weights of type {ggml_type.name} are not supported; supported: "
                          f"{', '.join(QTYPES.values())} (requantize with --dtype fp32 to run it dequantized)")
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(shape[0], -1)
    return QWeight(qtype, (int(shape[0]), int(shape[1])), torch.from_numpy(raw.copy()))


def quantize(w: Tensor, qtype: str) -> QWeight:
    """A float matrix (out, in) in `qtype` (GGUF's rounding, as gguf.quants.quantize and llama.cpp do)."""
    from gguf.quants import quantize as gq
    if qtype not in REQUANTIZABLE:
        raise ConfigError(f"cannot quantize to {qtype}; --dtype takes {', '.join(REQUANTIZABLE)}")
    raw = gq(w.detach().float().cpu().numpy(), _ggml(qtype))
    return QWeight(qtype, tuple(w.shape), torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)))


def dequantize(w: QWeight) -> Tensor:
    """The float32 matrix (out, in) `w` holds."""
    from gguf.quants import dequantize as gd
    x = gd(w.data.numpy(), _ggml(w.qtype))
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32).reshape(w.shape))


_HALF_FIELDS = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q6_k": [208]}  # fp16 fields of a
# block (byte offsets): d, and Q4_1's m / Q4_K's dmin


def random(qtype: str, shape: tuple[int, int], g: torch.Generator) -> QWeight:
    """A (out, in) `qtype` matrix of random bytes (tests, benchmarks: every bit pattern of the quants and of the
    6- and 8-bit scales) whose fp16 scales are of either sign in [1e-3, 2e-2] (Q4_1's offset m: 8 times that);
    fp32 and bf16: standard normal values."""
    out, inp = shape
    if qtype in ("fp32", "bf16"):
        w = torch.randn(out, inp, generator=g).to(torch.float32 if qtype == "fp32" else torch.bfloat16)
        return QWeight(qtype, (out, inp), w.contiguous().view(torch.uint8).reshape(out, -1).clone())
    per, size = block_shape(qtype)
    nb = inp // per
    raw = torch.randint(0, 256, (out, nb, size), generator=g, dtype=torch.uint8)
    for i, off in enumerate(_HALF_FIELDS[qtype]):
        h = torch.rand(out, nb, generator=g) * 0.019 + 0.001
        h = torch.where(torch.rand(out, nb, generator=g) < 0.5, -h, h) * (8 if i == 1 and qtype == "q4_1" else 1)
        raw[:, :, off:off + 2] = h.to(torch.float16).view(torch.uint8).reshape(out, nb, 2)
    return QWeight(qtype, (out, inp), raw.reshape(out, -1))


def take(w: QWeight, ids: Tensor) -> Tensor:
    """Rows `ids` of `w` in float32 (an embedding lookup): only those rows are dequantized, with the same values
    as `dequantize` (by the C kernels when they are available: a decode step's lookup, where the gguf package's
    numpy path costs tens of microseconds)."""
    out, inp = w.shape
    flat = ids.reshape(-1)
    if w.qtype == "fp32":
        return w.data.view(torch.float32)[flat].reshape(*ids.shape, inp)
    if not kernels.available():
        return dequantize(w.rows(flat)).reshape(*ids.shape, inp)
    idx = flat.to(torch.int64).contiguous()
    y = torch.empty(idx.numel(), inp)
    rc = kernels.qrows(w.data, QTYPE_CODE[w.qtype], out, inp, idx, y)
    if rc == -2:
        raise IndexError(f"an index of {flat.tolist()} is outside the {out} rows of the matrix")
    if rc != 0:
        raise ConfigError(f"the C kernels cannot read rows of a {w.qtype} matrix of shape {w.shape}")
    return y.reshape(*ids.shape, inp)


QTYPE_CODE = {q: i for i, q in enumerate(QTYPES)}  # csrc/quant.c's QT_* numbering (0: float panels)


def packed_bytes(qtype: str, shape: tuple[int, int]) -> int:
    """Bytes of the C kernels' panels of a (out, in) `qtype` matrix (pack): GGUF's bytes with the outputs padded
    to a multiple of 16 (Q4_K: 148 bytes a block, its 6-bit scales unpacked)."""
    out, inp = shape
    if qtype == "fp32":
        return kernels.packed_numel(shape) * 4
    per, size = block_shape(qtype)
    return -(-out // kernels.PANEL) * kernels.PANEL * (inp // per) * (size + 4 * (qtype == "q4_k"))


def pack(w: QWeight, out: Tensor | None = None) -> QWeight:
    """`w` with `packed` set (once) to the C kernels' panels of its bytes: written into `out` when given (a
    uint8 tensor of packed_bytes(w.qtype, w.shape) bytes, e.g. a slice of an arena holding every matrix, whose
    start is a multiple of 64 bytes), else into their own huge-page buffer. `w` as it is without the kernels."""
    if w.packed is not None or not kernels.available():
        return w
    n = packed_bytes(w.qtype, w.shape)
    if out is not None and (out.dtype != torch.uint8 or out.numel() != n or not out.is_contiguous()
                            or out.data_ptr() % 64):
        raise ValueError(f"pack: out must be {n} contiguous uint8 bytes starting at a multiple of 64")
    buf = kernels.hugepage_tensor(-(-n // 4)).view(torch.uint8)[:n] if out is None else out
    if w.qtype == "fp32":
        w.packed = kernels.pack(w.data.view(torch.float32), out=buf.view(torch.float32))
        return w
    dst = buf
    data = w.data.contiguous()
    if kernels.qpack(data, QTYPE_CODE[w.qtype], w.shape[0], w.shape[1], dst) != 0:
        raise ConfigError(f"the C kernels cannot pack a {w.qtype} matrix of shape {w.shape}")
    w.packed = dst
    return w


def linear(x: Tensor, w: QWeight, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """residual + x W^T + bias for x (..., in) float32 (bias (out,), residual (..., out)): through the C kernels
    on pack(w) when they are available, else dequantize, then torch."""
    if not kernels.available():
        y = F.linear(x, dequantize(w), bias)
        return y if residual is None else residual + y
    out, inp = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, inp).float().contiguous()
    res = None if residual is None else residual.reshape(-1, out).float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    pack(w)
    if w.qtype == "fp32":
        return kernels.linear(x2, w.packed, out, b, res).reshape(*lead, out)
    y = torch.empty(x2.shape[0], out)
    rc = kernels.qlinear(w.packed, QTYPE_CODE[w.qtype], x2, b, res, y, x2.shape[0], out, inp)
    if rc != 0:
        raise MemoryError(f"a {w.qtype} product over {x2.shape[0]} rows: out of memory for its buffers")
    return y.reshape(*lead, out)


def set_int8_activations(on: bool | None = None) -> bool:
    """Whether the C kernels' Q8_0 / Q4_0 / Q4_1 / Q4_K products write x as two int8 digits per block of 32 and sum in
    integers (the default: faster, x's rounding to max |x| / 64516 an element the price; csrc/qint.c) or keep x
    in float32 (the same bits as the float32 product over the dequantized weights); sets it when `on` is given.
    Returns the previous setting (False without the kernels)."""
    if not kernels.available():
        return False
    return kernels.qset_int8(on)


__all__ = ["QTYPES", "QTYPE_CODE", "REQUANTIZABLE", "QWeight", "block_shape", "dequantize", "from_gguf", "linear",
           "pack", "packed_bytes", "qtype_of", "quantize", "random", "set_int8_activations", "take"]
