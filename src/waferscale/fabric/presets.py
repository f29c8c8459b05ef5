"""WSE-1, WSE-2, WSE-3 presets. Each number cites its row in shared/WSE.md ("Chip", "PE", "Fabric", "System");
the ones it does not publish are listed per generation, with where the value comes from, in `assumptions.py`."""

from __future__ import annotations

import difflib

from waferscale.errors import ConfigError
from waferscale.fabric.spec import FabricSpec

_COMMON = dict(
    sram_bytes_per_pe=48 * 1024,  # Chip: "SRAM per PE 48 KB" (A)
    fp32_flops_per_cycle_per_pe=2,  # Chip: "fp32 per PE 1 FMAC = 2 FLOP/cycle" (A)
    sram_read_bytes_per_cycle=16,  # PE: "per cycle 2x64-bit reads" (A) on WSE-2; an assumption for WSE-1/3
    sram_write_bytes_per_cycle=8,  # PE: "+ 1x64-bit write" (A) on WSE-2; an assumption for WSE-1/3
    link_bytes_per_cycle=4,  # Fabric: "32 bits per cycle per direction per link" (A)
    hop_latency_cycles=1,  # Fabric: "one hop per cycle" (A)
    ramp_latency_cycles=2,  # Fabric: "ramp (core<->router) latency ~ 2 cycles" (A)
    colors=24 - 6,  # Fabric: "24 routable colors ... the SDK runtime reserves 6" (A)
    routes_per_pe=31,  # Fabric: "fewer than 2^5 distinct routes" per PE (A)
    io_bytes_per_s=150e9,  # System: "12 x 100 GbE = 1.2 Tb/s ~ 150 GB/s per CS-2/CS-3" (V/A); assumed for CS-1
    io_latency_s=5e-6,  # System: "CS-3 I/O latency < 5 us per hop" (V); the bound, assumed for every generation
    # the PE's own costs, calibrated on the fidelity suite's kernel-level rows by bench/calibrate.py (least
    # squares; fabric/assumptions.py gives each one's plausible range and source); one PE design for every
    # generation: no source says these costs changed
    task_overhead_cycles=0,
    vector_op_cycles=18,
    fp32_fmac_sustained_fraction=0.32,
)

PRESETS: dict[str, FabricSpec] = {
    "wse1": FabricSpec(
        name="wse1", rows=595, cols=600,  # Chip: "fabric grid ~600x595 used in SC20" (A)
        clock_hz=1.1e9,  # not published for WSE-1 (Chip: clock "—"); an assumption: WSE-2's paper maximum
        fp16_flops_per_cycle_per_pe=8,  # Chip: "4-wide FMAC = 8 FLOP/cycle" (A/V)
        power_w=20e3,  # Chip: "system power ~20 kW" (V)
        **_COMMON),
    "wse2": FabricSpec(
        name="wse2", rows=994, cols=750,  # Chip: "largest program rectangle 750x994 = 745,500" (A)
        # Chip: "1.1 GHz (papers, Hot Chips)": published. The core "running at 1.1 GHz" (Hot Chips 34, S. Lie, 2022;
        # IEEE Micro 43(3), 2023); WaferLLM (OSDI'25, sec. 7) measured on a WSE-2 whose cores operate "at a maximum of
        # 1.1 GHz" and converts its device cycles at 1.1 GHz. The SDK examples' 850 MHz is a conversion convention.
        clock_hz=1.1e9,
        fp16_flops_per_cycle_per_pe=8,  # Chip: "4-wide FMAC = 8 FLOP/cycle" (A/V)
        power_w=22.8e3,  # Chip: "22.8 kW average measured under load" (V/A)
        **_COMMON),
    "wse3": FabricSpec(
        name="wse3", rows=1170, cols=755,  # Chip: "program rectangle ~755x1170 (D)"
        clock_hz=1.1e9,  # Chip: "not published" (The Next Platform, 2024-03-14: raised "a little bit ... but
        # Cerebras is not telling"); an assumption: WSE-2's published 1.1 GHz (fabric/assumptions.py)
        fp16_flops_per_cycle_per_pe=16,  # Chip: "8-wide = 16 FLOP/cycle" (A/V)
        power_w=23e3,  # Chip: "~23 kW" (V)
        **_COMMON),
}


def preset_key(name: str) -> str:
    """'WSE-3' -> 'wse3'; ConfigError for an unknown target."""
    key = name.strip().lower().replace("-", "")
    if key not in PRESETS:
        close = difflib.get_close_matches(key, PRESETS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown target {name!r}{hint}; known targets: {', '.join(PRESETS)}")
    return key


def fabric_from_name(name: str, *, pes: tuple[int, int] | None = None, clock_hz: float | None = None) -> FabricSpec:
    spec = PRESETS[preset_key(name)]
    if clock_hz is not None:
        if clock_hz <= 0:
            raise ConfigError(f"clock must be positive, got {clock_hz}")
        spec = spec.with_clock(clock_hz)
    return spec.with_pes(*pes) if pes else spec


def parse_pes(text: str) -> tuple[int, int]:
    """'8x8' -> (8, 8) as (rows, cols)."""
    try:
        r, c = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--pes must look like ROWSxCOLS (e.g. 8x8), got {text!r}") from None
    if r <= 0 or c <= 0:
        raise ConfigError(f"--pes must be positive, got {text!r}")
    return r, c
