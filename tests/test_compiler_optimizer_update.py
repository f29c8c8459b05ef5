"""Weight-streaming training: the Adam update in MemoryX (compiler/weight_streaming.OptimizerUpdate)."""

from __future__ import annotations

import pytest

from waferscale.compiler.capture import capture_zoo
from waferscale.compiler.compile import compile_model
from waferscale.compiler.sensitivity import sensitivity

# a batch small enough that MemoryX's update outlasts the wafer's work on 4 systems
REQ = dict(mode="train", target="wse2", systems=4, batch_size=16, seq_len=2048)


@pytest.fixture(scope="module")
def gpt():
    return capture_zoo("gpt3-1.3b")


@pytest.fixture(scope="module")
def plan(gpt):
    return compile_model(graph=gpt, **REQ)


def test_the_update_is_counted_by_bytes_and_waits_past_its_window(plan, gpt):
    p = plan.projection
    o = p["optimizer_update"]
    assert plan.strategy == "weight_streaming" and o["bytes_per_param"] == 2 + 4 + 4 + 4 + 2 + 4 + 4 + 4
    assert o["params"] == gpt.params and o["memoryx_bytes_per_s"] == 150e9
    assert o["update_s"] == pytest.approx(gpt.params * 28 / 150e9)
    embed = gpt.units[0]  # its gradients arrive last, with those of the matrix it shares with the head
    assert o["first_layer_update_s"] == pytest.approx((embed.params + embed.tied_params) * 28 / 150e9)
    assert o["exposed_s"] == pytest.approx(max(o["first_layer_update_s"], o["update_s"] - o["overlap_window_s"]))
    assert o["exposed_s"] > o["first_layer_update_s"]  # 1.3 B parameters at 150 GB/s outlast one micro-batch
    # the wafer's work under the update is off the critical path: the step follows MemoryX there
    assert p["time_shares"]["MemoryX update"] == pytest.approx(
        (o["exposed_s"] + o["overlap_window_s"]) / p["step_time_s"], abs=1e-4)
    assert plan.bottleneck == "MemoryX update"
    assert any(d.startswith("optimizer update in MemoryX") for d in plan.decisions)


def test_a_fast_memoryx_hides_all_but_the_first_layer(plan, gpt):
    fast = compile_model(graph=gpt, assume={"memoryx_bytes_per_s": 10 * 150e9}, **REQ)
    o, of = plan.projection["optimizer_update"], fast.projection["optimizer_update"]
    assert of["exposed_s"] == pytest.approx(of["first_layer_update_s"]) == pytest.approx(o["first_layer_update_s"] / 10)
    # nothing else in the step changes
    assert plan.projection["step_time_s"] - fast.projection["step_time_s"] == pytest.approx(
        o["exposed_s"] - of["exposed_s"], rel=1e-9)


def test_weak_scaling_pays_the_update_once_per_step(plan):
    rows = plan.projection["scaling"]
    assert [r["systems"] for r in rows] == [1, 2, 4, 8, 16]
    exposed = plan.projection["optimizer_update"]["exposed_s"]
    for r in rows:  # MemoryX updates the gradients summed over the systems: the same work for any N
        assert r["memoryx_update_exposed_s"] == pytest.approx(exposed, rel=1e-3)
        assert r["efficiency"] > 0.99


def test_memoryx_bandwidth_is_in_the_sensitivity_table(plan, gpt):
    s = sensitivity(dict(graph=gpt, **REQ), plan)
    row = next(r for r in s["rows"] if r["name"] == "memoryx_bytes_per_s")
    assert row["value"] == 150e9 and "1.2 Tb/s" in row["source"]
    assert row["minus"]["step_time_s"] > 0 > row["plus"]["step_time_s"]
    # MemoryX outlasts the wafer's work, so the step does not follow the clock (WSE-2's is published, so it is not
    # in the table: recompile at +-10% of it, the batch held at the plan's)
    assert plan.bottleneck == "MemoryX update"
    assert "clock_hz" not in [r["name"] for r in s["rows"]]
    assert (plan.workload["batch_size"], plan.workload["seq_len"]) == (REQ["batch_size"], REQ["seq_len"])
    for f in (0.9, 1.1):
        other = compile_model(graph=gpt, clock_hz=1.1e9 * f, **REQ)
        # a tenth off or on the clock moves the step by under a quarter of that (only the wafer's work before the
        # update's window follows the clock)
        assert other.projection["step_time_s"] == pytest.approx(plan.projection["step_time_s"], rel=0.025)
