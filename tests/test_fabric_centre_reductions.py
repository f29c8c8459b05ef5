"""Centre-rooted reductions: the GEMV all-reduce "phases" (WaferLLM's MeshGEMV K-tree: K phases of two chains
into group centres, the final root at the row's centre multicasting both ways) and the 2D all-reduce "center"
(rows into the middle column, that column into the centre PE, then the centre multicasts back), also in K phases
per axis (fan_in = K: every row, then the middle column, by the GEMV's K-phase tree). Each: the cycle model within
10% of the wavelet-level event simulation, the tile-by-tile execution equal to numpy, and on big meshes faster
than its corner-rooted counterpart because the sum travels about half the hops in and out."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from waferscale.errors import ConfigError
from waferscale.fabric import cost_collectives as KC
from waferscale.fabric import sim as S
from waferscale.fabric.cost_matmul import gemv_allreduce_cycles
from waferscale.fabric.kernel_run import run_kernel
from waferscale.fabric.kernels import allreduce, gemv_allreduce, reduce
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.presets import fabric_from_name
from waferscale.fabric.schedules import broadcast_chains, reduce_parents, reduce_root, used
from waferscale.fabric.schedules_gemv import bottom_up, row_reduce_depth, row_reduce_parents, row_root
from waferscale.fabric.sim_gemv import sim_gemv_allreduce

LIMIT = 0.10


def _close(model: float, des: int, what: str) -> None:
    err = abs(model - des) / des
    assert err <= LIMIT, f"{what}: model {model} vs event simulation {des} ({err:.1%})"


# ---- GEMV all-reduce "phases" ---------------------------------------------------------------------------
def test_phase_trees():
    """Groups of ~n^(1/K) consecutive PEs, each reduced as two chains into its centre; at most K phases; the
    final root near the row's centre; K = 1 is two chains meeting at the centre."""
    assert row_reduce_parents("phases", 7, 1) == {0: 1, 1: 2, 2: 3, 4: 3, 5: 4, 6: 5}
    p = row_reduce_parents("phases", 16, 2)  # 5 groups (an odd number: the middle one is centred), then their roots
    assert [p[j] for j in (0, 2, 1, 4, 10, 13, 15, 14)] == [1, 1, 4, 7, 7, 10, 14, 13] and row_root(p, 16) == 7
    for n, K in itertools.product((2, 5, 10, 31, 64, 100, 600), (1, 2, 3, 4)):
        par = row_reduce_parents("phases", n, K)
        root = row_root(par, n)
        assert len(par) == n - 1 and abs(root - (n - 1) / 2) <= 1.5, (n, K, root)
        assert 1 <= row_reduce_depth("phases", n, K) <= K
        order = bottom_up(par, n)
        assert order[-1] == root and all(order.index(c) < order.index(q) for c, q in par.items())
        g = max(2, next(g for g in range(1, n + 1) if g ** K >= n))  # PEs per group
        leaves = set(range(n)) - set(par.values())  # they send in phase 1 (or, alone in a group, in phase 2)
        assert all(abs(c - par[c]) <= g for c in leaves) and sum(abs(c - par[c]) == 1 for c in leaves) > len(leaves) / 2


@pytest.mark.parametrize("target", ["wse2", "wse3"])
@pytest.mark.parametrize("R,C", [(4, 4), (6, 5), (8, 8), (3, 16), (16, 16), (2, 31)])
def test_phases_model_vs_des(target, R, C):
    spec = fabric_from_name(target, pes=(R, C))
    for (m, k), K in itertools.product([(16, 16), (100, 256), (256, 64), (1024, 128)], (1, 2, 3)):
        _close(gemv_allreduce_cycles(spec, m, k, R, C, algo="phases", fan_in=K).total,
               sim_gemv_allreduce(spec, m, k, R, C, "fp16", "phases", K), f"phases/{K} {m}x{k} on {R}x{C}")
    _close(gemv_allreduce_cycles(spec, 64, 90, R, C, "fp32", algo="phases", fan_in=2).total,
           sim_gemv_allreduce(spec, 64, 90, R, C, "fp32", "phases", 2), f"fp32 phases on {R}x{C}")


def test_phases_model_vs_des_on_defective_meshes():
    spec = fabric_from_name("wse2", pes=(10, 10))
    for rate, seed in itertools.product((0.02, 0.05, 0.1), (0, 1)):
        mesh = Mesh.build(spec, rate, seed=seed)
        R, C = mesh.logical_rows, mesh.logical_cols
        for (m, k), K in itertools.product([(64, 64), (256, 128), (1024, 64)], (1, 2, 3)):
            _close(gemv_allreduce_cycles(spec, m, k, R, C, algo="phases", fan_in=K, mesh=mesh).total,
                   sim_gemv_allreduce(spec, m, k, R, C, "fp16", "phases", K, mesh=mesh),
                   f"phases/{K} {m}x{k}, defects {rate} seed {seed}")


def test_phases_big_defective_region_charges_detours():
    spec = fabric_from_name("wse2", pes=(80, 80))
    mesh = Mesh.build(spec, 0.02, seed=0)
    R, C = mesh.logical_rows, mesh.logical_cols
    assert gemv_allreduce_cycles(spec, 4096, 4096, R, C, algo="phases", mesh=mesh).total > \
        gemv_allreduce_cycles(spec, 4096, 4096, R, C, algo="phases").total


@pytest.mark.parametrize("defects", [0.0, 0.05])
def test_phases_tile_execution_equals_numpy(defects):
    mesh = Mesh.build(fabric_from_name("wse3", pes=(9, 11)), defects, seed=2)
    rng = np.random.default_rng(0)
    for (m, k), K in itertools.product([(37, 91), (64, 64), (200, 30)], (1, 2, 3, 5)):
        W = rng.standard_normal((m, k)).astype(np.float32)
        x = rng.standard_normal(k).astype(np.float32)
        ref = W.astype(np.float64) @ x
        run = gemv_allreduce(mesh, W, x, algo="phases", fan_in=K)
        assert run.out.shape == (run.cols, m)
        assert np.abs(run.out - ref[None]).max() < 1e-4 * max(1.0, np.abs(ref).max()), (m, k, K)


def test_phases_beat_the_corner_rooted_tree_on_big_meshes():
    """4096x4096 fp16 on n x n PEs of a WSE-2: from ~256 PEs a side the centre-rooted phases (K = 2, 3) beat
    every corner-rooted K-ary tree (K = 2..4), and the gap grows with the mesh, since the sum travels ~n/2 hops
    in and ~n/2 out instead of n and n. One row of the event simulation (all rows alike on a perfect mesh)
    checks the wafer's figures and the ordering."""
    spec = fabric_from_name("wse2")
    gap = []
    for n in (256, 420, 660):
        ktree = min(gemv_allreduce_cycles(spec, 4096, 4096, n, n, algo="ktree", fan_in=K).total for K in (2, 3, 4))
        phases = {K: gemv_allreduce_cycles(spec, 4096, 4096, n, n, algo="phases", fan_in=K).total for K in (2, 3)}
        assert max(phases.values()) < 0.8 * ktree, (n, phases, ktree)
        gap.append(ktree - phases[2])
        if n in (420, 660):
            C = used(4096, n)
            row = fabric_from_name("wse2", pes=(1, n))
            mt = -(-4096 // used(4096, n))
            des = {a: sim_gemv_allreduce(row, mt, 4096, 1, C, "fp16", a, 2) for a in ("phases", "ktree")}
            assert des["phases"] == pytest.approx(phases[2], rel=LIMIT) and des["phases"] < 0.8 * des["ktree"]
    assert gap[0] < gap[1] < gap[2]


def test_phases_colors_and_refusals():
    """4 colors per phase used (two chains alternating 2 each), the multicast one more, against 18 colors."""
    spec = fabric_from_name("wse2", pes=(4, 243))
    assert [row_reduce_depth("phases", 243, K) for K in (4, 5)] == [4, 5]
    assert gemv_allreduce_cycles(spec, 512, 243, 4, 243, algo="phases", fan_in=4).passes == 1  # 4 x 4 + 1 = 17
    five = gemv_allreduce_cycles(spec, 512, 243, 4, 243, algo="phases", fan_in=5)  # 5 x 4 + 1 = 21 > 18
    assert five.passes == 2 and five.bottleneck == "routing"
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="number of phases"):
            gemv_allreduce_cycles(spec, 64, 64, 4, 8, algo="phases", fan_in=bad)
    with pytest.raises(ConfigError, match="chain, ktree, phases"):
        gemv_allreduce_cycles(spec, 64, 64, 4, 8, algo="mesh")


def test_wsc_kernel_gemv_phases():
    d = run_kernel("gemv", m=100, k=70, n=None, target="wse3", pes=(6, 5), algo="phases", fan_in=2, verify=True,
                   defects=0.05, seed=1)
    assert d["verified"] and d["assumptions"]["phases"] == 2 and "fan_in" not in d["assumptions"]
    one = run_kernel("gemv", m=100, k=70, n=None, target="wse3", pes=(6, 5), algo="phases", fan_in=1)
    assert one["cycles"] > 0
    with pytest.raises(ConfigError, match="number of phases"):
        run_kernel("gemv", m=64, k=64, n=None, target="wse2", pes=(8, 8), algo="phases", fan_in=0)


# ---- 2D all-reduce "center" -----------------------------------------------------------------------------
def test_centre_tree():
    par = reduce_parents("center", 5, 4)
    assert reduce_root("center", 5, 4) == (2, 1) and (2, 1) not in par and len(par) == 19
    assert par[0, 0] == (0, 1) and par[0, 3] == (0, 2) and par[0, 1] == (1, 1) and par[4, 1] == (3, 1)
    pes, branches = broadcast_chains("center", 5, 4)
    assert pes[0] == (2, 1) and {p for b in [pes, *branches] for p in b} == {(i, j) for i in range(5) for j in range(4)}
    assert broadcast_chains("2d", 5, 4)[0] == [(0, j) for j in range(4)]


@pytest.mark.parametrize("target", ["wse2", "wse3"])
@pytest.mark.parametrize("R,C", [(1, 5), (4, 4), (4, 8), (6, 5), (8, 8), (3, 16), (16, 16), (9, 2)])
@pytest.mark.slow
def test_centre_allreduce_model_vs_des(target, R, C):
    spec = fabric_from_name(target, pes=(R, C))
    for n in (1, 16, 128, 512):
        _close(KC.allreduce_cycles(spec, n, R, C, "center").total, S.sim_allreduce(spec, n, R, C, "center"),
               f"center n={n} on {R}x{C}")


def test_centre_allreduce_model_vs_des_on_defective_meshes():
    spec = fabric_from_name("wse2", pes=(10, 10))
    for rate, seed in itertools.product((0.01, 0.05, 0.1), (0, 1)):
        mesh = Mesh.build(spec, rate, seed=seed)
        R, C = mesh.logical_rows, mesh.logical_cols
        for n in (1, 64, 300):
            _close(KC.allreduce_cycles(spec, n, R, C, "center", mesh=mesh).total,
                   S.sim_allreduce(spec, n, R, C, "center", mesh=mesh), f"center n={n}, defects {rate} seed {seed}")


@pytest.mark.parametrize("defects", [0.0, 0.05])
def test_centre_tile_execution_equals_numpy(defects):
    mesh = Mesh.build(fabric_from_name("wse2", pes=(9, 12)), defects, seed=3)
    data = np.random.default_rng(1).standard_normal((mesh.logical_rows, mesh.logical_cols, 33)).astype(np.float32)
    total = data.astype(np.float64).sum((0, 1))
    assert np.abs(reduce(mesh, data, "center").out - total).max() < 1e-4
    run = allreduce(mesh, data, "center")
    assert run.out.shape == data.shape and np.abs(run.out - total).max() < 1e-4
    if defects == 0:  # the sum flows toward the centre and back out on the opposite links: one vector per link
        assert run.max_link_wavelets == 33


def test_centre_beats_the_corner_on_big_meshes():
    """A 1-value all-reduce: the centre root halves the hops of the corner-rooted "2d" both ways (checked by
    the event simulation on 32x32), and on a WSE-1's whole 595x600 mesh it takes about half the cycles."""
    spec = fabric_from_name("wse2", pes=(32, 32))
    des = {a: S.sim_allreduce(spec, 1, 32, 32, a) for a in ("2d", "center")}
    assert des["center"] < 0.6 * des["2d"]
    wse1 = fabric_from_name("wse1")
    centre, corner = (KC.allreduce_cycles(wse1, 1, wse1.rows, wse1.cols, a) for a in ("center", "2d"))
    assert centre.passes == corner.passes == 1 and 0.4 < centre.total / corner.total < 0.6
    big = fabric_from_name("wse2", pes=(80, 80))  # a big defective region still charges its detours
    mesh = Mesh.build(big, 0.02, seed=1)
    R, C = mesh.logical_rows, mesh.logical_cols
    assert KC.allreduce_cycles(big, 64, R, C, "center", mesh=mesh).total > KC.allreduce_cycles(big, 64, R, C,
                                                                                                 "center").total


def test_centre_refusals_and_cli():
    spec = fabric_from_name("wse2", pes=(8, 8))
    with pytest.raises(ConfigError, match="chain, tree, 2d, center"):
        KC.allreduce_cycles(spec, 16, 8, 8, "ring")
    d = run_kernel("allreduce", m=40, k=1, n=None, target="wse2", pes=(8, 8), algo="center", verify=True,
                   defects=0.05, seed=2)
    assert d["verified"] and d["assumptions"]["algo"] == "center"


# ---- 2D all-reduce "center" in K phases per axis --------------------------------------------------------
def test_centre_phase_tree():
    """Every row reduces by the K-phase tree into the rows' root column, that column by its K-phase tree into
    the root (within two PEs of the centre); the broadcast starts there and reaches every PE; K = 1 is the
    chains of `test_centre_tree`."""
    assert reduce_parents("center", 5, 4, 1) == reduce_parents("center", 5, 4)
    for (R, C), K in itertools.product([(5, 4), (9, 13), (16, 16), (1, 31), (30, 2)], (1, 2, 3, 4)):
        par, (r, c) = reduce_parents("center", R, C, K), reduce_root("center", R, C, K)
        row, col = row_reduce_parents("phases", C, K), row_reduce_parents("phases", R, K)
        assert len(par) == R * C - 1 and (r, c) not in par and abs(r - (R - 1) / 2) <= 2 and abs(c - (C - 1) / 2) <= 2
        assert all(par[i, j] == (i, row[j]) for i in range(R) for j in row)
        assert all(par[i, c] == (col[i], c) for i in col)
        pes, branches = broadcast_chains("center", R, C, K)
        reached = {p for b in [pes, *branches] for p in b}
        assert pes[0] == (r, c) and reached == {(i, j) for i in range(R) for j in range(C)}


@pytest.mark.parametrize("target", ["wse2", "wse3"])
@pytest.mark.parametrize("R,C", [(1, 5), (4, 8), (6, 5), (3, 16), (16, 16), (9, 13), (2, 31), (12, 20)])
@pytest.mark.slow
def test_centre_phases_model_vs_des(target, R, C):
    """Where the schedule's colors (4 per phase of each axis) fit in one pass: the event simulation has no color
    limit, the model charges further passes (`test_centre_phases_colors`)."""
    spec = fabric_from_name(target, pes=(R, C))
    compared = 0
    for K, n in itertools.product((2, 3, 4), (1, 16, 128, 512)):
        model = KC.allreduce_cycles(spec, n, R, C, "center", fan_in=K)
        if model.passes == 1:
            compared += 1
            _close(model.total, S.sim_allreduce(spec, n, R, C, "center", fan_in=K), f"center/{K} n={n} on {R}x{C}")
    assert compared >= 4  # at least every n of K = 2 (16 colors)


def test_centre_phases_model_vs_des_on_defective_meshes():
    spec = fabric_from_name("wse2", pes=(10, 10))
    compared = 0
    for rate, seed, K in itertools.product((0.01, 0.05, 0.1), (0, 1), (2, 3)):
        mesh = Mesh.build(spec, rate, seed=seed)
        R, C = mesh.logical_rows, mesh.logical_cols
        for n in (1, 64):
            model = KC.allreduce_cycles(spec, n, R, C, "center", mesh=mesh, fan_in=K)
            if model.passes == 1:
                compared += 1
                _close(model.total, S.sim_allreduce(spec, n, R, C, "center", mesh=mesh, fan_in=K),
                       f"center/{K} n={n}, defects {rate} seed {seed}")
    assert compared >= 12


def test_centre_phases_colors():
    """4 colors per phase of each axis: 2 phases on both axes take 16 of WSE-2's 18 (one pass), 3 phases 24
    (two passes: the reduction pays its fill again), which only the model knows of."""
    spec = fabric_from_name("wse2", pes=(16, 16))
    two, three = (KC.allreduce_cycles(spec, 1, 16, 16, "center", fan_in=K) for K in (2, 3))
    assert two.passes == 1 and three.passes == 2
    wide = KC.allreduce_cycles(dataclasses.replace(spec, colors=24), 1, 16, 16, "center", fan_in=3)
    assert wide.passes == 1 and wide.total == S.sim_allreduce(spec, 1, 16, 16, "center", fan_in=3) < three.total


@pytest.mark.parametrize("defects", [0.0, 0.05])
def test_centre_phases_tile_execution_equals_numpy(defects):
    mesh = Mesh.build(fabric_from_name("wse2", pes=(17, 23)), defects, seed=3)
    data = np.random.default_rng(2).standard_normal((mesh.logical_rows, mesh.logical_cols, 33)).astype(np.float32)
    total = data.astype(np.float64).sum((0, 1))
    for K in (1, 2, 3, 4):
        assert np.abs(reduce(mesh, data, "center", fan_in=K).out - total).max() < 1e-4
        run = allreduce(mesh, data, "center", fan_in=K)
        assert run.out.shape == data.shape and np.abs(run.out - total).max() < 1e-4
        if defects == 0:  # a link carries at most one chain edge per phase, plus the broadcast
            assert run.max_link_wavelets <= (K + 1) * 33


def test_centre_phases_fewer_stages_on_big_meshes():
    """Each chain stage pays ramp out + hop + ramp in + add: two phases pay about 2 sqrt(n) stages per axis
    instead of n / 2, so a 1-value all-reduce gets faster (the event simulation on 48x48; the model on a WSE-1's
    whole mesh, where two phases fit the colors in one pass and come within 1.25x the diameter)."""
    spec = fabric_from_name("wse2", pes=(48, 48))
    des = {K: S.sim_allreduce(spec, 1, 48, 48, "center", fan_in=K) for K in (1, 2)}
    assert des[2] < 0.7 * des[1]
    wse1 = fabric_from_name("wse1")
    one, two = (KC.allreduce_cycles(wse1, 1, wse1.rows, wse1.cols, "center", fan_in=K) for K in (1, 2))
    assert two.passes == 1 and two.total < 0.5 * one.total and two.total < 1.25 * (wse1.rows + wse1.cols - 2)


def test_centre_phases_refusals_and_cli():
    spec = fabric_from_name("wse2", pes=(8, 8))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="number of phases per axis"):
            KC.allreduce_cycles(spec, 16, 8, 8, "center", fan_in=bad)
    with pytest.raises(ConfigError, match="'center' only"):
        KC.allreduce_cycles(spec, 16, 8, 8, "2d", fan_in=2)
    with pytest.raises(ConfigError, match="'center' only"):
        allreduce(Mesh.build(spec), np.ones((8, 8, 2), np.float32), "tree", fan_in=3)
    d = run_kernel("allreduce", m=40, k=1, n=None, target="wse2", pes=(8, 8), algo="center", fan_in=3, verify=True,
                   defects=0.05, seed=2)
    assert d["verified"] and d["assumptions"]["phases"] == 3
    assert run_kernel("allreduce", m=1, k=1, n=None, target="wse2", pes=(8, 8), algo="center")["assumptions"][
        "phases"] == 1
    with pytest.raises(ConfigError, match="--fan_in applies"):
        run_kernel("allreduce", m=40, k=1, n=None, target="wse2", pes=(8, 8), algo="2d", fan_in=3)
