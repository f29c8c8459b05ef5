"""bench/fidelity.py: the table of published measurements is complete, a row runs through the compiler, the
outputs are written atomically, and bad input exits 2 with a message."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wsc

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fid():
    return _load("fidelity")


def test_table_rows_sources_and_conditions(fid):
    t = sys.modules["fidelity_table"]
    rows = t.ROWS
    assert len(rows) >= 12
    assert len({r.source for r in rows}) >= 3
    assert len({r.id for r in rows}) == len(rows), "row ids must be unique"
    for r in rows:
        src = t.SOURCES[r.source]
        assert src.title and src.venue and src.url.startswith("http") and src.via, r.id
        for f in ("where", "date", "quantity", "unit", *t.CONDITIONS):
            assert isinstance(getattr(r, f), str) and getattr(r, f).strip(), f"{r.id}: condition {f!r} is empty"
        assert r.value > 0, r.id
        assert r.projection in fid.PROJECTORS, r.id
        fields = {f.name for f in dataclasses.fields(t.Row)}
        assert set(t.CONDITIONS) <= fields


def test_a_waferllm_row_runs_through_the_compiler(fid):
    row = next(r for r in fid.ROWS if r.id == "WL-DEC-72B-420")
    res = fid.run_row(row)
    assert res["projected"] > 0 and "not_reached" not in res
    assert res["layout_chosen"] == "model_parallel 420x420"
    assert res["parts_unit"] == "share" and "fabric latency" in res["parts"]
    assert set(res["parts"]) <= {"compute", "SRAM", "fabric latency", "routing", "I/O"}
    assert "4 layers compiled x 20" in res["detail"]
    # their method scales a few layers to all 80 ("uniform layer structure"): 8 layers compiled agree
    plan, g, blocks, scale, _ = fid._waferllm_plan(row.args["model"], 420, 8, None)
    assert 1 / (scale * sum(plan.projection["unit_times_s"][i] for i in blocks)) == pytest.approx(res["projected"],
                                                                                                   rel=0.01)


def test_waferllm_graph_pads_like_their_config(fid):
    # their llama8B_4k_1_420.json: dim 4200, ffn_dim 14700, seq_len 4200, n_heads 1, n_kv_heads 1
    g, ctx, n_layers = fid.waferllm_graph("llama3-8b", 420, 1)
    block = next(u for u in g.units if u.kind == "block")
    assert (ctx, n_layers, block.d_in, block.n_heads, block.kv_heads, block.head_dim) == (4200, 32, 4200, 1, 1, 4200)
    assert sorted(mm.m for mm in block.matmuls)[-1] == 2 * 14700  # gate and up fused


def test_a_refused_row_is_not_reached_with_its_reason(fid):
    row = next(r for r in fid.ROWS if r.id == "CS-70B")
    res = fid.run_row(dataclasses.replace(row, args=dict(row.args, systems=1)))
    assert res["projected"] is None and res["error"] is None
    assert "systems" in res["not_reached"]
    s = fid.summarize([res])
    assert (s["reached"], s["not_reached"], s["within_band"]) == (0, 1, 0)
    assert "not reached:" in fid.table([res], s) and "| - | - | not reached:" in fid.markdown([res], s)


def test_out_files_written_atomically(fid, tmp_path, capsys):
    out = tmp_path / "fid"
    assert fid.main(["--only", "SC20-AR", "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["fidelity.json", "fidelity.png"]  # no temporary file left
    data = json.loads((out / "fidelity.json").read_text())
    assert [r["id"] for r in data["rows"]] == ["SC20-AR"] and data["summary"]["reached"] == 1
    assert (out / "fidelity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "SC20-AR" in capsys.readouterr().out


def test_bad_out_exits_2_with_a_message(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    src = str(BENCH.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(BENCH / "fidelity.py"), "--out", str(blocker / "sub")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2
    assert "--out" in p.stderr and "cannot create the directory" in p.stderr
    assert "Traceback" not in p.stderr


def test_unknown_row_id_exits_2(fid, capsys):
    assert fid.main(["--only", "NOPE"]) == 2
    assert "unknown row id(s) NOPE" in capsys.readouterr().err


def test_markdown_table_has_every_row(fid, capsys):
    assert fid.main(["--only", "SC20-AR", "--markdown"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("| row | role | source |") and "| SC20-AR | calibrate |" in text


def test_every_row_has_a_role_kernels_calibrate_and_the_rest_validate_or_bound(fid):
    t = sys.modules["fidelity_table"]
    roles = {r.id: r.role for r in t.ROWS}
    assert set(roles.values()) == set(t.ROLES)
    for r in t.ROWS:  # calibration rows are kernel-level (one kernel, one collective, one GEMM); never a system
        assert (r.role == "calibrate") == (r.projection in ("gemv", "allreduce", "sgemm")), r.id
        if r.role == "bound":  # a public service's figure that includes what the compiler does not model
            assert r.unit == "s" and r.projection == "zoo", r.id
    assert sum(role == "validate" for role in roles.values()) >= 24


def test_summary_keeps_calibration_validation_and_bounds_apart(fid):
    by_id = {r.id: r for r in fid.ROWS}
    res = [fid.run_row(by_id[i]) for i in ("SC20-AR", "WL-GEMV-16K", "AA-70B-TTFT")]
    bound = res[2]
    assert bound["error"] is None and bound["projected"] > 0 and bound["bound_ok"] is (bound["projected"] <= 0.17)
    s = fid.summarize(res)
    assert (s["calibrate"]["reached"], s["validate"]["rows"], s["bounds"]["rows"]) == (2, 0, 1)
    assert s["reached"] == 2  # the bound is outside the error statistics
    assert set(s["per_source"]) == {"calibrate SC20", "calibrate WaferLLM"}
    text = fid.table(res, s)
    assert "calibration rows (the fit's residuals): 2 of 2 projected" in text and "bounds" in text


def test_assume_reaches_a_kernel_row(fid):
    row = next(r for r in fid.ROWS if r.id == "WL-GEMV-16K")
    base = fid.run_row(row, assume={"vector_op_cycles": 0, "task_overhead_cycles": 0})["projected"]
    slower = fid.run_row(row, assume={"vector_op_cycles": 16, "task_overhead_cycles": 0})["projected"]
    assert slower > base


def test_calibrate_fit_finds_the_least_squares_point_of_its_grid():
    cal = _load("calibrate")
    target = {"task_overhead_cycles": 3, "vector_op_cycles": 17, "fp32_fmac_sustained_fraction": 0.42}

    def residual_fn(rows, v):  # a synthetic objective with its minimum at `target`, on the grid
        return {k: (v[k] - target[k]) / (40 if k != "fp32_fmac_sustained_fraction" else 1) for k in v}

    values, sse = cal.fit([], log=lambda *_: None, residual_fn=residual_fn)
    assert values == target and sse == pytest.approx(0)


@pytest.mark.slow
def test_waferllm_params_files_are_current_and_reproduce_a_row_from_the_cli(fid, tmp_path):
    for r in fid.ROWS:  # the files the rows' printed commands name
        if r.projection.startswith("waferllm_"):
            path = fid.waferllm_params_path(r.args["model"], r.args["side"])
            assert path.read_text() == fid.waferllm_params_yaml(r.args["model"], r.args["side"], r.args.get("layers")), \
                f"{path} is stale: python bench/fidelity.py --write-waferllm-params"
    row = next(r for r in fid.ROWS if r.id == "WL-DEC-8B-660")
    res = fid.run_row(row)
    cmd = res["detail"].split("reproduce: ")[1].split(" (")[0].replace("DIR", str(tmp_path / "plan")).split()
    assert cmd[:2] == ["wsc", "compile"]
    p = wsc(*cmd[1:], cwd=Path(__file__).resolve().parents[1])  # the real CLI, from the repository's root
    assert p.returncode == 0, p.stderr
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    blocks = [i for i, u in enumerate(plan["graph"]["units"]) if u["kind"] == "block"]
    per_token = sum(plan["projection"]["unit_times_s"][i] for i in blocks)
    assert len(blocks) == 32 and 1 / per_token == pytest.approx(res["projected"], rel=1e-9)
