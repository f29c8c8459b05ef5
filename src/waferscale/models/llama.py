"""The Llama family: Llama-2 (Touvron et al. 2023), Llama-3.1 (Meta 2024) and SmolLM2 (Hugging Face 2024).

RMSNorm, rotary positions (with Llama-3.1 frequency scaling), SwiGLU MLP, no biases, grouped-query
attention where n_kv_head < n_head. Shapes are those of each release's config.json.
"""

from __future__ import annotations

from waferscale.models.config import ModelConfig, RopeScaling
from waferscale.models.layers import CausalLM


class Llama(CausalLM):
    """A Llama-family causal LM; all structure lives in `layers.py`, driven by the config."""


def _llama(name: str, *, vocab: int, n_layer: int, d_model: int, n_head: int, n_kv: int, d_ff: int, ctx: int,
           theta: float, tie: bool = False, scaling: RopeScaling | None = None) -> ModelConfig:
    return ModelConfig(name=name, family="llama", vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv,
                       d_model=d_model, d_ff=d_ff, max_seq_len=ctx, norm="rmsnorm", norm_eps=1e-5,
                       activation="swiglu", position="rotary", rope_theta=theta, rope_scaling=scaling,
                       tie_embeddings=tie, attn_bias=False, mlp_bias=False)


# What each release shares across its sizes (Llama 3.1 adds frequency-dependent rope scaling).
_LLAMA2 = dict(vocab=32000, ctx=4096, theta=1e4)
_LLAMA31 = dict(vocab=128256, ctx=131072, theta=5e5, scaling=RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192))
_SMOLLM2 = dict(vocab=49152, ctx=8192, tie=True)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    _llama("llama2-7b", n_layer=32, d_model=4096, n_head=32, n_kv=32, d_ff=11008, **_LLAMA2),
    _llama("llama2-13b", n_layer=40, d_model=5120, n_head=40, n_kv=40, d_ff=13824, **_LLAMA2),
    _llama("llama2-70b", n_layer=80, d_model=8192, n_head=64, n_kv=8, d_ff=28672, **_LLAMA2),
    _llama("llama3.1-8b", n_layer=32, d_model=4096, n_head=32, n_kv=8, d_ff=14336, **_LLAMA31),
    _llama("llama3.1-70b", n_layer=80, d_model=8192, n_head=64, n_kv=8, d_ff=28672, **_LLAMA31),
    _llama("llama3.1-405b", n_layer=126, d_model=16384, n_head=128, n_kv=8, d_ff=53248, **_LLAMA31),
    _llama("smollm2-135m", n_layer=30, d_model=576, n_head=9, n_kv=3, d_ff=1536, theta=1e5, **_SMOLLM2),
    _llama("smollm2-360m", n_layer=32, d_model=960, n_head=15, n_kv=5, d_ff=2560, theta=1e5, **_SMOLLM2),
    _llama("smollm2-1.7b", n_layer=24, d_model=2048, n_head=32, n_kv=32, d_ff=8192, theta=1.3e5, **_SMOLLM2),
    # tiny shape for tests
    _llama("llama-tiny", vocab=256, n_layer=2, d_model=32, n_head=4, n_kv=2, d_ff=64, ctx=64, theta=1e4),
]}

# Instruct releases share the base shapes; their weights come from a checkpoint (see models/gguf.py).
ALIASES = {"smollm2-135m-instruct": "smollm2-135m", "smollm2-360m-instruct": "smollm2-360m",
           "smollm2-1.7b-instruct": "smollm2-1.7b", "llama2-70b-chat": "llama2-70b"}
