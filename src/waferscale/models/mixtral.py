"""The Mixtral family (Mistral AI 2024): sparse mixtures of experts on Mistral's decoder.

Mistral's attention (grouped-query, rotary with theta 1e6; no sliding window in these releases), RMSNorm, no
biases, untied head; each block's MLP is 8 SwiGLU experts of which a router picks 2 per token (`layers.MoE`),
trained with the router's load-balancing loss weighted by `router_aux_loss_coef`. Shapes are those of each
release's config.json. A token computes with `num_active_params` of the `num_params` (12.9 B of 46.7 B for
Mixtral-8x7B), yet every expert's weights must be held.
"""

from __future__ import annotations

from waferscale.models.config import ModelConfig
from waferscale.models.layers import CausalLM


class Mixtral(CausalLM):
    """A Mixtral-family causal LM; all structure lives in `layers.py`, driven by the config."""


def _mixtral(name: str, *, vocab: int, n_layer: int, d_model: int, n_head: int, n_kv: int, d_ff: int, ctx: int,
             experts: int = 8, top_k: int = 2, aux: float, theta: float = 1e6) -> ModelConfig:
    return ModelConfig(name=name, family="mixtral", vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv,
                       d_model=d_model, d_ff=d_ff, max_seq_len=ctx, norm="rmsnorm", norm_eps=1e-5,
                       activation="swiglu", position="rotary", rope_theta=theta, tie_embeddings=False,
                       attn_bias=False, mlp_bias=False, n_experts=experts, experts_per_token=top_k,
                       router_aux_loss_coef=aux)


PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    _mixtral("mixtral-8x7b", vocab=32000, n_layer=32, d_model=4096, n_head=32, n_kv=8, d_ff=14336, ctx=32768,
             aux=0.02),
    _mixtral("mixtral-8x22b", vocab=32000, n_layer=56, d_model=6144, n_head=48, n_kv=8, d_ff=16384, ctx=65536,
             aux=0.001),
    # tiny shape for tests
    _mixtral("mixtral-tiny", vocab=256, n_layer=2, d_model=32, n_head=4, n_kv=2, d_ff=64, ctx=64, experts=4,
             aux=0.02, theta=1e4),
]}

# The instruct release of 8x7B shares the base shape; its weights come from a checkpoint.
ALIASES = {"mixtral-8x7b-instruct": "mixtral-8x7b"}
