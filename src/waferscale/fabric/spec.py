"""Wafer fabric specifications: frozen, typed, every number citing its row in shared/WSE.md.

Units are in the names: *_bytes, *_hz, *_per_cycle, *_cycles, *_s. The clock of the WSE-3 is not published
and the WSE-2's has two published values, so `clock_hz` is a parameter (`with_clock`); every value WSE.md does
not publish is listed per generation in `fabric/assumptions.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from waferscale.errors import ConfigError


MAY_BE_ZERO = ("task_overhead_cycles", "vector_op_cycles")  # fields that may be 0 (the PE's fixed costs)
# the PE's calibrated constants at the values of the micro-model without them (no fixed costs, the full fp32
# rate): `--assume` these to see a projection without the calibration
UNCALIBRATED = {"task_overhead_cycles": 0, "vector_op_cycles": 0, "fp32_fmac_sustained_fraction": 1.0}


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
    # unpublished (fabric/assumptions.py says where each value comes from); fields so a changed value reaches
    # every kernel and plan through the spec
    program_reserve_bytes_per_pe: int = 6 * 1024  # SRAM kept for code, routing tables, queues and stack
    exp_ops: float = 8  # SIMD ops per exp() (a polynomial)
    memoryx_bytes_per_s: float = 150e9  # optimizer state MemoryX reads and writes per second in its update
    # the PE's own fixed costs (fabric/pe.py), calibrated on kernel-level measurements (bench/calibrate.py;
    # values, ranges and rows: fabric/assumptions.py); 0 is allowed (the uncalibrated micro-model)
    task_overhead_cycles: int = 0  # per task activation, whatever the task does
    vector_op_cycles: int = 0  # per vector (DSD) instruction, beyond its elements
    fp32_fmac_sustained_fraction: float = 1.0  # of the 1 fp32 FMAC a cycle an fp32 multiply-add sustains

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in MAY_BE_ZERO:
                if not isinstance(v, (int, float)) or v < 0:
                    raise ConfigError(f"fabric spec {self.name!r}: {f.name} must be a number >= 0, got {v!r}")
            elif f.name != "name" and (not isinstance(v, (int, float)) or v <= 0):
                raise ConfigError(f"fabric spec {self.name!r}: {f.name} must be a positive number, got {v!r}")
        if self.program_reserve_bytes_per_pe >= self.sram_bytes_per_pe:
            raise ConfigError(f"fabric spec {self.name!r}: the program reserve ({self.program_reserve_bytes_per_pe} "
                              f"B) leaves no SRAM for data of the {self.sram_bytes_per_pe} B per PE")

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

    def uncalibrated(self) -> "FabricSpec":
        """The same spec with the PE's calibrated fixed costs at the micro-model's values (no task or vector
        instruction overhead, the full fp32 rate): fabric/assumptions.UNCALIBRATED."""
        return dataclasses.replace(self, **UNCALIBRATED)

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
    swarmx_fanout: int = 4  # System: "each node does 1:4 or two 1:2 broadcast-reduces at line rate" (V)
    swarmx_port_bytes_per_s: float = 100e9 / 8  # System: SwarmX "100 Gb/s interfaces" (V)

    def __post_init__(self) -> None:
        if self.systems <= 0:
            raise ConfigError(f"--systems must be a positive integer, got {self.systems}")
        if self.swarmx_fanout < 2 or self.swarmx_port_bytes_per_s <= 0:
            raise ConfigError("SwarmX fan-out must be >= 2 and its port bandwidth positive")

    @property
    def swarmx_levels(self) -> int:
        """Broadcast-reduce nodes between MemoryX and each of the N systems: ceil(log_fanout N) (System row:
        "latency grows with log N"); 0 for one system (MemoryX feeds it directly)."""
        n, levels = self.systems, 0
        while n > 1:
            n, levels = -(-n // self.swarmx_fanout), levels + 1
        return levels

    @property
    def swarmx_hops(self) -> int:
        """I/O hops from MemoryX to a system (or a system's gradients to MemoryX): one per tree level + 1."""
        return self.swarmx_levels + 1

    @property
    def swarmx_bytes_per_s(self) -> float:
        """Per-system weight/gradient bandwidth through the tree: every node works at line rate and a system's
        12 x 100 GbE ports are 12 parallel trees of 100 Gb/s links, so it is the system I/O for any N."""
        ports = max(1, round(self.fabric.io_bytes_per_s / self.swarmx_port_bytes_per_s))
        return ports * self.swarmx_port_bytes_per_s
