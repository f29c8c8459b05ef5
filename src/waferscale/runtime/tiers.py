"""MemoryX's storage tiers (runtime/memoryx.py): a unit's flat buffers as RAM tensors (pinned for CUDA) or as
files on flash, memory-mapped only while the unit is read or updated."""

from __future__ import annotations

import os
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


def return_freed_memory_to_os() -> None:
    """glibc raises its mmap threshold as large blocks are freed, after which freed staging buffers stay in the
    heap and keep counting in RSS. A flash tier exists to bound RSS, so pin the threshold at 1 MiB: buffers
    that size and up are mmap-ed and go back to the OS when freed. No-op off glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass
