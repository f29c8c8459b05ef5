"""Placement: rectangles never overlap, stay on live cores, honour memory, and snake (next stage one hop away)."""

import numpy as np
import pytest

from waferscale.compiler import compile_model
from waferscale.compiler._fabric import wafer_map
from waferscale.compiler.placement import Rect, snake, split_contiguous as _partition
from waferscale.compiler.strategy import data_bytes_per_pe
from waferscale.fabric.presets import fabric_from_name


def _check(plan):
    spec = fabric_from_name("wse3", pes=(plan.fabric["rows"], plan.fabric["cols"]))
    for w in plan.wafers:
        wm = wafer_map(spec, w["defect_rate"], w["seed"])
        regs = [r for r in plan.regions if r.system == w["system"]]
        rects = [Rect(r.row, r.col, r.rows, r.cols) for r in regs]
        for i, a in enumerate(rects):  # never overlap, inside the logical mesh
            assert 0 <= a.row and a.row + a.rows <= wm.rows and 0 <= a.col and a.col + a.cols <= wm.cols
            assert not any(a.overlaps(b) for b in rects[i + 1:])
        for r in regs:  # memory fits in the live PEs; no tile on a dead core
            assert r.bytes <= r.live_pes * data_bytes_per_pe(spec)
            pr = wm.mesh.phys_rows[r.row:r.row + r.rows]
            pc = wm.mesh.phys_cols[r.row:r.row + r.rows, r.col:r.col + r.cols]
            assert not np.asarray(wm.mesh.dead_cores)[pr[:, None], pc].any()
    for rep in {r.replica for r in plan.regions}:  # snake: consecutive stages on one wafer share an edge
        pipe = sorted((r for r in plan.regions if r.replica == rep), key=lambda r: r.stage)
        for a, b in zip(pipe, pipe[1:]):
            if a.system == b.system:
                assert Rect(a.row, a.col, a.rows, a.cols).touches(Rect(b.row, b.col, b.rows, b.cols)), (a, b)


@pytest.mark.parametrize("kw", [
    dict(model="gpt-mini", pes=(64, 64)),
    dict(model="llama-tiny", pes=(48, 40), defects=0.03, seed=2),
    dict(model="gpt-tiny", pes=(16, 16), defects=0.05, seed=5, systems=2),
    dict(model="gpt-mini", pes=(64, 64), mode="train", batch_size=4, seq_len=64),
])
def test_regions_valid(kw):
    plan = compile_model(**kw)
    assert plan.regions
    _check(plan)


def test_defects_reduce_usable_pes_and_are_reported():
    p = compile_model(model="llama-tiny", pes=(48, 40), defects=0.03, seed=2)
    assert p.wafers[0]["dead_pes"] > 0 and p.wafers[0]["usable_pes"] < 48 * 40
    assert "dead" in p.explain()


def test_snake_unit_cases():
    box = Rect(0, 0, 20, 30)
    rects = snake([50, 60, 70, 80, 90, 40], box)
    assert rects is not None and len(rects) == 6
    for a, b in zip(rects, rects[1:]):
        assert a.touches(b)
    assert all(r.area >= n for r, n in zip(rects, [50, 60, 70, 80, 90, 40]))
    assert snake([700], box) is None  # more than the box holds
    assert _partition([5, 5, 5], 2, 10) == [(0, 2), (2, 3)] or _partition([5, 5, 5], 2, 10) == [(0, 1), (1, 3)]
