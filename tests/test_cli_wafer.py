"""The wafer commands (`wsc kernel`, `wsc compile`, `wsc estimate`) through the real CLI in fresh interpreters.

Every command is its own `python -m waferscale ...` process (a `compile` imports torch: a few seconds each), so
the module launches them all at once, two at a time, and the tests read their results.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import wsc

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

GOOD = {
    "gemv": ("kernel", "gemv", "--m", "64", "--k", "64", "--target", "wse2", "--pes", "8x8", "--verify", "--json"),
    "spmv": ("kernel", "spmv", "--m", "64", "--k", "64", "--target", "wse2", "--pes", "8x8", "--defects", "0.05",
             "--seed", "1", "--verify", "--json"),
    "allreduce": ("kernel", "allreduce", "--m", "64", "--k", "1", "--target", "wse3", "--pes", "8x8", "--defects",
                  "0.05", "--seed", "2", "--verify", "--json"),
    "gemm": ("kernel", "gemm", "--m", "64", "--k", "64", "--n", "4", "--target", "wse2", "--pes", "8x8",
             "--defects", "0.05", "--seed", "3", "--verify", "--json"),
    "sgemm": ("kernel", "gemm", "--m", "33000", "--k", "33000", "--n", "33000", "--target", "wse2", "--pes",
              "750x750", "--algo", "cannon", "--dtype", "fp32", "--json"),  # the fidelity suite's fp32 SGEMM row
    "kernel_text": ("kernel", "gemv", "--m", "64", "--k", "64", "--target", "wse2", "--pes", "8x8", "--verify"),
    "tiny": ("compile", "--model", "llama-tiny", "--pes", "16x16", "--out", "{out}", "--json"),
    "70b": ("compile", "--model", "llama3.1-70b", "--target", "wse3", "--systems", "4", "--json"),
    "train": ("compile", "--mode", "train", "--params", str(CONFIGS / "gpt3_xl.yaml"), "--target", "wse2", "--json"),
    "estimate": ("estimate", "--model", "gpt3-xl"),
}

BAD = {  # name: (argv, words the one-line message must contain)
    "zero size": (("kernel", "gemv", "--m", "0", "--k", "64", "--target", "wse2", "--pes", "8x8"), ("m",)),
    "negative size": (("kernel", "gemm", "--m", "64", "--k", "-3", "--n", "2", "--target", "wse2", "--pes", "8x8"),
                      ("k",)),
    "zero batch": (("compile", "--model", "llama-tiny", "--pes", "16x16", "--mode", "train", "--batch_size", "0"),
                   ("--batch_size",)),
    "zero mesh": (("compile", "--model", "llama-tiny", "--pes", "0x16"), ("--pes",)),
    "defect rate 1": (("kernel", "gemv", "--m", "64", "--k", "64", "--target", "wse2", "--pes", "8x8", "--defects",
                       "1.0"), ("--defects", "[0, 1)")),
    "negative defect rate": (("compile", "--model", "llama-tiny", "--pes", "16x16", "--defects", "-0.1"),
                             ("--defects",)),
    "allreduce in fp16": (("kernel", "allreduce", "--m", "64", "--k", "1", "--pes", "8x8", "--dtype", "fp16"),
                          ("fp32", "--dtype")),
    "unknown dtype": (("kernel", "gemv", "--m", "64", "--k", "64", "--dtype", "fp8"), ("--dtype", "fp32")),
    "unknown target": (("kernel", "gemv", "--m", "64", "--k", "64", "--target", "wse9"), ("unknown target", "wse3")),
    "unknown compile target": (("compile", "--model", "llama-tiny", "--target", "wse7"), ("unknown target",)),
    "mesh smaller than a tile": (("kernel", "gemv", "--m", "4096", "--k", "4096", "--target", "wse2", "--pes", "2x2"),
                                 ("mesh too small", "--pes")),
    "mesh smaller than the units": (("compile", "--model", "llama-tiny", "--pes", "1x2"), ("--pes",)),
    "cannot fit": (("compile", "--model", "llama3.1-405b", "--target", "wse1"), ("--systems",)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("wafer")
    jobs = {name: [a.replace("{out}", str(out)) for a in argv] for name, argv in GOOD.items()}
    jobs.update({f"bad: {name}": list(argv) for name, (argv, _) in BAD.items()})
    with ThreadPoolExecutor(max_workers=2) as pool:  # 2 cores: two interpreters at a time
        futures = {name: pool.submit(wsc, *argv, timeout=240) for name, argv in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
    results["out_dir"] = out
    return results


def _ok_json(r) -> dict:
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_kernel_gemv_verify_json(runs: dict) -> None:
    d = _ok_json(runs["gemv"])
    assert {"cycles", "time_s", "pes", "flops", "verified"} <= d.keys()
    assert d["verified"] is True and d["pes"] == 64 and d["flops"] == 2 * 64 * 64
    assert d["cycles"] > 0 and d["time_s"] == pytest.approx(d["cycles"] / d["assumptions"]["clock_hz"])
    text = runs["kernel_text"]
    assert text.returncode == 0 and "cycles" in text.stdout and "verified vs numpy: OK" in text.stdout


def test_kernel_sgemm_row_in_fp32(runs: dict) -> None:
    d = _ok_json(runs["sgemm"])
    a = d["assumptions"]
    assert a["dtype"] == "fp32" and a["algo"] == "cannon" and d["pes"] == 750 * 750
    assert d["flops"] == 2 * 33000 ** 3 and d["cycles"] > 0


@pytest.mark.parametrize("kind", ["spmv", "allreduce", "gemm"])
def test_kernels_with_defects_verify(runs: dict, kind: str) -> None:
    d = _ok_json(runs[kind])
    assert d["verified"] is True, d
    assert d["assumptions"]["defect_rate"] == 0.05 and "dead cores" in d["assumptions"]["defects"]
    assert d["usable_pes"] < 64  # spare remapping took some PEs out
    assert d["cycles"] > 0 and d["flops"] > 0 and d["pes"] <= d["usable_pes"]


def test_compile_tiny_writes_all_outputs(runs: dict) -> None:
    d = _ok_json(runs["tiny"])
    out = runs["out_dir"]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["fingerprint_sha256"] == d["fingerprint"] and len(d["fingerprint"]) == 64
    assert plan["version"] and plan["regions"]
    assert (out / "wafer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = (out / "wafer.svg").read_text()
    assert "<svg" in svg and "</svg>" in svg
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    assert events and all({"name", "ph", "pid"} <= e.keys() for e in events)
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert {"strategy", "fits_in_sram", "pes_used", "bottleneck"} <= d.keys()


def test_compile_70b_on_four_wse3(runs: dict) -> None:
    d = _ok_json(runs["70b"])
    assert d["strategy"] == "multi_wafer_pipelined" and d["wafers_per_pipeline"] == 4
    for k in ("decode_tokens_per_s_per_user", "aggregate_decode_tokens_per_s", "prefill_tokens_per_s",
              "time_to_first_token_s"):
        assert d[k] > 0 and math.isfinite(d[k]), k
    assert d["aggregate_decode_tokens_per_s"] >= d["decode_tokens_per_s_per_user"]
    assert d["fits_in_sram"] is True and d["bottleneck"] and d["assumptions"]["clock_hz"] > 0


def test_compile_gpt3_xl_training(runs: dict) -> None:
    d = _ok_json(runs["train"])
    assert d["strategy"] == "weight_streaming" and d["fits_in_sram"] is False
    for k in ("step_time_s", "tokens_per_s", "mfu", "no_stall_min_tokens_per_step"):
        assert d[k] > 0, k
    assert d["mfu"] < 1
    sc = d["scaling"]
    assert [r["systems"] for r in sc][:2] == [1, 2] and sc[-1]["systems"] >= 16
    for r in sc:  # weak scaling: per-system batch fixed, never superlinear
        assert r["per_system_batch"] == sc[0]["per_system_batch"] and r["global_batch"] == r["systems"] * \
            sc[0]["per_system_batch"]
        assert 0 < r["efficiency"] <= 1.0 + 1e-9
    assert any("weak scaling" in w and "SwarmX" in w for w in d["why"])


def test_estimate_table(runs: dict) -> None:
    r = runs["estimate"]
    assert r.returncode == 0, r.stderr
    for word in ("weights", "gradients", "Adam", "training", "inference"):
        assert word in r.stdout, word


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_one_line_exit_2(runs: dict, name: str) -> None:
    r = runs[f"bad: {name}"]
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    for word in BAD[name][1]:
        assert word in lines[0], (word, lines[0])
