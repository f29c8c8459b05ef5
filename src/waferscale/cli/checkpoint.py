"""`wsc checkpoint convert` (the `cszoo checkpoint convert` role) between a Cerebras Model Zoo checkpoint (`.mdl`)
of a GPT or Llama model and a Hugging Face directory (config.json + model.safetensors), either way.

The flags are cszoo's: CHECKPOINT, --model, --src-fmt, --tgt-fmt, --config, --output-dir, --drop-unmatched-keys.
Every `cs-X.Y` format (and `cs-auto` / `cs-current`) is the same here: a .mdl is read in whatever format its own
`__version__` says (`runtime/mdl.py`) and written in the current one, under the parameter names Model Zoo's
converters read and its 2.x trainer saves (`models/modelzoo.py`).

* cs -> hf: --config is the params YAML the checkpoint was trained with; the directory is written to --output-dir
  (default: beside the checkpoint, `<name>_to_hf`). A muP model (the Cerebras-GPT muP family) gets its scalings
  folded into the weights, as cszoo does (`modelzoo.fold_mup`, applied by `hf.save_hf_dir`). The Hugging Face
  side is always safetensors (cszoo's `--export-safetensors` is accepted and changes nothing).
* hf -> cs: CHECKPOINT is the Hugging Face directory; --config is its config.json (cszoo's meaning) or the params
  YAML the model will train with on the Cerebras system, which must describe the same model. The checkpoint
  `{"model": ...}` is written to --output-dir (default: beside the directory) as `<name>_to_<tgt-fmt>.mdl`; unlike
  cszoo, no params YAML is written (the one given, or Model Zoo's for the architecture, is what trains it).
* wsc -> cs (ours, not cszoo's): CHECKPOINT is one of our checkpoints (`wsc run`'s or `cstorch.save`'s, a file,
  or a model_dir for the latest), --config the params YAML it trained with. The .mdl holds what a Model Zoo run
  saves: the weights under its names, the optimizer state numbered in its param groups
  (`models/modelzoo_optim.py`) and global_step, so the run can go on on a Cerebras system (the learning-rate
  scheduler's state is not written: `zoo/mdl.py`).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from waferscale.errors import CheckpointError, ConfigError

# cszoo's model names (and its aliases) -> the families Model Zoo builds under them
MODELS = {"gpt2": ("gpt",), "llama": ("llama",), "llamaV2": ("llama",), "code-llama": ("llama",),
          "mistral": ("mistral",)}
_CS = re.compile(r"cs(-auto|-current|-\d+\.\d+)?")
# what makes two configs compute different functions (the rest: names, dropout, initializers)
_FUNCTION = ("family", "vocab_size", "n_layer", "n_head", "kv_heads", "d_model", "ffn_dim", "max_seq_len", "norm",
             "norm_eps", "norm_bias", "activation", "position", "rope_theta", "rope_scaling", "rotary_dims",
             "rotary_interleaved", "sliding_window", "tie_embeddings", "attn_bias", "mlp_bias", "lm_head_bias")


def cmd_checkpoint_convert(a: argparse.Namespace) -> int:
    if a.model not in MODELS:
        raise ConfigError(f"--model {a.model!r} is not supported; give one of {', '.join(MODELS)}")
    if _CS.fullmatch(a.src_fmt) and a.tgt_fmt == "hf":
        return _cs_to_hf(a)
    if a.src_fmt in ("hf", "wsc") and _CS.fullmatch(a.tgt_fmt) and a.tgt_fmt != "cs-auto":
        return _hf_to_cs(a) if a.src_fmt == "hf" else _wsc_to_cs(a)
    raise ConfigError(f"--src-fmt {a.src_fmt} --tgt-fmt {a.tgt_fmt} is not supported; convert cs-X.Y (or cs-auto) "
                      f"-> hf, or hf or wsc (a waferscale run's checkpoint) -> cs-X.Y (or cs-current)")


def _params_config(a: argparse.Namespace) -> Any:
    from waferscale.params import load_params

    cfg = load_params(a.config).model.to_model_config()
    if cfg.family not in MODELS[a.model]:
        raise ConfigError(f"--config {a.config} describes a {cfg.family} model, not --model {a.model}")
    return cfg


def _cs_to_hf(a: argparse.Namespace) -> int:
    from waferscale.models.hf import save_hf_dir
    from waferscale.models.modelzoo import model_state, state_dict_from_zoo
    from waferscale.models.registry import build
    from waferscale.runtime.checkpoint import load_model_weights
    from waferscale.runtime.mdl import is_mdl, load_mdl

    src = Path(a.checkpoint_file)
    if not src.is_file():
        raise CheckpointError(f"no checkpoint at {src}")
    if not is_mdl(src):
        raise CheckpointError(f"{src} is not a Cerebras .mdl checkpoint (an HDF5 file written by cstorch.save)")
    cfg = _params_config(a)
    weights = state_dict_from_zoo(model_state(load_mdl(src), str(src)), cfg, where=str(src),
                                  drop_unmatched=a.drop_unmatched_keys)
    model = build(cfg, device="cpu")
    load_model_weights(model, weights, str(src))
    out = Path(a.output_dir) if a.output_dir else src.with_name(f"{src.stem}_to_hf")
    save_hf_dir(model, out)
    print(f"Checkpoint saved to {out / 'model.safetensors'}")
    print(f"Config saved to {out / 'config.json'}")
    return 0


def _hf_to_cs(a: argparse.Namespace) -> int:
    from waferscale.models.hf import config_from_hf, load_hf_dir
    from waferscale.models.modelzoo import state_dict_to_zoo
    from waferscale.runtime.mdl import save_mdl

    src = Path(a.checkpoint_file)
    model = load_hf_dir(src)
    if a.config.endswith(".json"):  # the Hugging Face config (cszoo's --config for an hf source)
        try:
            cfg = config_from_hf(json.loads(Path(a.config).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--config {a.config}: cannot read it as a Hugging Face config.json ({e})") from None
        if cfg.family not in MODELS[a.model]:
            raise ConfigError(f"--config {a.config} describes a {cfg.family} model, not --model {a.model}")
    else:
        cfg = _params_config(a)
        if getattr(cfg, "has_mup", False):
            raise ConfigError(f"--config {a.config} is a muP model; Hugging Face weights carry no muP scalings to "
                              f"take apart again: give a params file without embeddings_scale, "
                              f"output_logits_scale, scale_qk_dot_by_d and attention_logits_alpha")
    differ = [f for f in _FUNCTION if getattr(cfg, f) != getattr(model.config, f)]
    if differ:
        f = differ[0]
        raise ConfigError(f"--config {a.config} describes another model than {src}: {f} is "
                          f"{getattr(cfg, f)!r} there and {getattr(model.config, f)!r} in the checkpoint"
                          f"{f' (also differing: {differ[1:]})' if differ[1:] else ''}")
    out = Path(a.output_dir) if a.output_dir else src.resolve().parent
    path = out / f"{src.resolve().name}_to_{a.tgt_fmt}.mdl"
    save_mdl({"model": state_dict_to_zoo(model.state_dict(), cfg)}, path)
    print(f"Checkpoint saved to {path}")
    return 0


def _wsc_to_cs(a: argparse.Namespace) -> int:
    from waferscale.models import ModelConfig
    from waferscale.params import load_params
    from waferscale.runtime.checkpoint import load_checkpoint
    from waferscale.runtime.mdl import save_mdl
    from waferscale.zoo.mdl import zoo_checkpoint

    params = load_params(a.config)
    cfg = _params_config(a)
    c = load_checkpoint(a.checkpoint_file)
    saved = ModelConfig.from_dict(c.model_config) if c.model_config is not None else cfg  # (a script's: the params')
    differ = [f for f in _FUNCTION if getattr(cfg, f) != getattr(saved, f)]
    if differ:
        raise ConfigError(f"--config {a.config} describes another model than {c.path}: {differ[0]} is "
                          f"{getattr(cfg, differ[0])!r} there and {getattr(saved, differ[0])!r} in the checkpoint")
    out = Path(a.output_dir) if a.output_dir else c.path.parent
    path = out / f"{c.path.stem}_to_{a.tgt_fmt}.mdl"
    save_mdl(zoo_checkpoint(c, cfg, params.optimizer), path)
    print(f"Checkpoint saved to {path}")
    return 0


def register(sub: Any) -> None:
    """Add `wsc checkpoint convert` to the `wsc` subparsers."""
    p = sub.add_parser("checkpoint", help="convert a Cerebras Model Zoo checkpoint (cszoo checkpoint)",
                       description="convert a Cerebras Model Zoo checkpoint (cszoo checkpoint)")
    act = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = act.add_parser("convert", help="a Model Zoo GPT/Llama .mdl <-> a Hugging Face directory",
                       description="a Model Zoo GPT/Llama .mdl <-> a Hugging Face directory")
    c.set_defaults(fn=cmd_checkpoint_convert)
    c.add_argument("checkpoint_file", metavar="CHECKPOINT", help="a Model Zoo .mdl, or a Hugging Face directory")
    c.add_argument("--model", required=True, help=f"the model: {', '.join(MODELS)}")
    c.add_argument("--src-fmt", "--src_fmt", dest="src_fmt", required=True,
                   help="cs-X.Y / cs-auto, hf, or wsc (a waferscale run's checkpoint)")
    c.add_argument("--tgt-fmt", "--tgt_fmt", dest="tgt_fmt", required=True, help="hf, or cs-X.Y / cs-current")
    c.add_argument("--config", required=True, help="cs/wsc -> : the params YAML the checkpoint was trained with; "
                                                   "hf -> cs: the directory's config.json or the params YAML")
    c.add_argument("--output-dir", "--output_dir", dest="output_dir", default=None,
                   help="where to write (default: beside CHECKPOINT)")
    c.add_argument("--drop-unmatched-keys", "--drop_unmatched_keys", dest="drop_unmatched_keys",
                   action="store_true", help="cs -> hf: leave out tensors that are not Model Zoo parameter names "
                                             "of the model instead of refusing the checkpoint")
    c.add_argument("--export-safetensors", "--export_safetensors", dest="export_safetensors", action="store_true",
                   help="accepted for cszoo compatibility: the Hugging Face weights are always safetensors")
