"""Benchmark: the C kernels' products over weights in their file's own precision (serve/quant.py,
csrc/quant.c), against the bytes they read and against the float32 panels the engine runs today.

For each of SmolLM2-135M's matrix shapes (out x in: q/o 576 x 576, k/v 192 x 576, gate/up 1536 x 576, down
576 x 1536, the tied head 49152 x 576) and each type (random bytes with sane scales, `quant.random`; Q4_K and
Q6_K only where `in` is a multiple of their 256-weight blocks, i.e. the down projection):

- decode: one row (GEMV) through the C entry points directly (ctypes, no tensor allocation; the per-call
  overhead of a ctypes call into the library is measured on a 16 x 32 product and printed: it is in every
  figure but `C only`, which takes it off, as the engine's one-C-call decode does not pay it), over enough
  copies of the packed matrix that a pass outruns the caches (>= --mb MB), back to back in one huge-page arena
  (as the engine holds its weights), as decode streams its weights from memory. Time per product, weight GB/s
  (the bytes the kernel reads: the packed panels), and that over this machine's copy bandwidth
  (bench/serve_decode.copy_bandwidth: read + written per second of a large copy with the same threads, on
  huge pages), the bound a memory-bound product can reach.
  Q8_0, Q4_0, Q4_1 and Q4_K run both ways: x as two int8 digits (`int8`, the default) and in float32 (`float`,
  exact).
- prefill: --rows rows (GFLOP/s, 2 out in rows per product), one copy (compute-bound), not the head.
Rounds alternate over the types (each round times every type once); medians over --rounds are reported.

    python bench/serve_quant_kernels.py [--threads 1 2] [--rounds 7] [--mb 256] [--rows 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_decode import copy_bandwidth  # noqa: E402

from waferscale.serve import kernels, quant  # noqa: E402

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
WAYS = ["fp32", "bf16", "q8_0:int8", "q8_0:float", "q4_0:int8", "q4_0:float", "q4_1:int8", "q4_1:float", "q4_k:int8",
        "q4_k:float", "q6_k"]


def _ways(shape: tuple[int, int]) -> list[str]:
    return [w for w in WAYS if shape[1] % quant.block_shape(w.split(":")[0])[0] == 0]


class Product:
    """One way of computing x W^T: the packed weight (and copies of it), a bound C call with no allocation."""

    def __init__(self, way: str, shape: tuple[int, int], g: torch.Generator, copies_mb: float) -> None:
        self.way, self.qtype = way, way.split(":")[0]
        self.int8 = way.endswith(":int8")
        self.out, self.inp = shape
        self.nbytes = quant.packed_bytes(self.qtype, shape)
        n = max(1, min(4096, int(copies_mb * 2**20 // self.nbytes)))
        step = -(-self.nbytes // 64) * 64
        arena = kernels.hugepage_tensor(-(-n * step // 4)).view(torch.uint8)  # back to back, as the engine's
        w = quant.random(self.qtype, shape, g)
        self.copies = []
        for i in range(n):
            w.packed = None
            self.copies.append(quant.pack(w, arena[i * step:i * step + self.nbytes]).packed)
        self.lib = kernels._lib
        self.code = quant.QTYPE_CODE[self.qtype]

    def run(self, x: torch.Tensor, y: torch.Tensor, copies: list[torch.Tensor]) -> float:
        """Seconds per product over `copies` in turn."""
        quant.set_int8_activations(self.int8)
        rows, xp, yp = x.shape[0], x.data_ptr(), y.data_ptr()
        ptrs = [c.data_ptr() for c in copies]
        t = time.perf_counter()
        if self.qtype == "fp32":
            f = self.lib.wsc_linear
            for p in ptrs:
                f(p, xp, None, None, yp, rows, self.out, self.inp)
        else:
            f, code = self.lib.wsc_qlinear, self.code
            for p in ptrs:
                f(p, code, xp, None, None, yp, rows, self.out, self.inp)
        return (time.perf_counter() - t) / len(ptrs)


def call_overhead() -> float:
    """Seconds of one ctypes call of a 16 x 32 Q8_0 product (the smallest there is), median of 7 x 2000."""
    p = Product("q8_0", (16, 32), torch.Generator().manual_seed(0), 0)
    x, y = torch.randn(1, 32), torch.empty(1, 16)
    return statistics.median(p.run(x, y, p.copies * 2000) for _ in range(7))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mb", type=float, default=256, help="bytes of copies per decode product (beyond the caches)")
    ap.add_argument("--rows", type=int, default=512, help="rows of the prefill products")
    args = ap.parse_args()
    if not kernels.available():
        sys.exit(f"error: the C kernels are unavailable: {kernels.unavailable_reason()}")
    int8_was = quant.set_int8_activations()
    g = torch.Generator().manual_seed(0)
    for threads in args.threads:
        kernels.set_threads(threads)
        torch.set_num_threads(threads)
        call = call_overhead()
        print(f"\n== {threads} thread(s); ctypes call overhead {call * 1e6:.2f} us: in `us`, `GB/s`, `of copy`; "
              f"not in `C only` (of copy, less the call)")
        print(f"{'shape':>11} {'way':>10} {'MB':>7} {'us':>9} {'GB/s':>6} {'copy GB/s':>9} {'of copy':>7} "
              f"{'C only':>6} {'vs fp32':>7} {'prefill GFLOP/s':>15}")
        for shape in SHAPES:
            prods = [Product(w, shape, g, args.mb) for w in _ways(shape)]
            x1, y1 = torch.randn(1, shape[1], generator=g), torch.empty(1, shape[0])
            xr, yr = torch.randn(args.rows, shape[1], generator=g), torch.empty(args.rows, shape[0])
            dec = {p.way: [] for p in prods}
            pre = {p.way: [] for p in prods}
            bws = []
            for _ in range(args.rounds):
                bws.append(copy_bandwidth())
                for p in prods:
                    dec[p.way].append(p.run(x1, y1, p.copies))
                if shape[0] < 49152:
                    for p in prods:
                        pre[p.way].append(p.run(xr, yr, p.copies[:1]))
            bw = statistics.median(bws)
            t32 = statistics.median(dec["fp32"])
            for p in prods:
                t = statistics.median(dec[p.way])
                gflops = (f"{2 * args.rows * shape[0] * shape[1] / statistics.median(pre[p.way]) / 1e9:15.1f}"
                          if pre[p.way] else f"{'-':>15}")
                print(f"{shape[0]:>5}x{shape[1]:<5} {p.way:>10} {p.nbytes / 1e6:7.2f} {t * 1e6:9.1f} "
                      f"{p.nbytes / t / 1e9:6.1f} {bw / 1e9:9.1f} {p.nbytes / t / bw:7.0%} "
                      f"{p.nbytes / (t - call) / bw:6.0%} {t32 / t:6.2f}x {gflops}")
            del prods
    quant.set_int8_activations(int8_was)


if __name__ == "__main__":
    main()
