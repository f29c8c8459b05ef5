"""Load a model + tokenizer for sampling: a zoo name, real weights (an asset, a Hugging Face directory, a
.gguf), or a training checkpoint (runtime/checkpoint.py manifests). Sampling itself runs on the serving
engine (serve/llm.py), as `wsc generate` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from waferscale.data import check_vocab_fits, load_tokenizer
from waferscale.errors import CheckpointError, ConfigError
from waferscale.models import CausalLM, ModelConfig, build, config_from_name
from waferscale.models.pretrained import is_pretrained, load_pretrained
from waferscale.models.registry import META_THRESHOLD_PARAMS
from waferscale.runtime import checkpoint as ckpt
from waferscale.runtime.executor import resolve_device

def _is_training_dir(p: Path) -> bool:
    """A `wsc run` model_dir or one of its checkpoint manifests."""
    return (p.is_dir() and ckpt.latest_checkpoint(p) is not None) or (p.is_file() and p.name.startswith(
        "checkpoint_") and p.suffix == ".json")


def _checkpoint_or_weights(checkpoint: str) -> tuple[str | None, str | None]:
    """--checkpoint PATH -> (training checkpoint, None) or, for a Hugging Face directory or a .gguf file,
    (None, PATH) to load as real weights. A directory that is neither: CheckpointError naming both kinds."""
    p = Path(checkpoint).expanduser()
    if (p.is_dir() and (p / "config.json").is_file()) or (p.is_file() and p.suffix == ".gguf"):
        return None, checkpoint
    if not p.exists() and p.suffix == ".gguf":
        raise CheckpointError(f"--checkpoint {p}: no such GGUF file")
    if p.is_dir() and ckpt.latest_checkpoint(p) is None:
        raise CheckpointError(f"no checkpoint_*.json found in {p}, and it is not a Hugging Face model directory "
                              "(no config.json): --checkpoint takes a `wsc run` model_dir, a checkpoint_*.json, "
                              "a Hugging Face directory or a .gguf file; for a zoo or asset name use --model")
    return checkpoint, None


def load_for_generation(*, model: str | None, checkpoint: str | None, tokenizer: str | None, device: str = "auto",
                        need_tokenizer: bool = True, keep_quantized: bool = False) -> tuple[CausalLM, Any, str | None]:
    """Returns (model in eval mode on the device, tokenizer or None, a note for the user or None).

    checkpoint: a `wsc run` model_dir (its latest checkpoint) or checkpoint_*.json; a Hugging Face directory or
    a .gguf file is loaded as `model` loads it. CheckpointError names the flag to use for the other kind.
    keep_quantized: a GGUF's matrices stay in the file's precision (models/gguf.py), for the serving engine,
    which runs them on CPU."""
    note = None
    tok = None
    if checkpoint is not None:
        checkpoint, model = _checkpoint_or_weights(checkpoint)
    elif model is not None and _is_training_dir(Path(model).expanduser()):
        raise CheckpointError(f"{model} holds `wsc run` checkpoints: pass it with --checkpoint, not --model")
    if checkpoint is not None:
        c = ckpt.load_checkpoint(checkpoint, with_optimizer=False)
        m = build(ModelConfig.from_dict(c.model_config), device="cpu")
        ckpt.load_model_weights(m, c.model, str(c.path))
        tok_dir = c.path.parent / c.manifest.get("tokenizer", "tokenizer")
        if tokenizer is not None:
            tok = load_tokenizer(tokenizer)
        elif tok_dir.exists():
            tok = load_tokenizer(str(tok_dir))
    elif is_pretrained(model):
        m = load_pretrained(model, keep_quantized=keep_quantized)
        tok = load_tokenizer(tokenizer or model)
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
    if tok is not None:
        check_vocab_fits(tok, m.config.vocab_size)
    if getattr(m, "gguf_matrices", None) is not None:  # matrices held outside the model: it stays on the CPU
        if device not in ("auto", "cpu"):
            raise ConfigError(f"--device {device}: quantized weights (the file's own precision, or a --dtype other "
                              "than fp32) run on CPU only; pass --dtype fp32 to run in float32 there")
        return m.eval(), tok, note
    return m.to(resolve_device(device)).eval(), tok, note


__all__ = ["load_for_generation"]
