"""A params file's run splits weight decay as Model Zoo's `configure_param_groups` does: biases and the parameters
of torch LayerNorms are not decayed; the gains of Model Zoo's own RMSNorm (Llama, Mistral, Mixtral, T5) are.
The resident optimizer and MemoryX's groups agree; an optimizer state grouped otherwise (a run's from before this
split) is refused with the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import tiny_params
from waferscale.errors import CheckpointError
from waferscale.models.config import FAMILIES
from waferscale.models.modelzoo_optim import weight_decay_exempt
from waferscale.models.registry import PRESETS, build
from waferscale.params import params_from_dict
from waferscale.pytorch.backend import Backend
from waferscale.pytorch.distributed import ClusterConfig
from waferscale.runtime.optim import build_optimizer
from waferscale.zoo.lm import compile_lm_step
from waferscale.zoo.mdl import resident_param_index
from waferscale.zoo.optim import optimizer_spec

# the norm_type of Model Zoo's configs per family: get_norm("layernorm" / "biasless-layernorm") is torch's LayerNorm
# (not decayed), get_norm("rmsnorm") its own RMSNorm module (decayed)
LAYERNORM = {"gpt", "gptj", "gpt_neox", "falcon", "mpt", "bert", "roberta"}
RMSNORM = {"llama", "mistral", "mixtral", "t5"}


def test_every_family_splits_as_model_zoo() -> None:
    assert LAYERNORM | RMSNORM == set(FAMILIES)
    seen = set()
    for cfg in PRESETS.values():
        if cfg.family in seen:
            continue
        seen.add(cfg.family)
        model = build(cfg.replace(n_layer=1), device="meta")
        exempt = weight_decay_exempt(model)
        for name, p in model.named_parameters():
            if name.endswith(".bias") or name.endswith(".rel.weight"):  # (T5's: relative_attention_bias)
                want = False
            elif name.endswith("norm.weight"):
                assert p.ndim == 1, name
                want = cfg.family in RMSNORM
            else:
                assert p.ndim == 2, name
                want = True
            assert (name not in exempt) == want, (cfg.family, name)
    assert seen == set(FAMILIES)


def _compile(model: str, execution: str) -> tuple[Any, Any, Any]:
    d = tiny_params(Path("unused"), Path("unused"))
    d["model"]["name"] = model
    params = params_from_dict(d, "t")
    cfg = params.model.to_model_config()
    backend = Backend(execution, torch.device("cpu"), Path("unused"), Path("unused"), False, ClusterConfig())
    return params, cfg, compile_lm_step(None, cfg, backend, params.optimizer)


def _groups(model: str, execution: str) -> tuple[dict[str, int], list[tuple[float, set[int]]]]:
    params, cfg, (_, executor) = _compile(model, execution)
    state = executor.optimizer_state()
    return resident_param_index(cfg, params.optimizer), [(g["weight_decay"], set(g["params"]))
                                                         for g in state["param_groups"]]


@pytest.mark.parametrize("model", ["llama-tiny", "gpt-tiny"])
def test_a_params_file_run_decays_as_model_zoo(model: str) -> None:
    index, resident = _groups(model, "CPU")
    assert _groups(model, "CSX")[1] == resident  # MemoryX's groups are the resident run's
    decayed = {i for rate, members in resident if rate > 0 for i in members}
    assert all(rate in (0.0, 0.1) for rate, _ in resident)
    for name, i in index.items():
        if name.endswith(".bias"):
            want = False
        elif name.endswith("norm.weight"):
            want = model == "llama-tiny"
        else:
            want = True
        assert (i in decayed) == want, name
    assert any(n.endswith("norm.weight") for n in index) and (model == "llama-tiny" or any(
        n.endswith(".bias") for n in index))


def test_a_state_grouped_by_dimension_is_refused_with_the_reason() -> None:
    params, _, (model, executor) = _compile("llama-tiny", "CPU")
    by_dimension = build_optimizer(model.parameters(), optimizer_spec(params.optimizer)).state_dict()
    with pytest.raises(CheckpointError, match=r"param groups hold \[\d+, \d+\] parameters, this run's \[\d+\]"):
        executor.load_optimizer_state(by_dimension)
