"""Honest performance figures: the host's measured matmul peak (the MFU denominator) and memory readings."""

from __future__ import annotations

import functools
import time

import torch


@functools.lru_cache(maxsize=None)
def measured_peak_flops(device_type: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024) -> float:
    """FLOP/s of a large square matmul on this device and dtype, best of a few runs.

    The CPU has no published peak we can trust across machines, so MFU on a host is reported against this
    measured figure (and labelled as such). On CUDA the same measurement is used for consistency.
    """
    dev = torch.device(device_type)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / 4)
    return 2 * n**3 / best
