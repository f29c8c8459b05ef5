"""`wsc checkpoint convert` (the `cszoo checkpoint convert` role): a Cerebras Model Zoo checkpoint (`.mdl`) of a
GPT or Llama model -> a Hugging Face directory (config.json + model.safetensors).

The flags are cszoo's: CHECKPOINT, --model, --src-fmt, --tgt-fmt, --config (the params YAML the checkpoint was
trained with), --output-dir (default: beside the checkpoint, `<name>_to_hf`), --drop-unmatched-keys. Every
`cs-X.Y` source format (and `cs-auto`) reads the same way: the file's own `__version__` tells its .mdl format
(`runtime/mdl.py`), and the GPT/Llama parameter names are those Model Zoo's converters read
(`models/modelzoo.py`). The Hugging Face side is always safetensors (cszoo's
`--export-safetensors`, accepted, changes nothing). A muP model (the Cerebras-GPT muP family) is written with its
scalings folded into the weights, as cszoo does (`modelzoo.fold_mup`, applied by `hf.save_hf_dir`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from waferscale.errors import CheckpointError, ConfigError

# cszoo's model names (and its aliases) -> the families Model Zoo builds under them
MODELS = {"gpt2": ("gpt",), "llama": ("llama",), "llamaV2": ("llama",), "code-llama": ("llama",),
          "mistral": ("mistral",)}


def cmd_checkpoint_convert(a: argparse.Namespace) -> int:
    from waferscale.models.hf import save_hf_dir
    from waferscale.models.modelzoo import model_state, state_dict_from_zoo
    from waferscale.models.registry import build
    from waferscale.params import load_params
    from waferscale.runtime.checkpoint import load_model_weights
    from waferscale.runtime.mdl import is_mdl, load_mdl

    if not re.fullmatch(r"cs(-auto|-\d+\.\d+)?", a.src_fmt):
        raise ConfigError(f"--src-fmt {a.src_fmt!r} is not supported; give cs-X.Y (e.g. cs-2.4) or cs-auto, a "
                          f"Cerebras .mdl checkpoint")
    if a.tgt_fmt != "hf":
        raise ConfigError(f"--tgt-fmt {a.tgt_fmt!r} is not supported; give hf (a Hugging Face directory)")
    if a.model not in MODELS:
        raise ConfigError(f"--model {a.model!r} is not supported; give one of {', '.join(MODELS)}")
    src = Path(a.checkpoint_file)
    if not src.is_file():
        raise CheckpointError(f"no checkpoint at {src}")
    if not is_mdl(src):
        raise CheckpointError(f"{src} is not a Cerebras .mdl checkpoint (an HDF5 file written by cstorch.save)")
    cfg = load_params(a.config).model.to_model_config()
    if cfg.family not in MODELS[a.model]:
        raise ConfigError(f"--config {a.config} describes a {cfg.family} model, not --model {a.model}")
    weights = state_dict_from_zoo(model_state(load_mdl(src), str(src)), cfg, where=str(src),
                                  drop_unmatched=a.drop_unmatched_keys)
    model = build(cfg, device="cpu")
    load_model_weights(model, weights, str(src))
    out = Path(a.output_dir) if a.output_dir else src.with_name(f"{src.stem}_to_hf")
    save_hf_dir(model, out)
    print(f"Checkpoint saved to {out / 'model.safetensors'}")
    print(f"Config saved to {out / 'config.json'}")
    return 0


def register(sub: Any) -> None:
    """Add `wsc checkpoint convert` to the `wsc` subparsers."""
    p = sub.add_parser("checkpoint", help="convert a Cerebras Model Zoo checkpoint (cszoo checkpoint)",
                       description="convert a Cerebras Model Zoo checkpoint (cszoo checkpoint)")
    act = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = act.add_parser("convert", help="a Model Zoo GPT/Llama .mdl -> a Hugging Face directory",
                       description="a Model Zoo GPT/Llama .mdl -> a Hugging Face directory")
    c.set_defaults(fn=cmd_checkpoint_convert)
    c.add_argument("checkpoint_file", metavar="CHECKPOINT", help="the Model Zoo checkpoint (.mdl)")
    c.add_argument("--model", required=True, help=f"the model: {', '.join(MODELS)}")
    c.add_argument("--src-fmt", "--src_fmt", dest="src_fmt", required=True, help="cs-X.Y or cs-auto")
    c.add_argument("--tgt-fmt", "--tgt_fmt", dest="tgt_fmt", required=True, help="hf")
    c.add_argument("--config", required=True, help="the params YAML the checkpoint was trained with")
    c.add_argument("--output-dir", "--output_dir", dest="output_dir", default=None,
                   help="the Hugging Face directory to write (default: CHECKPOINT's name + _to_hf, beside it)")
    c.add_argument("--drop-unmatched-keys", "--drop_unmatched_keys", dest="drop_unmatched_keys",
                   action="store_true", help="leave out tensors that are not Model Zoo parameter names of the model "
                                             "instead of refusing the checkpoint")
    c.add_argument("--export-safetensors", "--export_safetensors", dest="export_safetensors", action="store_true",
                   help="accepted for cszoo compatibility: the Hugging Face weights are always safetensors")
