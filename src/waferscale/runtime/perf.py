"""Honest performance figures: the host's measured matmul peak (the MFU denominator) and memory readings."""

from __future__ import annotations

import functools
import time

import torch


def measured_peak_flops(device_type: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024,
                        budget_s: float = 0.5, threads: int | None = None) -> float:
    """`_measured_peak_flops` at `threads` intra-op threads (default: this process's current count)."""
    threads = threads or torch.get_num_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measured_peak_flops(device_type, dtype, n, budget_s, threads)
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def _measured_peak_flops(device_type: str, dtype: torch.dtype, n: int, budget_s: float, threads: int) -> float:
    """FLOP/s of a square matmul on this device and dtype: the best of as many runs as fit in ~budget_s.

    The CPU has no published peak we can trust across machines, so MFU on a host is reported against this
    measured figure (and labelled as such). On CUDA the same measurement is used for consistency. Half
    precision on a CPU without native support can be ~100x slower than fp32; the size shrinks until one
    matmul takes under a tenth of the budget, so the measurement never costs more than about budget_s.
    """
    dev = torch.device(device_type)

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    while True:
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        first = timed(a, b)  # also the warm-up
        if first < budget_s / 10 or n <= 128:
            break
        n //= 2
    best, spent = first, first
    while spent < budget_s:
        t = timed(a, b)
        best, spent = min(best, t), spent + t
    return 2 * n**3 / best
