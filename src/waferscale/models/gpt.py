"""The GPT family: GPT-2 (Radford et al. 2019) and GPT-3 (Brown et al. 2020) shapes.

Learned absolute positions, LayerNorm, GELU MLP (4x), biases everywhere, tied input/output embeddings.
GPT-3 shapes follow Table 2.1 of the GPT-3 paper, except the seed's GPT-3 XL, which the Cerebras Model Zoo
configures with 16 heads (hidden 2048, 24 layers); its context is 2048 and its vocab GPT-2's 50257.
"""

from __future__ import annotations

from waferscale.models.config import ModelConfig
from waferscale.models.layers import CausalLM


class GPT(CausalLM):
    """A GPT-family causal LM; all structure lives in `layers.py`, driven by the config."""


def _gpt(name: str, n_layer: int, d_model: int, n_head: int, *, ctx: int, activation: str) -> ModelConfig:
    return ModelConfig(name=name, family="gpt", vocab_size=50257, n_layer=n_layer, n_head=n_head,
                       d_model=d_model, max_seq_len=ctx, norm="layernorm", activation=activation,
                       position="learned", tie_embeddings=True)


# What each release shares across its sizes.
_GPT2 = dict(ctx=1024, activation="gelu_tanh")
_GPT3 = dict(ctx=2048, activation="gelu")

PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    _gpt("gpt2-small", 12, 768, 12, **_GPT2),
    _gpt("gpt2-medium", 24, 1024, 16, **_GPT2),
    _gpt("gpt2-large", 36, 1280, 20, **_GPT2),
    _gpt("gpt2-xl", 48, 1600, 25, **_GPT2),
    _gpt("gpt3-125m", 12, 768, 12, **_GPT3),
    _gpt("gpt3-350m", 24, 1024, 16, **_GPT3),
    _gpt("gpt3-760m", 24, 1536, 16, **_GPT3),
    _gpt("gpt3-1.3b", 24, 2048, 16, **_GPT3),  # the seed's GPT-3 XL
    _gpt("gpt3-2.7b", 32, 2560, 32, **_GPT3),
    _gpt("gpt3-6.7b", 32, 4096, 32, **_GPT3),
    _gpt("gpt3-13b", 40, 5120, 40, **_GPT3),
    _gpt("gpt3-175b", 96, 12288, 96, **_GPT3),
    # tiny shapes for tests and the demo
    ModelConfig(name="gpt-tiny", family="gpt", vocab_size=256, n_layer=2, n_head=4, d_model=32,
                max_seq_len=64, activation="gelu_tanh"),
    ModelConfig(name="gpt-mini", family="gpt", vocab_size=256, n_layer=4, n_head=4, d_model=128,
                max_seq_len=128, activation="gelu_tanh"),
]}

ALIASES = {"gpt2": "gpt2-small", "gpt3-xl": "gpt3-1.3b", "gpt3-small": "gpt3-125m", "gpt3-medium": "gpt3-350m",
           "gpt3-large": "gpt3-760m"}
