"""Cheap checks first: `wsc run` checks the data paths, the tokenizer against the model's vocabulary and the batch
split before it builds the model and optimizer, so a 70B config with a bad data_dir fails at once, allocating
nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from waferscale.cli.main import main
from waferscale.zoo import runner

ROOT = Path(__file__).resolve().parents[1]
LLAMA3_70B = ROOT / "tests" / "data" / "modelzoo" / "params_llama3p1_70b_msl_8k.yaml"


def test_a_70b_config_with_a_missing_data_dir_fails_before_allocating(tmp_path: Path) -> None:
    """Its data_dir (Model Zoo's ./datasets/...) does not exist here: one `error:` line, exit 2, and the
    process's peak RSS stays far below the 70B model's weights (282 GB in fp32; built first, it was killed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    # the run's peak RSS as its own parent sees it (this process's RUSAGE_CHILDREN would be the largest of every
    # process the suite has started so far): a small parent runs it and prints its children's peak last
    parent = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    r = subprocess.run([sys.executable, "-c", parent, sys.executable, "-m", "waferscale", "run", "--params",
                        str(LLAMA3_70B), "--model_dir", str(tmp_path / "md"), "--no_progress"], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=120)
    peak_mb = int(r.stdout.split()[-1]) / 1024  # Linux: KiB
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "rpj_1t_100k_llama3p1_msl8k_train' does not exist" in errors[0]
    assert peak_mb < 1024, peak_mb  # the model was never built (its weights alone are 282 GB)
    assert not (tmp_path / "md").exists()


@pytest.fixture
def no_build(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built before the cheap checks")

    monkeypatch.setattr(runner, "build_executor", refuse)


def _llama2_70b(tmp_path: Path, **train_input: object) -> Path:
    d = yaml.safe_load((ROOT / "configs" / "llama2_70b.yaml").read_text())
    d["train_input"].update(train_input)
    d.pop("eval_input", None)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def test_tokenizer_larger_than_the_vocabulary_fails_before_the_model_is_built(tmp_path: Path, no_build, capsys) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(chr(0x100 + i) for i in range(300)) * 4)  # 300 distinct characters
    path = _llama2_70b(tmp_path, data_dir=[str(corpus)], tokenizer="char", data_processor=None)
    d = yaml.safe_load(path.read_text())
    d["model"]["vocab_size"] = 256
    path.write_text(yaml.safe_dump(d))
    assert main(["run", "--params", str(path), "--model_dir", str(tmp_path / "md"), "--no_progress"]) == 2
    assert "tokenizer has 300 tokens but model.vocab_size is 256" in capsys.readouterr().err


def test_an_uneven_batch_split_fails_before_the_model_is_built(tmp_path: Path, no_build, capsys) -> None:
    path = _llama2_70b(tmp_path, batch_size=6, micro_batch_size=None)
    assert main(["run", "--params", str(path), "--num_csx", "4", "--no_progress"]) == 2
    assert "batch_size: 6 is not divisible by --num_csx 4" in capsys.readouterr().err
