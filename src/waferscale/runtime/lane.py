"""Lanes: one daemon thread running submitted callables in order, each returning a Future. The prefetch, the
gradient write-back, MemoryX's optimizer and SwarmX's collectives each run on their own lane (daemon: a hung
collective never blocks interpreter exit).

A lane's torch ops run on its own thread alone (one OpenMP thread): every thread that enters an OpenMP parallel
region gets a team of the intra-op size, so lanes with teams of their own would put more OpenMP threads than
cores beside the compute thread's, and libgomp then stops spinning between regions: every short op of the compute
thread pays a futex wake-up of its team. Measured on 2 cores: after a streamed step with multi-threaded lanes, a
resident Mixtral forward + backward in the same process took 272 ms instead of 177 (element-wise ops 2-3x, scatter
20x slower); with single-threaded lanes, 187. `share_cores=False` keeps the intra-op count: MemoryX's optimizer
when the compute runs on a CUDA device and the CPU's cores are the optimizer's."""

from __future__ import annotations

import ctypes
import functools
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch

__all__ = ["Lane", "done_future"]


class Lane:
    def __init__(self, name: str, share_cores: bool = True) -> None:
        self._share_cores = share_cores
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self._share_cores:
            _one_openmp_thread()
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                fut.set_exception(e)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._q.put((fut, fn, args))
        return fut

    def close(self, timeout: float | None = 10.0) -> None:
        self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


@functools.lru_cache(maxsize=1)
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (libgomp, or LLVM's / Intel's libomp), or None (none found, not Linux)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return None
    for path in sorted(paths):
        if any(name in path.rsplit("/", 1)[-1] for name in ("libgomp", "libomp", "libiomp")):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def _one_openmp_thread() -> None:
    """The calling thread's OpenMP regions run on it alone (its own setting: other threads keep theirs)."""
    torch.get_num_threads()  # ATen's lazy per-thread init first: it sets the thread's count at its first op
    lib = _openmp()
    if lib is not None:
        lib.omp_set_num_threads(1)


def done_future(value: Any = None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f
