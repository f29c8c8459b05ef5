"""GEMM on 2D-distributed operands (SUMMA, Cannon): the cycle model stays within 10% of the wavelet-level event
simulation, the tile-by-tile execution equals numpy, bad input is refused, and the comparison with the
weight-stationary streamed GEMM shows when each wins."""

from __future__ import annotations

import numpy as np
import pytest

from waferscale.errors import ConfigError
from waferscale.fabric.cost_gemm2d import EXACT_PES, gemm2d_cycles
from waferscale.fabric.cost_matmul import gemm_cycles
from waferscale.fabric.kernel_run import run_kernel
from waferscale.fabric.kernels.gemm2d import gemm2d
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.presets import fabric_from_name
from waferscale.fabric.schedules_gemm2d import ALGOS
from waferscale.fabric.sim_gemm2d import sim_gemm2d

LIMIT = 0.10
# (P, m, k, n) on a P x P mesh: compute-bound blocks, fabric-bound small blocks, uneven last tiles, k >> m, n
SQUARE = [(2, 30, 50, 70), (3, 100, 40, 20), (4, 17, 33, 65), (5, 100, 100, 100), (8, 96, 96, 96),
          (8, 32, 32, 32), (8, 16, 200, 16), (12, 24, 24, 24), (12, 60, 100, 200)]


def _close(model: float, des: float, what: str) -> None:
    err = abs(model - des) / des
    assert err <= LIMIT, f"{what}: model {model} vs event simulation {des} ({err:.1%})"


@pytest.mark.parametrize("target", ["wse2", "wse3"])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.slow
def test_model_vs_des_square(target, algo):
    for P, m, k, n in SQUARE[::2] if target == "wse3" else SQUARE:  # WSE-3: every other shape (time)
        spec = fabric_from_name(target, pes=(P, P))
        _close(gemm2d_cycles(spec, m, k, n, P, P, algo=algo).total, sim_gemm2d(spec, m, k, n, P, P, "fp16", algo),
               f"{algo} {m}x{k}x{n} on {target} {P}x{P}")


def test_model_vs_des_summa_rectangular_and_fp32():
    for R, C, m, k, n in [(2, 5, 40, 60, 100), (6, 3, 100, 70, 30), (4, 12, 64, 128, 200), (3, 10, 9, 300, 40)]:
        spec = fabric_from_name("wse2", pes=(R, C))
        _close(gemm2d_cycles(spec, m, k, n, R, C).total, sim_gemm2d(spec, m, k, n, R, C), f"summa {m}x{k}x{n}")
    spec = fabric_from_name("wse3", pes=(6, 6))
    for algo in ALGOS:
        _close(gemm2d_cycles(spec, 40, 40, 40, 6, 6, "fp32", algo=algo).total,
               sim_gemm2d(spec, 40, 40, 40, 6, 6, "fp32", algo), f"{algo} fp32")


def test_model_vs_des_defective_meshes():
    """Detours make blocks share links (the model's link queues): within 15% on 10x10 meshes with 3-10% dead
    cores and links (bench/fabric_model_vs_des.py: the wider sweep)."""
    spec = fabric_from_name("wse2", pes=(10, 10))
    for rate, seed in [(0.03, 0), (0.1, 1)]:
        mesh = Mesh.build(spec, rate, seed=seed)
        P = min(mesh.logical_rows, mesh.logical_cols)
        for algo in ALGOS:
            model = gemm2d_cycles(spec, 64, 64, 64, P, P, algo=algo, mesh=mesh).total
            des = sim_gemm2d(spec, 64, 64, 64, P, P, "fp16", algo, mesh=mesh)
            assert abs(model - des) / des <= 0.15, f"{algo} on {mesh.summary()}: model {model} vs {des}"


@pytest.mark.parametrize("algo", ALGOS)
def test_tiles_equal_numpy(algo):
    rng = np.random.default_rng(1)
    meshes = [Mesh.perfect(fabric_from_name("wse2", pes=(P, P))) for P in (2, 4, 6)]
    meshes.append(Mesh.build(fabric_from_name("wse2", pes=(10, 10)), 0.05, seed=1))  # detoured routes
    for mesh, (m, k, n) in zip(meshes, [(5, 7, 9), (33, 17, 40), (64, 50, 70), (64, 64, 64)]):
        W, X = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
        P = min(mesh.logical_rows, mesh.logical_cols)
        run = gemm2d(mesh, W, X, algo, P, P)
        np.testing.assert_allclose(run.out, W.astype(np.float64) @ X, rtol=1e-4, atol=1e-4)
        assert run.max_link_wavelets > 0 and run.sram_bytes_per_pe <= mesh.spec.sram_bytes_per_pe
    if algo == "summa":  # rectangular mesh, and fewer rows of W than mesh rows (the region shrinks)
        W, X = rng.standard_normal((3, 100)).astype(np.float32), rng.standard_normal((100, 41)).astype(np.float32)
        run = gemm2d(Mesh.perfect(fabric_from_name("wse2", pes=(5, 7))), W, X, algo)
        np.testing.assert_allclose(run.out, W.astype(np.float64) @ X, rtol=1e-4, atol=1e-4)
        assert (run.rows, run.cols) == (3, 7)


def test_refusals():
    spec = fabric_from_name("wse2", pes=(8, 8))
    with pytest.raises(ConfigError, match="square"):
        gemm2d_cycles(spec, 64, 64, 64, 4, 8, algo="cannon")
    with pytest.raises(ConfigError, match="unknown 2D GEMM"):
        gemm2d_cycles(spec, 64, 64, 64, 8, 8, algo="fox")
    with pytest.raises(ConfigError, match="k must be a positive"):
        gemm2d_cycles(spec, 64, 0, 64, 8, 8)
    with pytest.raises(ConfigError, match="SRAM"):  # 2048^2 fp16 blocks on 4x4 PEs: 1 MB of W per PE
        gemm2d_cycles(spec, 2048, 2048, 64, 4, 4)
    with pytest.raises(ConfigError, match="SRAM"):  # the tile execution refuses the overflow on its own
        gemm2d(Mesh.perfect(spec), np.ones((512, 512)), np.ones((512, 64)), "summa", 2, 2)
    with pytest.raises(ConfigError, match="exceeds"):
        gemm2d_cycles(spec, 64, 64, 64, 16, 16)


def test_when_each_wins_against_weight_stationary():
    """The orderings asserted here follow from what each schedule moves, not from tuned numbers:

    * few tokens (n << m): SUMMA and Cannon move W itself (every PE receives its whole row panel of W, k * m / R
      values), the weight-stationary GEMM never moves W and streams n short vectors, so it wins;
    * many tokens (n in the thousands): both do the same AXPY tasks per PE (k * n / (C * values per wavelet) of
      m / R rows each), but the weight-stationary GEMM also adds every vector's partial sums along its rows
      (m / R values per PE per vector) while SUMMA accumulates Y in place, so SUMMA wins;
    * SUMMA never does worse than Cannon on a mesh without wrap-around links: both receive the same panels,
      and Cannon adds the skew and a P - 1 hop wrap-around on every step.
    On the micro-model without the PE's calibrated fixed costs: what each schedule moves, nothing else."""
    spec = fabric_from_name("wse3", pes=(64, 64)).uncalibrated()
    m = k = 1024
    few = {a: gemm2d_cycles(spec, m, k, 64, 64, 64, algo=a).total for a in ALGOS}
    assert gemm_cycles(spec, m, k, 64, 64, 64).total < min(few.values())
    many = {a: gemm2d_cycles(spec, m, k, 4096, 64, 64, algo=a).total for a in ALGOS}
    assert many["summa"] < gemm_cycles(spec, m, k, 4096, 64, 64).total
    for P, mm, kk, n in SQUARE:
        small = fabric_from_name("wse2", pes=(P, P)).uncalibrated()
        assert gemm2d_cycles(small, mm, kk, n, P, P).total <= gemm2d_cycles(small, mm, kk, n, P, P,
                                                                           algo="cannon").total
    assert few["summa"] <= few["cannon"] and many["summa"] <= many["cannon"]


def test_wsc_kernel_gemm_algo():
    for algo in ALGOS:
        d = run_kernel("gemm", m=50, k=70, n=40, target="wse3", pes=(6, 5), algo=algo, verify=True)
        assert d["verified"] and d["assumptions"]["algo"] == algo
        assert d["region"] == ("6x5" if algo == "summa" else "5x5")  # Cannon: the largest square
    with pytest.raises(ConfigError, match="gemm --algo"):
        run_kernel("gemm", m=50, k=70, n=40, target="wse3", pes=(6, 5), algo="fox")


def test_grouped_evaluation_of_large_meshes():
    """Above EXACT_PES PEs the model evaluates g x g groups of PEs, each as its latest member: never faster than
    the per-PE evaluation, and close to it (equal when compute-bound; a few hops more per panel or step when
    the blocks are small enough for latency to matter)."""
    spec = fabric_from_name("wse2")
    assert 160 * 160 > EXACT_PES  # so the default evaluates 2 x 2 groups
    for m, k, n in [(2048, 2048, 1024), (320, 320, 320)]:
        for algo in ALGOS:
            grouped = gemm2d_cycles(spec, m, k, n, 160, 160, algo=algo).total
            exact = gemm2d_cycles(spec, m, k, n, 160, 160, algo=algo, group=1).total
            assert exact <= grouped <= 1.10 * exact, f"{algo} {m}x{k}x{n}: grouped {grouped} vs per PE {exact}"
