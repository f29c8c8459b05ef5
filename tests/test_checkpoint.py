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
        stored = load_file(str(path.with_suffix(".safetensors")))
        assert "head.lm_head.weight" not in stored and "embed.tok.weight" in stored
        c = ckpt.load_checkpoint(path, with_optimizer=False)
        back = build(cfg, device="cpu")
        ckpt.load_model_weights(back, c.model, str(path))
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), m.state_dict().values()))
    cstorch.save({"model": m.state_dict()}, tmp_path / "c.safetensors")
    assert len(load_file(str(tmp_path / "c.safetensors"))) == len(ckpt.unique_state_dict(m))
