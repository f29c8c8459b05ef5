"""The GEMV of the in-layer model-parallel layout (x already on its column, a row all-reduce of the partials):
the cycle model stays within 10% of the wavelet-level event simulation for both reductions (chain, K-ary tree)
and several fan-ins, the tile-by-tile execution equals numpy on every PE, and on big meshes the chain's latency
grows with the mesh while the tree's grows much more slowly (so the chain's GEMV is fastest on a moderate mesh)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from waferscale.errors import ConfigError
from waferscale.fabric.cost import BOTTLENECKS
from waferscale.fabric.cost_matmul import gemv_allreduce_cycles
from waferscale.fabric.kernel_run import run_kernel
from waferscale.fabric.kernels import gemv_allreduce
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.presets import fabric_from_name
from waferscale.fabric.schedules import reduce_parents
from waferscale.fabric.schedules_gemv import row_reduce_depth, row_reduce_parents
from waferscale.fabric.sim_gemv import sim_gemv_allreduce

LIMIT = 0.10
ALGOS = [("chain", 2), ("ktree", 2), ("ktree", 3), ("ktree", 4)]


def _close(model, des: int, what: str) -> None:
    assert model.passes == 1, f"{what}: the event simulation does not time extra routing passes"
    err = abs(model.total - des) / des
    assert err <= LIMIT, f"{what}: model {model.total} vs event simulation {des} ({err:.1%})"


@pytest.mark.parametrize("target", ["wse2", "wse3"])
@pytest.mark.parametrize("R,C", [(4, 4), (6, 5), (8, 8), (3, 16), (16, 16)])
def test_model_vs_des(target, R, C):
    spec = fabric_from_name(target, pes=(R, C))
    for (m, k), (algo, K) in itertools.product([(16, 16), (100, 256), (256, 64), (1024, 128)], ALGOS):
        _close(gemv_allreduce_cycles(spec, m, k, R, C, algo=algo, fan_in=K),
               sim_gemv_allreduce(spec, m, k, R, C, "fp16", algo, K), f"{algo}/{K} {m}x{k} on {R}x{C}")
    for algo, K in [("chain", 2), ("ktree", 5)]:  # fp32 (one value per wavelet), a fan-in above the row's half
        _close(gemv_allreduce_cycles(spec, 64, 90, R, C, "fp32", algo=algo, fan_in=K),
               sim_gemv_allreduce(spec, 64, 90, R, C, "fp32", algo, K), f"fp32 {algo}/{K} on {R}x{C}")


def test_model_vs_des_on_defective_meshes():
    """Detoured routes, and the queueing where detours make rows share a link, on 10x10 wafers."""
    spec = fabric_from_name("wse2", pes=(10, 10))
    for rate, seed in itertools.product((0.02, 0.05), (0, 1)):
        mesh = Mesh.build(spec, rate, seed=seed)
        R, C = mesh.logical_rows, mesh.logical_cols
        for (m, k), (algo, K) in itertools.product([(64, 64), (256, 128)], ALGOS):
            _close(gemv_allreduce_cycles(spec, m, k, R, C, algo=algo, fan_in=K, mesh=mesh),
                   sim_gemv_allreduce(spec, m, k, R, C, "fp16", algo, K, mesh=mesh),
                   f"{algo}/{K} {m}x{k}, defects {rate} seed {seed}")


def test_big_defective_region_charges_detours():
    """Above 64x64 PEs the model adds the worst row's detour hops to the reduction and to the multicast."""
    spec = fabric_from_name("wse2", pes=(80, 80))
    mesh = Mesh.build(spec, 0.02, seed=0)
    R, C = mesh.logical_rows, mesh.logical_cols
    for algo in ("chain", "ktree"):
        bad = gemv_allreduce_cycles(spec, 4096, 4096, R, C, algo=algo, mesh=mesh).total
        good = gemv_allreduce_cycles(spec, 4096, 4096, R, C, algo=algo).total
        assert bad > good


def test_row_trees():
    """The K-ary tree: fan_in 2 is the recursive halving of the all-reduce's "tree"; a fan-in of at least the
    row is one level (every PE straight to column 0); the chain is n - 1 stages."""
    halving = reduce_parents("tree", 1, 13)
    assert row_reduce_parents("ktree", 13, 2) == {j: halving[0, j][1] for j in range(1, 13)}
    assert row_reduce_parents("ktree", 9, 9) == {p: 0 for p in range(1, 9)}
    assert row_reduce_parents("ktree", 10, 3)[7] == 6 and row_reduce_parents("ktree", 10, 3)[9] == 0
    assert row_reduce_parents("chain", 5) == {1: 0, 2: 1, 3: 2, 4: 3}
    assert [row_reduce_depth("ktree", n, 3) for n in (1, 2, 3, 4, 9, 10, 27, 28)] == [0, 1, 1, 2, 2, 3, 3, 4]
    assert row_reduce_depth("chain", 7) == 6


@pytest.mark.parametrize("defects", [0.0, 0.05])
def test_tile_execution_equals_numpy(defects):
    spec = fabric_from_name("wse3", pes=(9, 11))
    mesh = Mesh.build(spec, defects, seed=2)
    rng = np.random.default_rng(0)
    for m, k in [(37, 91), (64, 64), (200, 30)]:
        W = rng.standard_normal((m, k)).astype(np.float32)
        x = rng.standard_normal(k).astype(np.float32)
        ref = W.astype(np.float64) @ x
        for algo, K in ALGOS + [("ktree", 11)]:
            run = gemv_allreduce(mesh, W, x, algo=algo, fan_in=K)
            assert run.out.shape == (run.cols, m)  # y as each column of PEs holds it: every PE has its segment
            assert np.abs(run.out - ref[None]).max() < 1e-4 * max(1.0, np.abs(ref).max()), (m, k, algo, K)
            assert run.max_link_wavelets > 0 and run.sram_bytes_per_pe > 0


def test_chain_slows_down_on_big_meshes_while_the_tree_does_not():
    """4096x4096 fp16 (a decode GEMV) on n x n PEs of a wafer, n = 64..512. Every row reduces alone on a perfect
    mesh, so one row of the event simulation (1 x n PEs, the row's tile height) checks the wafer's figure. The
    micro-model without the PE's calibrated fixed costs (with them a small mesh's many vector instructions
    weigh more: the minimum moves to a larger mesh, the model and the simulation still agree)."""
    spec = fabric_from_name("wse2").uncalibrated()
    sizes = (64, 96, 128, 192, 256, 384, 512)
    t = {}
    for algo in ("chain", "ktree"):
        for n in sizes:
            t[algo, n] = gemv_allreduce_cycles(spec, 4096, 4096, n, n, algo=algo, fan_in=2).total
            if n in (64, 512):
                row = fabric_from_name("wse2", pes=(1, n)).uncalibrated()
                cal = fabric_from_name("wse2", pes=(1, n))
                assert sim_gemv_allreduce(cal, 4096 // n, 4096, 1, n, "fp16", algo, 2) == pytest.approx(
                    gemv_allreduce_cycles(fabric_from_name("wse2"), 4096, 4096, n, n, algo=algo, fan_in=2).total,
                    rel=LIMIT)
                assert sim_gemv_allreduce(row, 4096 // n, 4096, 1, n, "fp16", algo, 2) == pytest.approx(
                    t[algo, n], rel=LIMIT)
    chain = [t["chain", n] for n in sizes]
    best = sizes[int(np.argmin(chain))]
    assert 64 < best < 512 and t["chain", 512] > 2.5 * min(chain)  # a minimum at a moderate mesh
    grow_chain, grow_tree = t["chain", 512] - t["chain", 128], t["ktree", 512] - t["ktree", 128]
    assert grow_chain > 3 * grow_tree > 0
    assert t["ktree", 512] < 0.5 * t["chain", 512]


def test_breakdown_and_routing_passes():
    spec = fabric_from_name("wse2", pes=(4, 64))
    c = gemv_allreduce_cycles(spec, 512, 4096, 4, 64, algo="ktree", fan_in=2)
    assert c.bottleneck in BOTTLENECKS and c.passes == 1 and c.total > 0
    assert c.fabric == 6 * 64  # column 0 takes log2(64) = 6 partials of 64 wavelets through its ramp
    wide = gemv_allreduce_cycles(spec, 512, 4096, 4, 64, algo="ktree", fan_in=16)
    assert wide.passes == 2 and wide.bottleneck == "routing"  # 15 + 3 offsets + the multicast: 19 > 18 colors
    one = gemv_allreduce_cycles(spec, 512, 4, 4, 64, algo="chain")  # k = 4 fills 4 columns only
    assert one.total == gemv_allreduce_cycles(spec, 512, 4, 4, 4, algo="chain").total
    col = gemv_allreduce_cycles(spec, 64, 1, 4, 64, algo="chain")  # one column: no reduction, no multicast
    assert col.fabric == 0 and col.total == sim_gemv_allreduce(spec, 64, 1, 4, 64, "fp16", "chain")


def test_refusals():
    spec = fabric_from_name("wse2", pes=(8, 8))
    with pytest.raises(ConfigError, match="chain, ktree"):
        gemv_allreduce_cycles(spec, 64, 64, 8, 8, algo="ring")
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ConfigError, match="fan_in"):
            gemv_allreduce_cycles(spec, 64, 64, 8, 8, fan_in=bad)
    with pytest.raises(ConfigError, match="m must be"):
        gemv_allreduce_cycles(spec, 0, 64, 8, 8)
    with pytest.raises(ConfigError, match="exceeds"):
        gemv_allreduce_cycles(spec, 64, 64, 9, 8)
    mesh = Mesh.build(spec, 0.0)
    with pytest.raises(ConfigError, match="chain, ktree"):
        gemv_allreduce(mesh, np.ones((4, 4)), np.ones(4), algo="star")


def test_wsc_kernel_gemv_algo():
    for algo, K in [("chain", 2), ("ktree", 3)]:
        d = run_kernel("gemv", m=100, k=70, n=None, target="wse3", pes=(6, 5), algo=algo, fan_in=K, verify=True,
                       defects=0.05, seed=1)
        assert d["verified"] and d["assumptions"]["algo"] == algo and d["cycles"] > 0
    plain = run_kernel("gemv", m=100, k=70, n=None, target="wse3", pes=(6, 5))
    assert "algo" not in plain["assumptions"]  # the default stays the weight-stationary streamed GEMV
    ok = dict(m=64, k=64, n=None, target="wse2", pes=(8, 8))
    with pytest.raises(ConfigError, match="chain, ktree"):
        run_kernel("gemv", **ok, algo="tree")
    with pytest.raises(ConfigError, match="fan_in"):
        run_kernel("gemv", **ok, algo="ktree", fan_in=1)
    with pytest.raises(ConfigError, match="--fan_in applies"):
        run_kernel("allreduce", **ok, fan_in=4)
    with pytest.raises(ConfigError, match="spmv takes no --algo"):
        run_kernel("spmv", **ok, algo="chain")
