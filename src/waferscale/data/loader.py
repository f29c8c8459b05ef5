"""Resumable, deterministic batches of (input, target) windows over a 1-D token stream.

Batch k is a pure function of (tokens, batch_size, seq_len, seed, shuffle, k): resuming is restoring k, and
the global batch is the same whatever the world size (rank r takes its contiguous block of rows).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from waferscale.errors import DataError

__all__ = ["BatchLoader", "eval_batches", "resume_step"]

_STATE_VERSION = 1


def resume_step(state: Any, mine: dict[str, Any]) -> int:
    """The step to resume at from a saved loader `state`, checked against the loader's own `state_dict()`
    (`mine`): every saved key but "step" and "version" must be equal, or the batches would differ."""
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or state["step"] < 0:
        raise DataError(f"loader state must be a dict with a non-negative int 'step', got {state!r}")
    diffs = [f"{name}: saved {state[name]!r}, now {mine[name]!r}"
             for name in mine if name not in ("step", "version") and name in state and state[name] != mine[name]]
    if diffs:
        raise DataError(f"cannot resume the data loader: it would yield different batches ({'; '.join(diffs)}); "
                        "restore the original settings and data, or start the loader from step 0")
    return state["step"]


def _check_shape(n_tokens: int, batch_size: int, seq_len: int) -> None:
    if batch_size <= 0 or seq_len <= 0:
        raise DataError(f"batch_size and seq_len must be positive, got batch_size={batch_size}, seq_len={seq_len}")
    if n_tokens < seq_len + 1:
        raise DataError(f"{n_tokens} tokens are too few for one sequence of seq_len={seq_len} (needs seq_len + 1 = "
                        f"{seq_len + 1}); use more text or a shorter seq_len")


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather windows tokens[s : s + seq_len + 1] -> x, y of shape (len(starts), seq_len), int64."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # (b, seq_len + 1)
    w = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))  # (b, seq_len + 1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class StepBatches(ABC):
    """An iterator over `batch(step)`, `step` counting up: a loader whose batch k depends on k alone (so its
    position is one number, `step`, and a run resumes by setting it)."""

    step: int

    @abstractmethod
    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch k: (x, y) of this rank."""

    def __iter__(self) -> StepBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out


@dataclass(eq=False, repr=False)
class BatchLoader(StepBatches):
    """Infinite iterator of (x, y) LongTensors of shape (batch_size // world_size, seq_len); y is x shifted by one.

    shuffle=True: the batch_size window starts of batch k are drawn uniformly from [0, n_tokens - seq_len)
    with `np.random.default_rng([seed, k])`. shuffle=False: consecutive non-overlapping windows, batch k holds
    windows k*batch_size ... (k+1)*batch_size - 1, wrapping around the stream.
    """

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int = 0
    shuffle: bool = True
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1:
            raise DataError(f"tokens must be a 1-D stream, got shape {tuple(self.tokens.shape)}")
        batch_size, world_size = self.batch_size, self.world_size
        _check_shape(len(self.tokens), batch_size, self.seq_len)
        if world_size <= 0 or not 0 <= self.rank < world_size:
            raise DataError(f"need 0 <= rank < world_size, got rank={self.rank}, world_size={world_size}")
        if batch_size % world_size:
            raise DataError(f"batch_size={batch_size} is not divisible by world_size={world_size}; use a multiple "
                            f"of {world_size} (e.g. {batch_size - batch_size % world_size or world_size})")
        self.seed = int(self.seed)
        self.local_batch_size = batch_size // world_size
        self.step = 0  # index k of the next global batch
        self.n_windows = (len(self.tokens) - 1) // self.seq_len  # non-overlapping windows (shuffle=False)

    def global_starts(self, k: int) -> np.ndarray:
        """Window start offsets of global batch k, shape (batch_size,)."""
        if self.shuffle:
            rng = np.random.default_rng([self.seed, k])
            return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        j = k * self.batch_size + np.arange(self.batch_size)
        return (j % self.n_windows) * self.seq_len

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of global batch k (does not move the iterator)."""
        lo = self.rank * self.local_batch_size
        starts = self.global_starts(k)[lo : lo + self.local_batch_size]
        return _windows(self.tokens, starts, self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position; rank/world_size are not part of it (resume on any world size)."""
        return {
            "version": _STATE_VERSION,
            "step": self.step,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "n_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state["step"]`. DataError if the state came from a loader that yields other batches."""
        self.step = resume_step(state, self.state_dict())

    def __repr__(self) -> str:
        return (f"BatchLoader(n_tokens={len(self.tokens)}, batch_size={self.batch_size}, seq_len={self.seq_len}, "
                f"shuffle={self.shuffle}, seed={self.seed}, rank={self.rank}/{self.world_size}, step={self.step})")


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                 max_batches: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed evaluation batches: non-overlapping windows from the start of `tokens`, in order.

    Returns up to `max_batches` (all when None) batches of shape (batch_size, seq_len); the last batch may have
    fewer rows when the windows run out. Every target token is scored at most once.
    """
    _check_shape(len(tokens), batch_size, seq_len)
    if max_batches is not None and max_batches <= 0:
        raise DataError(f"max_batches must be positive, got {max_batches}")
    starts = np.arange((len(tokens) - 1) // seq_len) * seq_len  # every non-overlapping window, in order
    if max_batches is not None:
        starts = starts[:max_batches * batch_size]
    return [_windows(tokens, starts[i:i + batch_size], seq_len) for i in range(0, len(starts), batch_size)]
