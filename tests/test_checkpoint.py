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
    assert path.name == "checkpoint_7.json"
    c = ckpt.load_checkpoint(tmp_path)  # a model_dir resolves to its latest checkpoint
    assert c.step == 7 and c.manifest["data"] == {"step": 7}
    assert "head.lm_head.weight" not in c.model  # tied: stored once
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
    weights = tmp_path / "checkpoint_1.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, as by a crash mid-write of a copy
    with pytest.raises(CheckpointError, match="partial"):
        ckpt.load_checkpoint(path)
    path.unlink()
    with pytest.raises(CheckpointError, match="no checkpoint"):
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
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint_2.json", "checkpoint_2.optim.safetensors", "checkpoint_2.safetensors"]
