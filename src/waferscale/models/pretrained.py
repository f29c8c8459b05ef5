"""`load_pretrained(name_or_path)`: real weights from an installed asset, a .gguf file or a HF directory.

The names are the "model" assets of `waferscale.util.assets`. The tokenizer that belongs to the same name or
path is `waferscale.data.load_tokenizer(name_or_path)` (models and data do not import each other: the
caller, e.g. the serving engine or `wsc generate`, puts the two together).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from waferscale.errors import CheckpointError
from waferscale.models.gguf import load_gguf
from waferscale.models.hf import load_hf_dir
from waferscale.models.layers import CausalLM
from waferscale.util.assets import asset_path, find_asset, names


def is_pretrained(name_or_path: str | os.PathLike) -> bool:
    """True for a model asset name or an existing path (what `load_pretrained` accepts or explains)."""
    return find_asset(str(name_or_path), "model") is not None or Path(name_or_path).expanduser().exists()


def load_pretrained(name_or_path: str | os.PathLike, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None, *, keep_quantized: bool = False) -> CausalLM:
    """Load real weights, in eval mode.

    Accepts an asset name ("smollm2-135m-instruct", "smollm2"), a `.gguf` file (dequantized; dtype=None ->
    float32) or a Hugging Face model directory (config.json + safetensors; dtype=None -> as stored).
    keep_quantized: a GGUF's matrices stay in the file's precision, for the serving engine (models/gguf.py).
    """
    s = str(name_or_path)
    p = asset_path(s, "model") if find_asset(s, "model") is not None else Path(s).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p, device=device, dtype=dtype or torch.float32, keep_quantized=keep_quantized)[0]
    if p.is_dir():
        return load_hf_dir(p, device=device, dtype=dtype)
    raise CheckpointError(f"{s!r} is neither a pretrained model name ({', '.join(names('model'))}), nor a .gguf "
                          "file, nor a Hugging Face model directory (config.json + *.safetensors)")


__all__ = ["is_pretrained", "load_pretrained"]
