"""The model zoo: GPT and Llama families, one file each, sharing `layers.py`."""

from waferscale.models.config import ModelConfig, RopeScaling
from waferscale.models.layers import CausalLM, KVCache, lm_loss
from waferscale.models.registry import PRESETS, build, canonical_name, config_from_name, from_name, names

__all__ = ["ModelConfig", "RopeScaling", "CausalLM", "KVCache", "lm_loss", "PRESETS", "build", "canonical_name",
           "config_from_name", "from_name", "names"]
