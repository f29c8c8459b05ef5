"""Presets, the defect map, spare remapping and routing around defects."""

from __future__ import annotations

import json

import numpy as np
import pytest

from waferscale.errors import ConfigError
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.presets import PRESETS, fabric_from_name, parse_pes


def test_presets_numbers():
    w2, w3 = PRESETS["wse2"], PRESETS["wse3"]
    assert (w2.rows, w2.cols) == (994, 750) and w2.pes == 745_500
    assert w2.sram_bytes_per_pe == 48 * 1024 and w2.fp16_flops_per_cycle_per_pe == 8
    assert w3.fp16_flops_per_cycle_per_pe == 16 and w2.fp32_flops_per_cycle_per_pe == 2
    assert w2.link_bytes_per_cycle == 4 and w2.hop_latency_cycles == 1 and w2.ramp_latency_cycles == 2
    assert w2.colors == 18
    # WSE.md quotes ~7.5 PF for 850k marketing cores; the 745,500-PE program rectangle gives 6.56 PF
    assert w2.peak_flops() == pytest.approx(745_500 * 8 * 1.1e9)
    s = fabric_from_name("wse2", pes=parse_pes("8x8"), clock_hz=850e6)
    assert (s.rows, s.cols, s.clock_hz) == (8, 8, 850e6)


def test_perfect_mesh_is_identity():
    m = Mesh.build(fabric_from_name("wse2", pes=(6, 7)))
    assert (m.logical_rows, m.logical_cols, m.usable_pes) == (6, 7, 42)
    assert m.physical(3, 4) == (3, 4)
    assert m.route((0, 0), (2, 3)) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 3), (2, 3)]  # XY
    assert m.hops((0, 0), (2, 3)) == 5


def test_random_defects_rate_and_seed():
    spec = fabric_from_name("wse2", pes=(100, 100))
    a, b = Mesh.build(spec, 0.05, seed=7), Mesh.build(spec, 0.05, seed=7)
    assert np.array_equal(a.dead_cores, b.dead_cores) and np.array_equal(a.dead_east, b.dead_east)
    assert 0.04 < a.dead_cores.mean() < 0.06
    c = Mesh.build(spec, 0.05, seed=8)
    assert not np.array_equal(a.dead_cores, c.dead_cores)
    assert a.usable_pes < spec.pes


def test_clustered_defects_are_blobs():
    spec = fabric_from_name("wse2", pes=(60, 60))
    m = Mesh.build(spec, 0.05, seed=1, clustered=True, n_clusters=2)
    assert m.n_dead_cores == round(0.05 * 3600)
    # blobs: most dead cores have a dead neighbour (random scatter at 5% would give ~19%)
    d = m.dead_cores
    nb = np.zeros_like(d)
    nb[1:] |= d[:-1]; nb[:-1] |= d[1:]; nb[:, 1:] |= d[:, :-1]; nb[:, :-1] |= d[:, 1:]
    assert (d & nb).sum() / d.sum() > 0.7


def test_defect_file_round_trip(tmp_path):
    spec = fabric_from_name("wse2", pes=(12, 12))
    m = Mesh.build(spec, 0.08, seed=3)
    path = m.save_defects(tmp_path / "defects.json")
    m2 = Mesh.build(spec, defect_file=path)
    for a in ("dead_cores", "dead_east", "dead_south", "phys_rows", "phys_cols"):
        assert np.array_equal(getattr(m, a), getattr(m2, a)), a
    # a hand-written file in the documented format
    (tmp_path / "h.json").write_text(json.dumps({"format": "waferscale-defects/1", "rows": 12, "cols": 12,
                                                 "dead_cores": [[2, 3]], "dead_links": [[5, 5, "W"], [0, 0, "S"]]}))
    h = Mesh.build(spec, defect_file=tmp_path / "h.json")
    assert h.n_dead_cores == 1 and h.dead_east[5, 4] and h.dead_south[0, 0]


def test_logical_mesh_perfect_and_nothing_on_dead_cores():
    spec = fabric_from_name("wse2", pes=(16, 16))
    for seed in range(4):
        m = Mesh.build(spec, 0.06, seed=seed)
        pr, pc = m.physical_grid()
        assert not m.dead_cores[pr, pc].any()  # nothing placed on a dead core
        assert len(set(zip(pr.ravel().tolist(), pc.ravel().tolist()))) == m.usable_pes  # one-to-one
        assert np.all(np.diff(pc, axis=1) > 0) and np.all(np.diff(m.phys_rows) > 0)  # order preserved
        assert m.usable_pes == m.logical_rows * m.logical_cols


def test_spares_explicit():
    spec = fabric_from_name("wse2", pes=(10, 10))
    m = Mesh.build(spec, 0.03, seed=2, spare_rows=2, spare_cols=2)
    assert m.logical_cols == 8 and m.logical_rows <= 8


def test_routes_avoid_dead_cores_and_links():
    spec = fabric_from_name("wse2", pes=(12, 12))
    m = Mesh.build(spec, 0.1, seed=5)
    assert m.n_dead_links > 0 and m.n_dead_cores > 0
    rng = np.random.default_rng(0)
    detoured = 0
    for _ in range(200):
        a = tuple(int(v) for v in rng.integers(0, [m.logical_rows, m.logical_cols]))
        b = tuple(int(v) for v in rng.integers(0, [m.logical_rows, m.logical_cols]))
        path = m.route(a, b)
        assert path[0] == m.physical(*a) and path[-1] == m.physical(*b)
        assert all(m.link_ok(p, q) for p, q in zip(path, path[1:]))
        assert not any(m.dead_cores[p] for p in path)
        manhattan = abs(path[0][0] - path[-1][0]) + abs(path[0][1] - path[-1][1])
        detoured += m.hops(a, b) > manhattan
    assert detoured > 0  # some routes really went around something


def test_bad_input():
    spec = fabric_from_name("wse2", pes=(8, 8))
    for rate in (-0.1, 1.0, 1.5):
        with pytest.raises(ConfigError):
            Mesh.build(spec, rate)
    with pytest.raises(ConfigError):
        Mesh.build(spec, spare_cols=8)
    with pytest.raises(ConfigError):
        Mesh.build(spec).physical(8, 0)
    with pytest.raises(ConfigError):
        Mesh.build(spec).check_region(0, 4)
    with pytest.raises(ConfigError):
        fabric_from_name("wse9")
    with pytest.raises(ConfigError):
        parse_pes("0x8")
