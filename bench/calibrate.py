"""Calibrate the PE's own constants on the fidelity suite's kernel-level rows, by least squares.

    python bench/calibrate.py [--loso] [--check]

The wafer model's PE (`fabric/pe.py`) has three costs no source publishes: `task_overhead_cycles` (per task
activation), `vector_op_cycles` (per vector instruction, beyond its elements) and `fp32_fmac_sustained_fraction` (the
share of its 1 FMAC a cycle an fp32 multiply-add sustains). They are fitted here on the rows of
`fidelity_table.ROWS` whose role is "calibrate" (one kernel, one collective, one GEMM each) and on nothing else:
the fit minimizes the sum of squared log errors, ln(projected / published)^2, over a grid of each constant's
plausible range (`fabric/assumptions.py` states the ranges and their sources; cycles are whole cycles, the
fraction goes in steps of 0.01), by a pattern search from the uncalibrated micro-model (0 cycles, 0 cycles, the
full width). The rows are projected exactly as the suite does (`fidelity.run_row` with the trial values as
`assume`). It prints the fit, each calibration row's residual and the constants' values; the values committed
in `fabric/presets.py` must be these (`--check` exits 1 if they are not).

--loso: leave one source out. For each source of calibration rows, refit without its rows, then project every
validation row with those constants; prints the validation median |error| of each refit beside the full fit's,
so a reader sees whether the result hangs on one source. Exit status 2 with a message on bad arguments.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity  # noqa: E402
from fidelity_table import ROWS, Row  # noqa: E402

from waferscale.fabric.assumptions import UNCALIBRATED  # noqa: E402

# (name, the grid of its plausible range): fabric/assumptions.py gives each range's source
PARAMS: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("task_overhead_cycles", tuple(range(0, 41))),
    ("vector_op_cycles", tuple(range(0, 31))),
    ("fp32_fmac_sustained_fraction", tuple(round(0.25 + 0.01 * i, 2) for i in range(76))),
)
START = dict(UNCALIBRATED)  # the micro-model without the constants


def residuals(rows: list[Row], values: dict[str, float]) -> dict[str, float]:
    """ln(projected / published) of each row under `values` (a row the compiler refuses: +inf)."""
    out = {}
    for r in rows:
        res = fidelity.run_row(r, assume=values)
        out[r.id] = math.log(res["projected"] / r.value) if res["projected"] else math.inf
    return out


def fit(rows: list[Row], log=print, residual_fn=residuals) -> tuple[dict[str, float], float]:
    """The constants minimizing the sum of squared log errors over `rows` (residual_fn(rows, values) -> {id:
    ln(projected / published)}), and that sum: a coordinate pattern search on each constant's grid (steps
    halving from a quarter of the grid), sweeps until none moves."""
    cache: dict[tuple, float] = {}

    def cost(v: dict[str, float]) -> float:
        key = tuple(v[n] for n, _ in PARAMS)
        if key not in cache:
            cache[key] = sum(e * e for e in residual_fn(rows, v).values())
        return cache[key]

    cur = dict(START)
    best = cost(cur)
    for sweep in range(6):
        moved = False
        for name, grid in PARAMS:
            i = grid.index(cur[name])
            step = max(1, len(grid) // 4)
            while step >= 1:
                tried = False
                for j in (i - step, i + step):
                    if 0 <= j < len(grid):
                        c = cost(cur | {name: grid[j]})
                        if c < best - 1e-12:
                            best, i, tried, moved = c, j, True, True
                            cur = cur | {name: grid[j]}
                if not tried:
                    step //= 2
        log(f"  sweep {sweep + 1}: {', '.join(f'{k} {v:g}' for k, v in cur.items())}; sum of squared log errors "
            f"{best:.4f} ({len(cache)} trials)")
        if not moved:
            break
    return cur, best


def committed() -> dict[str, float]:
    """The values fabric/presets.py carries (every generation shares them)."""
    from waferscale.fabric.presets import PRESETS

    vals = {k: {getattr(spec, k) for spec in PRESETS.values()} for k, _ in PARAMS}
    return {k: next(iter(v)) if len(v) == 1 else math.nan for k, v in vals.items()}


def validation_median(values: dict[str, float]) -> tuple[float, int, int]:
    """Median |error| of the validation rows under `values`, how many are within +-25%, and how many rows."""
    errs = []
    for r in (r for r in ROWS if r.role == "validate"):
        res = fidelity.run_row(r, assume=values)
        if res["error"] is not None:
            errs.append(abs(res["error"]))
    return statistics.median(errs), sum(e <= fidelity.BAND for e in errs), len(errs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loso", action="store_true", help="also refit leaving each calibration source out")
    ap.add_argument("--check", action="store_true", help="exit 1 unless fabric/presets.py carries the fitted values")
    a = ap.parse_args(argv)
    rows = [r for r in ROWS if r.role == "calibrate"]
    t0 = time.perf_counter()
    print(f"calibration rows: {', '.join(r.id for r in rows)}")
    values, sse = fit(rows)
    print(f"fit ({time.perf_counter() - t0:.0f} s): " + ", ".join(f"{k} = {v:g}" for k, v in values.items()))
    print(f"{'row':<14} {'published':>10} {'unit':<9} {'residual':>9}")
    for r in rows:
        res = fidelity.run_row(r, assume=values)
        print(f"{r.id:<14} {r.value:>10.4g} {r.unit:<9} {res['error']:>+9.1%}")
    uncal = residuals(rows, START)
    print("uncalibrated micro-model: " + ", ".join(f"{k} {math.exp(v) - 1:+.1%}" for k, v in uncal.items()))
    have = committed()
    if a.loso:
        med, within, n = validation_median(values)
        print(f"\nvalidation rows with the full fit: median |error| {med:.1%}, {within} of {n} within +-25%")
        for src in dict.fromkeys(r.source for r in rows):
            kept = [r for r in rows if r.source != src]
            if not kept:
                continue
            v, _ = fit(kept, log=lambda *_: None)
            med, within, n = validation_median(v)
            print(f"without {src:<10}: " + ", ".join(f"{k} {x:g}" for k, x in v.items())
                  + f"; validation median |error| {med:.1%}, {within} of {n} within +-25%")
    if have != values:
        print("fabric/presets.py carries " + ", ".join(f"{k} = {v:g}" for k, v in have.items())
              + ": not this fit", file=sys.stderr)
        if a.check:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
