"""The model zoo: GPT and Llama families, one file each, sharing `layers.py`."""

from waferscale.models.config import ModelConfig
from waferscale.models.layers import CausalLM, lm_loss
from waferscale.models.registry import PRESETS, build, config_from_name, from_name

__all__ = ["ModelConfig", "CausalLM", "lm_loss", "PRESETS", "build", "config_from_name", "from_name"]
