"""Model registry: preset names -> ModelConfig -> model, with big presets built on the meta device."""

from __future__ import annotations

import difflib
import os
from typing import Any

import torch

from waferscale.errors import ConfigError

from waferscale.models import bert, falcon, gpt, gpt_neox, gptj, llama, mistral, mixtral, mpt, t5
from waferscale.models.config import ModelConfig
from waferscale.models.layers import CausalLM

_FAMILIES = (gptj, gpt_neox, falcon, mpt, mistral, bert, t5)
PRESETS: dict[str, ModelConfig] = {**gpt.PRESETS, **llama.PRESETS, **mixtral.PRESETS,
                                   **{k: v for m in _FAMILIES for k, v in m.PRESETS.items()}}
ALIASES: dict[str, str] = {**gpt.ALIASES, **llama.ALIASES, **mixtral.ALIASES,
                           **{k: v for m in _FAMILIES for k, v in m.ALIASES.items()}}
FAMILY_CLASSES: dict[str, type[CausalLM]] = {"gpt": gpt.GPT, "llama": llama.Llama, "mixtral": mixtral.Mixtral,
                                             "gptj": gptj.GPTJ, "gpt_neox": gpt_neox.GPTNeoX, "falcon": falcon.Falcon,
                                             "mpt": mpt.MPT, "mistral": mistral.Mistral, "bert": bert.BERT,
                                             "roberta": bert.RoBERTa, "t5": t5.T5}

# Above this many parameters, `from_name(..., device="auto")` builds on the meta device: shapes and counts
# without memory. 1 B fp32 parameters = 4 GB, a sixth of this machine's RAM.
META_THRESHOLD_PARAMS = 1_000_000_000


FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth", ".mdl", ".h5")  # names meant as a model's file


def names() -> list[str]:
    return sorted(PRESETS) + sorted(ALIASES)


def canonical_name(name: str) -> str:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        if "/" in name or os.sep in name or name.lower().endswith(FILE_SUFFIXES):  # meant as a file or folder
            raise ConfigError(f"no such model file or directory: {name!r} (a model is a zoo name, a GGUF file or "
                              "a Hugging Face directory)")
        close = difflib.get_close_matches(name.lower(), names(), n=3)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise ConfigError(f"unknown model {name!r}{hint}; known models: {', '.join(names())}")
    return key


def config_from_name(name: str, **overrides: Any) -> ModelConfig:
    cfg = PRESETS[canonical_name(name)]
    return cfg.replace(name=name.strip().lower(), **overrides) if overrides or name != cfg.name else cfg


def build(cfg: ModelConfig, device: torch.device | str | None = "auto",
          dtype: torch.dtype | None = None) -> CausalLM:
    """Instantiate a model. device="auto": meta for presets above META_THRESHOLD_PARAMS, else CPU."""
    if device == "auto":
        device = "meta" if cfg.num_params > META_THRESHOLD_PARAMS else "cpu"
    with torch.device(device or "cpu"):
        model = FAMILY_CLASSES[cfg.family](cfg)
    return model.to(dtype) if dtype is not None else model


def from_name(name: str, device: torch.device | str | None = "auto", dtype: torch.dtype | None = None,
              **overrides: Any) -> CausalLM:
    """`from_name("llama3.1-405b")` returns instantly on the meta device; tiny models are materialized."""
    return build(config_from_name(name, **overrides), device=device, dtype=dtype)
