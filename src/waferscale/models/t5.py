"""The encoder-decoder family: T5 (Raffel et al. 2020), T5 v1.1 and FLAN-T5 (Chung et al. 2022).

An encoder stack reads the input; a decoder stack generates the output, each of its layers attending to its own
past (causal self-attention) and to the encoder's output (cross-attention). Blocks are pre-norm with T5's
LayerNorm (RMS: no mean, no bias), attention has no biases and no 1/sqrt(d) scaling (T5 folds it into the query
initialisation), and positions enter only as a learned bias on the attention scores, one per (head, bucket of
relative distance): bidirectional buckets in the encoder, causal ones in the decoder. Each stack's table belongs
to its first layer and serves every layer of the stack, as in Hugging Face's T5 (here the other layers borrow
it, so a streamed layer receives it with its own weights and sends its gradient back to the owner's). The
feed-forward is ReLU (T5 v1.0) or tanh-GELU-gated (v1.1, FLAN-T5: activation geglu). v1.0 ties the output head
to the shared token embedding and scales the decoder's output by d_model**-0.5 first; v1.1 / FLAN-T5 have an
untied head and no scaling (tie_embeddings says which).

Units, for weight streaming and SwarmX: embedding, the encoder's layers, the encoder's final norm, the decoder's
layers, the head. They run on one packed sequence per example, max_seq_len encoder tokens then the decoder's
tokens: the embedding embeds both; an encoder unit updates the encoder part and passes the decoder part through;
a decoder unit reads the encoder part (its cross-attention keys and values) and updates the decoder part; the
head computes the logits of the decoder part. The encoder's output thus travels alongside the decoder stream,
and the gradient of every decoder layer's cross-attention reaches it and flows back into the encoder. Generation
and Hugging Face parity use `encode` / `decode` on separate inputs, with the same layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from waferscale.errors import ConfigError
from waferscale.models.config import ModelConfig
from waferscale.models.layers import CausalLM, KVCache, lm_loss, make_norm

__all__ = ["T5", "relative_position_bucket", "PRESETS", "ALIASES"]


def relative_position_bucket(rel: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """Bucket of each relative position (key position - query position), Mesh TensorFlow's rule as T5 uses it:
    half the buckets hold exact distances, the other half logarithmically wider bins up to max_distance (all
    farther distances share the last); bidirectional: half the buckets for keys after the query, else keys after
    the query fall in bucket 0 (the causal mask removes them)."""
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets += (rel > 0).long() * num_buckets
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(rel < max_exact, rel, large)


class RelativeBias(nn.Module):
    """A stack's relative-position bias table (buckets, heads) -> the attention bias (1, nh, T, S)."""

    def __init__(self, cfg: ModelConfig, bidirectional: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.relative_attention_num_buckets, cfg.n_head))
        self.bidirectional = bidirectional
        self.max_distance = cfg.relative_attention_max_distance

    def forward(self, q_len: int, k_len: int, q_start: int = 0) -> Tensor:
        """Bias of q_len queries at positions q_start.. over keys at 0..k_len-1; causal (the decoder's): keys
        after their query get -inf."""
        dev = self.weight.device
        q = torch.arange(q_start, q_start + q_len, device=dev)[:, None]
        rel = torch.arange(k_len, device=dev)[None, :] - q  # (T, S)
        buckets = relative_position_bucket(rel, self.bidirectional, self.weight.shape[0], self.max_distance)
        # index_select, not F.embedding: the same rows, but its backward (an index_add into the few buckets) costs
        # a fifth of the embedding's (which sorts the T * S indices), in every layer of every step
        rows = self.weight.index_select(0, buckets.reshape(-1)).view(*buckets.shape, -1)  # (T, S, nh)
        bias = rows.permute(2, 0, 1).unsqueeze(0)  # (1, nh, T, S)
        return bias if self.bidirectional else bias.masked_fill(rel > 0, float("-inf"))


class T5Attention(nn.Module):
    """Multi-head attention without biases or score scaling: softmax(q k^T + bias) v. Self-attention, or
    cross-attention over given keys and values (`kv`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.hd = cfg.n_head, cfg.head_dim
        inner = self.n_head * self.hd
        self.q_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.o_proj = nn.Linear(inner, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def _heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.n_head, self.hd).transpose(1, 2)  # (B, nh, T, hd)

    def kv(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, nh, S, hd) of `src` (B, S, C): what cross-attention computes once per encoding."""
        return self._heads(self.k_proj(src)), self._heads(self.v_proj(src))

    def forward(self, x: Tensor, bias: Tensor | None, kv: tuple[Tensor, Tensor] | None = None,
                cache: KVCache | None = None, start_pos: int = 0) -> Tensor:
        B, T, _ = x.shape
        q = self._heads(self.q_proj(x))
        if kv is None:
            k, v = self.kv(x)
            if cache is not None:
                k, v = cache.update(start_pos, k, v)  # (B, nh, start_pos + T, hd)
        else:
            k, v = kv
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias.to(q.dtype),
                                           dropout_p=self.dropout if self.training else 0.0, scale=1.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.hd))


class T5MLP(nn.Module):
    """down(dropout(act(up(x)))) (T5 v1.0: relu), or gated, down(dropout(act(gate(x)) * up(x))) (v1.1: geglu).
    Hugging Face's wi / wi_0, wi_1 and wo are up_proj / gate_proj, up_proj and down_proj."""

    ACTS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
            "geglu": lambda x: F.gelu(x, approximate="tanh"), "swiglu": F.silu}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False) if cfg.gated_mlp else None
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)
        self.act = self.ACTS[cfg.activation]
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.up_proj(x)) if self.gate_proj is None else self.act(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(self.drop(h))


# ---- the units ------------------------------------------------------------------------------------------

class T5Embedding(nn.Module):
    """Unit 0: token ids (B, S) -> the shared token embedding (B, S, C) (encoder and decoder tokens alike)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        return self.drop(self.tok(idx))


class _PackedUnit(nn.Module):
    """A unit over the packed sequence: the first `split` positions are the encoder's, the rest the decoder's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.split = cfg.max_seq_len

    def _parts(self, h: Tensor) -> tuple[Tensor, Tensor]:
        if h.shape[1] <= self.split:
            raise ConfigError(f"a packed T5 sequence is max_seq_len ({self.split}) encoder tokens followed by the "
                              f"decoder's, got {h.shape[1]} positions in all")
        return h[:, :self.split], h[:, self.split:]


class EncoderBlock(_PackedUnit):
    """One encoder layer: x += attn(norm(x), bidirectional bias); x += mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, rel: RelativeBias) -> None:
        super().__init__(cfg)
        self.rel = rel  # the stack's table: owned by the first layer (registered there first), borrowed after
        self.attn_norm = make_norm(cfg)
        self.attn = T5Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = T5MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def layer(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), bias))
        return x + self.drop(self.mlp(self.mlp_norm(x)))

    def forward(self, h: Tensor) -> Tensor:
        enc, dec = self._parts(h)
        return torch.cat((self.layer(enc, self.rel(enc.shape[1], enc.shape[1])), dec), dim=1)


class EncoderNorm(_PackedUnit):
    """The encoder's final norm (and dropout): its output is what every decoder layer attends to."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.norm = make_norm(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def final(self, x: Tensor) -> Tensor:
        return self.drop(self.norm(x))

    def forward(self, h: Tensor) -> Tensor:
        enc, dec = self._parts(h)
        return torch.cat((self.final(enc), dec), dim=1)


class DecoderBlock(_PackedUnit):
    """One decoder layer: y += self_attn(norm(y), causal bias); y += cross_attn(norm(y), encoder output);
    y += mlp(norm(y))."""

    def __init__(self, cfg: ModelConfig, rel: RelativeBias) -> None:
        super().__init__(cfg)
        self.rel = rel
        self.attn_norm = make_norm(cfg)
        self.attn = T5Attention(cfg)
        self.cross_norm = make_norm(cfg)
        self.cross = T5Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = T5MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def layer(self, y: Tensor, enc: Tensor | None, bias: Tensor, cross_kv: tuple[Tensor, Tensor] | None = None,
              cache: KVCache | None = None, start_pos: int = 0) -> Tensor:
        y = y + self.drop(self.attn(self.attn_norm(y), bias, cache=cache, start_pos=start_pos))
        y = y + self.drop(self.cross(self.cross_norm(y), None, kv=cross_kv if cross_kv is not None
                                     else self.cross.kv(enc)))
        return y + self.drop(self.mlp(self.mlp_norm(y)))

    def forward(self, h: Tensor) -> Tensor:
        enc, dec = self._parts(h)
        return torch.cat((enc, self.layer(dec, enc, self.rel(dec.shape[1], dec.shape[1]))), dim=1)


class T5Head(_PackedUnit):
    """Last unit: the decoder's final norm (and dropout), T5 v1.0's d_model**-0.5 rescale when the head is tied,
    the LM head: packed (B, S, C) -> logits of the decoder positions (B, S - max_seq_len, V)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.norm = make_norm(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.scale = cfg.d_model ** -0.5 if cfg.tie_embeddings else None

    def logits(self, y: Tensor) -> Tensor:
        y = self.drop(self.norm(y))
        return self.lm_head(y * self.scale if self.scale is not None else y)

    def forward(self, h: Tensor) -> Tensor:
        return self.logits(self._parts(h)[1])


class T5(CausalLM):
    """Encoder-decoder: `forward(input_ids, decoder_input_ids)` -> logits of the decoder positions; `forward` of
    one packed sequence (input ids then decoder ids) runs the units, as the streaming runtimes do."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)  # (CausalLM's constructor builds a decoder-only chain)
        self.config = cfg
        self.embed = T5Embedding(cfg)
        enc_rel, dec_rel = RelativeBias(cfg, bidirectional=True), RelativeBias(cfg, bidirectional=False)
        self.encoder = nn.ModuleList(EncoderBlock(cfg, enc_rel) for _ in range(cfg.n_layer))
        self.encoder_norm = EncoderNorm(cfg)
        self.decoder = nn.ModuleList(DecoderBlock(cfg, dec_rel) for _ in range(cfg.decoder_layers))
        self.head = T5Head(cfg)
        if cfg.tie_embeddings:
            self.head.lm_head.weight = self.embed.tok.weight
        if not self.head.lm_head.weight.is_meta:
            self.reset_parameters()

    def units(self) -> list[nn.Module]:
        return [self.embed, *self.encoder, self.encoder_norm, *self.decoder, self.head]

    # ---- separate inputs: parity with Hugging Face, generation ----
    def encode(self, idx: Tensor) -> Tensor:
        """Input ids (B, L) -> the encoder's output (B, L, C) (one bias, computed once, serves every layer)."""
        x = self.embed(idx)
        bias = self.encoder[0].rel(idx.shape[1], idx.shape[1])
        for block in self.encoder:
            x = block.layer(x, bias)
        return self.encoder_norm.final(x)

    def decode(self, idx: Tensor, enc: Tensor | None, start_pos: int = 0, kv_caches: list[KVCache] | None = None,
               cross_kv: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
        """Decoder ids (B, T) at positions start_pos.. -> logits (B, T, V). With `kv_caches` (`make_kv_caches`)
        the self-attention keys and values of earlier positions come from them; `cross_kv` (`cross_kv(enc)`)
        are the cross-attention keys and values, computed once per encoding (then `enc` may be None)."""
        y = self.embed(idx)
        T = idx.shape[1]
        bias = self.decoder[0].rel(T, start_pos + T, start_pos)
        for i, block in enumerate(self.decoder):
            y = block.layer(y, enc, bias, cross_kv[i] if cross_kv is not None else None,
                            kv_caches[i] if kv_caches is not None else None, start_pos)
        return self.head.logits(y)

    def cross_kv(self, enc: Tensor) -> list[tuple[Tensor, Tensor]]:
        return [block.cross.kv(enc) for block in self.decoder]

    def forward(self, idx: Tensor, decoder_input_ids: Tensor | None = None,
                with_aux: bool = False) -> Tensor | tuple[Tensor, None]:
        """(input ids (B, L), decoder ids (B, T)) -> logits (B, T, V); without decoder ids, `idx` is the packed
        sequence (B, max_seq_len + T) and runs unit by unit. `with_aux`: (logits, None), T5 has no auxiliary
        loss."""
        if decoder_input_ids is not None:
            logits = self.decode(decoder_input_ids, self.encode(idx))
        else:
            logits = idx
            for unit in self.units():
                logits = unit(logits)
        return (logits, None) if with_aux else logits

    def forward_aux(self, idx: Tensor) -> tuple[Tensor, None]:
        return self(idx, with_aux=True)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Packed targets (B, max_seq_len + T): -100 over the encoder part, then the decoder's labels. The mean
        cross-entropy over the labels or, with `mlm_loss_weight`, Model Zoo's weight x their sum / the number of
        sequences."""
        targets = targets[:, self.config.max_seq_len:]
        w = self.config.mlm_loss_weight
        if w is None:
            return lm_loss(logits, targets)
        total = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
                                reduction="sum")
        return w * total / targets.shape[0]

    def make_kv_caches(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> list[KVCache]:
        """The decoder's self-attention caches (cross-attention keys and values: `cross_kv`)."""
        cfg, p = self.config, self.head.lm_head.weight
        return [KVCache(batch, cfg.n_head, max_len, cfg.head_dim, dtype or p.dtype, device or p.device)
                for _ in range(cfg.decoder_layers)]

    def init_buffers(self, device: torch.device | str = "cpu") -> None:
        """T5 has no non-persistent buffers (its positions are the learned bias tables)."""

    @torch.no_grad()
    def init_parameter(self, name: str, t: Tensor) -> None:
        """T5's initialisation (Mesh TensorFlow's, as transformers' T5 with initializer_factor 1): embeddings and
        an untied head N(0, 1); queries N(0, (d_model * d_kv)^-1/2), keys, values, the bias tables and the
        feed-forward's input N(0, d_model^-1/2); attention outputs N(0, (n_head * d_kv)^-1/2); the feed-forward's
        output N(0, d_ff^-1/2); norms 1 (a LayerNorm's bias, where a Model Zoo config asks for one, 0)."""
        cfg = self.config
        d, inner = cfg.d_model, cfg.n_head * cfg.head_dim
        std = {"tok": 1.0, "lm_head": 1.0, "q_proj": (d * cfg.head_dim) ** -0.5, "o_proj": inner ** -0.5,
               "down_proj": cfg.ffn_dim ** -0.5}
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith("norm.bias"):
            t.zero_()
        else:
            t.normal_(0.0, std.get(name.split(".")[-2], d ** -0.5))


def _t5(name: str, *, d_model: int, n_layer: int, n_head: int, d_ff: int, v11: bool, vocab: int = 32128,
        d_kv: int = 64, ctx: int = 512) -> ModelConfig:
    """T5 v1.0 (relu, tied head) or v1.1 / FLAN-T5 (geglu, untied head): no biases, T5 LayerNorm (eps 1e-6),
    32 buckets up to distance 128, pad (0) starts the decoder."""
    return ModelConfig(name=name, family="t5", vocab_size=vocab, n_layer=n_layer, n_head=n_head, d_model=d_model,
                       d_ff=d_ff, d_kv=d_kv, max_seq_len=ctx, norm="rmsnorm", norm_eps=1e-6,
                       activation="geglu" if v11 else "relu", position="relative", tie_embeddings=not v11,
                       attn_bias=False, mlp_bias=False, pad_token_id=0)


# Shapes of the released checkpoints' config.json (google-t5/t5-small, -base, -large; google/flan-t5-small, -base,
# -large, -xl, which share T5 v1.1's shapes); vocabulary 32128 (SentencePiece's 32000, 100 sentinels, padding).
PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    _t5("t5-small", d_model=512, n_layer=6, n_head=8, d_ff=2048, v11=False),  # 60.5 M
    _t5("t5-base", d_model=768, n_layer=12, n_head=12, d_ff=3072, v11=False),  # 223 M
    _t5("t5-large", d_model=1024, n_layer=24, n_head=16, d_ff=4096, v11=False),  # 738 M
    _t5("flan-t5-small", d_model=512, n_layer=8, n_head=6, d_ff=1024, v11=True),  # 77 M
    _t5("flan-t5-base", d_model=768, n_layer=12, n_head=12, d_ff=2048, v11=True),  # 248 M
    _t5("flan-t5-large", d_model=1024, n_layer=24, n_head=16, d_ff=2816, v11=True),  # 783 M
    _t5("flan-t5-xl", d_model=2048, n_layer=24, n_head=32, d_ff=5120, v11=True),  # 2.85 B
    # tiny shapes for tests: v1.0 and v1.1 structure
    _t5("t5-tiny", d_model=32, n_layer=2, n_head=4, d_ff=64, d_kv=8, v11=False, vocab=256, ctx=64),
    _t5("flan-t5-tiny", d_model=32, n_layer=2, n_head=4, d_ff=64, d_kv=8, v11=True, vocab=256, ctx=64),
]}

ALIASES = {"t5": "t5-small", "flan-t5": "flan-t5-base", "t5-v1_1-small": "flan-t5-small",
           "t5-v1_1-base": "flan-t5-base", "t5-v1_1-large": "flan-t5-large", "t5-v1_1-xl": "flan-t5-xl"}
