"""ModelConfig: the one typed description of every zoo model (GPT, Llama and the decoder families beside them).

Derived quantities (head_dim, parameter count, FLOPs per token) are properties so the compiler and the
runtimes read them from one place.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any

from waferscale.errors import ConfigError
from waferscale.models.init import Initializer

FAMILIES = ("gpt", "llama", "gptj", "gpt_neox", "falcon", "mpt", "mistral", "mixtral", "bert", "roberta", "t5")
ENCODERS = ("bert", "roberta")  # bidirectional attention, post-norm blocks, a masked-LM head
ENCODER_DECODERS = ("t5",)  # an encoder stack and a decoder stack with cross-attention, relative positions
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "swiglu", "geglu")  # swiglu / geglu: gated (silu / tanh-GELU gate)
POSITIONS = ("learned", "rotary", "alibi", "relative")  # relative: T5's bucketed relative-position attention bias
# sequential: x += attn(norm1(x)); x += mlp(norm2(x)). parallel: x += attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX,
# Falcon-40B). parallel_shared_norm: one norm feeds both, x += attn(h) + mlp(h), h = norm(x) (GPT-J, Falcon-7B).
# post_norm (BERT, RoBERTa): x = norm1(x + attn(x)); x = norm2(x + mlp(x)).
BLOCKS = ("sequential", "parallel", "parallel_shared_norm", "post_norm")
INITIALIZER_FIELDS = ("initializer", "ffn_initializer", "output_layer_initializer", "ffn_output_layer_initializer",
                      "embedding_initializer")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"
    family: str = "gpt"
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # None = n_head (multi-head); fewer = grouped-query attention
    d_model: int = 768
    d_ff: int | None = None  # None = 4 * d_model
    max_seq_len: int = 1024
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    activation: str = "gelu_tanh"
    position: str = "learned"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rotary_dim: int | None = None  # None = head_dim; fewer: only the first rotary_dim dims of each head rotate
    rotary_interleaved: bool = False  # GPT-J's "rotate every two" pairs (0,1), (2,3).. instead of (i, i + dim/2)
    sliding_window: int | None = None  # attend to at most this many latest positions (self included); None = all
    block: str = "sequential"
    tie_embeddings: bool = True
    attn_bias: bool = True  # bias on q/k/v and output projections
    mlp_bias: bool = True
    norm_bias: bool = True  # LayerNorm's additive bias (RMSNorm has none)
    lm_head_bias: bool = False
    dropout: float = 0.0
    init_std: float = 0.02
    # initializers (models/init.py, Model Zoo's names): initializer: q/k/v and a router; ffn_initializer: the MLP's
    # input projections; output_layer_initializer: the attention output projection; ffn_output_layer_initializer:
    # the MLP's output projection; embedding_initializer: token and learned position embeddings. None: as Model
    # Zoo's model for the family falls back (`CausalLM.init_for`), all None: the family's own rule
    initializer: Initializer | None = None
    ffn_initializer: Initializer | None = None
    output_layer_initializer: Initializer | None = None
    ffn_output_layer_initializer: Initializer | None = None
    embedding_initializer: Initializer | None = None
    # muP as Model Zoo's GPT models compute it (the Cerebras-GPT muP family): the embedding output (token +
    # position) times embeddings_scale, the logits times output_logits_scale, attention logits alpha * q.k / d
    # with scale_qk_dot_by_d (else alpha * q.k / sqrt(d)), d the head size
    embeddings_scale: float = 1.0
    output_logits_scale: float = 1.0
    scale_qk_dot_by_d: bool = False
    attention_logits_alpha: float = 1.0
    # mixture of experts (Mixtral): n_experts > 0 replaces each block's MLP by n_experts MLPs of the same shape
    # (the experts), of which a router picks experts_per_token for each token
    n_experts: int = 0
    experts_per_token: int = 2
    router_aux_loss_coef: float = 0.0  # weight of the router's load-balancing loss in the training loss
    # encoders (BERT, RoBERTa): segment embeddings, RoBERTa's padding token (its positions count from it, as
    # fairseq numbered them) and BERT's next-sentence head (pooler + 2-way classifier)
    type_vocab_size: int = 0  # 0 = no token type embeddings
    pad_token_id: int | None = None
    nsp_head: bool = False
    # the masked-LM loss: None = the mean cross-entropy over the masked positions; a weight w = Model Zoo's BERT
    # loss, w x their sum / the number of sequences (w about 1 / masked positions per sequence gives about the mean)
    mlm_loss_weight: float | None = None
    # encoder-decoders (T5): max_seq_len is the encoder's input length in training (the packed training sequence
    # is that many encoder tokens, then the decoder's); n_layer counts the encoder's layers, n_decoder_layer the
    # decoder's (None = as many); d_kv, the size of each attention head (None = d_model / n_head); the relative
    # attention bias buckets distances logarithmically up to relative_attention_max_distance
    n_decoder_layer: int | None = None
    d_kv: int | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"model config {self.name!r}: {msg}")

        for k, allowed in (("family", FAMILIES), ("norm", NORMS), ("activation", ACTIVATIONS), ("position", POSITIONS),
                           ("block", BLOCKS)):
            if getattr(self, k) not in allowed:
                bad(f"{k} must be one of {allowed}, got {getattr(self, k)!r}")
        for k in ("vocab_size", "n_layer", "n_head", "d_model", "max_seq_len"):
            if int(getattr(self, k)) <= 0:
                bad(f"{k} must be a positive integer, got {getattr(self, k)!r}")
        if self.d_kv is None and self.d_model % self.n_head:
            bad(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.kv_heads:
            bad(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.kv_heads})")
        if self.position == "rotary" and self.rotary_dims % 2:
            bad(f"rotary embeddings need an even rotary_dim, got {self.rotary_dims}")
        if self.rotary_dim is not None and not 0 < self.rotary_dim <= self.head_dim:
            bad(f"rotary_dim must be in 1..head_dim ({self.head_dim}), got {self.rotary_dim}")
        if (self.rotary_dim is not None or self.rotary_interleaved) and self.position != "rotary":
            bad(f"rotary_dim / rotary_interleaved need position 'rotary', got {self.position!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            bad(f"sliding_window must be a positive number of positions or None, got {self.sliding_window}")
        if not self.norm_bias and self.norm != "layernorm":
            bad("norm_bias=False applies to layernorm only (rmsnorm has no bias)")
        if not 0.0 <= self.dropout < 1.0:
            bad(f"dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.rope_scaling, dict):  # accept a plain mapping (from YAML / JSON)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for k in INITIALIZER_FIELDS:
            if getattr(self, k) is not None:  # a name or a mapping (from YAML / JSON) -> Initializer
                object.__setattr__(self, k, Initializer.parse(getattr(self, k)))
        if self.has_mup and (self.is_encoder or self.is_encoder_decoder):
            bad("embeddings_scale / output_logits_scale / scale_qk_dot_by_d / attention_logits_alpha (muP) belong "
                "to the decoder families")
        for k in ("embeddings_scale", "output_logits_scale", "attention_logits_alpha"):
            if not getattr(self, k) > 0:
                bad(f"{k} must be > 0, got {getattr(self, k)}")
        if self.n_experts < 0:
            bad(f"n_experts must be 0 (a dense MLP) or a positive number of experts, got {self.n_experts}")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            bad(f"experts_per_token must be in 1..n_experts ({self.n_experts}), got {self.experts_per_token}")
        if self.router_aux_loss_coef < 0:
            bad(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        if self.is_encoder != (self.block == "post_norm"):
            bad(f"family {self.family!r} needs block 'post_norm' if and only if it is an encoder {ENCODERS}, "
                f"got block {self.block!r}")
        if self.is_encoder and (self.position != "learned" or self.n_experts or self.sliding_window
                                or self.gated_mlp):
            bad("encoders have learned positions, a two-matrix MLP, no experts and no sliding window")
        if (self.type_vocab_size or self.nsp_head) and not self.is_encoder:
            bad(f"type_vocab_size / nsp_head belong to the encoder families {ENCODERS}")
        if self.mlm_loss_weight is not None and not (self.is_encoder or self.is_encoder_decoder):
            bad(f"mlm_loss_weight belongs to the encoder and encoder-decoder families {ENCODERS + ENCODER_DECODERS}")
        if self.mlm_loss_weight is not None and self.mlm_loss_weight <= 0:
            bad(f"mlm_loss_weight must be > 0 (or None for the mean over the masked positions), got "
                f"{self.mlm_loss_weight}")
        if self.family == "roberta" and self.pad_token_id is None:
            bad("roberta needs pad_token_id (its positions start after it)")
        if self.d_kv is not None and self.d_kv <= 0:
            bad(f"d_kv must be a positive head size or None (d_model / n_head), got {self.d_kv}")
        if self.is_encoder_decoder != (self.position == "relative"):
            bad(f"position 'relative' (T5's bucketed bias) belongs to the encoder-decoder families {ENCODER_DECODERS} "
                f"and they need it, got family {self.family!r} with position {self.position!r}")
        if self.n_decoder_layer is not None and (not self.is_encoder_decoder or self.n_decoder_layer <= 0):
            bad(f"n_decoder_layer is a positive layer count of the encoder-decoder families {ENCODER_DECODERS}, got "
                f"{self.n_decoder_layer} for family {self.family!r}")
        if self.is_encoder_decoder:
            if self.relative_attention_num_buckets < 4 or self.relative_attention_max_distance <= 0:
                bad("relative_attention_num_buckets must be >= 4 and relative_attention_max_distance positive")
            if self.n_experts or self.sliding_window or self.block != "sequential" or self.n_kv_head not in (
                    None, self.n_head):
                bad("T5 blocks are sequential pre-norm blocks with multi-head attention, no experts and no "
                    "sliding window")
            if self.attn_bias or self.mlp_bias or self.lm_head_bias or not self.norm_bias:
                bad("T5 has no biases: set attn_bias, mlp_bias and lm_head_bias False (norm_bias stays True: an "
                    "rmsnorm has none)")
            if self.pad_token_id is None:
                bad("t5 needs pad_token_id (the decoder starts from it)")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def has_mup(self) -> bool:
        """Whether any muP scaling differs from the standard parameterization's."""
        return (self.embeddings_scale, self.output_logits_scale, self.scale_qk_dot_by_d,
                self.attention_logits_alpha) != (1.0, 1.0, False, 1.0)

    @property
    def attention_scale(self) -> float:
        """The factor on q.k in attention: 1 / sqrt(head size), or muP's alpha / head size (see the fields)."""
        return self.attention_logits_alpha / (self.head_dim if self.scale_qk_dot_by_d else math.sqrt(self.head_dim))

    @property
    def is_encoder(self) -> bool:
        return self.family in ENCODERS

    @property
    def is_encoder_decoder(self) -> bool:
        return self.family in ENCODER_DECODERS

    @property
    def decoder_layers(self) -> int:
        """Layers of an encoder-decoder's decoder stack (0 for the other families)."""
        return (self.n_decoder_layer or self.n_layer) if self.is_encoder_decoder else 0

    @property
    def gated_mlp(self) -> bool:
        return self.activation in ("swiglu", "geglu")

    @property
    def position_offset(self) -> int:
        """Index of position 0 in the position table: RoBERTa's are numbered after its padding token."""
        return self.pad_token_id + 1 if self.family == "roberta" else 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_kv or self.d_model // self.n_head

    @property
    def rotary_dims(self) -> int:
        """How many dims of each head rotate (0 without rotary positions)."""
        return (self.rotary_dim or self.head_dim) if self.position == "rotary" else 0

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def norm_params(self) -> int:
        return 2 * self.d_model if self.norm == "layernorm" and self.norm_bias else self.d_model

    @property
    def params_per_block(self) -> int:
        d, hd = self.d_model, self.head_dim
        q_out, kv_out = self.n_head * hd, 2 * self.kv_heads * hd
        attn = d * (q_out + kv_out) + q_out * d
        if self.attn_bias:
            attn += q_out + kv_out + d
        mlp = self.mlp_params * max(1, self.n_experts) + d * self.n_experts  # every expert, and the router
        return attn + mlp + (1 if self.block == "parallel_shared_norm" else 2) * self.norm_params

    @property
    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        d = self.d_model
        if self.is_encoder_decoder:  # one shared embedding, a relative-bias table per stack, a final norm per stack
            attn = 4 * d * self.n_head * self.head_dim
            enc = attn + self.mlp_params + 2 * self.norm_params
            dec = 2 * attn + self.mlp_params + 3 * self.norm_params
            tables = 2 * self.relative_attention_num_buckets * self.n_head
            head = 0 if self.tie_embeddings else self.vocab_size * d
            return (self.vocab_size * d + tables + self.n_layer * enc + self.decoder_layers * dec
                    + 2 * self.norm_params + head)
        emb = self.vocab_size * d + ((self.max_seq_len + self.position_offset) * d if self.position == "learned" else 0)
        head = (0 if self.tie_embeddings else self.vocab_size * d) + (self.vocab_size if self.lm_head_bias else 0)
        if self.is_encoder:  # segments and the embedding norm; the MLM head's transform (dense + norm); the NSP head
            emb += self.type_vocab_size * d + self.norm_params
            head += d * d + d + (d * d + d + 2 * d + 2 if self.nsp_head else 0)
        return emb + self.n_layer * self.params_per_block + self.norm_params + head

    @property
    def mlp_params(self) -> int:
        """Parameters of one MLP: the block's, or one expert's in a mixture of experts."""
        n_mats = 3 if self.gated_mlp else 2
        bias = (n_mats - 1) * self.ffn_dim + self.d_model if self.mlp_bias else 0
        return n_mats * self.d_model * self.ffn_dim + bias

    @property
    def idle_params_per_block(self) -> int:
        """Parameters of a block that a token does not use: the experts the router did not pick (0 if dense)."""
        return (self.n_experts - self.experts_per_token) * self.mlp_params if self.n_experts else 0

    @property
    def active_params_per_block(self) -> int:
        return self.params_per_block - self.idle_params_per_block

    @property
    def num_active_params(self) -> int:
        """Parameters one token computes with (a mixture of experts: only its routed experts; else num_params)."""
        return self.num_params - self.n_layer * self.idle_params_per_block

    def flops_per_token(self, seq_len: int | None = None, training: bool = True) -> float:
        """Model FLOPs per token (PaLM appendix B): 6N + 12·L·H·T (training) or a third of it (forward).

        N excludes the embedding lookups (they are gathers, not matmuls) but includes the LM head; in a mixture of
        experts it counts only the experts a token is routed to (and the router).
        """
        t = seq_len or self.max_seq_len
        if self.is_encoder_decoder:
            return self._encoder_decoder_flops(t, training)
        n = self.n_layer * self.active_params_per_block + self.vocab_size * self.d_model
        fwd = 2 * n + 4 * self.n_layer * t * self.d_model  # + QK^T and AV over the full window, as PaLM counts
        return 3 * fwd if training else fwd

    def _encoder_decoder_flops(self, t: int, training: bool) -> float:
        """Per token of a packed training sequence of t tokens: max_seq_len encoder tokens, then t - max_seq_len
        decoder tokens (t <= max_seq_len: t encoder tokens and as many decoder tokens). Matmuls 2 FLOPs per
        weight per token (each stack's tokens through its layers; the decoder's also through the head), attention
        4 * keys * inner per token and layer (self-attention over its own stack, cross-attention over the
        encoder's tokens)."""
        enc_t = min(t, self.max_seq_len)
        dec_t = t - enc_t if t > self.max_seq_len else enc_t
        inner = self.n_head * self.head_dim
        attn = 4 * self.d_model * inner
        enc_w = self.n_layer * (attn + self.mlp_params)
        dec_w = self.decoder_layers * (2 * attn + self.mlp_params) + self.vocab_size * self.d_model
        fwd = (2 * (enc_t * enc_w + dec_t * dec_w) + 4 * inner * (self.n_layer * enc_t * enc_t
               + self.decoder_layers * (dec_t * dec_t + dec_t * enc_t)))
        fwd /= enc_t + dec_t
        return 3 * fwd if training else fwd

    def replace(self, **overrides: Any) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, known, 1)) else repr(k)
                     for k in unknown]
            raise ConfigError(f"model config {self.name!r}: unknown field(s) {', '.join(hints)}; "
                             f"known fields: {', '.join(sorted(known))}")
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**d)  # __post_init__ turns a rope_scaling dict into RopeScaling


__all__ = ["ModelConfig", "RopeScaling"]
