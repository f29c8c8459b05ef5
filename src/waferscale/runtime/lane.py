"""Lanes: one daemon thread running submitted callables in order, each returning a Future. The prefetch, the
gradient write-back, MemoryX's optimizer and SwarmX's collectives each run on their own lane (daemon: a hung
collective never blocks interpreter exit)."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

__all__ = ["Lane", "done_future"]


class Lane:
    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
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


def done_future(value: Any = None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f
