"""The analytic cycle model stays within 10% of the wavelet-level event simulation across a sweep of shapes,
and refuses bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from waferscale.errors import ConfigError
from waferscale.fabric import cost as K
from waferscale.fabric import cost_collectives as KC
from waferscale.fabric import cost_matmul as KM
from waferscale.fabric import sim as S
from waferscale.fabric.kernels import random_sparse
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.presets import fabric_from_name
from waferscale.fabric.schedules import attention_phases, norm_phases, softmax_phases, used

LIMIT = 0.10
MESHES = [(4, 4), (6, 5), (8, 8)]


def _close(model: float, des: float, what: str) -> float:
    err = abs(model - des) / des
    assert err <= LIMIT, f"{what}: model {model} vs event simulation {des} ({err:.1%})"
    return err


@pytest.mark.parametrize("target", ["wse2", "wse3"])
@pytest.mark.parametrize("R,C", MESHES)
def test_gemv_gemm_model_vs_des(target, R, C):
    spec = fabric_from_name(target, pes=(R, C))
    for m, k in itertools.product([16, 64, 100, 256], [16, 64, 256]):
        _close(KM.gemv_cycles(spec, m, k, R, C).total, S.sim_gemv(spec, m, k, R, C), f"gemv {m}x{k} on {R}x{C}")
    for m, k, n in [(64, 64, 4), (128, 64, 8), (32, 256, 16)]:
        _close(KM.gemm_cycles(spec, m, k, n, R, C).total, S.sim_gemm(spec, m, k, n, R, C), f"gemm {m}x{k}x{n}")


@pytest.mark.parametrize("R,C", MESHES)
def test_collectives_model_vs_des(R, C):
    spec = fabric_from_name("wse2", pes=(R, C))
    for algo, n in itertools.product(("chain", "2d", "tree"), (1, 16, 256)):
        _close(KC.allreduce_cycles(spec, n, R, C, algo).total, S.sim_allreduce(spec, n, R, C, algo), f"{algo} n={n}")
    for n in (1, 100):
        _close(KC.broadcast_cycles(spec, n, R, C).total, S.sim_broadcast(spec, n, R, C), f"broadcast n={n}")


@pytest.mark.parametrize("R,C", [(4, 4), (8, 8)])
def test_spmv_elementwise_rows_model_vs_des(R, C):
    spec = fabric_from_name("wse2", pes=(R, C))
    rng = np.random.default_rng(0)
    for m, k, sp in [(64, 64, 0.9), (256, 256, 0.9), (128, 128, 0.5)]:
        W = random_sparse(m, k, sp, rng)
        _close(KM.spmv_cycles(spec, m, k, int((W != 0).sum()), R, C).total,
               S.sim_gemm(spec, m, k, 1, R, C, nnz_cols=S.nnz_columns(W, R, C)), f"spmv {m}x{k} {sp}")
    for n in (100, 4096):
        _close(K.elementwise_cycles(spec, n, R, C, 2).total, S.sim_elementwise(spec, n, R, C, 2), f"elementwise {n}")
    for tok, w in [(8, 64), (16, 1024)]:
        Rt, Ct = used(tok, R), used(w, C)
        tt, wt = -(-tok // Rt), -(-w // Ct)
        for rms in (False, True):
            _close(K.norm_cycles(spec, tok * w, w, R, C, rms=rms).total,
                   S.sim_row_program(spec, norm_phases(spec, tt, wt, rms, "fp32"), Rt, Ct), f"norm {tok}x{w}")
        _close(K.softmax_cycles(spec, tok * w, w, R, C).total,
               S.sim_row_program(spec, softmax_phases(spec, tt, wt, "fp32"), Rt, Ct), f"softmax {tok}x{w}")
    for H, d, T in [(8, 64, 128), (4, 128, 64)]:
        _close(K.attention_decode_cycles(spec, H, d, T, R, C).total, _sim_attention(spec, H, d, T, R, C),
               f"attention {H},{d},{T}")


def _sim_attention(spec, H: int, d: int, T: int, R: int, C: int, kv: int | None = None, mesh=None) -> int:
    """The event simulation of the layout the attention model charges."""
    phases, Rt, Ct, group = K.attention_decode_schedule(spec, H, d, T, R, C, n_kv_heads=kv, mesh=mesh)
    return S.sim_row_program(spec, phases, Rt, Ct, "fp16", mesh=mesh, group=group)


@pytest.mark.parametrize("rate,seed", [(0.01, 2), (0.05, 1), (0.05, 2), (0.1, 0)])
@pytest.mark.slow
def test_model_vs_des_with_defects(rate, seed):
    """Detoured routes, their contention on shared links and the smaller edge tiles: every kernel family that
    takes a mesh stays within 10% of the event simulation on defective meshes too."""
    spec = fabric_from_name("wse2", pes=(10, 10))
    mesh = Mesh.build(spec, rate, seed=seed)
    assert mesh.has_defects
    R, C = mesh.logical_rows, mesh.logical_cols
    rng = np.random.default_rng(seed)
    for m, k in [(64, 64), (256, 128)]:
        _close(KM.gemv_cycles(spec, m, k, R, C, mesh=mesh).total, S.sim_gemv(spec, m, k, R, C, mesh=mesh), "gemv")
    _close(KM.gemm_cycles(spec, 64, 64, 8, R, C, mesh=mesh).total, S.sim_gemm(spec, 64, 64, 8, R, C, mesh=mesh), "gemm")
    for m, k, sp in [(64, 64, 0.9), (256, 128, 0.5)]:
        W = random_sparse(m, k, sp, rng)
        _close(KM.spmv_cycles(spec, m, k, int((W != 0).sum()), R, C, mesh=mesh).total,
               S.sim_gemm(spec, m, k, 1, R, C, mesh=mesh, nnz_cols=S.nnz_columns(W, R, C)), f"spmv {m}x{k} {sp}")
    for algo in ("chain", "2d", "tree"):
        _close(KC.allreduce_cycles(spec, 64, R, C, algo, mesh=mesh).total,
               S.sim_allreduce(spec, 64, R, C, algo, mesh=mesh), algo)
    _close(KC.broadcast_cycles(spec, 64, R, C, mesh=mesh).total, S.sim_broadcast(spec, 64, R, C, mesh=mesh), "bcast")
    for tok, w in [(8, 64), (64, 256)]:  # row programs: detours may make rows' chains share a link
        Rt, Ct = used(tok, R), used(w, C)
        tt, wt = -(-tok // Rt), -(-w // Ct)
        _close(K.norm_cycles(spec, tok * w, w, R, C, mesh=mesh).total,
               S.sim_row_program(spec, norm_phases(spec, tt, wt, False, "fp32"), Rt, Ct, mesh=mesh), "norm")
        _close(K.softmax_cycles(spec, tok * w, w, R, C, mesh=mesh).total,
               S.sim_row_program(spec, softmax_phases(spec, tt, wt, "fp32"), Rt, Ct, mesh=mesh), "softmax")
    for H, kv, d, T in [(8, 2, 64, 512), (4, 1, 128, 1024), (4, 4, 32, 100)]:  # several rows per KV head
        _close(K.attention_decode_cycles(spec, H, d, T, R, C, n_kv_heads=kv, mesh=mesh).total,
               _sim_attention(spec, H, d, T, R, C, kv, mesh), f"attention {H}/{kv} ctx {T}")
    # detours cost: the defective mesh's latency terms are at least the perfect mesh's
    perfect = KM.gemv_cycles(spec, 64, 64, R, C)
    assert KM.gemv_cycles(spec, 64, 64, R, C, mesh=mesh).total >= perfect.total


def test_spmv_model_is_the_expectation():
    """SpMV work is random per PE: the model is the expected critical path, so it sits inside the spread of
    event simulations over many random matrices of the same density (not above all of them)."""
    spec = fabric_from_name("wse3", pes=(6, 5))
    des = [S.sim_gemm(spec, 64, 64, 1, 6, 5, nnz_cols=S.nnz_columns(random_sparse(64, 64, 0.9, np.random.default_rng(s)),
                                                                     6, 5)) for s in range(12)]
    model = KM.spmv_cycles(spec, 64, 64, round(64 * 64 * 0.1), 6, 5).total
    # (the simulations count whole cycles, the expectation need not be one: a cycle of slack at either end)
    assert min(des) - 1 <= model <= max(des) + 1 and abs(model - np.mean(des)) / np.mean(des) < 0.05


def test_big_region_detours_are_charged():
    """Regions over 64x64 PEs use per-link hop estimates; they still charge the detours (never below the
    perfect mesh) and agree with the exact routes on the same mesh to within a few hops."""
    spec = fabric_from_name("wse2", pes=(80, 80))
    mesh = Mesh.build(spec, 0.02, seed=1)
    R, C = mesh.logical_rows, mesh.logical_cols
    for axis in (0, 1):
        est = mesh.chain_hops(R, C, axis)
        exact = np.array([[mesh.hops((i, j + 1), (i, j)) if axis == 1 else mesh.hops((i, j), (i + 1, j))
                           for j in range(est.shape[1])] for i in range(est.shape[0])])
        assert (est >= 1).all() and abs(int(est.sum()) - int(exact.sum())) <= 0.02 * exact.sum()
    sub = mesh.subregion(10, 20, 30, 40)
    assert sub.logical_rows == 30 and sub.physical(0, 0) == mesh.physical(10, 20)
    for f in (lambda mm: KM.gemv_cycles(spec, 4096, 4096, R, C, mesh=mm),
              lambda mm: KC.allreduce_cycles(spec, 64, R, C, "2d", mesh=mm),
              lambda mm: KC.broadcast_cycles(spec, 64, R, C, mesh=mm)):
        assert f(mesh).total > f(None).total


def test_attention_gqa_kv_heads():
    """Grouped-query attention: the KV slice per PE follows the KV heads, not the query heads."""
    spec = fabric_from_name("wse2", pes=(8, 8))
    mha = K.attention_decode_cycles(spec, 32, 128, 128, 8, 8)
    assert K.attention_decode_cycles(spec, 32, 128, 128, 8, 8, n_kv_heads=32).total == mha.total
    with pytest.raises(ConfigError, match="KV cache slice"):
        K.attention_decode_cycles(spec, 32, 128, 512, 8, 8)  # 4 heads x 64 positions x 128 x K,V x 2 B = 128 KiB
    gqa = K.attention_decode_cycles(spec, 32, 128, 512, 8, 8, n_kv_heads=8)  # 1 KV head per row: 32 KiB, fits
    assert gqa.total > 0
    with pytest.raises(ConfigError, match="multiple"):
        K.attention_decode_cycles(spec, 32, 128, 512, 8, 8, n_kv_heads=5)
    for H, kv in [(8, 2), (8, 8), (4, 1)]:  # against the event simulation of the same row program
        _close(K.attention_decode_cycles(spec, H, 64, 128, 4, 4, n_kv_heads=kv).total,
               _sim_attention(spec, H, 64, 128, 4, 4, kv), f"attention gqa {H}/{kv}")


@pytest.mark.parametrize("target", ["wse2", "wse3"])
@pytest.mark.parametrize("R,C", [(4, 4), (8, 8), (12, 6), (16, 8)])
@pytest.mark.slow
def test_attention_rows_per_head_model_vs_des(target, R, C):
    """Each KV head's context over several rows (q down column 0 and along the rows, row merge chains, then a
    merge chain up column 0): the model of the layout it picks stays within 10% of the event simulation."""
    spec = fabric_from_name(target, pes=(R, C))
    groups = set()
    for H, kv, d, T in [(8, 2, 64, 512), (8, 8, 64, 128), (16, 2, 32, 2000), (8, 4, 64, 300), (2, 1, 64, 4096)]:
        if 2 * (T // (R * C // kv)) * d * 2 > spec.sram_bytes_per_pe:
            continue  # even every row of the region holds too much of this cache
        group = K.attention_decode_schedule(spec, H, d, T, R, C, n_kv_heads=kv)[3]
        groups.add(group)
        _close(K.attention_decode_cycles(spec, H, d, T, R, C, n_kv_heads=kv).total,
               _sim_attention(spec, H, d, T, R, C, kv), f"attention {H}/{kv} x{d} ctx {T}: {group} rows per head")
    assert max(groups) > 1


def test_attention_spreads_over_all_rows():
    """rows == n_kv: one row per KV head, the row program as before; more rows: the cache spreads over them,
    which is faster at long contexts and moves the SRAM refusal to contexts rows // n_kv times longer."""
    spec = fabric_from_name("wse2", pes=(64, 64))
    one_row = {}
    for C, T in [(64, 4096), (50, 300)]:
        Ct = used(T, C)
        one_row[T] = K.row_program_cycles(spec, attention_phases(spec, 4, -(-T // Ct), 128, "fp16"), 8, Ct, "fp16")
        assert K.attention_decode_cycles(spec, 32, 128, T, 8, C, n_kv_heads=8) == one_row[T]
        assert K.attention_decode_schedule(spec, 32, 128, T, 8, C, n_kv_heads=8)[1:] == (8, Ct, 1)
        assert K.attention_decode_cycles(spec, 32, 128, T, 64, C, n_kv_heads=8).total <= one_row[T].total
    assert K.attention_decode_schedule(spec, 32, 128, 4096, 64, 64, n_kv_heads=8)[1:] == (64, 64, 8)
    assert K.attention_decode_cycles(spec, 32, 128, 4096, 64, 64, n_kv_heads=8).total < 0.3 * one_row[4096].total
    with pytest.raises(ConfigError, match="KV cache slice"):  # 2 x 512 positions x 128 x 2 B = 256 KiB per PE
        K.attention_decode_cycles(spec, 32, 128, 32768, 8, 64, n_kv_heads=8)
    assert K.attention_decode_cycles(spec, 32, 128, 32768, 64, 64, n_kv_heads=8).total > 0  # 64 positions: 32 KiB


def test_des_is_a_real_simulation():
    """The event simulation moves every wavelet: its event count grows with the data, and link contention
    (a tree root's fan-in) shows up as time the latency alone does not explain."""
    spec = fabric_from_name("wse2", pes=(8, 8))
    sim = S.EventSim(spec, None, 8, 8)
    tree = S.broadcast_tree(sim, 8, 8)
    for w in range(50):
        sim.send(0, (0, 0), tree, lambda t, pe, w: None, w)
    assert sim.run() == 50 - 1 + 2 * 2 + 14 and sim.events > 50 * 64  # one event per wavelet per hop at least
    assert S.sim_allreduce(spec, 256, 8, 8, "tree") > 5 * S.sim_allreduce(spec, 1, 8, 8, "tree")
    assert S.sim_allreduce(spec, 256, 8, 8, "chain") < S.sim_allreduce(spec, 256, 8, 8, "tree")  # bandwidth
    assert S.sim_allreduce(spec, 1, 8, 8, "chain") > S.sim_allreduce(spec, 1, 8, 8, "tree")  # latency


def test_cycles_contract():
    spec = fabric_from_name("wse2")
    c = KM.gemv_cycles(spec, 4096, 4096, 994, 750)
    assert c.bottleneck in K.BOTTLENECKS and c.total > 0
    assert c.seconds(spec) == pytest.approx(c.total / 1.1e9)
    big = KM.gemm_cycles(fabric_from_name("wse2", pes=(8, 8)), 256, 256, 64, 8, 8)
    assert big.bottleneck in ("compute", "SRAM")  # many streamed vectors: the PEs are the limit
    assert KC.allreduce_cycles(spec, 16, 994, 750, "tree").bottleneck == "routing"  # 20 levels > 18 colors
    assert (c + c).total == 2 * c.total
    for f in (K.norm_cycles(spec, 4096 * 8, 4096, 64, 64), K.softmax_cycles(spec, 1024 * 4, 1024, 64, 64),
              K.attention_decode_cycles(spec, 32, 128, 4096, 32, 256), K.elementwise_cycles(spec, 1 << 20, 64, 64),
              KC.broadcast_cycles(spec, 4096, 64, 64), KM.spmv_cycles(spec, 4096, 4096, 1 << 20, 512, 512)):
        assert f.total > 0 and f.bottleneck in K.BOTTLENECKS


def test_cost_bad_input():
    with pytest.raises(ConfigError):
        KM.gemv_cycles(fabric_from_name("wse2", pes=(8, 8)), 64, 64, 9, 8)
    with pytest.raises(ConfigError):
        KC.allreduce_cycles(fabric_from_name("wse2", pes=(8, 8)), 64, 8, 8, "ring")
