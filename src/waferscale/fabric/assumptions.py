"""The unpublished hardware assumptions of each generation: the values a projection rests on that shared/WSE.md
does not publish (or publishes only as a bound, or twice with different values).

Every other number of a preset cites its WSE.md row (`presets.py`). Each assumption here names the
`FabricSpec` field that carries it, so a changed value (`apply`: `wsc compile --assume NAME=VALUE`, or the
+-10% of `wsc compile --sensitivity`) reaches every kernel and plan through the spec, and says where the
assumed value comes from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from waferscale.errors import ConfigError
from waferscale.fabric.presets import preset_key
from waferscale.fabric.spec import MAY_BE_ZERO, UNCALIBRATED, FabricSpec  # noqa: F401 (UNCALIBRATED: re-exported)


@dataclass(frozen=True)
class Assumption:
    name: str  # the FabricSpec field that carries it
    unit: str
    source: str  # where the assumed value comes from
    integer: bool = False  # a count of bytes or cycles: a changed value is rounded

    def value(self, spec: FabricSpec) -> float:
        return getattr(spec, self.name)


_CLOCK_UNPUBLISHED = Assumption(
    "clock_hz", "Hz", "Chip row: clock not published for this generation (for WSE-3 The Next Platform, 2024-03-14: "
                      "raised 'a little bit ... but Cerebras is not telling'); assumed WSE-2's published 1.1 GHz "
                      "(Hot Chips 34; WaferLLM converts its WSE-2 cycles at 1.1 GHz)")
_IO_LATENCY = Assumption(
    "io_latency_s", "s", "System row: 'CS-3 I/O latency < 5 us per hop' (V), taken at the bound for every "
                         "generation (the only published figure)")
_SRAM_READ = Assumption(
    "sram_read_bytes_per_cycle", "B/cycle", "PE row: '2x64-bit reads + 1x64-bit write per cycle' is stated for "
                                            "WSE-2; assumed unchanged in this generation")
_SRAM_WRITE = Assumption("sram_write_bytes_per_cycle", "B/cycle", _SRAM_READ.source)
_COMMON = (
    Assumption("program_reserve_bytes_per_pe", "B", "not in WSE.md: SRAM a PE keeps for code, routing tables, "
                                                    "queues and stack (PE row: SRAM holds code and data); 6 KiB of "
                                                    "the 48 KiB", integer=True),
    Assumption("exp_ops", "ops", "not in WSE.md: SIMD ops per exp() in softmax and attention, a polynomial "
                                 "evaluation of about 8 multiply-adds"),
    Assumption("memoryx_bytes_per_s", "B/s", "System row: 'MemoryX ... runs the optimizer update, its I/O at least "
                                             "matches the CS-2's 1.2 Tb/s' (V); its update is assumed to read and "
                                             "write optimizer state at that rate, 150 GB/s (its DRAM and CPUs are "
                                             "not published)"),
)

# The PE's own fixed costs (fabric/pe.py): no source publishes them; fitted by least squares on the suite's
# calibration rows (kernel-level measurements) by bench/calibrate.py. Cycles are cycles: one PE design is assumed
# for every generation (no source says these costs changed), so the values fitted on WSE-1/WSE-2 kernels apply
# to WSE-3 too.
_CALIBRATED_ON = ("calibrated on rows SC20-AR, WL-GEMV-16K, WL-GEMV-32K, JIP-SGEMM (bench/calibrate.py; WSE-1 and "
                  "WSE-2 kernels, one value for every generation: no source says the PE changed); ")
_CALIBRATED = (
    Assumption("task_overhead_cycles", "cycles",
               _CALIBRATED_ON + "plausible "
               "range 0-40 cycles: the SDK says a PE responds to a wavelet 'within a few cycles' (sdk.cerebras.net, "
               "A Conceptual View) and gives no figure", integer=True),
    Assumption("vector_op_cycles", "cycles",
               _CALIBRATED_ON + "plausible "
               "range 0-30 cycles: not in the SDK documentation; 15-17 cycles of setup per vector op measured on "
               "CS-3 silicon by an unpublished third-party characterization (cross-check only)", integer=True),
    Assumption("fp32_fmac_sustained_fraction", "of 1 FMAC/cycle",
               _CALIBRATED_ON + "plausible "
               "range 0.25-1: the Chip row's '1 FMAC' is the peak; the SDK's SIMD table (sdk.cerebras.net/csl/"
               "language/appendix) lists no width for @fmacs while fp32 adds and moves run 2 a cycle on WSE-2; an "
               "unpublished third-party characterization measured 0.5 fp32 FMA a cycle on CS-3 silicon (cross-check "
               "only)"),
)

UNPUBLISHED: dict[str, tuple[Assumption, ...]] = {
    "wse1": (_CLOCK_UNPUBLISHED,
             Assumption("io_bytes_per_s", "B/s", "System row: '12 x 100 GbE = 1.2 Tb/s ~ 150 GB/s' is stated for "
                                                 "CS-2/CS-3; assumed for CS-1"),
             _IO_LATENCY, _SRAM_READ, _SRAM_WRITE, *_COMMON, *_CALIBRATED),
    "wse2": (Assumption("fp16_flops_per_cycle_per_pe", "FLOP/cycle",
                        "Chip row: '4-wide FMAC = 8 FLOP/cycle' (vendor, A/V) while WaferLLM (OSDI'25, sec. 7) describes "
                        "a WSE-2 core's cycle as 'fetch two 32-bit operands from SRAM, perform a multiply-accumulate "
                        "operation, and then write back': the sources disagree, the vendor's peak is kept",
                        integer=True),
             _IO_LATENCY, *_COMMON, *_CALIBRATED),  # its clock is published (presets.py): not an assumption
    "wse3": (_CLOCK_UNPUBLISHED, _IO_LATENCY, _SRAM_READ, _SRAM_WRITE, *_COMMON, *_CALIBRATED),
}


def unpublished(target: str) -> tuple[Assumption, ...]:
    """The unpublished assumptions of `target`'s generation (ConfigError for an unknown target)."""
    return UNPUBLISHED[preset_key(target)]


def apply(spec: FabricSpec, target: str, values: Mapping[str, float]) -> FabricSpec:
    """`spec` with some of its generation's unpublished assumptions changed (name -> value); a count is rounded.
    ConfigError for a name that is not one of them or a value the spec refuses."""
    known = {a.name: a for a in unpublished(target)}
    changed = {}
    for name, v in values.items():
        if name not in known:
            raise ConfigError(f"{name!r} is not an unpublished assumption of {preset_key(target)}; its assumptions "
                              f"are {', '.join(known)} (the published values cite shared/WSE.md and stay fixed)")
        zero_ok = name in MAY_BE_ZERO
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 if zero_ok else v > 0):
            raise ConfigError(f"assumption {name} must be a {'number >= 0' if zero_ok else 'positive number'}, "
                              f"got {v!r}")
        changed[name] = max(0 if zero_ok else 1, round(v)) if known[name].integer else float(v)
    return dataclasses.replace(spec, **changed)


def parse_assume(items: list[str]) -> dict[str, float]:
    """--assume NAME=VALUE (repeated) -> {NAME: VALUE}."""
    out = {}
    for item in items:
        name, _, text = item.partition("=")
        try:
            out[name.strip()] = float(text)
        except ValueError:
            raise ConfigError(f"--assume must look like NAME=VALUE (e.g. clock_hz=0.85e9), got {item!r}") from None
    return out


def describe(spec: FabricSpec, target: str) -> dict[str, dict]:
    """name -> {value, unit, source} of every unpublished assumption, as `spec` has it (for the plan)."""
    return {a.name: {"value": a.value(spec), "unit": a.unit, "source": a.source} for a in unpublished(target)}
