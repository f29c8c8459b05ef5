"""Tiny fixtures shared across the suite: a small text corpus and a params dict for a 2-layer GPT."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# One intra-op thread per process, for the suite and every process it starts (CLI runs, ranks, servers inherit
# the variable): the tests' models are tiny, and on a busy 2-core machine (CI, with the servers and ranks the tests
# start) torch's second OpenMP thread only spins. tests/test_nsp.py took 83 s with torch's default of 2, 16 s with 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402  (after the variable: OpenMP reads it when torch loads)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

def pytest_sessionstart(session: pytest.Session) -> None:
    """Under CI (WSC_REQUIRE_KERNELS=1, set by .ci/run) C kernels that do not build stop the run: their test modules
    would otherwise skip, and a green run would say nothing of them."""
    if os.environ.get("WSC_REQUIRE_KERNELS") == "1":
        from waferscale.serve import kernels

        if not kernels.available():
            pytest.exit(f"the C serving kernels do not build here: {kernels.unavailable_reason()}", returncode=1)


TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\n") * 40


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token caches go to a per-session temp dir, never the user's ~/.cache."""
    monkeypatch.setenv("WSC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "wsc-cache"))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text(TEXT)
    (d / "b.jsonl").write_text('{"text": "Speak, speak. We are accounted poor citizens."}\n' * 30)
    return d


def tiny_params(corpus: Path, model_dir: Path, **run: object) -> dict:
    return {
        "train_input": {"data_dir": [str(corpus)], "tokenizer": "char", "batch_size": 4,
                        "max_sequence_length": 32, "shuffle": True, "shuffle_seed": 1, "val_fraction": 0.1},
        "model": {"name": "gpt-tiny", "vocab_size": 64, "max_position_embeddings": 32, "mixed_precision": False},
        "optimizer": {"optimizer_type": "AdamW", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                      "max_gradient_norm": 1.0,
                      "learning_rate": [{"scheduler": "Linear", "initial_learning_rate": 0.0,
                                         "end_learning_rate": 3e-3, "total_iters": 2},
                                        {"scheduler": "CosineDecay", "initial_learning_rate": 3e-3,
                                         "end_learning_rate": 3e-4, "total_iters": 8}]},
        "runconfig": {"max_steps": 6, "eval_steps": 2, "log_steps": 1, "seed": 3, "model_dir": str(model_dir),
                      **run},
    }


def wsc_main(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """`wsc ARGS` by its main in this process, for tests whose subject is not the fresh-interpreter command line
    (no interpreter to start, seconds each): what `wsc` returns, its exit code and what it printed."""
    from waferscale.cli.main import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["wsc", *args], code, out.out, out.err)


def wsc(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real CLI in a fresh interpreter, as a user would."""
    src = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's package, not another install's
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "waferscale", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)
