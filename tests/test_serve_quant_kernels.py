"""The C kernels' products over weights in their file's own precision (serve/quant.py, csrc/quant.c), each
quantization type alone: against the float64 product over `quant.dequantize` (the gguf package's reading of
GGUF's blocks), with the bound float32 summation allows, and against the float panels over the same dequantized
matrix, which the exact path matches bit for bit (each weight dequantized exactly, then the same FMA chain)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from waferscale.serve import kernels, quant
from waferscale.serve.quant import QWeight

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C kernels unavailable")

BLOCK_TYPES = ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k"]
# the fp16 fields of each block type (byte offsets in a block): d, and Q4_1's m / Q4_K's dmin
_HALF_FIELDS = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q6_k": [208]}


def random_qweight(qtype: str, out: int, inp: int, g: torch.Generator) -> QWeight:
    """A (out, in) matrix of `qtype` with random quants and scales (every bit pattern of the quants and the
    6-/8-bit scales; fp16 scales of either sign in [1e-3, 2e-2], Q4_1's offset m in [-0.16, 0.16])."""
    if qtype in ("fp32", "bf16"):
        w = torch.randn(out, inp, generator=g)
        if qtype == "bf16":
            w = w.to(torch.bfloat16)
        return QWeight(qtype, (out, inp), w.contiguous().view(torch.uint8).reshape(out, -1).clone())
    per, size = quant.block_shape(qtype)
    nb = inp // per
    raw = torch.randint(0, 256, (out, nb, size), generator=g, dtype=torch.uint8).numpy()
    for i, off in enumerate(_HALF_FIELDS[qtype]):
        h = torch.rand(out, nb, generator=g).numpy() * 0.019 + 0.001
        sign = np.where(torch.rand(out, nb, generator=g).numpy() < 0.5, -1.0, 1.0)
        h = (h * sign * (8 if i == 1 and qtype == "q4_1" else 1)).astype(np.float16)
        raw[:, :, off:off + 2] = h.view(np.uint8).reshape(out, nb, 2)
    return QWeight(qtype, (out, inp), torch.from_numpy(raw.reshape(out, -1).copy()))


def _bound(x: torch.Tensor, wd: torch.Tensor, b: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """|float32 result - exact| <= (in + 2) u (|x| |W|^T + |b| + |res|), u = 2^-24: each output is a chain of
    `in` FMAs then two adds, each rounding once (relative u), so the error is at most (in + 2) u times the sum
    of the magnitudes, to first order (the second-order term is below float32's reach at these sizes)."""
    mag = x.double().abs() @ wd.double().abs().T + b.double().abs() + res.double().abs()
    return (x.shape[1] + 2) * 2.0 ** -24 * mag


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest):
    kernels.set_threads(request.param)
    yield request.param
    kernels.set_threads(1)


@pytest.mark.parametrize("qtype", ["bf16", *BLOCK_TYPES])
@pytest.mark.parametrize("shape", [(37, 512), (5, 256), (80, 768)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_product_matches_dequantized_float64_and_float_panels(qtype: str, shape: tuple[int, int], threads: int) -> None:
    g = torch.Generator().manual_seed(hash((qtype, shape)) % 2**31)
    w = random_qweight(qtype, *shape, g)
    wd = quant.dequantize(w)
    wp = kernels.pack(wd)
    out, inp = shape
    for rows in (1, 3, 17):
        x = torch.randn(rows, inp, generator=g)
        b, res = torch.randn(out, generator=g), torch.randn(rows, out, generator=g)
        y = quant.linear(x, w, b, res)
        exact = x.double() @ wd.double().T + b.double() + res.double()
        assert ((y.double() - exact).abs() <= _bound(x, wd, b, res)).all(), (qtype, shape, rows)
        assert torch.equal(y, kernels.linear(x, wp, out, b, res)), (qtype, shape, rows)
        one = torch.cat([quant.linear(x[r:r + 1], w) for r in range(rows)])
        assert torch.equal(one, quant.linear(x, w)), "a row's result depends on the batch"


@pytest.mark.parametrize("qtype", quant.REQUANTIZABLE)
def test_quantized_by_gguf_runs_as_dequantized(qtype: str) -> None:
    """Weights rounded by the gguf package's quantizer (as a `--dtype` requantization does): no bias, no
    residual, an output count that is not a multiple of the panel width."""
    g = torch.Generator().manual_seed(7)
    w = quant.quantize(torch.randn(45, 96, generator=g), qtype)
    x = torch.randn(2, 96, generator=g)
    wd = quant.dequantize(w)
    assert torch.equal(quant.linear(x, w), kernels.linear(x, kernels.pack(wd), 45))
    assert quant.pack(w).packed.numel() >= quant.packed_bytes(qtype, w.shape) // (4 if qtype == "fp32" else 1)


def test_leading_dimensions_and_packing_once() -> None:
    g = torch.Generator().manual_seed(3)
    w = random_qweight("q4_1", 20, 64, g)
    x = torch.randn(2, 3, 64, generator=g)
    y = quant.linear(x, w)
    packed = w.packed
    assert y.shape == (2, 3, 20)
    assert torch.equal(y.reshape(6, 20), quant.linear(x.reshape(6, 64), w))
    assert w.packed is packed
    assert packed.numel() == quant.packed_bytes("q4_1", (20, 64)) == 32 * 2 * 20
