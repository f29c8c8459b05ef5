"""Wafer fabric specifications: frozen, typed, every number citing its row in shared/WSE.md.

Units are in the names: *_bytes, *_hz, *_per_cycle, *_cycles, *_s. The clock of the WSE-3 is not published
and the WSE-2's has two published values, so `clock_hz` is a parameter (`with_clock`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from waferscale.errors import ConfigError


@dataclass(frozen=True)
class FabricSpec:
    name: str
    rows: int  # PEs along Y (the program rectangle a compiler may use)
    cols: int  # PEs along X
    clock_hz: float
    sram_bytes_per_pe: int
    fp16_flops_per_cycle_per_pe: int
    fp32_flops_per_cycle_per_pe: int
    sram_read_bytes_per_cycle: int
    sram_write_bytes_per_cycle: int
    link_bytes_per_cycle: int  # per direction per link
    hop_latency_cycles: int
    ramp_latency_cycles: int
    colors: int  # routable colors (virtual channels) available to a program
    routes_per_pe: int  # distinct routes a PE's router can hold
    io_bytes_per_s: float  # system I/O (weights / activations into the wafer edges)
    io_latency_s: float  # one inter-system hop
    power_w: float

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "name" and (not isinstance(v, (int, float)) or v <= 0):
                raise ConfigError(f"fabric spec {self.name!r}: {f.name} must be a positive number, got {v!r}")

    # ---- derived ---------------------------------------------------------------------------------------
    @property
    def pes(self) -> int:
        return self.rows * self.cols

    @property
    def sram_bytes(self) -> int:
        return self.pes * self.sram_bytes_per_pe

    def peak_flops(self, dtype: str = "fp16") -> float:
        per = self.fp16_flops_per_cycle_per_pe if dtype in ("fp16", "bf16") else self.fp32_flops_per_cycle_per_pe
        return self.pes * per * self.clock_hz

    @property
    def diameter_hops(self) -> int:
        return self.rows + self.cols - 2

    def with_clock(self, clock_hz: float) -> "FabricSpec":
        return dataclasses.replace(self, clock_hz=clock_hz)

    def with_pes(self, rows: int, cols: int) -> "FabricSpec":
        """The same PE on a smaller mesh (for tests and tile-level runs), e.g. 8x8."""
        if rows <= 0 or cols <= 0:
            raise ConfigError(f"--pes must be positive, got {rows}x{cols}")
        if rows > self.rows or cols > self.cols:
            raise ConfigError(f"--pes {rows}x{cols} exceeds {self.name}'s {self.rows}x{self.cols} fabric")
        return dataclasses.replace(self, name=f"{self.name}[{rows}x{cols}]", rows=rows, cols=cols)


@dataclass(frozen=True)
class SystemSpec:
    """N wafers (CS systems) joined by their I/O; only activations (inference) or weights/gradients through
    SwarmX (training) cross between them."""

    fabric: FabricSpec
    systems: int = 1

    def __post_init__(self) -> None:
        if self.systems <= 0:
            raise ConfigError(f"--systems must be a positive integer, got {self.systems}")

    @property
    def inter_system_bytes_per_s(self) -> float:
        return self.fabric.io_bytes_per_s

    @property
    def inter_system_latency_s(self) -> float:
        return self.fabric.io_latency_s
