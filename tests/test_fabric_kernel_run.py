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
