"""The GPT-J family: GPT-J-6B (Wang & Komatsuzaki 2021, EleutherAI's mesh-transformer-jax).

Attention and MLP run in parallel off one LayerNorm (x + attn(ln(x)) + mlp(ln(x))); rotary positions on the first
`rotary_dim` dims of each head in GPT-J's interleaved "rotate every two" layout; no attention biases, a biased
GELU MLP; an untied LM head with a bias. Shapes are those of EleutherAI/gpt-j-6b's config.json.
"""

from __future__ import annotations

from waferscale.models.config import ModelConfig
from waferscale.models.layers import CausalLM


class GPTJ(CausalLM):
    """A GPT-J-family causal LM; all structure lives in `layers.py`, driven by the config."""


def _gptj(name: str, *, vocab: int, n_layer: int, d_model: int, n_head: int, rotary_dim: int, ctx: int) -> ModelConfig:
    return ModelConfig(name=name, family="gptj", vocab_size=vocab, n_layer=n_layer, n_head=n_head, d_model=d_model,
                       max_seq_len=ctx, norm="layernorm", activation="gelu_tanh", position="rotary",
                       rotary_dim=rotary_dim, rotary_interleaved=True, block="parallel_shared_norm",
                       tie_embeddings=False, attn_bias=False, mlp_bias=True, lm_head_bias=True)


PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    _gptj("gptj-6b", vocab=50400, n_layer=28, d_model=4096, n_head=16, rotary_dim=64, ctx=2048),
    # tiny shape for tests: a quarter of each head rotates, as in GPT-J-6B
    _gptj("gptj-tiny", vocab=256, n_layer=2, d_model=32, n_head=4, rotary_dim=2, ctx=64),
]}

ALIASES = {"gpt-j-6b": "gptj-6b"}
