"""The GPT-NeoX family: GPT-NeoX-20B (Black et al. 2022) and the Pythia suite (Biderman et al. 2023).

LayerNorm with biases, rotary positions on the first quarter of each head (rotate_half layout), biases
everywhere, a GELU MLP, an untied LM head without bias. Blocks use the parallel residual
x + attn(ln1(x)) + mlp(ln2(x)) (`use_parallel_residual`); `block="sequential"` gives the other setting.
Shapes are those of each release's config.json.
"""

from __future__ import annotations

from waferscale.models.config import ModelConfig
from waferscale.models.layers import CausalLM


class GPTNeoX(CausalLM):
    """A GPT-NeoX-family causal LM; all structure lives in `layers.py`, driven by the config."""


def _neox(name: str, *, vocab: int, n_layer: int, d_model: int, n_head: int, ctx: int = 2048) -> ModelConfig:
    return ModelConfig(name=name, family="gpt_neox", vocab_size=vocab, n_layer=n_layer, n_head=n_head,
                       d_model=d_model, d_ff=4 * d_model, max_seq_len=ctx, norm="layernorm", activation="gelu",
                       position="rotary", rotary_dim=d_model // n_head // 4, block="parallel", tie_embeddings=False)


PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    _neox("gpt-neox-20b", vocab=50432, n_layer=44, d_model=6144, n_head=64),
    _neox("pythia-70m", vocab=50304, n_layer=6, d_model=512, n_head=8),
    _neox("pythia-160m", vocab=50304, n_layer=12, d_model=768, n_head=12),
    _neox("pythia-410m", vocab=50304, n_layer=24, d_model=1024, n_head=16),
    _neox("pythia-1b", vocab=50304, n_layer=16, d_model=2048, n_head=8),
    _neox("pythia-1.4b", vocab=50304, n_layer=24, d_model=2048, n_head=16),
    _neox("pythia-2.8b", vocab=50304, n_layer=32, d_model=2560, n_head=32),
    _neox("pythia-6.9b", vocab=50432, n_layer=32, d_model=4096, n_head=32),
    _neox("pythia-12b", vocab=50688, n_layer=36, d_model=5120, n_head=40),
    # tiny shape for tests
    _neox("gpt-neox-tiny", vocab=256, n_layer=2, d_model=32, n_head=4, ctx=64),
]}

ALIASES = {"neox-20b": "gpt-neox-20b"}
