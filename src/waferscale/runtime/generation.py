"""Load a model + tokenizer for sampling, whatever names it (runtime/source.py). Sampling itself runs on the
serving engine (serve/llm.py), as `wsc generate` does."""

from __future__ import annotations

from typing import Any

from waferscale.data import check_vocab_fits
from waferscale.errors import ConfigError
from waferscale.models import CausalLM
from waferscale.runtime.executor import resolve_device
from waferscale.runtime.source import ModelSource, resolve


def load_for_generation(model: str | ModelSource, *, tokenizer: str | None, device: str = "auto",
                        need_tokenizer: bool = True, keep_quantized: bool = False) -> tuple[CausalLM, Any, str | None]:
    """Returns (model in eval mode on the device, tokenizer or None, a note for the user or None).

    model: resolved as every command resolves a model (runtime/source.py: a packaged model, a zoo name, a Hugging
    Face directory, a .gguf, a checkpoint or a `wsc run` model_dir). keep_quantized: a GGUF's matrices stay in the
    file's precision (models/gguf.py), for the serving engine, which runs them on CPU."""
    src = resolve(model)
    m = src.load(keep_quantized=keep_quantized)
    tok = src.tokenizer(tokenizer)
    if need_tokenizer and tok is None:
        raise ConfigError("no tokenizer known for this model: pass --tokenizer (e.g. smollm2, a tokenizer.json, "
                          "or a .gguf file)")
    if tok is not None:
        check_vocab_fits(tok, m.config.vocab_size)
    if getattr(m, "gguf_matrices", None) is not None:  # matrices held outside the model: it stays on the CPU
        if device not in ("auto", "cpu"):
            raise ConfigError(f"--device {device}: quantized weights (the file's own precision, or a --dtype other "
                              "than fp32) run on CPU only; pass --dtype fp32 to run in float32 there")
        return m.eval(), tok, src.note
    return m.to(resolve_device(device)).eval(), tok, src.note


__all__ = ["load_for_generation"]
