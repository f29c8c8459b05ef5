"""Load a model + tokenizer for sampling (zoo name, real checkpoint, or training checkpoint) and stream text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from waferscale.data import load_tokenizer
from waferscale.errors import CheckpointError, ConfigError
from waferscale.models import CausalLM, ModelConfig, build, config_from_name
from waferscale.models.generate import generate
from waferscale.models.registry import META_THRESHOLD_PARAMS
from waferscale.runtime import checkpoint as ckpt
from waferscale.runtime.executor import resolve_device

# zoo names whose real weights ship as an installable asset (see ASSETS.md)
PRETRAINED = {"smollm2-135m-instruct"}


def _is_pretrained(name: str) -> bool:
    return name.lower() in PRETRAINED or Path(name).exists()


def load_for_generation(*, model: str | None, checkpoint: str | None, tokenizer: str | None, device: str = "auto",
                        need_tokenizer: bool = True) -> tuple[CausalLM, Any, str | None]:
    """Returns (model in eval mode on the device, tokenizer or None, a note for the user or None)."""
    note = None
    tok = None
    if checkpoint is not None:
        c = ckpt.load_checkpoint(checkpoint, with_optimizer=False)
        m = build(ModelConfig.from_dict(c.model_config), device="cpu")
        ckpt.load_model_weights(m, c.model, str(c.path))
        tok_dir = c.path.parent / c.manifest.get("tokenizer", "tokenizer")
        if tokenizer is not None:
            tok = load_tokenizer(tokenizer)
        elif tok_dir.exists():
            tok = load_tokenizer(str(tok_dir))
    elif _is_pretrained(model):
        from waferscale.models.pretrained import load_pretrained, pretrained_tokenizer

        m = load_pretrained(model)
        tok = load_tokenizer(tokenizer) if tokenizer else pretrained_tokenizer(model)
    else:
        cfg = config_from_name(model)
        if cfg.num_params > META_THRESHOLD_PARAMS:
            raise ConfigError(f"{model} has {cfg.num_params / 1e9:.1f}B parameters and no weights ship with it; "
                              f"sampling it would only materialize random weights. Use a checkpoint or a smaller model")
        m = build(cfg, device="cpu")
        note = f"note: {model} has random weights (no checkpoint given); expect noise"
        tok = load_tokenizer(tokenizer) if tokenizer else None
    if need_tokenizer and tok is None:
        raise ConfigError("no tokenizer known for this model: pass --tokenizer (e.g. smollm2, a tokenizer.json, "
                          "or a .gguf file)")
    if tok is not None and tok.vocab_size > m.config.vocab_size:
        raise CheckpointError(f"tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                              f"{m.config.vocab_size}: they do not belong together")
    return m.to(resolve_device(device)).eval(), tok, note


def stream_text(model: CausalLM, tok: Any, text: str, *, max_new_tokens: int, temperature: float = 0.8,
                top_k: int | None = None, top_p: float | None = None, seed: int | None = None) -> Iterator[str]:
    """Yield printable text pieces as tokens are sampled (byte-level BPE pieces decode once complete)."""
    prompt = tok.encode(text)
    stop = {tok.eos_id} if tok.eos_id is not None else set()
    ids: list[int] = []
    printed = ""
    for t in generate(model, prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                      seed=seed, stop_ids=stop, vocab_limit=tok.vocab_size):
        ids.append(t)
        full = tok.decode(ids)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            continue
        yield full[len(printed):]
        printed = full
    full = tok.decode(ids)
    if len(full) > len(printed):
        yield full[len(printed):]


def generate_text(model: CausalLM, tok: Any, text: str, **kw: Any) -> str:
    return "".join(stream_text(model, tok, text, **kw))


__all__ = ["load_for_generation", "stream_text", "generate_text"]
