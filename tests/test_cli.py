"""The real `wsc` command line in fresh interpreters: happy paths and every bad input (exit 2, one line)."""

import json
from pathlib import Path

import pytest
import yaml

from conftest import tiny_params, wsc
from serve_helpers import have_smollm2, tiny_model_dir


def _write(tmp_path: Path, d: dict, name: str = "p.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d))
    return p


def _assert_user_error(r, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().startswith("error:"), r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


@pytest.mark.slow
def test_run_generate_plot_export(corpus: Path, tmp_path: Path) -> None:
    md = tmp_path / "md"
    p = _write(tmp_path, tiny_params(corpus, md))
    r = wsc("run", "--params", str(p), "--mode", "train_and_eval", "--no_progress")
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout and "eval" in r.stdout
    r = wsc("generate", "--checkpoint", str(md), "--prompt", "First", "--max_new_tokens", "20", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("First") and len(r.stdout) > len("First")
    r = wsc("plot", str(md))
    assert r.returncode == 0 and (md / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "hf"
    r = wsc("export", "--checkpoint", str(md), "--format", "hf", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"


def test_python_dash_m_equals_wsc() -> None:
    r = wsc("models")
    assert r.returncode == 0 and "llama3.1-405b" in r.stdout and "gpt3-1.3b" in r.stdout


@pytest.mark.parametrize("case", ["missing_file", "malformed", "unknown_key", "wrong_type", "unknown_model",
                                  "bad_data_path", "vocab_mismatch", "num_steps_zero", "num_steps_negative"])
@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(case: str, corpus: Path, tmp_path: Path) -> None:
    md = tmp_path / "md"
    d = tiny_params(corpus, md)
    extra: list[str] = []
    needles: tuple[str, ...] = ()
    if case == "missing_file":
        p = tmp_path / "nope.yaml"
        needles = ("nope.yaml",)
    elif case == "malformed":
        p = tmp_path / "bad.yaml"
        p.write_text("train_input: {batch_size: 4\nmodel: [")
        needles = ("bad.yaml",)
    else:
        if case == "unknown_key":
            d["optimizer"]["max_gradient_nrm"] = 1.0
            needles = ("max_gradient_nrm", "max_gradient_norm")
        elif case == "wrong_type":
            d["train_input"]["batch_size"] = "four"
            needles = ("batch_size",)
        elif case == "unknown_model":
            d["model"]["name"] = "gpt2-smal"
            needles = ("gpt2-small",)
        elif case == "bad_data_path":
            d["train_input"]["data_dir"] = [str(tmp_path / "no_such_dir")]
            needles = ("no_such_dir",)
        elif case == "vocab_mismatch":
            d["model"]["vocab_size"] = 8
            needles = ("vocab_size",)
        elif case == "num_steps_zero":
            extra = ["--num_steps", "0"]
            needles = ("--num_steps",)
        elif case == "num_steps_negative":
            extra = ["--num_steps", "-3"]
            needles = ("--num_steps",)
        p = _write(tmp_path, d)
    r = wsc("run", "--params", str(p), "--no_progress", *extra)
    _assert_user_error(r, *needles)
    assert not md.exists() or not any(md.iterdir()), "nothing may be written on bad input"


@pytest.mark.slow
def test_checkpoint_of_other_architecture(corpus: Path, tmp_path: Path) -> None:
    md = tmp_path / "md"
    p = _write(tmp_path, tiny_params(corpus, md))
    assert wsc("run", "--params", str(p), "--no_progress").returncode == 0
    other = tiny_params(corpus, md)
    other["model"]["name"] = "llama-tiny"
    r = wsc("run", "--params", str(_write(tmp_path, other, "other.yaml")), "--no_progress")
    _assert_user_error(r, "another architecture")


@pytest.mark.slow
def test_generate_bad_input(tmp_path: Path) -> None:
    _assert_user_error(wsc("generate", "--model", "gpt-tni", "--prompt", "x"), "gpt-tiny")
    _assert_user_error(wsc("generate", "--checkpoint", str(tmp_path), "--prompt", "x"), "checkpoint_*",
                       "Hugging Face")
    _assert_user_error(wsc("generate", "--model", "gpt-tiny", "--prompt", "x"), "--tokenizer")
    (tmp_path / "checkpoint_3.json").write_text("{}")  # a `wsc run` model_dir (either flag) with a foreign manifest
    _assert_user_error(wsc("generate", "--model", str(tmp_path), "--prompt", "x"), "not a waferscale checkpoint")
    for missing in (str(tmp_path / "nope" / "model.gguf"), "SmolLM2-135M-Instruct.Q4_1.gguf"):  # not there
        _assert_user_error(wsc("generate", "--model", missing, "--prompt", "x"), "no such model file or directory",
                           "a GGUF file")


@pytest.mark.slow
def test_server_module_is_wsc_serve() -> None:
    """One argparse: `python -m waferscale.serve.server` is `wsc serve` (same flags, same bad-input rule)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "waferscale.serve.server", "--help"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and r.stdout == wsc("serve", "--help").stdout
    for flag in ("--model", "--host", "--port", "--api-key", "--stages", "--target", "--systems", "--max-num-seqs"):
        assert flag in r.stdout, flag
    _assert_user_error(wsc("serve", "--max-num-seqs", "0"), "--max-num-seqs")


@pytest.mark.assets
@pytest.mark.skipif(not have_smollm2(), reason="needs the smollm2 asset's tokenizer (make setup installs it)")
def test_generate_checkpoint_takes_a_hf_dir(tmp_path: Path) -> None:
    hf = tiny_model_dir(tmp_path)
    args = ("--prompt", "Hello", "--max_new_tokens", "8", "--temperature", "0")
    r = wsc("generate", "--checkpoint", str(hf), *args)
    assert r.returncode == 0 and r.stdout.startswith("Hello"), r.stderr
    assert r.stdout == wsc("generate", "--model", str(hf), *args).stdout


@pytest.mark.slow
def test_run_compile_only_writes_the_wafer_plan_and_validate_only_checks(corpus: Path, tmp_path: Path) -> None:
    """--compile_only writes what `wsc compile --params P --mode train` writes (into the model_dir) and trains
    nothing; --validate_only (and `wsc validate`) checks the file and the flags, and writes nothing."""
    md = tmp_path / "md"
    p = _write(tmp_path, tiny_params(corpus, md))
    r = wsc("run", "--params", str(p), "--compile_only", "--target", "wse2")
    assert r.returncode == 0, r.stderr
    written = {f.name for f in md.iterdir()}
    assert written == {"plan.json", "wafer.png", "wafer.svg", "trace.json"}  # no checkpoint, no metrics
    assert (md / "wafer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = json.loads((md / "plan.json").read_text())
    assert plan["mode"] == "train" and plan["target"] == "wse2" and plan["systems"] == 1
    assert plan["workload"]["batch_size"] == 4 and plan["workload"]["seq_len"] == 32
    assert "tokens/s" in r.stdout and f"wrote {md / 'plan.json'}" in r.stdout
    out = tmp_path / "compiled"
    r = wsc("compile", "--params", str(p), "--mode", "train", "--target", "wse2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "plan.json").read_text())["fingerprint_sha256"] == plan["fingerprint_sha256"]

    md2 = tmp_path / "md2"
    p2 = _write(tmp_path, tiny_params(corpus, md2), "p2.yaml")
    for argv in (("run", "--params", str(p2), "--validate_only"), ("validate", str(p2))):
        r = wsc(*argv)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"{p2}: valid") and "M-parameter model" in r.stdout
    assert not md2.exists()
    _assert_user_error(wsc("run", "--params", str(p2), "--validate_only", "--num_csx", "3"), "--num_csx 3")
    _assert_user_error(wsc("run", "--params", str(p2), "--validate_only", "--num_steps", "0"), "--num_steps")
