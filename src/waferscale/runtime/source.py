"""Which model a name or path means: the one answer every command gives (`wsc generate`, `wsc serve`, `wsc export`,
`wsc sparsity_report`, `wsc serve --target`'s projection, `LLM(...)`, the appliance's deployments).

`resolve(spec)` -> a `ModelSource` of one kind:

    asset   a packaged model ("smollm2-135m-instruct", "smollm2")
    hf      a Hugging Face model directory (config.json + safetensors)
    gguf    a .gguf file
    checkpoint  a checkpoint (runtime/checkpoint.py: `wsc run`'s or `cstorch.save`'s, any format, or a Model Zoo
                `.mdl`), or a model_dir (its latest)
    zoo     a zoo architecture name ("gpt2-small"): random weights, said so in `note`

A checkpoint `wsc run` wrote carries its architecture (`model_config`); a `.mdl`, or a cstorch script's checkpoint
that saved none, needs it given: `resolve(spec, config=ModelConfig)` (the CLI's `--config PARAMS.yaml`, the params
file it was trained with, as Model Zoo's own tools take it)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from waferscale.errors import CheckpointError, ConfigError
from waferscale.models import CausalLM, ModelConfig, build, config_from_name
from waferscale.models.config import INITIALIZER_FIELDS
from waferscale.models.registry import META_THRESHOLD_PARAMS, canonical_name
from waferscale.runtime import checkpoint as ckpt
from waferscale.runtime.mdl import is_mdl
from waferscale.util.assets import asset_path, find_asset

__all__ = ["ModelSource", "resolve", "served_id"]

KINDS = ("asset", "hf", "gguf", "checkpoint", "zoo")


@dataclass(frozen=True)
class ModelSource:
    spec: str  # as given
    kind: str  # one of KINDS
    path: Path | None  # the file or directory (a checkpoint: its file); None for a zoo name
    given: ModelConfig | None = None  # the architecture of a checkpoint that does not carry its own

    @property
    def id(self) -> str:
        """The name clients use for it (`served_id`)."""
        return served_id(self.spec)[0]

    @property
    def note(self) -> str | None:
        """What the user should know before sampling it."""
        if self.kind == "zoo":
            return f"note: {self.spec} has random weights (no checkpoint given); expect noise"
        return None

    def config(self) -> ModelConfig:
        """The architecture, without reading the weights where the source says it apart from them."""
        if self.kind == "zoo":
            return config_from_name(self.spec)
        if self.kind == "hf":
            from waferscale.models.hf import config_from_hf

            return config_from_hf(json.loads((self.path / "config.json").read_text()))
        if self.kind == "checkpoint":
            saved = self._saved("model_config")
            if saved is not None:
                own = ModelConfig.from_dict(saved)
                inits = {k: getattr(own, k) for k in INITIALIZER_FIELDS}
                if self.given is not None and self.given.replace(name=own.name, **inits) != own:
                    raise ConfigError(f"the params file given (--config) describes another model than the one "
                                      f"{self.path} was written for ({own.name}, which it carries): drop --config")
                return own
            if self.given is None:
                raise ConfigError(f"{self.path} holds weights without the model's architecture: give the params "
                                  "file it was trained with (--config PARAMS.yaml; `wsc compile`, which needs only "
                                  "the architecture: --params PARAMS.yaml; in Python: resolve(..., config=...))")
            return self.given
        return self.load().config  # (an asset or a .gguf: its metadata and matrices come together)

    def _saved(self, key: str) -> Any:
        """A checkpoint's own entry `key` (read from its header; a .mdl carries none of ours)."""
        return None if is_mdl(self.path) else ckpt.load_state(self.path, only=()).get(key)

    def graph(self) -> Any:
        """The compiler's graph of it (compiler/capture.py's `capture_config`: shapes only, on the meta device),
        for `wsc compile --model` and `wsc serve --target`'s projection."""
        from waferscale.compiler.capture import capture_config

        cfg = self.config()
        return capture_config(cfg, source=f"zoo:{cfg.name}" if self.kind == "zoo" else f"{self.kind}:{self.path}")

    def load(self, *, keep_quantized: bool = False, device: Any = "cpu") -> CausalLM:
        """The model in eval mode. keep_quantized: a GGUF's matrices stay in the file's precision (models/gguf.py),
        for the serving engine, which runs them on the CPU."""
        if self.kind == "zoo":
            cfg = config_from_name(self.spec)
            if cfg.num_params > META_THRESHOLD_PARAMS:
                raise ConfigError(f"{self.spec} has {cfg.num_params / 1e9:.1f}B parameters and no weights ship with "
                                  "it; sampling it would only materialize random weights. Use a checkpoint or a "
                                  "smaller model")
            return build(cfg, device=device).eval()
        if self.kind == "checkpoint":
            cfg = self.config()
            c = ckpt.load_checkpoint(self.path, with_optimizer=False, model_config=cfg)
            m = build(cfg, device="cpu")
            ckpt.load_model_weights(m, c.model, str(c.path))
            return m.to(device).eval()
        from waferscale.models.pretrained import load_pretrained

        return load_pretrained(self.path, device=device, keep_quantized=keep_quantized)

    def tokenizer(self, override: str | None = None) -> Any | None:
        """`override` (a tokenizer name or path) if given, else the source's own; None when it has none."""
        from waferscale.data import load_tokenizer

        if override is not None:
            return load_tokenizer(override)
        if self.kind == "zoo":
            return None
        if self.kind == "checkpoint":
            tok_dir = self.path.parent / (self._saved("tokenizer") or "tokenizer")
            return load_tokenizer(str(tok_dir)) if tok_dir.exists() else None
        return load_tokenizer(str(self.path))


def resolve(spec: str | Path | ModelSource, config: ModelConfig | None = None) -> ModelSource:
    """The model `spec` names (see the module's docstring; a ModelSource: itself); ConfigError / CheckpointError
    naming what was tried. config: the architecture of a checkpoint that does not carry its own (a `.mdl`)."""
    if isinstance(spec, ModelSource):
        return spec if config is None or spec.given is not None else dataclasses.replace(spec, given=config)
    s = str(spec)
    p = Path(s).expanduser()
    if p.exists():
        if p.is_dir():
            if (p / "config.json").is_file():
                return ModelSource(s, "hf", p)
            latest = ckpt.latest_checkpoint(p)
            if latest is not None:
                return ModelSource(s, "checkpoint", ckpt.resolve_checkpoint_path(latest), config)
            raise CheckpointError(f"{p} is neither a `wsc run` model_dir (no checkpoint_*) nor a Hugging Face "
                                  "model directory (no config.json)")
        if p.suffix == ".gguf":
            return ModelSource(s, "gguf", p)
        if p.name.startswith("checkpoint_") or is_mdl(p) or ckpt.is_checkpoint_file(p):
            return ModelSource(s, "checkpoint", ckpt.resolve_checkpoint_path(p), config)
        if p.suffix == ".safetensors":
            raise CheckpointError(f"{p} is a tensor file without the model's architecture: pass the checkpoint or "
                                  "model_dir it belongs to, or a Hugging Face directory holding it")
        raise CheckpointError(f"{p}: not a model this package reads (a .gguf file, a Hugging Face directory, a "
                              "checkpoint or a `wsc run` model_dir)")
    if find_asset(s, "model") is not None:
        return ModelSource(s, "asset", asset_path(s, "model"))
    if p.suffix in (".gguf", ".json", ".mdl", ".safetensors") or "/" in s:
        raise CheckpointError(f"no such model file or directory: {s!r} (a model is a packaged model, a zoo name, a "
                              "GGUF file, a Hugging Face directory, a checkpoint or a `wsc run` model_dir)")
    try:
        canonical_name(s)
    except ConfigError as e:
        raise ConfigError(f"{s!r} is not a packaged model, a zoo name or a path ({e})") from None
    return ModelSource(s, "zoo", None)


def served_id(spec: str | ModelSource) -> tuple[str, set[str]]:
    """The id clients use for the model `spec` names, and the other names that reach it: a packaged or zoo name
    as given (any case), a path's final component (`.gguf` dropped; a checkpoint_* file: its model_dir's),
    the path as given and resolved also working. Reads nothing but the path's existence (the appliance asks it
    about deployments on its own machine)."""
    spec = spec.spec if isinstance(spec, ModelSource) else spec
    p = Path(spec).expanduser()
    if p.exists():
        r = p.resolve()
        name = r.parent.name if r.name.startswith("checkpoint_") and r.is_file() else r.name
        return name.removesuffix(".gguf"), {spec, str(r)}
    return spec, {spec.lower()}
