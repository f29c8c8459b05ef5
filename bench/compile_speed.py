"""Compile Llama-3.1-70B for 4 x WSE-3 at full resolution (every PE of the 1170x755 program rectangle per
wafer) and print wall seconds and peak RSS. Target (issue 3, section 5): < 10 s and < 2 GB on 2 cores.

    python bench/compile_speed.py [--model llama3.1-70b] [--systems 4] [--target wse3] [--defects 0.0] [--out DIR]

The time includes importing torch (the compiler's capture step builds the model on the meta device).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.1-70b")
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--target", default="wse3")
    ap.add_argument("--defects", type=float, default=0.0)
    ap.add_argument("--out", default=None, help="also write plan.json, wafer.png/svg, trace.json here (timed apart)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    from waferscale.compiler import compile_model, plan_summary, write_outputs

    t_import = time.perf_counter() - t0
    plan = compile_model(model=a.model, target=a.target, systems=a.systems, defects=a.defects)
    t_compile = time.perf_counter() - t0
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB
    pes = sum(w["logical_rows"] * w["logical_cols"] for w in plan.wafers)
    print(plan_summary(plan))
    print(f"\ncompile {a.model} for {a.systems} x {a.target}: {t_compile:.2f} s wall "
          f"(of which imports {t_import:.2f} s), peak RSS {rss_gb:.2f} GB, {pes:,} PEs placed at full resolution, "
          f"{len(plan.regions)} regions")
    print(f"target: < 10 s and < 2 GB -> {'OK' if t_compile < 10 and rss_gb < 2 else 'MISSED'}")
    if a.out:
        t1 = time.perf_counter()
        paths = write_outputs(plan, a.out)
        print(f"outputs in {time.perf_counter() - t1:.2f} s: {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
