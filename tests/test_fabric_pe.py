"""fabric/pe.py: a task's cycles with the PE's calibrated fixed costs (task activation, vector instructions, the
fp32 multiply-add rate), and the constants as --assume values."""

from __future__ import annotations

import dataclasses

import pytest

from waferscale.errors import ConfigError
from waferscale.fabric import assumptions
from waferscale.fabric import pe as PE
from waferscale.fabric.presets import fabric_from_name


def _spec(**kw):
    return dataclasses.replace(fabric_from_name("wse2"), **kw)


def test_axpy_charges_one_vector_instruction_per_x_value():
    s = _spec(task_overhead_cycles=0, vector_op_cycles=0)
    assert PE.axpy_task(s, "fp16", 2, 40) == 2 * 40 // 4  # 4 fp16 FMACs a cycle on WSE-2
    s = _spec(task_overhead_cycles=5, vector_op_cycles=16)
    assert PE.axpy_task(s, "fp16", 2, 40) == 5 + 20 + 2 * 16
    # (compute, SRAM): 320 B read at 16 B a cycle, 160 B written at 8; each part carries the activation
    assert PE.axpy_parts(s, "fp16", 2, 40) == (5 + 20 + 32, 5 + 20)


def test_reduction_adds_are_scalar_and_fp32_fmacs_run_at_their_share():
    s = _spec(task_overhead_cycles=1, vector_op_cycles=16, fp32_fmac_sustained_fraction=0.5)
    assert PE.add_task(s, "fp32", 1) == 1 + 1  # no vector instruction to set up
    assert PE.axpy_task(s, "fp32", 1, 44) == 1 + 88 + 16  # 44 FMACs at half of 1 a cycle
    assert PE.axpy_task(s, "fp16", 2, 44) == 1 + 22 + 32  # the fraction is fp32's only


def test_calibrated_constants_are_assumptions_that_may_be_zero():
    names = {a.name for a in assumptions.unpublished("wse3")}
    assert {"task_overhead_cycles", "vector_op_cycles", "fp32_fmac_sustained_fraction"} <= names
    s = assumptions.apply(fabric_from_name("wse3"), "wse3", {"vector_op_cycles": 0, "task_overhead_cycles": 2.6})
    assert (s.vector_op_cycles, s.task_overhead_cycles) == (0, 3)
    for src in (a.source for a in assumptions.unpublished("wse2") if a.name.endswith(("_cycles", "fraction"))
                and a.name in names):
        assert "calibrated on rows" in src and "plausible range" in src
    with pytest.raises(ConfigError, match="must be a number >= 0"):
        assumptions.apply(fabric_from_name("wse2"), "wse2", {"vector_op_cycles": -1})
    with pytest.raises(ConfigError, match=">= 0"):
        _spec(task_overhead_cycles=-1)
