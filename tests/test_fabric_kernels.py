"""Every kernel's functional tile-level execution equals numpy, on small meshes, with and without defects."""

from __future__ import annotations

import numpy as np
import pytest

from waferscale.errors import ConfigError
from waferscale.fabric import kernels as K
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.presets import fabric_from_name

SPEC = fabric_from_name("wse2", pes=(8, 8))
MESHES = {"perfect": Mesh.build(SPEC), "defects": Mesh.build(SPEC, 0.08, seed=4)}
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(params=list(MESHES))
def mesh(request) -> Mesh:
    return MESHES[request.param]


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _on_live_cores(mesh: Mesh, run: K.TileRun) -> None:
    """Data lived on / passed through live cores only, and crossed no dead link."""
    assert not any(mesh.dead_cores[p] for p in run.touched)
    for a, b in run.link_wavelets:
        assert mesh.link_ok(a, b)


def test_defect_mesh_has_defects():
    m = MESHES["defects"]
    assert m.n_dead_cores > 0 and m.n_dead_links > 0 and m.usable_pes < 64


@pytest.mark.parametrize("m,k", [(64, 64), (37, 50), (8, 200), (3, 5)])
def test_gemv(mesh, m, k):
    r = _rng(m * k)
    W, x = r.standard_normal((m, k)).astype(np.float32), r.standard_normal(k).astype(np.float32)
    run = K.gemv(mesh, W, x)
    np.testing.assert_allclose(run.out, W.astype(np.float64) @ x, **TOL)
    _on_live_cores(mesh, run)
    assert run.max_link_wavelets > 0 and run.sram_bytes_per_pe <= SPEC.sram_bytes_per_pe


def test_gemv_really_moves_partials_hop_by_hop():
    mesh = MESHES["perfect"]
    run = K.gemv(mesh, np.ones((64, 64), np.float32), np.ones(64, np.float32))
    # the East->West chain: each row link carries the 8 partials of its row once
    assert run.link_wavelets[((0, 7), (0, 6))] == 8 and run.link_wavelets[((0, 1), (0, 0))] == 8
    # x goes down columns: 8 values per link
    assert run.link_wavelets[((0, 3), (1, 3))] == 8


def test_gemv_on_8x8_is_vectorized_over_pes(monkeypatch):
    """What keeps the functional execution fast, counted instead of timed: data moves as whole slices, one
    `Tiles.move` per hop of the x multicast down the columns and of the East->West partial-sum chain
    ((R - 1) + (C - 1) moves), each routing one path per PE of the slice — counts that do not grow with the
    tile size (no per-value Python loop)."""
    moves = []  # PEs (routes looked up) per call of Tiles.move
    move = K.Tiles.move
    monkeypatch.setattr(K.Tiles, "move", lambda self, data, src, dst: (moves.append(len(src)),
                                                                       move(self, data, src, dst))[1])
    r = _rng()
    for m, k in [(64, 64), (512, 512)]:  # 8x8 and 64x64 values per PE
        moves.clear()
        W, x = r.standard_normal((m, k)).astype(np.float32), r.standard_normal(k).astype(np.float32)
        run = K.gemv(MESHES["perfect"], W, x)
        np.testing.assert_allclose(run.out, W.astype(np.float64) @ x, **TOL)
        assert (run.rows, run.cols) == (8, 8)
        assert moves == [8] * (7 + 7), (m, k, moves)


def test_gemm(mesh):
    r = _rng(1)
    W, X = r.standard_normal((48, 40)).astype(np.float32), r.standard_normal((40, 6)).astype(np.float32)
    run = K.gemm(mesh, W, X)
    np.testing.assert_allclose(run.out, W.astype(np.float64) @ X, **TOL)
    _on_live_cores(mesh, run)


@pytest.mark.parametrize("sparsity", [0.0, 0.9, 0.99])
def test_spmv(mesh, sparsity):
    r = _rng(2)
    W = K.random_sparse(70, 90, sparsity, r)
    x = r.standard_normal(90).astype(np.float32)
    run = K.spmv(mesh, W, x)
    np.testing.assert_allclose(run.out, W.astype(np.float64) @ x, **TOL)
    _on_live_cores(mesh, run)


@pytest.mark.parametrize("algo", K.ALGOS)
def test_reduce_allreduce(mesh, algo):
    R, C = mesh.logical_rows, mesh.logical_cols
    data = _rng(3).standard_normal((R, C, 13)).astype(np.float32)
    ref = data.astype(np.float64).sum((0, 1))
    np.testing.assert_allclose(K.reduce(mesh, data, algo).out, ref, **TOL)
    run = K.allreduce(mesh, data, algo)
    np.testing.assert_allclose(run.out, np.broadcast_to(ref, run.out.shape), **TOL)
    _on_live_cores(mesh, run)


def test_broadcast(mesh):
    v = _rng(4).standard_normal(17).astype(np.float32)
    run = K.broadcast(mesh, v, 5, 4)
    assert run.out.shape == (5, 4, 17)
    np.testing.assert_array_equal(run.out, np.broadcast_to(v, run.out.shape))


@pytest.mark.parametrize("op", list(K.ELEMENTWISE_OPS))
def test_elementwise(mesh, op):
    r = _rng(5)
    x, y = r.standard_normal(300).astype(np.float32), r.standard_normal(300).astype(np.float32)
    np.testing.assert_allclose(K.elementwise(mesh, op, x, y).out, K.ELEMENTWISE_OPS[op](x, y), **TOL)


@pytest.mark.parametrize("shape", [(10, 37), (3, 64), (20, 5)])
def test_norms_and_softmax(mesh, shape):
    r = _rng(6)
    X = r.standard_normal(shape).astype(np.float32) * 3
    g, b = r.standard_normal(shape[1]).astype(np.float32), r.standard_normal(shape[1]).astype(np.float32)
    Xd = X.astype(np.float64)
    mu, var = Xd.mean(-1, keepdims=True), Xd.var(-1, keepdims=True)
    np.testing.assert_allclose(K.layernorm(mesh, X, g, b).out, (Xd - mu) / np.sqrt(var + 1e-5) * g + b, **TOL)
    np.testing.assert_allclose(K.rmsnorm(mesh, X, g).out, Xd / np.sqrt((Xd ** 2).mean(-1, keepdims=True) + 1e-6) * g,
                               **TOL)
    e = np.exp(Xd - Xd.max(-1, keepdims=True))
    np.testing.assert_allclose(K.softmax(mesh, X).out, e / e.sum(-1, keepdims=True), **TOL)


@pytest.mark.parametrize("H,d,T", [(6, 16, 45), (8, 32, 128), (1, 8, 3)])
def test_attention_decode(mesh, H, d, T):
    r = _rng(7)
    q, Kc, Vc = (r.standard_normal(s).astype(np.float32) for s in ((H, d), (T, H, d), (T, H, d)))
    run = K.attention_decode(mesh, q * 2, Kc, Vc)
    np.testing.assert_allclose(run.out, K.attention_reference(q.astype(np.float64) * 2, Kc, Vc), **TOL)
    _on_live_cores(mesh, run)


def test_sram_overflow_is_config_error():
    tiny = Mesh.build(fabric_from_name("wse2", pes=(2, 2)))
    W = np.ones((512, 512), np.float32)  # 256x256 fp32 tiles = 256 KiB per PE > 48 KiB
    with pytest.raises(ConfigError, match="mesh too small"):
        K.gemv(tiny, W, np.ones(512, np.float32))


def test_kernel_bad_input():
    mesh = MESHES["perfect"]
    with pytest.raises(ConfigError):
        K.gemv(mesh, np.ones((4, 5)), np.ones(6))
    with pytest.raises(ConfigError):
        K.gemv(mesh, np.ones((0, 5)), np.ones(5))
    with pytest.raises(ConfigError):
        K.allreduce(mesh, np.ones((8, 8, 3)), "ring")
    with pytest.raises(ConfigError):
        K.elementwise(mesh, "tan", np.ones(3))
    with pytest.raises(ConfigError):
        K.gemv(mesh, np.ones((4, 4)), np.ones(4), rows=9)


@pytest.mark.parametrize("H,kv", [(8, 2), (4, 1), (6, 3)])
def test_attention_decode_gqa(H, kv):
    """Grouped-query attention: K, V hold kv heads, each shared by H/kv query heads; KV stored once per PE."""
    mesh = Mesh.perfect(fabric_from_name("wse2", pes=(4, 4)))
    rng = np.random.default_rng(H * 10 + kv)
    q = rng.standard_normal((H, 16)).astype(np.float32)
    Kc, Vc = (rng.standard_normal((40, kv, 16)).astype(np.float32) for _ in range(2))
    run = K.attention_decode(mesh, q, Kc, Vc)
    np.testing.assert_allclose(run.out, K.attention_reference(q.astype(np.float64), Kc, Vc), rtol=1e-4, atol=1e-5)
    assert run.rows == 4 // kv * kv  # every KV head gets 4 // kv rows of the region
    if kv > 1:
        with pytest.raises(ConfigError, match="multiple"):
            K.attention_decode(mesh, np.concatenate([q, q[:1]]), Kc, Vc)  # H + 1 query heads, kv does not divide


@pytest.mark.parametrize("H,kv,T", [(8, 2, 200), (4, 1, 1000), (2, 1, 70), (6, 3, 40)])
def test_attention_decode_rows_per_head(mesh, H, kv, T):
    """A KV head's context spread over several rows (row chains into column 0, then a chain up column 0 into
    the head's first row) equals numpy softmax attention for every rows_per_head, padding PEs included."""
    rng = np.random.default_rng(T)
    q = rng.standard_normal((H, 16)).astype(np.float32)
    Kc, Vc = (rng.standard_normal((T, kv, 16)).astype(np.float32) for _ in range(2))
    ref = K.attention_reference(q.astype(np.float64), Kc, Vc)
    for rph in range(1, mesh.logical_rows // kv + 1):
        run = K.attention_decode(mesh, q, Kc, Vc, rows_per_head=rph)
        np.testing.assert_allclose(run.out, ref, **TOL)
        _on_live_cores(mesh, run)
        ct = -(-T // (rph * run.cols))  # positions per PE
        assert run.rows == kv * -(-T // (ct * run.cols)) and run.sram_bytes_per_pe >= 2 * ct * 16 * 4
    with pytest.raises(ConfigError, match="rows_per_head"):
        K.attention_decode(mesh, q, Kc, Vc, rows_per_head=mesh.logical_rows // kv + 1)


def test_attention_decode_merges_up_column_0():
    """Two rows per head: the partials of row 1 reach row 0 over column 0's link, q comes down it first."""
    mesh = MESHES["perfect"]
    rng = np.random.default_rng(3)
    q, Kc, Vc = rng.standard_normal((2, 8)), rng.standard_normal((64, 1, 8)), rng.standard_normal((64, 1, 8))
    run = K.attention_decode(mesh, q, Kc, Vc, rows_per_head=2)
    assert run.rows == 2 and run.cols == 8
    assert run.link_wavelets[((1, 0), (0, 0))] == 2 * (8 + 2)  # (m, l, o) of 2 query heads, up column 0
    assert run.link_wavelets[((0, 0), (1, 0))] == 2 * 8  # q down column 0
    assert ((2, 0), (1, 0)) not in run.link_wavelets  # the head has no third row
