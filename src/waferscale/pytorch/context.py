"""The state of a cstorch run, in one place: the backend, the half dtype, the running data executor, the steps
being traced and the optimizers that may bind to MemoryX. (This process's place in a multi-system run is not a
run's: it is the process's, as torch.distributed's process group is; pytorch/distributed.py holds it.)

A script has one run: the first cstorch call starts it, and everything after shares it, as on a Cerebras
system. A process that runs several (tests, a notebook, a service) starts each afresh with `cstorch.reset()`, or
scopes one with `with cstorch.run_context(): ...`, which restores the previous run afterwards; neither run then
sees the other's backend, dtype, optimizers or data loop."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from waferscale.pytorch.backend import Backend
    from waferscale.pytorch.utils.data import DataExecutor

__all__ = ["RunContext", "current", "reset", "run_context"]


@dataclass
class RunContext:
    backend: Backend | None = None
    half: torch.dtype | None = None  # cstorch.amp's half dtype (None: full precision)
    data: DataExecutor | None = None  # the DataExecutor whose loop is running
    deferred: list[list[tuple[Callable[..., Any], tuple, dict]]] = field(default_factory=list)  # per traced step
    optimizers: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # cstorch optimizers, for MemoryX binding


_run = RunContext()


def current() -> RunContext:
    return _run


def reset() -> RunContext:
    """Start a fresh run (the current one's state dropped); returns it."""
    global _run
    _run = RunContext()
    return _run


@contextlib.contextmanager
def run_context() -> Iterator[RunContext]:
    """A fresh run for the block; the run before it is current again afterwards."""
    global _run
    outer, _run = _run, RunContext()
    try:
        yield _run
    finally:
        _run = outer
