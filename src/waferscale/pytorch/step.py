"""`@cstorch.trace` (also `@cstorch.step`), `@cstorch.step_closure`, `@cstorch.checkpoint_closure`.

A traced function is one training (or evaluation) step. Closures called inside it run when the step is
complete, once per step (on rank 0 when several systems run), with scalar tensors averaged over the systems;
called outside a step they run at once. A checkpoint closure runs only on the DataExecutor's checkpoint steps
(every `checkpoint_steps`, and the last step)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from waferscale.pytorch import context
from waferscale.pytorch import distributed as _dist
from waferscale.pytorch.utils.data import current_executor

__all__ = ["trace", "step", "step_closure", "checkpoint_closure"]

def trace(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        deferred = context.current().deferred  # one list per step being traced
        deferred.append([])
        try:
            out = fn(*args, **kwargs)
        finally:
            pending = deferred.pop()
        _run_closures(pending)
        ex = current_executor()
        if ex is not None:
            ex._step_done()
        return out

    return traced


step = trace


def _run_closures(pending: list[tuple[Callable[..., Any], tuple, dict]]) -> None:
    if not pending:
        return
    scalars = [t for _, a, k in pending for t in (*a, *k.values())
               if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()]
    means = _dist.all_mean([float(t.detach()) for t in scalars])  # every system joins, then only rank 0 runs
    if not _dist.is_master():
        return
    mean_of = {id(t): m for t, m in zip(scalars, means)}

    def swap(v: Any) -> Any:
        return torch.tensor(mean_of[id(v)], dtype=v.dtype) if id(v) in mean_of and _dist.world_size() > 1 else v

    for f, a, k in pending:
        f(*[swap(v) for v in a], **{key: swap(v) for key, v in k.items()})


def _closure(fn: Callable[..., Any], checkpoint: bool) -> Callable[..., Any]:
    @functools.wraps(fn)
    def closure(*args: Any, **kwargs: Any) -> None:
        if checkpoint:
            ex = current_executor()
            if ex is not None and not ex.on_checkpoint_step:
                return
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        if (deferred := context.current().deferred):
            deferred[-1].append((fn, args, kwargs))
        else:
            _run_closures([(fn, args, kwargs)])

    return closure


def step_closure(fn: Callable[..., Any]) -> Callable[..., Any]:
    return _closure(fn, checkpoint=False)


def checkpoint_closure(fn: Callable[..., Any]) -> Callable[..., Any]:
    return _closure(fn, checkpoint=True)
