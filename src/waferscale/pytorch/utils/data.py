"""`cstorch.utils.data`: `DataLoader(input_fn, *args)` and `DataExecutor(dataloader, num_steps, checkpoint_steps)`.

`DataLoader` wraps a factory of a torch DataLoader (or any iterable of batches): it is built when the
executor starts. `DataExecutor` yields `num_steps` batches (repeating the loader as epochs), tracks the step,
decides checkpoint steps and measures the rate. With several systems each gets its 1/N of every batch (split
along the first dimension), so the loader's batch size is the global batch."""

from __future__ import annotations

import functools
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch

from waferscale.errors import ConfigError
from waferscale.pytorch import context
from waferscale.pytorch import distributed as _dist
from waferscale.pytorch.backend import cerebras_only, current_backend

__all__ = ["DataLoader", "DataExecutor", "RateTracker", "current_executor"]

def current_executor() -> "DataExecutor | None":
    return context.current().data


class DataLoader:
    def __init__(self, input_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if not callable(input_fn):
            raise ConfigError("cstorch.utils.data.DataLoader takes a function that returns a torch DataLoader "
                              "(or any iterable of batches), not the loader itself")
        self.input_fn, self.args, self.kwargs = input_fn, args, kwargs

    @functools.cached_property
    def loader(self) -> Any:
        loader = self.input_fn(*self.args, **self.kwargs)
        if not hasattr(loader, "__iter__"):
            raise ConfigError(f"input_fn returned {type(loader).__name__}, which is not iterable")
        return loader

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class RateTracker:
    """Samples per second: since the start (`global_rate`) and smoothed over recent steps (`rate`)."""

    def __init__(self, smoothing: float = 0.9) -> None:
        self.smoothing = smoothing
        self.total_samples = 0
        self.total_time = 0.0
        self._rate: float | None = None
        self._t = time.perf_counter()

    def add(self, samples: int) -> None:
        now = time.perf_counter()
        dt, self._t = now - self._t, now
        self.total_samples += samples
        self.total_time += dt
        r = samples / dt if dt > 0 else 0.0
        self._rate = r if self._rate is None else self.smoothing * self._rate + (1 - self.smoothing) * r

    def rate(self) -> float:
        return self._rate or 0.0

    def global_rate(self) -> float:
        return self.total_samples / self.total_time if self.total_time else 0.0

    def reset_time(self) -> None:
        self._t = time.perf_counter()


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, dict):
        return _batch_size(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    return 1


def _to(batch: Any, device: torch.device) -> Any:
    """The batch's tensors on the backend's device (as Cerebras' executor moves them: a script's loss compares
    the model's output with targets it never moved)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def _shard(batch: Any, rank: int, world: int) -> Any:
    if isinstance(batch, torch.Tensor):
        if batch.ndim == 0 or batch.shape[0] % world:
            raise ConfigError(f"a batch of {batch.shape[0] if batch.ndim else 1} does not split evenly over "
                              f"num_csx {world}; use a batch size that is a multiple of {world}")
        return batch.chunk(world)[rank]
    if isinstance(batch, dict):
        return {k: _shard(v, rank, world) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_shard(v, rank, world) for v in batch)
    return batch


class DataExecutor:
    def __init__(self, dataloader: DataLoader | Any, num_steps: int | None = None,
                 checkpoint_steps: int | None = None, activation_steps: int | None = None,
                 writer: Any = None, start_step: int = 0, **cerebras: Any) -> None:
        """start_step: steps already taken (a resumed run): `user_iteration` and checkpoint steps count from it.
        Cerebras' profiling and listener arguments are named in a warning (no effect here); others raise."""
        cerebras_only("DataExecutor", cerebras, ("cs_config", "listeners", "profiler_activities", "micro_batch_size"))
        for name, v in (("num_steps", num_steps), ("checkpoint_steps", checkpoint_steps)):
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ConfigError(f"DataExecutor {name} must be a non-negative integer, got {v!r}")
        self.dataloader = dataloader
        self.checkpoint_steps = checkpoint_steps or 0
        self.activation_steps = activation_steps or 1
        self.writer = writer
        if num_steps is None:
            try:
                num_steps = len(dataloader)
            except TypeError:
                raise ConfigError("DataExecutor needs num_steps for a dataloader without a length") from None
        b = current_backend()
        self.num_steps = 0 if b is not None and b.compile_only else num_steps
        self.start_step = start_step
        self.iteration = 0  # steps completed by this executor
        self.profiler = SimpleNamespace(rate_tracker=RateTracker())  # as cstorch's executor.profiler
        self._batch = 0
        self._step = 0

    @property
    def user_iteration(self) -> int:
        """The 1-based global number of the step in progress (or of the last one, after the loop)."""
        return self.start_step + (self._step if self._running else self.iteration)

    @property
    def on_final_iteration(self) -> bool:
        return self.user_iteration == self.start_step + self.num_steps

    @property
    def on_checkpoint_step(self) -> bool:
        s = self.user_iteration
        return self.checkpoint_steps > 0 and (s % self.checkpoint_steps == 0 or self.on_final_iteration)

    @property
    def on_activations_step(self) -> bool:
        return self.user_iteration % self.activation_steps == 0 or self.on_final_iteration

    def __len__(self) -> int:
        return self.num_steps

    _running = False

    def __iter__(self) -> Iterator[Any]:
        run = context.current()
        run.data, self._running = self, True
        rank, world = _dist.rank(), _dist.world_size()
        try:
            self.profiler.rate_tracker.reset_time()
            while self.iteration < self.num_steps:
                got_any = False
                for batch in self.dataloader:
                    got_any = True
                    self._batch = _batch_size(batch)
                    local = _shard(batch, rank, world) if world > 1 else batch
                    b = current_backend()
                    if b is not None and b.device.type != "cpu":
                        local = _to(local, b.device)
                    self._step = self.iteration + 1
                    _dist.step_started(self._step)
                    yield local
                    self._step_done()  # counts a step that was not traced (a traced one has counted itself)
                    if self.iteration >= self.num_steps:
                        break
                if not got_any:
                    raise ConfigError("the dataloader yielded no batches")
        finally:
            run.data, self._running = None, False

    def _step_done(self) -> None:
        if self.iteration >= self._step:  # a second traced function on the same batch (an eval step, say)
            return
        self.iteration += 1
        self.profiler.rate_tracker.add(self._batch)
