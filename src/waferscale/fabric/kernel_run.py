"""`wsc kernel`: one fabric kernel projected on a target by the cost model (`cost*.py`) on the target's mesh
(with defects), optionally verified tile by tile (`kernels/`) against numpy, and reported with its assumptions.
"""

from __future__ import annotations

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric import kernels as KN
from waferscale.fabric import pe as PE
from waferscale.fabric import schedules_gemm2d as G2
from waferscale.fabric.cost import check_positive
from waferscale.fabric.cost_collectives import allreduce_cycles
from waferscale.fabric.cost_gemm2d import gemm2d_cycles
from waferscale.fabric.cost_matmul import gemm_cycles, gemv_allreduce_cycles, gemv_cycles, spmv_cycles
from waferscale.fabric.kernels.gemm2d import gemm2d
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.presets import fabric_from_name
from waferscale.fabric.schedules import used
from waferscale.fabric.schedules_gemv import ROW_REDUCE_ALGOS, check_row_reduce

KERNELS = ("gemv", "gemm", "spmv", "allreduce")
VERIFY_MAX_PES = 64 * 64  # functional verification runs on at most this many PEs (numpy, tile by tile)


def run_kernel(kind: str, *, m: int, k: int, n: int | None, target: str, pes: tuple[int, int] | None,
               defects: float = 0.0, seed: int = 0, verify: bool = False, sparsity: float = 0.9,
               clock_hz: float | None = None, algo: str | None = None, fan_in: int | None = None,
               dtype: str | None = None) -> dict:
    """Project (and optionally verify) one kernel on a target. Sizes: gemv/spmv y(m) = W(m, k) x(k); gemm with
    n streamed vectors (weight-stationary), or with algo summa | cannon | cannon_folded Y(m, n) = W X with W, X
    and Y in 2D blocks (Cannon on the largest square of the mesh); gemv with algo chain | ktree (of `fan_in`) |
    phases (`fan_in` = the number of phases) is the GEMV of the in-layer model-parallel layout (x already on every
    PE of its column, a row all-reduce leaves y on every PE of its row; without algo: x streamed into stationary
    W; fan_in defaults to 2); allreduce of an m-element fp32 vector per PE (k, n unused; algo chain | tree | 2d,
    the default | center, its `fan_in` the number of phases per axis, default 1). Without `pes` the whole
    (logical, defect-free part of the) wafer is used. `verify` runs the functional tile-level execution on the
    same mesh and compares it with numpy. `dtype` (fp16 | bf16 | fp32) is the precision the PEs store and compute
    in: default fp16 for the matrix kernels, fp32 for allreduce (the only precision it models); it sets the SIMD
    rate and the bytes per element in SRAM and on the fabric (the numpy verification runs in float32 either way:
    it checks the schedule, not the rounding)."""
    if kind not in KERNELS:
        raise ConfigError(f"unknown kernel {kind!r}; use one of {', '.join(KERNELS)}")
    check_positive(m=m, k=k)
    if n is not None:
        check_positive(n=n)
    if kind == "gemm" and n is None:
        raise ConfigError("gemm needs --n (the number of streamed input vectors)")
    gemm2d_algo = kind == "gemm" and algo in G2.ALGOS
    if kind == "gemm" and not gemm2d_algo and algo is not None:
        raise ConfigError(f"gemm --algo must be one of {', '.join(G2.ALGOS)} (or none: weight-stationary streaming), "
                          f"got {algo!r}")
    centre = kind == "allreduce" and algo == "center"
    fan_in = fan_in if fan_in is not None else 1 if centre else 2
    if fan_in != 2 and not (kind == "gemv" and algo in ("ktree", "phases") or centre):
        raise ConfigError(f"--fan_in applies to gemv --algo ktree or phases and to allreduce --algo center only "
                          f"(got {kind} with --algo {algo})")
    if kind == "gemv" and algo is not None:
        check_row_reduce(algo, fan_in)
    if kind == "spmv" and algo is not None:
        raise ConfigError(f"spmv takes no --algo (gemv: {', '.join(ROW_REDUCE_ALGOS)}; gemm: {', '.join(G2.ALGOS)})")
    algo = "2d" if kind == "allreduce" and algo is None else algo
    if not 0.0 <= sparsity < 1.0:
        raise ConfigError(f"--sparsity must be in [0, 1), got {sparsity}")
    spec = fabric_from_name(target, pes=pes, clock_hz=clock_hz)
    mesh = Mesh.build(spec, defect_rate=defects, seed=seed)
    R, C = mesh.logical_rows, mesh.logical_cols
    if dtype is not None and dtype not in PE.DTYPE_BYTES:
        raise ConfigError(f"--dtype must be one of {', '.join(PE.DTYPE_BYTES)}, got {dtype!r}")
    if kind == "allreduce" and dtype not in (None, "fp32"):
        raise ConfigError(f"allreduce is modelled in fp32 only (got --dtype {dtype}); drop --dtype")
    dtype = dtype or ("fp32" if kind == "allreduce" else "fp16")
    rng = np.random.default_rng(seed)
    W = None
    region = (R, C) if kind == "allreduce" else (used(m, R), used(k, C))
    if kind == "gemv" and algo is not None:
        cyc = gemv_allreduce_cycles(spec, m, k, R, C, dtype, algo=algo, fan_in=fan_in, mesh=mesh)
        flops = 2 * m * k
    elif kind == "gemv":
        cyc, flops = gemv_cycles(spec, m, k, R, C, dtype, mesh=mesh), 2 * m * k
    elif gemm2d_algo:
        if algo != "summa":
            R = C = min(R, C)
        cyc, flops = gemm2d_cycles(spec, m, k, n, R, C, dtype, algo=algo, mesh=mesh), 2 * m * k * n
        region = G2.region(algo, m, k, n, R, C)
    elif kind == "gemm":
        cyc, flops = gemm_cycles(spec, m, k, n, R, C, dtype, mesh=mesh), 2 * m * k * n
    elif kind == "spmv":
        W = KN.random_sparse(m, k, sparsity, rng) if verify else None
        nnz = int((W != 0).sum()) if verify else max(1, round(m * k * (1 - sparsity)))
        cyc, flops = spmv_cycles(spec, m, k, nnz, R, C, dtype, mesh=mesh), 2 * nnz
    else:
        cyc = allreduce_cycles(spec, m, R, C, algo, mesh=mesh, fan_in=fan_in if centre else 1)
        flops = m * (R * C - 1)
    ws_bytes = -(-m // used(m, R)) * -(-k // used(k, C)) * PE.dtype_bytes(dtype) if kind != "allreduce" else 0
    used_pes = region[0] * region[1]
    if kind in ("gemv", "gemm") and not gemm2d_algo and ws_bytes > spec.sram_bytes_per_pe:
        need = -(-m * k * PE.dtype_bytes(dtype) // spec.sram_bytes_per_pe)
        raise ConfigError(f"mesh too small: a {m}x{k} {dtype} W needs {ws_bytes:,} B per PE on {R}x{C} PEs, over "
                          f"the {spec.sram_bytes_per_pe:,} B SRAM; use at least {need:,} PEs (a larger --pes)")
    out = {
        "kernel": kind, "target": spec.name,
        "region": f"{region[0]}x{region[1]}", "pes": int(used_pes),
        "usable_pes": mesh.usable_pes, "cycles": cyc.total, "time_s": cyc.seconds(spec), "flops": int(flops),
        "flops_per_s": flops / cyc.seconds(spec) if cyc.total else 0.0,
        "bottleneck": cyc.bottleneck, "breakdown": cyc.as_dict(),
        "assumptions": {
            "clock_hz": spec.clock_hz, "dtype": dtype,
            "flops_per_cycle_per_pe": spec.fp16_flops_per_cycle_per_pe if PE.dtype_bytes(dtype) == 2
            else spec.fp32_flops_per_cycle_per_pe,
            "sram_read_bytes_per_cycle": spec.sram_read_bytes_per_cycle,
            "sram_write_bytes_per_cycle": spec.sram_write_bytes_per_cycle,
            "link_bytes_per_cycle": spec.link_bytes_per_cycle, "hop_latency_cycles": spec.hop_latency_cycles,
            "ramp_latency_cycles": spec.ramp_latency_cycles, "colors": spec.colors,
            "defects": mesh.summary(), "defect_rate": defects, "seed": seed,
            **({"algo": algo} if algo is not None else {}),
            **({"fan_in": fan_in} if kind == "gemv" and algo == "ktree" else {}),
            **({"phases": fan_in} if kind == "gemv" and algo == "phases" or centre else {}),
            **({"sparsity": sparsity} if kind == "spmv" else {}),
            "model": "analytic (fabric/cost*.py), validated against the wavelet-level event simulation (sim*.py)",
        },
    }
    if verify:
        out.update(_verify(kind, mesh, m, k, n, W, algo, fan_in, rng, used_pes))
    return out


def _verify(kind: str, mesh: Mesh, m: int, k: int, n: int | None, W, algo: str | None, fan_in: int, rng,
            used_pes: int) -> dict:
    if used_pes > VERIFY_MAX_PES:
        raise ConfigError(f"--verify runs the tile-by-tile numpy execution; {used_pes:,} PEs is too many "
                          f"(limit {VERIFY_MAX_PES:,}); add --pes 8x8 (or another small mesh)")
    R, C = mesh.logical_rows, mesh.logical_cols
    if kind == "allreduce":
        R0, C0 = min(R, 64), min(C, 64)
        data = rng.standard_normal((R0, C0, m)).astype(np.float32)
        got = KN.allreduce(mesh, data, algo, R0, C0, fan_in if algo == "center" else 1).out
        ref = np.broadcast_to(data.sum((0, 1)), (R0, C0, m))
    else:
        W = rng.standard_normal((m, k)).astype(np.float32) if W is None else W
        if kind == "gemm":
            X = rng.standard_normal((k, n)).astype(np.float32)
            square = min(R, C)  # Cannon runs on the largest square of the mesh
            run = KN.gemm(mesh, W, X) if algo not in G2.ALGOS else \
                gemm2d(mesh, W, X, algo, *((R, C) if algo == "summa" else (square, square)))
            got, ref = run.out, W.astype(np.float64) @ X
        elif kind == "gemv" and algo is not None:  # y as every column of PEs holds it
            x = rng.standard_normal(k).astype(np.float32)
            got = KN.gemv_allreduce(mesh, W, x, algo=algo, fan_in=fan_in).out
            ref = np.broadcast_to(W.astype(np.float64) @ x, got.shape)
        else:
            x = rng.standard_normal(k).astype(np.float32)
            got = (KN.gemv if kind == "gemv" else KN.spmv)(mesh, W, x).out
            ref = W.astype(np.float64) @ x
    err = float(np.max(np.abs(got - ref)))
    tol = 1e-4 * max(1.0, float(np.max(np.abs(ref)))) * max(1.0, np.sqrt(max(k, R * C)) / 8)
    return {"verified": bool(err <= tol), "max_abs_err": err}


def format_kernel_report(d: dict) -> str:
    """A short human summary of `run_kernel`'s result, with its assumptions."""
    b, a = d["breakdown"], d["assumptions"]
    lines = [
        f"{d['kernel']}" + (f" ({a['algo']}" + (f", fan-in {a['fan_in']}" if "fan_in" in a else "")
                            + (f", {a['phases']} phases" if "phases" in a else "") + ")"
                            if "algo" in a else "")
        + f" on {d['target']}: {d['pes']:,} PEs used of {d['usable_pes']:,} usable (region {d['region']})",
        f"  {d['cycles']:,.0f} cycles = {d['time_s'] * 1e6:,.3f} us at {a['clock_hz'] / 1e9:g} GHz;  "
        f"{d['flops']:,} FLOP -> {d['flops_per_s'] / 1e12:,.3f} TFLOP/s",
        f"  bottleneck: {d['bottleneck']}  (compute {b['compute']:,.0f}, SRAM {b['sram']:,.0f}, "
        f"fabric {b['fabric']:,.0f}, fill/drain {b['fill_drain']:,.0f}, I/O {b['io']:,.0f} cycles"
        + (f", {b['passes']} routing passes" if b["passes"] > 1 else "") + ")",
        f"  assumed: {a['dtype']} at {a['flops_per_cycle_per_pe']} FLOP/cycle/PE, SRAM "
        f"{a['sram_read_bytes_per_cycle']}+{a['sram_write_bytes_per_cycle']} B/cycle, links "
        f"{a['link_bytes_per_cycle']} B/cycle/direction, {a['hop_latency_cycles']} cycle/hop, ramp "
        f"{a['ramp_latency_cycles']} cycles, {a['colors']} colors",
        f"  mesh: {a['defects']}",
    ]
    if "verified" in d:
        lines.append(f"  verified vs numpy: {'OK' if d['verified'] else 'FAILED'} (max abs err {d['max_abs_err']:.2e})")
    return "\n".join(lines)
