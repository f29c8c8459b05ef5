"""The C kernels' products over weights in their file's own precision (serve/quant.py, csrc/quant.c), each
quantization type alone. The float path: against the float64 product over `quant.dequantize` (the gguf
package's reading of GGUF's blocks), with the bound float32 summation allows, and against the float panels over
the same dequantized matrix, which it matches bit for bit (each weight dequantized exactly, then the same FMA
chain). The integer path (Q8_0, Q4_0, Q4_1, Q4_K with x as two int8 digits per block of 32): against the float64
product over the dequantized matrix, within x's documented rounding. Both: a row's result does not depend on
the batch or the number of threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from waferscale.serve import kernels, quant
from waferscale.serve.quant import QWeight

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"C kernels: {kernels.unavailable_reason()}")

BLOCK_TYPES = ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k"]
INT8_TYPES = ["q8_0", "q4_0", "q4_1", "q4_k"]
U = 2.0 ** -24  # float32's unit roundoff


def _bound(x: torch.Tensor, wd: torch.Tensor, b: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """|float32 result - exact| <= (in + 2) u (|x| |W|^T + |b| + |res|), u = 2^-24: each output is a chain of
    `in` FMAs then two adds, each rounding once (relative u), so the error is at most (in + 2) u times the sum
    of the magnitudes, to first order (the second-order term is below float32's reach at these sizes)."""
    mag = x.double().abs() @ wd.double().abs().T + b.double().abs() + res.double().abs()
    return (x.shape[1] + 2) * U * mag


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest):
    kernels.set_threads(request.param)
    yield request.param
    kernels.set_threads(1)


@pytest.fixture
def float_path():
    was = quant.set_int8_activations(False)
    yield
    quant.set_int8_activations(was)


@pytest.mark.parametrize("qtype", ["bf16", *BLOCK_TYPES])
@pytest.mark.parametrize("shape", [(37, 512), (5, 256), (80, 768)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_product_matches_dequantized_float64_and_float_panels(qtype: str, shape: tuple[int, int], threads: int,
                                                              float_path) -> None:
    g = torch.Generator().manual_seed(hash((qtype, shape)) % 2**31)
    w = quant.random(qtype, shape, g)
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
def test_quantized_by_gguf_runs_as_dequantized(qtype: str, float_path) -> None:
    """Weights rounded by the gguf package's quantizer (as a `--dtype` requantization does): no bias, no
    residual, an output count that is not a multiple of the panel width."""
    g = torch.Generator().manual_seed(7)
    w = quant.quantize(torch.randn(45, 96, generator=g), qtype)
    x = torch.randn(2, 96, generator=g)
    wd = quant.dequantize(w)
    assert torch.equal(quant.linear(x, w), kernels.linear(x, kernels.pack(wd), 45))
    assert quant.pack(w).packed.numel() >= quant.packed_bytes(qtype, w.shape) // (4 if qtype == "fp32" else 1)


@pytest.mark.parametrize("qtype", list(quant.QTYPES))
def test_take_reads_rows_as_dequantize(qtype: str) -> None:
    """An embedding lookup (the C kernels' row read) gives the rows of `dequantize` bit for bit, in the ids'
    shape, repeats included; an id outside the matrix is an IndexError, as torch's lookup."""
    g = torch.Generator().manual_seed(11)
    w = quant.random(qtype, (37, 512), g)
    ids = torch.tensor([[36, 0, 5], [5, 17, 36]])
    assert torch.equal(quant.take(w, ids), quant.dequantize(w)[ids])
    with pytest.raises(IndexError):
        quant.take(w, torch.tensor([3, 37]))


def test_leading_dimensions_and_packing_once() -> None:
    g = torch.Generator().manual_seed(3)
    w = quant.random("q4_1", (20, 64), g)
    x = torch.randn(2, 3, 64, generator=g)
    y = quant.linear(x, w)
    packed = w.packed
    assert y.shape == (2, 3, 20)
    assert torch.equal(y.reshape(6, 20), quant.linear(x.reshape(6, 64), w))
    assert w.packed is packed
    assert packed.numel() == quant.packed_bytes("q4_1", (20, 64)) == 32 * 2 * 20
    arena = torch.zeros(64 + packed.numel(), dtype=torch.uint8)
    start = -arena.data_ptr() % 64
    into = quant.pack(quant.QWeight(w.qtype, w.shape, w.data), arena[start:start + packed.numel()])
    assert into.packed.data_ptr() == arena.data_ptr() + start and torch.equal(quant.linear(x, into), y)
    with pytest.raises(ValueError, match="multiple of 64"):
        quant.pack(quant.QWeight(w.qtype, w.shape, w.data), arena[start + 1:start + 1 + packed.numel()])


def _block_offsets(w: QWeight) -> torch.Tensor:
    """(out, in) each weight's offset m within its block of 32, d q = w - m (Q4_1: its m; Q4_0: -8 d; Q8_0: 0;
    Q4_K: -dmin min of its sub-block)."""
    per, _ = quant.block_shape(w.qtype)
    raw = w.data.numpy().reshape(w.shape[0], w.shape[1] // per, -1)
    half = lambda at: raw[:, :, at:at + 2].copy().view(np.float16)[..., 0].astype(np.float64)  # noqa: E731
    if w.qtype == "q4_k":
        from gguf.quants import Q4_K
        _, mins = Q4_K.get_scale_min(raw[:, :, 4:16].reshape(-1, 12).copy())
        m = -(half(2)[..., None] * mins.reshape(*raw.shape[:2], 8).astype(np.float64)).reshape(w.shape[0], -1)
    else:
        m = {"q8_0": 0 * half(0), "q4_0": -8 * half(0), "q4_1": half(2)}[w.qtype]
    return torch.from_numpy(np.repeat(m, 32, axis=1))


@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("shape", [(37, 512), (80, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_int8_activations_within_their_rounding(qtype: str, shape: tuple[int, int], threads: int) -> None:
    """x as two int8 digits (csrc/qint.c): each element off by at most max |x| / (127 * 508) of its block (half
    the second digit's step; 0.1 % slack for dr's own rounding) plus 4 u max |x| (the float rest x - dx xq and
    its scaling), so the product by at most that times the block's sum of |w|; then float rounding: per output
    and block two multiplies (d dx, d dr), three FMAs into the sum and x's block sum (a 5-level tree), at most
    3 nb + 8 roundings of terms no larger than |x| (|w - m| + |m|) summed (with the bias and residual adds)."""
    was = quant.set_int8_activations(True)
    try:
        g = torch.Generator().manual_seed(hash((qtype, shape)) % 2**31)
        w = quant.random(qtype, shape, g)
        out, inp = shape
        wd = quant.dequantize(w).double()
        M = _block_offsets(w)
        for rows in (1, 4, 7):
            x = torch.randn(rows, inp, generator=g)
            b, res = torch.randn(out, generator=g), torch.randn(rows, out, generator=g)
            y = quant.linear(x, w, b, res)
            amax = x.double().abs().reshape(rows, -1, 32).amax(-1)
            per = amax / (127 * 508) * 1.001 + 4 * U * amax  # (rows, blocks)
            xround = per @ wd.abs().reshape(out, -1, 32).sum(-1).T
            mag = x.double().abs() @ ((wd - M).abs() + M.abs()).T + b.double().abs() + res.double().abs()
            exact = x.double() @ wd.T + b.double() + res.double()
            bound = xround + (3 * inp // 32 + 8) * U * (mag + xround)
            assert ((y.double() - exact).abs() <= bound).all(), (qtype, shape, rows)
            one = torch.cat([quant.linear(x[r:r + 1], w, b, res[r:r + 1]) for r in range(rows)])
            assert torch.equal(one, y), "a row's result depends on the batch"
    finally:
        quant.set_int8_activations(was)


def test_int8_is_the_default_and_switches() -> None:
    assert quant.set_int8_activations() is True
    g = torch.Generator().manual_seed(5)
    w = quant.random("q4_1", (16, 64), g)
    x = torch.randn(1, 64, generator=g)
    y8 = quant.linear(x, w)
    assert quant.set_int8_activations(False) is True
    try:
        yf = quant.linear(x, w)
        assert torch.equal(yf, kernels.linear(x, kernels.pack(quant.dequantize(w)), 16))
        assert not torch.equal(y8, yf)  # x's rounding shows
    finally:
        quant.set_int8_activations(True)


def _stack(weights: dict[str, object], C: int, nh: int, nkv: int, hd: int, ffn: int) -> kernels.DecodeStack:
    g = torch.Generator().manual_seed(11)
    layer = {"attn_norm": torch.rand(C, generator=g) + 0.5, "mlp_norm": torch.rand(C, generator=g) + 0.5,
             "attn_eps": 1e-5, "mlp_eps": 1e-5, "bqkv": None, "bo": None, "bgu": None, "bd": None,
             "cache": torch.zeros(2 * nkv, 8, hd), **weights}
    return kernels.DecodeStack([layer, dict(layer, cache=torch.zeros(2 * nkv, 8, hd))], nh, nkv, hd, ffn)


def test_decode_stack_runs_quantized_layers(float_path) -> None:
    """Every layer in one C call (kernels.DecodeStack) over QWeights: on the float path the bits of the same
    stack over the float panels of the dequantized matrices; on the integer path close to them (x's rounding)
    and the same on 1 or 2 threads."""
    C, nh, nkv, hd, ffn = 64, 4, 2, 16, 96
    g = torch.Generator().manual_seed(2)
    q = {"wqkv": quant.random("q4_1", ((nh + 2 * nkv) * hd, C), g), "wo": quant.random("q8_0", (C, nh * hd), g),
         "wgu": quant.random("q4_0", (2 * ffn, C), g), "wd": quant.random("bf16", (C, ffn), g)}
    f = {k: kernels.pack(quant.dequantize(w)) for k, w in q.items()}
    x = torch.randn(3, C, generator=g)

    def tokens(stack: kernels.DecodeStack) -> torch.Tensor:
        return torch.cat([stack(x[t:t + 1].clone(), None, None, 0, t + 1) for t in range(3)])

    want = tokens(_stack(f, C, nh, nkv, hd, ffn))
    assert torch.equal(tokens(_stack(q, C, nh, nkv, hd, ffn)), want)
    quant.set_int8_activations(True)
    one = tokens(_stack(q, C, nh, nkv, hd, ffn))
    kernels.set_threads(2)
    try:
        assert torch.equal(tokens(_stack(q, C, nh, nkv, hd, ffn)), one)
    finally:
        kernels.set_threads(1)
    assert not torch.equal(one, want)
    torch.testing.assert_close(one, want, rtol=0.05, atol=0.05 * want.abs().max().item())
