"""`run_kernel` (the `wsc kernel` entry point) projects, verifies and refuses bad input."""

from __future__ import annotations

import pytest

from waferscale.errors import ConfigError
from waferscale.fabric.cost import BOTTLENECKS
from waferscale.fabric.kernel_run import format_kernel_report, run_kernel


def test_run_kernel_verify_and_report():
    for kind, n in [("gemv", None), ("gemm", 4), ("spmv", None), ("allreduce", None)]:
        for defects in (0.0, 0.05):
            d = run_kernel(kind, m=64, k=64, n=n, target="wse2", pes=(8, 8), defects=defects, seed=1, verify=True)
            assert d["verified"] and d["max_abs_err"] < 1e-3, d
            assert d["cycles"] > 0 and d["time_s"] > 0 and d["flops"] > 0 and d["pes"] <= d["usable_pes"]
            assert d["bottleneck"] in BOTTLENECKS
            text = format_kernel_report(d)
            assert "cycles" in text and "assumed" in text and "verified" in text
    full = run_kernel("gemv", m=8192, k=8192, n=None, target="wse3", pes=None)
    assert full["usable_pes"] == 1170 * 755 and full["pes"] > 500_000


def test_run_kernel_dtype_sets_rate_and_bytes():
    """fp32 halves the SIMD rate of the 16-bit types and doubles the bytes a PE holds; bf16 costs what fp16 does"""
    args = dict(m=2048, k=2048, n=256, target="wse2", pes=(64, 64))
    d16, db16, d32 = (run_kernel("gemm", **args, dtype=t) for t in ("fp16", "bf16", "fp32"))
    assert run_kernel("gemm", **args)["assumptions"]["dtype"] == "fp16"  # the default
    assert db16["cycles"] == d16["cycles"] and db16["assumptions"]["dtype"] == "bf16"
    a16, a32 = d16["assumptions"], d32["assumptions"]
    assert a32["flops_per_cycle_per_pe"] < a16["flops_per_cycle_per_pe"]
    assert d32["breakdown"]["compute"] > d16["breakdown"]["compute"]
    d = run_kernel("gemm", m=64, k=64, n=4, target="wse2", pes=(8, 8), dtype="fp32", verify=True)
    assert d["verified"]
    with pytest.raises(ConfigError, match="fp32 only"):
        run_kernel("allreduce", m=64, k=1, n=None, target="wse2", pes=(8, 8), dtype="bf16")
    with pytest.raises(ConfigError, match="--dtype must be one of"):
        run_kernel("gemv", m=64, k=64, n=None, target="wse2", pes=(8, 8), dtype="int8")


def test_run_kernel_bad_input():
    ok = dict(m=64, k=64, n=None, target="wse2", pes=(8, 8))
    with pytest.raises(ConfigError, match="--pes 8x8"):
        run_kernel("gemv", **{**ok, "m": 8192, "k": 8192, "pes": None}, verify=True)
    with pytest.raises(ConfigError, match="mesh too small"):
        run_kernel("gemv", **{**ok, "m": 4096, "k": 4096, "pes": (2, 2)})
    with pytest.raises(ConfigError):
        run_kernel("gemv", **{**ok, "m": 0})
    with pytest.raises(ConfigError):
        run_kernel("gemv", **{**ok, "k": -3})
    with pytest.raises(ConfigError):
        run_kernel("gemv", **ok, defects=1.0)
    with pytest.raises(ConfigError):
        run_kernel("gemv", **ok, defects=-0.1)
    with pytest.raises(ConfigError, match="unknown target"):
        run_kernel("gemv", **{**ok, "target": "wse9"})
    with pytest.raises(ConfigError):
        run_kernel("conv", **ok)
    with pytest.raises(ConfigError, match="--n"):
        run_kernel("gemm", **ok)
