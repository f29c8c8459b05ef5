"""Analytic cycle model (fabric/cost*.py) vs the wavelet-level event simulation (fabric/sim*.py), side by side.

    python bench/fabric_model_vs_des.py

Prints, per kernel family, the number of cases, the worst and mean |model - DES| / DES, and the wall time of
each side (the model is the fast backend; the event simulation the slow reference). The "+defects" families
run on 10x10 meshes with 1-10% dead cores and links (spare-remapped, detoured routes), 4 seeds per rate.
"gemv-allreduce-*" is the GEMV of the in-layer model-parallel layout (x already on its column, the partials
all-reduced along the rows by a chain or by K-ary trees of fan-in 2, 3 and 4 into column 0, or by 1, 2 and 3
phases of two chains into group centres ending at the row's centre). "allreduce-center" roots the 2D
all-reduce at the centre PE; "allreduce-center/K" reaches it in K phases per axis (cases whose 4 colors per
phase fit the program's colors: the event simulation has no color limit).
SpMV is judged one random matrix at a time, while its model is the expectation over such matrices (the
spread of single instances is a few percent on small meshes)."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric import cost as K
from waferscale.fabric import cost_collectives as KC
from waferscale.fabric import cost_gemm2d as KG
from waferscale.fabric import cost_matmul as KM
from waferscale.fabric import sim as S
from waferscale.fabric.kernels import random_sparse
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.presets import fabric_from_name
from waferscale.fabric.schedules import norm_phases, softmax_phases, used
from waferscale.fabric.schedules_gemm2d import ALGOS as GEMM2D
from waferscale.fabric.schedules_gemm2d import check_sram, region
from waferscale.fabric.sim_gemm2d import sim_gemm2d
from waferscale.fabric.sim_gemv import sim_gemv_allreduce

errs: dict = defaultdict(list)
# the GEMV all-reduce's (algorithm, fan-in; for "phases" the number of phases)
GEMV_AR = [("chain", 2), ("ktree", 2), ("ktree", 3), ("ktree", 4), ("phases", 1), ("phases", 2), ("phases", 3)]
wall: dict = defaultdict(lambda: [0.0, 0.0])


def case(name: str, model, des) -> None:
    t0 = time.perf_counter(); a = model().total; t1 = time.perf_counter(); d = des(); t2 = time.perf_counter()
    errs[name].append(abs(a - d) / d)
    wall[name][0] += t1 - t0
    wall[name][1] += t2 - t1


def main() -> None:
    rng = np.random.default_rng(0)
    for tgt, (R, C) in itertools.product(("wse2", "wse3"), [(4, 4), (4, 8), (6, 5), (8, 8)]):
        sp = fabric_from_name(tgt, pes=(R, C))
        for m, k in itertools.product([16, 32, 64, 100, 128, 256], [16, 64, 100, 256]):
            case("gemv", lambda: KM.gemv_cycles(sp, m, k, R, C), lambda: S.sim_gemv(sp, m, k, R, C))
        for (m, k), (algo, fan) in itertools.product([(16, 64), (100, 256), (256, 64), (1024, 128)], GEMV_AR):
            case(f"gemv-allreduce-{algo}", lambda: KM.gemv_allreduce_cycles(sp, m, k, R, C, algo=algo, fan_in=fan),
                 lambda: sim_gemv_allreduce(sp, m, k, R, C, "fp16", algo, fan))
        for m, k, n in [(64, 64, 4), (128, 64, 8), (32, 256, 16), (256, 256, 4), (64, 64, 32)]:
            case("gemm", lambda: KM.gemm_cycles(sp, m, k, n, R, C), lambda: S.sim_gemm(sp, m, k, n, R, C))
        for algo, n in itertools.product(("chain", "2d", "tree", "center"), (1, 16, 128, 512)):
            case(f"allreduce-{algo}", lambda: KC.allreduce_cycles(sp, n, R, C, algo),
                 lambda: S.sim_allreduce(sp, n, R, C, algo))
        for ph, n in itertools.product((2, 3), (1, 16, 128, 512)):  # ph phases per axis
            if KC.allreduce_cycles(sp, n, R, C, "center", fan_in=ph).passes == 1:
                case(f"allreduce-center/{ph}", lambda: KC.allreduce_cycles(sp, n, R, C, "center", fan_in=ph),
                     lambda: S.sim_allreduce(sp, n, R, C, "center", fan_in=ph))
        for n in (1, 64, 500):
            case("broadcast", lambda: KC.broadcast_cycles(sp, n, R, C), lambda: S.sim_broadcast(sp, n, R, C))
        for m, k, s in [(64, 64, 0.9), (256, 256, 0.9), (128, 128, 0.5), (256, 128, 0.99)]:
            W = random_sparse(m, k, s, rng)
            case("spmv", lambda: KM.spmv_cycles(sp, m, k, int((W != 0).sum()), R, C),
                 lambda: S.sim_gemm(sp, m, k, 1, R, C, nnz_cols=S.nnz_columns(W, R, C)))
        for n in (100, 4096):
            case("elementwise", lambda: K.elementwise_cycles(sp, n, R, C, 2), lambda: S.sim_elementwise(sp, n, R, C, 2))
        for tok, w in [(8, 64), (64, 256), (16, 1024)]:
            Rt, Ct = used(tok, R), used(w, C)
            tt, wt = -(-tok // Rt), -(-w // Ct)
            case("layernorm", lambda: K.norm_cycles(sp, tok * w, w, R, C),
                 lambda: S.sim_row_program(sp, norm_phases(sp, tt, wt, False, "fp32"), Rt, Ct))
            case("softmax", lambda: K.softmax_cycles(sp, tok * w, w, R, C),
                 lambda: S.sim_row_program(sp, softmax_phases(sp, tt, wt, "fp32"), Rt, Ct))
        for H, kv, d, T in [(8, 8, 64, 128), (8, 8, 32, 128), (4, 4, 128, 64), (8, 2, 64, 512), (4, 1, 128, 1024)]:
            case("attention", lambda: K.attention_decode_cycles(sp, H, d, T, R, C, n_kv_heads=kv),
                 lambda: _sim_attention(sp, H, kv, d, T, R, C))
    sp = fabric_from_name("wse2", pes=(10, 10))
    for rate, seed in itertools.product((0.01, 0.03, 0.05, 0.1), range(4)):
        mesh = Mesh.build(sp, rate, seed=seed)
        R, C = mesh.logical_rows, mesh.logical_cols
        for m, k in [(64, 64), (256, 128)]:
            case("gemv+defects", lambda: KM.gemv_cycles(sp, m, k, R, C, mesh=mesh),
                 lambda: S.sim_gemv(sp, m, k, R, C, mesh=mesh))
        for (m, k), (algo, fan) in itertools.product([(64, 64), (256, 128), (1024, 64)], GEMV_AR):
            case(f"gemv-allreduce-{algo}+defects",
                 lambda: KM.gemv_allreduce_cycles(sp, m, k, R, C, algo=algo, fan_in=fan, mesh=mesh),
                 lambda: sim_gemv_allreduce(sp, m, k, R, C, "fp16", algo, fan, mesh=mesh))
        case("gemm+defects", lambda: KM.gemm_cycles(sp, 64, 64, 8, R, C, mesh=mesh),
             lambda: S.sim_gemm(sp, 64, 64, 8, R, C, mesh=mesh))
        for m, k, s in [(64, 64, 0.9), (256, 128, 0.5)]:
            W = random_sparse(m, k, s, rng)
            case("spmv+defects", lambda: KM.spmv_cycles(sp, m, k, int((W != 0).sum()), R, C, mesh=mesh),
                 lambda: S.sim_gemm(sp, m, k, 1, R, C, mesh=mesh, nnz_cols=S.nnz_columns(W, R, C)))
        for algo in ("chain", "2d", "tree"):
            case("allreduce+defects", lambda: KC.allreduce_cycles(sp, 64, R, C, algo, mesh=mesh),
                 lambda: S.sim_allreduce(sp, 64, R, C, algo, mesh=mesh))
        case("allreduce-center+defects", lambda: KC.allreduce_cycles(sp, 64, R, C, "center", mesh=mesh),
             lambda: S.sim_allreduce(sp, 64, R, C, "center", mesh=mesh))
        for ph, n in itertools.product((2, 3), (1, 64)):
            if KC.allreduce_cycles(sp, n, R, C, "center", mesh=mesh, fan_in=ph).passes == 1:
                case(f"allreduce-center/{ph}+defects",
                     lambda: KC.allreduce_cycles(sp, n, R, C, "center", mesh=mesh, fan_in=ph),
                     lambda: S.sim_allreduce(sp, n, R, C, "center", mesh=mesh, fan_in=ph))
        case("broadcast+defects", lambda: KC.broadcast_cycles(sp, 64, R, C, mesh=mesh),
             lambda: S.sim_broadcast(sp, 64, R, C, mesh=mesh))
        for tok, w in [(8, 64), (64, 256)]:
            Rt, Ct = used(tok, R), used(w, C)
            tt, wt = -(-tok // Rt), -(-w // Ct)
            case("layernorm+defects", lambda: K.norm_cycles(sp, tok * w, w, R, C, mesh=mesh),
                 lambda: S.sim_row_program(sp, norm_phases(sp, tt, wt, False, "fp32"), Rt, Ct, mesh=mesh))
            case("softmax+defects", lambda: K.softmax_cycles(sp, tok * w, w, R, C, mesh=mesh),
                 lambda: S.sim_row_program(sp, softmax_phases(sp, tt, wt, "fp32"), Rt, Ct, mesh=mesh))
        for H, kv, d, T in [(8, 2, 64, 512), (4, 1, 128, 1024), (4, 4, 32, 100)]:
            case("attention+defects", lambda: K.attention_decode_cycles(sp, H, d, T, R, C, n_kv_heads=kv, mesh=mesh),
                 lambda: _sim_attention(sp, H, kv, d, T, R, C, mesh))
    gemm2d_cases()
    print(f"{'kernel':28s} {'cases':>5s} {'max err':>8s} {'mean err':>8s} {'model s':>8s} {'DES s':>8s} "
          f"{'DES/model':>9s}")
    for name, e in errs.items():
        m_s, d_s = wall[name]
        print(f"{name:28s} {len(e):5d} {max(e):8.1%} {np.mean(e):8.1%} {m_s:8.3f} {d_s:8.3f} "
              f"{d_s / max(m_s, 1e-9):9.0f}x")


def _sim_attention(sp, H: int, kv: int, d: int, T: int, R: int, C: int, mesh=None) -> int:
    """The event simulation of the layout the attention model picks (KV heads over groups of rows)."""
    phases, Rt, Ct, group = K.attention_decode_schedule(sp, H, d, T, R, C, n_kv_heads=kv, mesh=mesh)
    return S.sim_row_program(sp, phases, Rt, Ct, "fp16", mesh=mesh, group=group)


def _fits(sp, algo: str, m: int, k: int, n: int, R: int, C: int) -> bool:
    """The 2D GEMM's blocks and buffers fit a PE's SRAM (the model refuses the rest)."""
    try:
        check_sram(sp, algo, m, k, n, *region(algo, m, k, n, R, C), "fp16")
    except ConfigError:
        return False
    return True


def gemm2d_cases() -> None:
    """GEMM on 2D-distributed operands (SUMMA, Cannon, folded Cannon) on square meshes 2x2..16x16, SUMMA also on
    rectangular ones; then 10x10 meshes with 1-10% defects (4 seeds per rate, the largest square of the logical
    mesh)."""
    shapes = [(30, 50, 70), (100, 40, 20), (64, 64, 64), (17, 33, 65), (96, 96, 96), (32, 32, 32), (16, 200, 16),
              (120, 120, 120), (60, 100, 200), (200, 64, 200)]
    for tgt, P, (m, k, n), algo in itertools.product(("wse2", "wse3"), (2, 3, 5, 8, 12, 16), shapes, GEMM2D):
        sp = fabric_from_name(tgt, pes=(P, P))
        if not _fits(sp, algo, m, k, n, P, P):
            continue
        case(f"gemm2d-{algo}", lambda: KG.gemm2d_cycles(sp, m, k, n, P, P, algo=algo),
             lambda: sim_gemm2d(sp, m, k, n, P, P, "fp16", algo))
    for (R, C), (m, k, n) in itertools.product([(2, 5), (6, 3), (4, 12), (12, 7)], shapes[:6]):
        sp = fabric_from_name("wse2", pes=(R, C))
        case("gemm2d-summa", lambda: KG.gemm2d_cycles(sp, m, k, n, R, C), lambda: sim_gemm2d(sp, m, k, n, R, C))
    sp = fabric_from_name("wse2", pes=(10, 10))
    for rate, seed in itertools.product((0.01, 0.03, 0.05, 0.1), range(4)):
        mesh = Mesh.build(sp, rate, seed=seed)
        P = min(mesh.logical_rows, mesh.logical_cols)
        for (m, k, n), algo in itertools.product([(64, 64, 64), (16, 160, 16), (120, 60, 90)], GEMM2D):
            case(f"gemm2d-{algo}+defects", lambda: KG.gemm2d_cycles(sp, m, k, n, P, P, algo=algo, mesh=mesh),
                 lambda: sim_gemm2d(sp, m, k, n, P, P, "fp16", algo, mesh=mesh))


if __name__ == "__main__":
    main()
