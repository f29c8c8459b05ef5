"""The Mistral family: Mistral-7B v0.1 (Jiang et al. 2023).

Llama's structure (RMSNorm, rotary, SwiGLU, no biases, grouped-query attention with 8 key/value heads) with
sliding-window attention: each position attends to the latest `sliding_window` positions (itself included),
in training, in prefill and with the KV cache. Shapes are those of mistralai/Mistral-7B-v0.1's config.json.
"""

from __future__ import annotations

from waferscale.models.config import ModelConfig
from waferscale.models.layers import CausalLM


class Mistral(CausalLM):
    """A Mistral-family causal LM; all structure lives in `layers.py`, driven by the config."""


def _mistral(name: str, *, vocab: int, n_layer: int, d_model: int, n_head: int, n_kv: int, d_ff: int, ctx: int,
             window: int) -> ModelConfig:
    return ModelConfig(name=name, family="mistral", vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv,
                       d_model=d_model, d_ff=d_ff, max_seq_len=ctx, norm="rmsnorm", norm_eps=1e-5,
                       activation="swiglu", position="rotary", rope_theta=10000.0, sliding_window=window,
                       tie_embeddings=False, attn_bias=False, mlp_bias=False)


PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    _mistral("mistral-7b", vocab=32000, n_layer=32, d_model=4096, n_head=32, n_kv=8, d_ff=14336, ctx=32768,
             window=4096),
    # tiny shape for tests: a window shorter than the context, so it matters
    _mistral("mistral-tiny", vocab=256, n_layer=2, d_model=32, n_head=4, n_kv=2, d_ff=64, ctx=64, window=8),
]}

ALIASES = {"mistral-7b-v0.1": "mistral-7b"}
