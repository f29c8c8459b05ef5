"""The Falcon family: Falcon-7B and Falcon-40B (TII 2023, Almazrouei et al.).

Parallel attention + MLP blocks, rotary positions (rotate_half), no biases, a GELU MLP, tied embeddings.
Falcon-7B is multi-query (one key/value head) with one LayerNorm feeding both branches; Falcon-40B
("new_decoder_architecture") has 8 key/value heads and a LayerNorm for each branch. Shapes are those of
tiiuae/falcon-7b and tiiuae/falcon-40b's config.json.
"""

from __future__ import annotations

from waferscale.models.config import ModelConfig
from waferscale.models.layers import CausalLM


class Falcon(CausalLM):
    """A Falcon-family causal LM; all structure lives in `layers.py`, driven by the config."""


def _falcon(name: str, *, vocab: int, n_layer: int, d_model: int, n_head: int, n_kv: int, block: str,
            ctx: int = 2048) -> ModelConfig:
    return ModelConfig(name=name, family="falcon", vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv,
                       d_model=d_model, d_ff=4 * d_model, max_seq_len=ctx, norm="layernorm", activation="gelu",
                       position="rotary", block=block, tie_embeddings=True, attn_bias=False, mlp_bias=False)


PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    _falcon("falcon-7b", vocab=65024, n_layer=32, d_model=4544, n_head=71, n_kv=1, block="parallel_shared_norm"),
    _falcon("falcon-40b", vocab=65024, n_layer=60, d_model=8192, n_head=128, n_kv=8, block="parallel"),
    # tiny shape for tests: grouped-query attention and two norms, as Falcon-40B
    _falcon("falcon-tiny", vocab=256, n_layer=2, d_model=32, n_head=4, n_kv=2, block="parallel", ctx=64),
]}

ALIASES = {"falcon-7b-instruct": "falcon-7b", "falcon-40b-instruct": "falcon-40b"}
