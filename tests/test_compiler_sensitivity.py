"""The unpublished hardware assumptions (fabric/assumptions.py) and `wsc compile --sensitivity`."""

from __future__ import annotations

import json

import pytest

from conftest import wsc_main
from waferscale.compiler.api import plan_summary
from waferscale.compiler.capture import capture_zoo
from waferscale.compiler.compile import compile_model
from waferscale.compiler.sensitivity import sensitivity
from waferscale.errors import ConfigError
from waferscale.fabric import assumptions as hw
from waferscale.fabric.presets import PRESETS, fabric_from_name
from waferscale.fabric.spec import MAY_BE_ZERO


@pytest.fixture(scope="module")
def mini():
    return capture_zoo("gpt-mini")


def test_every_generation_lists_its_unpublished_assumptions_as_spec_fields():
    for key, spec in PRESETS.items():
        names = [a.name for a in hw.unpublished(key)]
        assert len(names) == len(set(names)) and "program_reserve_bytes_per_pe" in names
        assert ("clock_hz" in names) == (key != "wse2")  # WSE-2's clock is published (presets.py), the others not
        for a in hw.unpublished(key):  # the PE's calibrated fixed costs may be 0 (fabric/spec.py)
            assert (a.value(spec) >= 0 if a.name in MAY_BE_ZERO else a.value(spec) > 0) and a.unit and a.source
    assert "io_bytes_per_s" in [a.name for a in hw.unpublished("wse1")]  # published for CS-2/CS-3 only
    assert "io_bytes_per_s" not in [a.name for a in hw.unpublished("WSE-3")]


def test_apply_changes_one_field_and_rounds_counts():
    spec = fabric_from_name("wse3")
    s2 = hw.apply(spec, "wse3", {"program_reserve_bytes_per_pe": 6144 * 1.1, "clock_hz": 0.9e9})
    assert s2.program_reserve_bytes_per_pe == 6758 and s2.clock_hz == 0.9e9
    assert s2.sram_bytes_per_pe == spec.sram_bytes_per_pe and s2.exp_ops == spec.exp_ops
    with pytest.raises(ConfigError, match="not an unpublished assumption of wse2"):
        hw.apply(fabric_from_name("wse2"), "wse2", {"sram_read_bytes_per_cycle": 20})  # published for WSE-2
    with pytest.raises(ConfigError, match="positive"):
        hw.apply(spec, "wse3", {"exp_ops": 0})
    with pytest.raises(ConfigError, match="no SRAM for data"):
        hw.apply(spec, "wse3", {"program_reserve_bytes_per_pe": 48 * 1024})
    assert hw.parse_assume(["clock_hz=8.5e8", " exp_ops=10"]) == {"clock_hz": 8.5e8, "exp_ops": 10.0}
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        hw.parse_assume(["clock_hz"])


def test_a_changed_assumption_reaches_the_plan(mini):
    base = compile_model(graph=mini, pes=(16, 16))
    more = compile_model(graph=mini, pes=(16, 16), assume={"exp_ops": 16})
    assert more.fabric["exp_ops"] == 16 and more.assumptions["unpublished"]["exp_ops"]["value"] == 16
    assert more.projection["time_to_first_token_s"] > base.projection["time_to_first_token_s"]  # softmax costs more
    with pytest.raises(ConfigError, match="given twice"):
        compile_model(graph=mini, pes=(16, 16), clock_hz=1e9, assume={"clock_hz": 0.9e9})


def test_clock_moves_a_cycle_bound_decode_by_ten_percent(mini):
    req = dict(graph=mini, pes=(16, 16))
    plan = compile_model(**req)
    s = sensitivity(req, plan)
    assert [r["name"] for r in s["rows"]] == [a.name for a in hw.unpublished("wse3")]
    assert s["compiles"] == 2 * len(s["rows"])
    assert s["held"]["users"] == plan.workload["users"] and s["held"]["layout"] == plan.projection["layout"]
    clock = s["rows"][0]
    assert clock["minus"]["value"] == pytest.approx(0.99e9) and clock["plus"]["value"] == pytest.approx(1.21e9)
    # one wafer: every decode term is cycles / clock, so tokens/s follows the clock
    assert clock["minus"]["decode_tokens_per_s_per_user"] == pytest.approx(-10, abs=0.5)
    assert clock["plus"]["decode_tokens_per_s_per_user"] == pytest.approx(10, abs=0.5)
    assert clock["plus"]["time_to_first_token_s"] < 0
    plan.extra["sensitivity"] = s
    text = plan_summary(plan)
    assert all(a.name in text for a in hw.unpublished("wse3")) and "-10.0% / +10.0%" in text


def test_training_headlines_and_a_clock_given_with_the_request(mini):
    req = dict(graph=mini, pes=(16, 16), mode="train", clock_hz=1e9)
    s = sensitivity(req, compile_model(**req), pct=5)
    assert set(s["figures"]) == {"tokens_per_s", "step_time_s"} and s["times"] == ["step_time_s"]
    clock = next(r for r in s["rows"] if r["name"] == "clock_hz")
    assert clock["minus"]["value"] == pytest.approx(0.95e9)
    assert clock["minus"]["step_time_s"] > 0 > clock["minus"]["tokens_per_s"]


def test_a_perturbation_that_no_longer_fits_is_reported(mini):
    def fits(users: int) -> bool:
        try:
            compile_model(graph=mini, pes=(16, 16), users=users, layout="pipelined")
            return True
        except ConfigError:
            return False

    lo, hi = 1, 2  # the most users whose KV caches fit in the pipelined layout: a larger program reserve cannot
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    req = dict(graph=mini, pes=(16, 16), users=lo, layout="pipelined")
    s = sensitivity(req, compile_model(**req))
    row = next(r for r in s["rows"] if r["name"] == "program_reserve_bytes_per_pe")
    assert "infeasible" in row["plus"] and "users" in row["plus"]["infeasible"]
    assert "infeasible" not in row["minus"]


@pytest.mark.parametrize("pct", [0, 100, -5])
def test_bad_percentages(mini, pct):
    req = dict(graph=mini, pes=(16, 16))
    with pytest.raises(ConfigError, match="percentage"):
        sensitivity(req, compile_model(**req), pct)


def test_cli_sensitivity_json_and_bad_input(capsys):
    r = wsc_main(capsys, "compile", "--model", "gpt-mini", "--pes", "16x16", "--sensitivity", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["sensitivity"]
    assert d["pct"] == 10 and [x["name"] for x in d["rows"]] == [a.name for a in hw.unpublished("wse3")]
    for args in (("--sensitivity", "0"), ("--assume", "power_w=1"), ("--assume", "clock_hz=1e9", "--clock_hz", "1e9")):
        r = wsc_main(capsys, "compile", "--model", "gpt-mini", "--pes", "16x16", *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
