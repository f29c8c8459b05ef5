"""MemoryX's storage tiers (runtime/memoryx.py): a unit's flat buffers as RAM tensors (pinned for CUDA) or as
files on flash, memory-mapped only while the unit is read or updated."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
from pathlib import Path

import torch
from torch import Tensor

from waferscale.errors import ConfigError


class UnitStore:
    """Flat buffers ("slots") of one unit, each `numel` long. RAM: resident tensors. Flash: one file per slot,
    mapped by `open()` and unmapped when the caller drops the tensor (so its pages leave the process RSS)."""

    def __init__(self, unit: int, numel: int, flash_dir: Path | None, pin: bool) -> None:
        self.unit, self.numel, self.flash_dir, self.pin = unit, numel, flash_dir, pin
        self._ram: dict[str, Tensor] = {}
        self._files: dict[str, tuple[Path, torch.dtype]] = {}

    @property
    def on_flash(self) -> bool:
        return self.flash_dir is not None

    def has(self, slot: str) -> bool:
        return slot in self._ram or slot in self._files

    def slots(self) -> list[str]:
        return list(self._ram) + list(self._files)

    def create(self, slot: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """A zero-filled slot (returned mapped/resident)."""
        if self.flash_dir is None:
            t = torch.zeros(self.numel, dtype=dtype, pin_memory=self.pin)
            self._ram[slot] = t
            return t
        path = self.flash_dir / f"unit{self.unit:04d}.{slot}.bin"
        with open(path, "wb") as f:  # a sparse file of zeros
            f.truncate(self.numel * torch.empty((), dtype=dtype).element_size())
        self._files[slot] = (path, dtype)
        return self.open(slot)

    def open(self, slot: str) -> Tensor:
        if slot in self._ram:
            return self._ram[slot]
        path, dtype = self._files[slot]
        if self.numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.from_file(str(path), shared=True, size=self.numel, dtype=dtype)

    def ram_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._ram.values())

    def flash_bytes(self) -> int:
        return sum(p.stat().st_size for p, _ in self._files.values())


def writable_dir(d: Path) -> Path:
    """The flash directory, created; a ConfigError if this process cannot write there."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".probe-{os.getpid()}"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"flash directory {d} is not writable ({e.strerror}); pass a writable --flash_dir") from None
    return d


class FlashDir:
    """One MemoryX's own directory under the flash directory, `run-<pid>-<random>`, so that runs sharing a flash
    directory never overwrite each other's files: locked (an flock held on its `.lock`) while the run lives,
    removed by `close()`. A run that starts removes the directories of runs that died without closing (their
    lock free)."""

    def __init__(self, root: Path) -> None:
        root = writable_dir(root)
        for d in root.glob("run-*"):
            if d.is_dir() and self._free(d):
                shutil.rmtree(d, ignore_errors=True)
        self.path = root / f"run-{os.getpid()}-{secrets.token_hex(4)}"
        self.path.mkdir()
        self._lock = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)

    @staticmethod
    def _free(d: Path) -> bool:
        """Whether no live run holds `d` (its lock can be taken now)."""
        try:
            fd = os.open(d / ".lock", os.O_RDWR)
        except OSError:
            return False  # (no lock file yet: a run between its mkdir and its lock; left alone)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._lock < 0:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)
        self._lock = -1


def return_freed_memory_to_os() -> None:
    """glibc raises its mmap threshold as large blocks are freed, after which freed staging buffers stay in the
    heap and keep counting in RSS. A flash tier exists to bound RSS, so pin the threshold at 1 MiB: buffers
    that size and up are mmap-ed and go back to the OS when freed. No-op off glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass
