"""The MPT family: MPT-7B and MPT-30B (MosaicML 2023).

ALiBi attention biases instead of any position embedding (Press et al. 2022), LayerNorms without bias, no
biases anywhere, a 4x GELU MLP, tied embeddings. Shapes are those of mosaicml/mpt-7b and mpt-30b's config.json.
"""

from __future__ import annotations

from waferscale.models.config import ModelConfig
from waferscale.models.layers import CausalLM


class MPT(CausalLM):
    """An MPT-family causal LM; all structure lives in `layers.py`, driven by the config."""


def _mpt(name: str, *, n_layer: int, d_model: int, n_head: int, ctx: int, vocab: int = 50432) -> ModelConfig:
    return ModelConfig(name=name, family="mpt", vocab_size=vocab, n_layer=n_layer, n_head=n_head, d_model=d_model,
                       d_ff=4 * d_model, max_seq_len=ctx, norm="layernorm", norm_bias=False, activation="gelu",
                       position="alibi", tie_embeddings=True, attn_bias=False, mlp_bias=False)


PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    _mpt("mpt-7b", n_layer=32, d_model=4096, n_head=32, ctx=2048),
    _mpt("mpt-30b", n_layer=48, d_model=7168, n_head=64, ctx=8192),
    # tiny shape for tests: 6 heads, so the ALiBi slopes of a head count that is no power of two are exercised
    _mpt("mpt-tiny", vocab=256, n_layer=2, d_model=48, n_head=6, ctx=64),
]}

ALIASES = {"mpt-7b-instruct": "mpt-7b", "mpt-30b-instruct": "mpt-30b"}
