from pathlib import Path

import pytest
import torch

from waferscale.errors import CheckpointError
from waferscale.models import from_name
from waferscale.runtime import checkpoint as ckpt


def _opt_state(model: torch.nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    opt.step()
    return opt.state_dict()


def test_round_trip_with_tied_weights_and_optimizer(tmp_path: Path) -> None:
    model = from_name("gpt-tiny")
    state = _opt_state(model)
    path = ckpt.save_checkpoint(tmp_path, 7, model, model.config.to_dict(), optimizer_state=state,
                                extra={"data": {"step": 7}})
    assert path.name == "checkpoint_7.safetensors"
    c = ckpt.load_checkpoint(tmp_path)  # a model_dir resolves to its latest checkpoint
    assert c.step == 7 and c.state["data"] == {"step": 7}
    head = c.model["head.lm_head.weight"]  # tied: stored once, one tensor under both names
    assert any(t is head for k, t in c.model.items() if k != "head.lm_head.weight")
    model.load_state_dict(c.model)  # every name back, as a script's strict load_state_dict wants
    other = from_name("gpt-tiny")
    ckpt.load_model_weights(other, c.model, "test")
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
    restored = c.optimizer_state()
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
    opt2.load_state_dict(restored)
    for k, st in state["state"].items():
        assert torch.equal(opt2.state_dict()["state"][k]["exp_avg"], st["exp_avg"])
    assert c.rng_state is not None and c.rng_state.dtype == torch.uint8


def test_partial_checkpoint_is_refused(tmp_path: Path) -> None:
    model = from_name("gpt-tiny")
    path = ckpt.save_checkpoint(tmp_path, 1, model, model.config.to_dict())
    path.write_bytes(path.read_bytes()[:-100])  # truncated, as by a crash mid-write of a copy
    with pytest.raises(CheckpointError, match="partial"):
        ckpt.load_checkpoint(path)
    path.write_bytes(path.read_bytes()[:100])  # (its header cut too)
    with pytest.raises(CheckpointError, match="partially written"):
        ckpt.load_checkpoint(tmp_path)
    path.unlink()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        ckpt.load_checkpoint(tmp_path)


def _save_v1(model_dir: Path, step: int, model: torch.nn.Module, opt_state: dict) -> Path:
    """A checkpoint in the first `wsc run` format (manifest + weights + optimizer files), as that code wrote it."""
    import json

    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    weights, optim = model_dir / f"checkpoint_{step}.safetensors", model_dir / f"checkpoint_{step}.optim.safetensors"
    save_file({k: v.contiguous() for k, v in ckpt.unique_state_dict(model).items()}, str(weights))
    tensors = {f"state.{i}.{k}": v for i, st in opt_state["state"].items() for k, v in st.items() if torch.is_tensor(v)}
    save_file({"rng.torch": torch.get_rng_state(), **tensors}, str(optim))
    manifest = {"format": "waferscale-checkpoint-v1", "step": step, "model_config": model.config.to_dict(),
                "data": {"step": step}, "tokenizer": "tokenizer",
                "optimizer": {"param_groups": opt_state["param_groups"], "scalars": {}, "extra": {}},
                "files": {weights.name: weights.stat().st_size, optim.name: optim.stat().st_size}}
    path = model_dir / f"checkpoint_{step}.json"
    path.write_text(json.dumps(manifest))
    return path


def test_first_format_checkpoints_still_load(tmp_path: Path) -> None:
    """A model_dir of the first format: the model_dir, its manifest or its weights file name it; weights, step, data
    position and optimizer state come back as from the current format, through load_checkpoint and cstorch.load."""
    import waferscale.pytorch as cstorch

    model = from_name("gpt-tiny")
    state = _opt_state(model)
    manifest = _save_v1(tmp_path, 5, model, state)
    for name in (tmp_path, manifest, tmp_path / "checkpoint_5.safetensors", tmp_path / "checkpoint_5"):
        c = ckpt.load_checkpoint(name)
        assert (c.path, c.step, c.state["data"]) == (manifest, 5, {"step": 5})
        assert c.model_config == model.config.to_dict() and c.rng_state is not None
        opt = torch.optim.AdamW(from_name("gpt-tiny").parameters(), lr=1e-3)
        opt.load_state_dict(c.optimizer_state())
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    loaded = cstorch.load(manifest)
    assert loaded["global_step"] == 5 and set(loaded["model"]) == set(ckpt.unique_state_dict(model))
    (tmp_path / "checkpoint_5.optim.safetensors").write_bytes(b"")  # one of its files damaged: refused
    with pytest.raises(CheckpointError, match="partial"):
        ckpt.load_checkpoint(tmp_path)


def test_other_architecture_is_refused(tmp_path: Path) -> None:
    model = from_name("gpt-tiny")
    ckpt.save_checkpoint(tmp_path, 1, model, model.config.to_dict())
    c = ckpt.load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="another architecture"):
        ckpt.load_model_weights(from_name("llama-tiny"), c.model, "x")
    with pytest.raises(CheckpointError, match="shape"):
        ckpt.load_model_weights(from_name("gpt-tiny", d_model=64), c.model, "x")


def test_no_temp_files_left(tmp_path: Path) -> None:
    model = from_name("gpt-tiny")
    ckpt.save_checkpoint(tmp_path, 2, model, model.config.to_dict(), optimizer_state=_opt_state(model))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_2.safetensors"]


def test_tied_weights_are_written_once_from_a_module_or_its_state_dict(tmp_path: Path) -> None:
    """One rule for "the same tensor" (runtime/checkpoint.py's tensor_identity), for `wsc run`'s checkpoints and
    cstorch.save alike: a tied head is stored once whether the model or its state_dict() (detached views, other
    objects) is given, and loads back into the model."""
    from safetensors.torch import load_file

    import waferscale.pytorch as cstorch
    from waferscale.models import build, config_from_name

    cfg = config_from_name("llama-tiny", vocab_size=64, max_seq_len=16, tie_embeddings=True)
    m = build(cfg, device="cpu")
    for i, source in enumerate((m, m.state_dict())):
        path = ckpt.save_checkpoint(tmp_path / f"run{i}", 1, source, cfg.to_dict())
        assert len(load_file(str(path))) == len(ckpt.unique_state_dict(m)) + 1  # (+ the RNG state)
        c = ckpt.load_checkpoint(path, with_optimizer=False)
        back = build(cfg, device="cpu")
        ckpt.load_model_weights(back, c.model, str(path))
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), m.state_dict().values()))
    cstorch.save({"model": m.state_dict()}, tmp_path / "c.safetensors")
    assert len(load_file(str(tmp_path / "c.safetensors"))) == len(ckpt.unique_state_dict(m))


def _run_tiny(corpus: Path, model_dir: Path, max_steps: int, checkpoint: Path | None = None) -> str:
    import io

    from conftest import tiny_params
    from waferscale.params import params_from_dict
    from waferscale.zoo.runner import RunOptions, run

    d = tiny_params(corpus, model_dir)
    d["runconfig"]["max_steps"] = max_steps
    out = io.StringIO()
    run(params_from_dict(d, "t"), RunOptions(model_dir=model_dir, progress=False,
                                             checkpoint_path=str(checkpoint) if checkpoint else None), out=out)
    return out.getvalue()


def test_either_training_path_resumes_the_others_checkpoint(corpus: Path, tmp_path: Path) -> None:
    """One format: a `wsc run` checkpoint is what a cstorch script loads (cstorch.load, strict load_state_dict, its
    optimizer state regrouped by the parameter names it carries), and a cstorch script's checkpoint, its optimizer
    grouped otherwise (torch's named parameters), resumes `wsc run` with that optimizer state."""
    import waferscale.pytorch as cstorch
    from waferscale.models import ModelConfig, build

    _run_tiny(corpus, tmp_path / "run", 2)
    state = cstorch.load(tmp_path / "run")  # a model_dir: its latest
    assert state["global_step"] == 2
    model = build(ModelConfig.from_dict(state["model_config"]), device="cpu")
    model.load_state_dict(state["model"])  # (strict: every name there, the tied head too)
    named = dict(model.named_parameters())
    groups = [{"params": [named[n] for n in g["param_names"]], "weight_decay": g["weight_decay"]}
              for g in state["optimizer"]["param_groups"]]
    opt = cstorch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    opt.load_state_dict(state["optimizer"])
    assert all(float(s["beta1_power"]) == pytest.approx(0.9 ** 3) for s in opt.state.values())  # 2 steps (beta1^(t+1))

    # the other way: one group of named parameters (torch writes their names), saved by cstorch.save
    one = cstorch.optim.AdamW(model.named_parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    one.step()
    one.step()
    cstorch.save({"model": model.state_dict(), "optimizer": one.state_dict(), "global_step": 2}, tmp_path / "s.ckpt")
    out = _run_tiny(corpus, tmp_path / "run2", 3, checkpoint=tmp_path / "s.ckpt")
    assert "(step 2)" in out
    after = ckpt.load_checkpoint(tmp_path / "run2")
    assert after.step == 3
    assert all(float(s["beta1_power"]) == pytest.approx(0.9 ** 4)  # its Adam state went on: 3 steps
               for s in after.optimizer_state()["state"].values())


def test_model_dirs_mixing_formats_and_partial_files_resolve_to_a_complete_checkpoint(tmp_path: Path) -> None:
    """A first-format save cut short (weights, no manifest) is skipped for the last complete checkpoint; a run that
    writes step N where a first-format step N exists replaces it whole; a stem names its file; a file is itself
    even beside an unrelated `<name>.json`."""
    model = from_name("gpt-tiny")
    state = _opt_state(model)
    _save_v1(tmp_path, 2, model, state)
    _save_v1(tmp_path, 4, model, state).unlink()  # (its weights and optimizer files written, the manifest not)
    assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint_2.json"
    with pytest.raises(CheckpointError, match="manifest .*is missing: it is partial"):
        ckpt.load_checkpoint(tmp_path / "checkpoint_4.safetensors")
    path = ckpt.save_checkpoint(tmp_path, 2, model, model.config.to_dict(), optimizer_state=state)
    assert not (tmp_path / "checkpoint_2.json").exists() and not (tmp_path / "checkpoint_2.optim.safetensors").exists()
    assert ckpt.latest_checkpoint(tmp_path) == path and ckpt.load_checkpoint(tmp_path).step == 2
    assert ckpt.resolve_checkpoint_path(tmp_path / "checkpoint_2") == path
    import waferscale.pytorch as cstorch

    cstorch.save({"model": model.state_dict()}, tmp_path / "x.ckpt")
    (tmp_path / "x.ckpt.json").write_text("{}")
    assert ckpt.resolve_checkpoint_path(tmp_path / "x.ckpt") == tmp_path / "x.ckpt"


def test_optimizer_state_moves_by_name_whatever_the_grouping() -> None:
    """Two groups the same sizes as ours but holding other parameters: each parameter's state still goes to its
    own index (by the names the state carries), not to whichever index has its position."""
    index = {"a": 0, "b": 1, "c": 2, "d": 3}
    ours = {"state": {}, "param_groups": [{"params": [0, 1], "lr": 1.0}, {"params": [2, 3], "lr": 1.0}]}
    theirs = {"state": {i: {"v": torch.tensor(float(i))} for i in range(4)},
              "param_groups": [{"params": [0, 1], "param_names": ["c", "a"]},
                               {"params": [2, 3], "param_names": ["d", "b"]}]}
    got = ckpt.regroup_optimizer_state(theirs, ours, index, "test")
    assert {i: float(s["v"]) for i, s in got["state"].items()} == {2: 0.0, 0: 1.0, 3: 2.0, 1: 3.0}
    assert got["param_groups"] is ours["param_groups"]
    named = ckpt.name_optimizer_state(ours, index)
    assert ckpt.regroup_optimizer_state(named, ours, index, "test") is named  # (already ours)
