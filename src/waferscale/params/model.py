"""The params file's `model` section: Model Zoo keys, optionally on top of a zoo preset, mapped onto our
`ModelConfig` (`ModelParams.to_model_config`).

Our extensions to the Model Zoo keys (all optional):
    model.name            a zoo preset to start from ('gpt-mini', 'gpt3-1.3b', 'llama2-70b', ...); explicit Model
                          Zoo keys override it. Model Zoo family names ('llama', 'gpt3', ...) are labels only.
    model.pretrained      weights to start from: a zoo name whose weights ship as an asset
                          ('smollm2-135m-instruct'), a Hugging Face model dir, or a .gguf file
    model.rope_scaling    {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}
                          (same meaning as Model Zoo's pos_scaling_type: llama3 + pos_scaling_*)

Initializers (`initializer`, `ffn_initializer`, `output_layer_initializer`, `ffn_output_layer_initializer`,
`embedding_initializer`: models/init.py) apply where Model Zoo's models apply them (`CausalLM.init_for`); a decoder
config naming no preset and giving none initializes as Model Zoo's models do by default (truncated_normal(0,
initializer_range)), one on a preset keeps the preset's rule. muP: the Cerebras-GPT configs' scalings
(embeddings_scale, output_logits_scale, scale_qk_dot_by_d, attention_logits_alpha, width-scaled initializers,
optimizer.adjust_learning_rate), or Model Zoo 2.3's base widths (mup_base_hidden_size, mup_base_filter_size), from
which they are derived as Model Zoo derives them.

Model Zoo runs GPT-J, GPT-NeoX and Falcon as one model (`name: gptj` or `falcon`): parallel attention + MLP
blocks, with one LayerNorm or, under `use_untied_layer_norm: true`, one per branch. Which of our families a
config is follows from its structure: ALiBi -> MPT; parallel blocks -> Falcon (named so, or grouped-query),
else GPT-NeoX (two norms) or GPT-J (one norm, rotating GPT-J's interleaved pairs); a sliding window on a SwiGLU
model -> Mistral.

Model Zoo's BERT model is an encoder (post-norm blocks, the embedding LayerNorm, the masked-LM head and, unless
`disable_nsp`, the next-sentence head with two segments); its RoBERTa configs are the same model with
`mask_padding_in_positional_embed` (positions counted over the non-padding tokens) and no NSP head. A config is
an encoder when its name says so (`bert`, `roberta`, or an encoder preset) or, unnamed, when it has a key only the
BERT model has (`ENCODER_KEYS`); such a key on a decoder is an error, never a fallback to GPT.

Model Zoo's T5 model is an encoder-decoder (our t5 family): a config is one when it names a T5 preset or `t5`, or
has a key only the T5 model has (`T5_KEYS`). Its vocabulary is src_vocab_size + extra_ids (the sentinels); one
embedding serves both stacks (share_encoder_decoder_embedding) and, under share_embedding_weights, the head;
d_kv is the head size, use_t5_layer_norm / norm_type choose T5's RMS norm or LayerNorm, encoder_nonlinearity
(= decoder_nonlinearity) relu, gelu or geglu (gated-gelu), src_max_position_embeddings the encoder's input length.
The loss is the mean over the target tokens (mlm_loss_scaling num_masked / precomputed_num_masked), or
lm_loss_weight x their sum / the number of sequences (batch_size, Model Zoo's default).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from waferscale.errors import ConfigError
from waferscale.models.config import INITIALIZER_FIELDS, ModelConfig, RopeScaling
from waferscale.models.init import Initializer
from waferscale.params.typed import Ctx, FieldError, check_fields, to_plain


def _convert_initializer(value: Any, path: str, ctx: Ctx, line: int | None) -> Initializer:
    """An initializer as Model Zoo gives one: a name, or a mapping with `name` and its arguments."""
    try:
        return Initializer.parse(to_plain(value))
    except ConfigError as e:
        raise ctx.error(path, str(e), line) from None


def _initializer_field() -> Any:
    return dataclasses.field(default=None, metadata={"convert": _convert_initializer})


@dataclass
class ExtraAttentionParams:
    num_kv_groups: int | None = None  # key/value heads (grouped-query attention); None = num_heads


@dataclass
class PosScalingExtraArgs:
    """Model Zoo's `pos_scaling_extra_args` for `pos_scaling_type: llama3`."""

    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class MoEParams:
    """Model Zoo's `moe` section (its MoEConfig): every block's MLP becomes `num_experts` experts, of which a
    learned softmax router picks `top_k` per token, weighted by their renormalized probabilities (Mixtral)."""

    num_experts: int = 0  # 0: a dense MLP
    top_k: int = 1
    load_balancing_loss_coef: float = 0.0
    routing_algorithm: Literal["learned"] = "learned"
    router_selection_nonlinearity: Literal["softmax"] = "softmax"
    expert_weighting_nonlinearity: Literal["softmax"] = "softmax"
    expert_weighting_normalization: bool = True
    num_shared_experts: int | None = None
    null_expert_bias: float | None = None
    probability_before_ffn: bool = False

    IGNORED_KEYS: ClassVar[dict[str, str]] = {
        "router_fp32": "the router's softmax always runs in fp32",
        "moe_implementation": "the implementation is the runtime's",
        "sinkhorn_n_iters": "used by sinkhorn routing only, which is not supported",
        "gate_initializer": "the router's weights take model.initializer (else the model's default initializer)",
    }

    def __post_init__(self) -> None:
        if not self.expert_weighting_normalization:
            raise FieldError("expert_weighting_normalization", "false is not supported: the chosen experts' "
                             "weights are renormalized to sum to 1 (Mixtral); set true")
        if self.num_shared_experts:
            raise FieldError("num_shared_experts", f"{self.num_shared_experts} is not supported: every expert is "
                             f"routed; set 0")
        if self.null_expert_bias:
            raise FieldError("null_expert_bias", f"{self.null_expert_bias} is not supported (no null expert); set 0")
        if self.probability_before_ffn:
            raise FieldError("probability_before_ffn", "true is not supported: the router's weights scale the "
                             "experts' outputs (Mixtral); set false")


# Model Zoo model names (trainer layout `model.name`) that say which family, not which preset.
ZOO_FAMILY_NAMES = ("gpt2", "gpt3", "gptj", "gpt-neox", "gpt_neox", "llama", "mistral", "mixtral", "falcon", "bloom",
                    "starcoder", "santacoder", "btlm", "jais", "mpt", "qwen2", "bert", "roberta")
ZOO_ENCODER_NAMES = ("bert", "roberta")
# keys only Model Zoo's BERT model has: one of them makes an unnamed config an encoder
ENCODER_KEYS = ("encoder_nonlinearity", "mlm_nonlinearity", "pooler_nonlinearity", "disable_nsp", "num_segments",
                "mask_padding_in_positional_embed", "use_ffn_bias_in_mlm", "use_output_bias_in_mlm", "num_classes",
                "mlm_loss_weight")
# decoder keys an encoder cannot take (its positions are learned, its blocks post-norm with a two-matrix MLP)
_DECODER_ONLY_KEYS = ("nonlinearity", "rotary_dim", "rope_theta", "rope_scaling", "pos_scaling_type",
                      "use_untied_layer_norm", "attention_sliding_window_length", "moe", "use_bias_in_output",
                      "embeddings_scale", "output_logits_scale", "scale_qk_dot_by_d", "attention_logits_alpha",
                      "mup_base_hidden_size", "mup_base_filter_size", "output_logits_alpha", "scale_output_logits_by_d")
# keys only Model Zoo's T5 model has: one of them makes a config T5
T5_KEYS = ("src_vocab_size", "tgt_vocab_size", "extra_ids", "d_kv", "decoder_num_hidden_layers", "decoder_nonlinearity",
           "use_t5_layer_norm", "share_encoder_decoder_embedding", "relative_attention_num_buckets",
           "src_max_position_embeddings", "tgt_max_position_embeddings", "lm_loss_weight", "mlm_loss_scaling")
_T5_NONLINEARITY = {"relu": "relu", "gelu": "gelu", "geglu": "geglu", "gated-gelu": "geglu"}
# Model Zoo's T5 model's defaults (its T5ModelConfig), for a config that names no T5 preset
_T5_DEFAULTS = dict(family="t5", position="relative", d_kv=64, d_ff=2048, max_seq_len=512, norm="rmsnorm",
                    norm_eps=1e-5, activation="relu", tie_embeddings=True, attn_bias=False, mlp_bias=False,
                    dropout=0.1, pad_token_id=0)
# Model Zoo's BERT defaults where they differ from the GPT model's (an unnamed encoder config starts from them)
_BERT_DEFAULTS = {"norm_eps": 1e-5, "dropout": 0.1, "pad_token_id": 0}
_NONLINEARITY = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh", "relu": "relu",
                 "swiglu": "swiglu", "geglu": "geglu", "gated-gelu": "geglu"}


@dataclass
class ModelParams:
    """The `model` section: Model Zoo keys, optionally on top of a zoo preset (`name`).

    Without `name`, vocab_size, hidden_size, num_hidden_layers, num_heads and max_position_embeddings are
    required and the other keys take Model Zoo's GPT defaults (learned positions, layernorm, gelu, biases, tied
    embeddings). `to_model_config()` is the one mapping to our `ModelConfig`.
    """

    name: str | None = None
    pretrained: str | None = None
    # shape
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_heads: int | None = None
    filter_size: int | None = None
    max_position_embeddings: int | None = None
    extra_attention_params: ExtraAttentionParams | None = None
    # multiquery_attention: num_kv_groups key/value heads (1 when not given, as Model Zoo); aiayn_attention: one per
    # head; None: as num_kv_groups says
    attention_module: Literal["aiayn_attention", "multiquery_attention"] | None = None
    # structure
    position_embedding_type: Literal["learned", "rotary", "alibi", "relative"] | None = None
    share_embedding_weights: bool | None = None
    nonlinearity: Literal["gelu", "gelu_new", "gelu_tanh", "relu", "swiglu"] | None = None
    norm_type: Literal["layernorm", "rmsnorm", "biasless-layernorm"] | None = None
    layer_norm_epsilon: float | None = None
    rope_theta: float | None = None
    rotary_dim: int | None = None  # dims of each head that rotate (fewer than the head dim: partial rotary)
    rope_scaling: RopeScaling | None = None
    pos_scaling_type: Literal["llama3", "linear"] | None = None
    pos_scaling_factor: float | None = None
    pos_scaling_extra_args: PosScalingExtraArgs | None = None
    use_projection_bias_in_attention: bool | None = None  # q/k/v biases
    use_ffn_bias_in_attention: bool | None = None  # attention output-projection bias
    use_ffn_bias: bool | None = None
    use_bias_in_output: bool | None = None  # a bias on the LM head (GPT-J)
    use_untied_layer_norm: bool | None = None  # set: parallel attention + MLP, each with its own norm if true
    attention_sliding_window_length: int | None = None  # attend to this many latest positions (Mistral)
    use_position_embedding: bool = True
    embedding_layer_norm: bool | None = None  # encoders always have it, decoders never
    attention_type: Literal["scaled_dot_product"] = "scaled_dot_product"
    use_pre_normalization: bool | None = None  # checked: decoders are pre-norm, encoders post-norm
    norm_first: bool | None = None  # the same, torch's spelling
    moe: MoEParams | None = None  # a mixture of experts
    # encoders (Model Zoo's BERT model; see the module docstring)
    encoder_nonlinearity: Literal["gelu", "gelu_new", "gelu_tanh", "relu", "geglu", "gated-gelu"] | None = None
    mlm_nonlinearity: Literal["gelu", "gelu_new", "gelu_tanh", "relu"] | None = None  # None: encoder_nonlinearity
    pooler_nonlinearity: str | None = None  # the NSP pooler's (tanh); None: encoder_nonlinearity, as Model Zoo
    disable_nsp: bool | None = None  # true: no next-sentence head
    num_segments: int | None = None  # token types; None: 2 with the NSP head, none without (Model Zoo's rule)
    num_classes: int | None = None  # the NSP classifier's classes: 2
    mask_padding_in_positional_embed: bool | None = None  # true: RoBERTa's positions (padding has its own)
    pad_token_id: int | None = None  # the padding token (Model Zoo's default 0); RoBERTa's positions count from it
    use_ffn_bias_in_mlm: bool | None = None  # the MLM head's dense bias: always there
    use_output_bias_in_mlm: bool | None = None  # the MLM decoder's bias: always there
    label_smoothing: float = 0.0
    mlm_loss_weight: float | None = None  # the loss: weight x (sum over masked positions) / sequences; None: mean
    # encoder-decoders (Model Zoo's T5 model; see the module docstring)
    src_vocab_size: int | None = None  # the vocabulary without the sentinels
    tgt_vocab_size: int | None = None  # the decoder's: one embedding serves both, so src_vocab_size
    extra_ids: int | None = None  # sentinels added to the vocabulary
    d_kv: int | None = None  # the size of each attention head (need not be hidden_size / num_heads)
    decoder_num_hidden_layers: int | None = None  # None: as many as the encoder
    decoder_nonlinearity: Literal["gelu", "relu", "geglu", "gated-gelu"] | None = None  # = encoder_nonlinearity
    use_t5_layer_norm: bool | None = None  # true: T5's RMS LayerNorm; false: LayerNorm
    share_encoder_decoder_embedding: bool | None = None
    relative_attention_num_buckets: int | None = None
    src_max_position_embeddings: int | None = None  # the encoder's input length
    tgt_max_position_embeddings: int | None = None  # the decoder's (relative positions: any length is read)
    lm_loss_weight: float | None = None  # with mlm_loss_scaling batch_size: weight x (sum over targets) / sequences
    mlm_loss_scaling: Literal["batch_size", "num_masked", "precomputed_num_masked"] | None = None
    # regularization and init
    dropout_rate: float | None = None
    embedding_dropout_rate: float | None = None
    residual_dropout_rate: float | None = None  # the GPT-J model's name for dropout_rate
    attention_dropout_rate: float | None = None
    initializer_range: float | None = None
    # where each applies: ModelConfig's fields of the same names (models/init.py has the names and arguments)
    initializer: Initializer | None = _initializer_field()
    ffn_initializer: Initializer | None = _initializer_field()
    output_layer_initializer: Initializer | None = _initializer_field()
    ffn_output_layer_initializer: Initializer | None = _initializer_field()
    embedding_initializer: Initializer | None = _initializer_field()
    # muP (ModelConfig's fields of the same names; the optimizer's adjust_learning_rate scales the hidden layers'
    # learning rates): the Cerebras-GPT configs give the scalings themselves (output_logits_scale, width-scaled
    # initializers); Model Zoo 2.3's form gives the base widths and derives them (`_mup_by_base_widths`)
    embeddings_scale: float | None = None
    output_logits_scale: float | None = None
    scale_qk_dot_by_d: bool | None = None
    attention_logits_alpha: float | None = None
    mup_base_hidden_size: float | None = None
    mup_base_filter_size: float | None = None
    output_logits_alpha: float | None = None  # base widths: the logits times alpha x base / width
    scale_output_logits_by_d: bool | None = None  # base widths: false, alpha x sqrt(base / width)
    # loss and precision
    loss_scaling: Literal["num_tokens", "batch_size"] = "num_tokens"
    loss_weight: float = 1.0
    mixed_precision: bool = False
    fp16_type: Literal["bfloat16", "float16", "cbfloat16"] | None = None  # None: float16 (Model Zoo's default)
    use_bfloat16: bool = False  # legacy spelling of fp16_type: bfloat16

    ALIASES: ClassVar[dict[str, str]] = {"num_attention_heads": "num_heads", "intermediate_size": "filter_size",
                                         "d_model": "hidden_size", "d_ff": "filter_size",
                                         "encoder_num_hidden_layers": "num_hidden_layers"}
    IGNORED_KEYS: ClassVar[dict[str, str]] = {
        "attention_softmax_fp32": "softmax always runs in fp32",
        "attention_kernel": "kernel choice is the compiler's",
        "tf_summary": "TensorFlow-only",
        "dropout_seed": "dropout follows runconfig.seed",
        "fixed_sparse_attention": "dense attention only",
        **dict.fromkeys(("precision_opt_level", "boundary_casting"), "a Cerebras compiler setting"),
        "compute_eval_metrics": "evaluation reports the loss",
        "enable_vts": "a Cerebras compiler setting (variable tensor shapes)",
    }

    def __post_init__(self) -> None:
        check_fields(self)
        if self.name is not None:
            self.name = self.name.strip()
        self.to_model_config()  # every shape check, now rather than at run time

    @property
    def half_dtype(self) -> str | None:
        """'bfloat16' | 'float16' for mixed precision, None for fp32. cbfloat16 is bfloat16 on a host."""
        if not self.mixed_precision:
            return None
        name = self.fp16_type or ("bfloat16" if self.use_bfloat16 else "float16")
        return "bfloat16" if name == "cbfloat16" else name

    @property
    def preset(self) -> str | None:
        """The registry preset `name` refers to, or None (no name, or a Model Zoo family label)."""
        from waferscale.models import registry

        if self.name is None:
            return None
        try:
            return registry.canonical_name(self.name)
        except ValueError as e:
            if self.name.lower() in ZOO_FAMILY_NAMES:
                return None
            raise FieldError("name", f"{e}. A Model Zoo family name ({', '.join(ZOO_FAMILY_NAMES[:6])}, ...) "
                             f"is also accepted as a label") from None

    def to_model_config(self) -> ModelConfig:
        """Map the Model Zoo keys onto a ModelConfig (on top of the preset, if any). Cheap: no weights."""
        from waferscale.models import registry

        if self._is_t5():
            return self._t5_config()
        encoder = self._is_encoder()
        self._refuse_unsupported(encoder)
        kv = self.extra_attention_params.num_kv_groups if self.extra_attention_params else None
        if self.attention_module == "aiayn_attention" and kv is not None:
            raise FieldError("extra_attention_params", "num_kv_groups applies to attention_module "
                             "multiquery_attention (aiayn_attention has a key/value head per head); set "
                             "attention_module: multiquery_attention or leave num_kv_groups out")
        if self.attention_module == "multiquery_attention" and kv is None:
            kv = 1  # Model Zoo's MultiQueryAttention: one key/value head unless num_kv_groups says otherwise
        zoo = {  # ModelConfig field <- Model Zoo key
            "vocab_size": self.vocab_size, "d_model": self.hidden_size, "n_layer": self.num_hidden_layers,
            "n_head": self.num_heads, "n_kv_head": kv, "d_ff": self.filter_size,
            "max_seq_len": self.max_position_embeddings, "position": self.position_embedding_type,
            "tie_embeddings": self.share_embedding_weights,
            "activation": _NONLINEARITY.get((self.encoder_nonlinearity if encoder else self.nonlinearity) or ""),
            "norm": "layernorm" if self.norm_type == "biasless-layernorm" else self.norm_type,
            "norm_bias": False if self.norm_type == "biasless-layernorm" else None,
            "norm_eps": self.layer_norm_epsilon, "rope_theta": self.rope_theta,
            "rope_scaling": self._rope_scaling(), "attn_bias": self._attn_bias(), "mlp_bias": self.use_ffn_bias,
            "dropout": self._dropout(), "init_std": self.initializer_range, **self._moe(),
            "lm_head_bias": self.use_bias_in_output, "block": self._block(),
            "sliding_window": self.attention_sliding_window_length, **self._init_and_mup(),
        }
        o = {k: v for k, v in zoo.items() if v is not None}  # overrides of the preset / defaults

        preset = self.preset
        if preset is None:
            missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads",
                                   "max_position_embeddings") if getattr(self, k) is None]
            if missing:
                also = f" (also missing: {', '.join(missing[1:])})" if missing[1:] else ""
                raise FieldError(missing[0], f"is required when model.name names no preset{also}; set it, or "
                                 f"set model.name to a zoo preset such as 'gpt3-1.3b' or 'llama2-70b' to start from")
            o = {"activation": "gelu"} | o  # Model Zoo's default nonlinearity (ModelConfig's is gelu_tanh)
        activation = o.get("activation") or registry.PRESETS[preset].activation  # type: ignore[index]
        experts = o.get("n_experts", registry.PRESETS[preset].n_experts if preset else 0)
        o["family"] = "mixtral" if experts else "llama" if activation == "swiglu" else "gpt"
        if preset is not None and registry.PRESETS[preset].is_encoder_decoder:  # a T5 preset stays one
            o["family"] = "t5"
        if encoder:  # an encoder stays one (its structure differs)
            o = self._encoder_fields(preset, o, activation)
        try:
            cfg = ModelConfig(name=self.name or "custom", **o) if preset is None else \
                registry.config_from_name(self.name, **o)  # type: ignore[arg-type]
            cfg = self._mup_by_base_widths(self._decoder_shape(cfg))
        except ValueError as e:  # ModelConfig's own shape checks, in Model Zoo's key names
            raise FieldError("", _zoo_names(str(e))) from None
        if preset is None and not encoder and not any(getattr(cfg, k) for k in INITIALIZER_FIELDS):
            # Model Zoo's model, not a preset's: its default initializers (CausalLM.init_for: the embedding's given,
            # the others follow as they do in Model Zoo)
            cfg = cfg.replace(embedding_initializer=Initializer("truncated_normal", mean=0.0, std=cfg.init_std))
        if preset is None and self.name is None:  # name an explicit shape after the preset it equals, if any
            inits = {k: getattr(cfg, k) for k in INITIALIZER_FIELDS}
            cfg = next((p.replace(**inits) for p in registry.PRESETS.values()
                        if _explicit(cfg.replace(name=p.name)) == _explicit(p.replace(**inits))), cfg)
        return cfg

    def _is_t5(self) -> bool:
        """Whether the config is Model Zoo's T5 model: a T5 preset or the label `t5`, or a key only it has."""
        from waferscale.models import registry

        preset = self.preset
        return ((preset is not None and registry.PRESETS[preset].is_encoder_decoder)
                or (self.name or "").strip().lower() == "t5" or self.position_embedding_type == "relative"
                or any(getattr(self, k) is not None for k in T5_KEYS))

    def _t5_config(self) -> ModelConfig:
        """The T5 keys onto a t5 ModelConfig: over the preset the name gives, or over Model Zoo's T5 defaults
        (`name: t5` is Model Zoo's label for its T5 model, not the t5-small preset it also selects)."""
        from waferscale.models import registry

        others = [k for k in (*_DECODER_ONLY_KEYS, *ENCODER_KEYS) if k != "encoder_nonlinearity"
                  and getattr(self, k) is not None]
        if others:
            raise FieldError(others[0], "is not a key of Model Zoo's T5 model (an encoder-decoder); drop it")
        inits = [k for k in INITIALIZER_FIELDS if getattr(self, k) is not None]
        if inits:
            raise FieldError(inits[0], "is not supported for T5: its weights take T5's own initialisation (Mesh "
                             "TensorFlow's, models/t5.py); drop it")
        if self.position_embedding_type not in (None, "relative"):
            raise FieldError("position_embedding_type", f"{self.position_embedding_type!r} is not supported for T5; "
                             "supported: relative")
        if self.share_encoder_decoder_embedding is False:
            raise FieldError("share_encoder_decoder_embedding", "false is not supported: the encoder and decoder "
                             "share one embedding; set true")
        if self.tgt_vocab_size not in (None, self.src_vocab_size):
            raise FieldError("tgt_vocab_size", f"{self.tgt_vocab_size} differs from src_vocab_size "
                             f"{self.src_vocab_size}; the encoder and decoder share one vocabulary")
        act = self.encoder_nonlinearity and _T5_NONLINEARITY.get(self.encoder_nonlinearity)
        if self.encoder_nonlinearity is not None and act is None:
            raise FieldError("encoder_nonlinearity", f"{self.encoder_nonlinearity!r} is not supported for T5; "
                             f"supported: {', '.join(_T5_NONLINEARITY)}")
        if self.decoder_nonlinearity is not None and _T5_NONLINEARITY[self.decoder_nonlinearity] != (act or "relu"):
            raise FieldError("decoder_nonlinearity", f"{self.decoder_nonlinearity!r} differs from "
                             f"encoder_nonlinearity {self.encoder_nonlinearity or 'relu'!r}; both stacks use one "
                             "nonlinearity")
        norm = {True: "rmsnorm", False: "layernorm", None: None}[self.use_t5_layer_norm]
        if self.norm_type is not None and norm is not None and self.norm_type != norm:
            raise FieldError("norm_type", f"{self.norm_type!r} contradicts use_t5_layer_norm "
                             f"{str(self.use_t5_layer_norm).lower()}; keep one")
        if self.mlm_loss_scaling != "batch_size" and self.mlm_loss_scaling is not None:
            weight = None  # num_masked, precomputed_num_masked: the mean over the target tokens
        else:
            weight = self.lm_loss_weight
        vocab = self.src_vocab_size if self.src_vocab_size is not None else self.vocab_size
        zoo = {  # ModelConfig field <- Model Zoo key
            "vocab_size": vocab + (self.extra_ids or 0) if vocab is not None else None,
            "d_model": self.hidden_size, "n_layer": self.num_hidden_layers,
            "n_decoder_layer": self.decoder_num_hidden_layers, "n_head": self.num_heads, "d_kv": self.d_kv,
            "d_ff": self.filter_size, "max_seq_len": self.src_max_position_embeddings or self.max_position_embeddings,
            "norm": norm or ("layernorm" if self.norm_type == "biasless-layernorm" else self.norm_type),
            "norm_bias": False if self.norm_type == "biasless-layernorm" else None, "norm_eps": self.layer_norm_epsilon,
            "activation": act, "tie_embeddings": self.share_embedding_weights, "attn_bias": self._attn_bias(),
            "mlp_bias": self.use_ffn_bias, "dropout": self._dropout(),
            "relative_attention_num_buckets": self.relative_attention_num_buckets, "pad_token_id": self.pad_token_id,
            "mlm_loss_weight": weight,
        }
        o = {k: v for k, v in zoo.items() if v is not None}
        if "n_decoder_layer" in o and o["n_decoder_layer"] == o.get("n_layer"):
            del o["n_decoder_layer"]  # (as many decoder layers as encoder layers: ModelConfig's None)
        preset = self.preset
        try:
            if preset is not None and (self.name or "").strip().lower() != "t5":
                return registry.config_from_name(self.name, **o)  # type: ignore[arg-type]
            missing = [k for k, f in (("src_vocab_size", "vocab_size"), ("d_model", "d_model"),
                                      ("encoder_num_hidden_layers", "n_layer"), ("num_heads", "n_head")) if f not in o]
            if missing:
                raise FieldError(missing[0], "is required for Model Zoo's T5 model without a T5 preset in model.name")
            return ModelConfig(**(_T5_DEFAULTS | {"name": self.name or "custom"} | o))
        except ValueError as e:  # ModelConfig's own checks, in Model Zoo's key names
            raise FieldError("", _zoo_names(str(e))) from None

    def _init_and_mup(self) -> dict[str, Any]:
        """ModelConfig's initializer and muP fields the file sets (the base-widths form: `_mup_by_base_widths`)."""
        bases = [k for k in ("mup_base_hidden_size", "mup_base_filter_size") if getattr(self, k) is not None]
        if bases:
            if len(bases) == 1:
                raise FieldError(bases[0], "muP by base widths needs both mup_base_hidden_size and "
                                 "mup_base_filter_size (Model Zoo's rule); give the other")
            if self.output_logits_scale is not None:
                raise FieldError("output_logits_scale", "is the muP form without base widths; with "
                                 "mup_base_hidden_size the logits scale is output_logits_alpha x base / width: drop it")
        else:
            given = [k for k in ("output_logits_alpha", "scale_output_logits_by_d") if getattr(self, k) is not None]
            if given:
                raise FieldError(given[0], "has an effect only with muP's base widths (mup_base_hidden_size, "
                                 "mup_base_filter_size); give them or drop it")
        keys = (*INITIALIZER_FIELDS, "embeddings_scale", "output_logits_scale", "scale_qk_dot_by_d",
                "attention_logits_alpha")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    def _width_mults(self, cfg: ModelConfig) -> tuple[float, float] | None:
        """(hidden_size / mup_base_hidden_size, filter_size / mup_base_filter_size), or None without base widths."""
        if self.mup_base_hidden_size is None:
            return None
        return cfg.d_model / self.mup_base_hidden_size, cfg.ffn_dim / self.mup_base_filter_size

    def _mup_by_base_widths(self, cfg: ModelConfig) -> ModelConfig:
        """Model Zoo 2.3's muP by base widths, as its GPT models derive it: with wh = hidden_size / base and
        wf = filter_size / base, the attention and MLP-input initializers' spread times wh^-1/2, the attention
        output's times wh^-1/2 (2 n_layer)^-1/2, the MLP output's times wf^-1/2 (2 n_layer)^-1/2 (each left out:
        truncated_normal(0, initializer_range), Model Zoo's default), the logits times output_logits_alpha / wh
        (/ sqrt(wh) with scale_output_logits_by_d false); learning rates: `lr_adjustment`."""
        mults = self._width_mults(cfg)
        if mults is None:
            return cfg
        if cfg.n_experts:
            raise FieldError("mup_base_hidden_size", "muP by base widths with a mixture of experts is not supported "
                             "(Model Zoo leaves the router's initializer unscaled, which this model cannot say)")
        wh, wf = mults
        default = Initializer("truncated_normal", mean=0.0, std=cfg.init_std)
        depth = (2 * cfg.n_layer) ** -0.5
        alpha = self.output_logits_alpha if self.output_logits_alpha is not None else 1.0
        return cfg.replace(
            initializer=(self.initializer or default).scaled(wh ** -0.5),
            ffn_initializer=(self.ffn_initializer or self.initializer or default).scaled(wh ** -0.5),
            output_layer_initializer=(self.output_layer_initializer or default).scaled(wh ** -0.5 * depth),
            ffn_output_layer_initializer=(self.ffn_output_layer_initializer or default).scaled(wf ** -0.5 * depth),
            embedding_initializer=self.embedding_initializer or default,
            output_logits_scale=alpha / (wh ** 0.5 if self.scale_output_logits_by_d is False else wh))

    def lr_adjustment(self) -> dict[str, float]:
        """The learning-rate scales muP by base widths gives the optimizer's groups (models/mup.py), Model Zoo's:
        the attention and MLP-input matrices 1 / wh, the MLP output 1 / wf; none without base widths. A params
        file's optimizer.adjust_learning_rate overrides them group by group."""
        mults = self._width_mults(self.to_model_config())
        if mults is None:
            return {}
        wh, wf = mults
        return {"decoder_attention": 1 / wh, "decoder_input_ffn": 1 / wh, "decoder_output_ffn": 1 / wf}

    def _block(self) -> str | None:
        """ModelConfig.block: Model Zoo's GPT-J model (named, or told by use_untied_layer_norm) is parallel."""
        label = (self.name or "").lower()
        if self.use_untied_layer_norm is not None:
            return "parallel" if self.use_untied_layer_norm else "parallel_shared_norm"
        if label in ("gptj", "falcon"):
            return "parallel_shared_norm"
        return "parallel" if label in ("gpt-neox", "gpt_neox") else None

    def _decoder_shape(self, cfg: ModelConfig) -> ModelConfig:
        """Partial rotary, then the decoder family the structure describes (the module docstring's rule)."""
        if self.rotary_dim is not None and cfg.position == "rotary":
            cfg = cfg.replace(rotary_dim=None if self.rotary_dim == cfg.head_dim else self.rotary_dim)
        if cfg.family not in ("gpt", "llama"):  # experts decided it (mixtral)
            return cfg
        if cfg.position == "alibi":
            return cfg.replace(family="mpt")
        if cfg.block != "sequential":
            if (self.name or "").lower() == "falcon" or cfg.kv_heads < cfg.n_head:
                return cfg.replace(family="falcon")
            if cfg.block == "parallel":
                return cfg.replace(family="gpt_neox")
            return cfg.replace(family="gptj", rotary_interleaved=cfg.position == "rotary")
        if cfg.sliding_window and cfg.activation == "swiglu":
            return cfg.replace(family="mistral")
        return cfg

    def _dropout(self) -> float | None:
        return self.dropout_rate if self.dropout_rate is not None else self.residual_dropout_rate

    def _is_encoder(self) -> bool:
        """Whether the config is an encoder (the module docstring's rule); encoder keys on a decoder, or decoder
        keys on an encoder, are errors."""
        from waferscale.models import registry

        keys = [k for k in ENCODER_KEYS if getattr(self, k) is not None]
        preset, label = self.preset, (self.name or "").lower()
        if preset is not None:
            encoder = registry.PRESETS[preset].is_encoder
        elif label in ZOO_FAMILY_NAMES:
            encoder = label in ZOO_ENCODER_NAMES
        else:
            encoder = bool(keys)
        if keys and not encoder:
            raise FieldError(keys[0], f"is a key of Model Zoo's BERT model, but model.name {self.name!r} is a "
                             f"decoder; drop it, or name an encoder ({', '.join(ZOO_ENCODER_NAMES)} or a preset "
                             f"such as 'bert-base')")
        decoder_keys = [k for k in _DECODER_ONLY_KEYS if getattr(self, k) is not None]
        if encoder and decoder_keys:
            hint = "; the encoder's is encoder_nonlinearity" if decoder_keys[0] == "nonlinearity" else ""
            raise FieldError(decoder_keys[0], f"is a decoder key, but this config is an encoder (Model Zoo's BERT "
                             f"model: learned positions, post-norm blocks, the masked-LM head){hint}")
        return encoder

    @property
    def _zoo_bert_defaults(self) -> bool:
        """An encoder config takes Model Zoo's BERT defaults unless it starts from a preset. `name: bert` is Model
        Zoo's label for its BERT model (trainer-layout configs name it so), not the bert-base preset it also
        selects: it takes them too, over bert-base's shape."""
        return self.preset is None or (self.name or "").strip().lower() == "bert"

    def _encoder_fields(self, preset: str | None, o: dict[str, Any], activation: str) -> dict[str, Any]:
        """The overrides `o` with Model Zoo's BERT keys added: on top of the preset's fields, or of Model Zoo's
        BERT defaults (two segments with the NSP head, none without; padding token 0; dropout 0.1)."""
        from waferscale.models import registry

        base = None if self._zoo_bert_defaults else registry.PRESETS[preset]  # type: ignore[index]
        if self.mlm_nonlinearity is not None and _NONLINEARITY[self.mlm_nonlinearity] != activation:
            raise FieldError("mlm_nonlinearity", f"{self.mlm_nonlinearity!r} differs from encoder_nonlinearity; the "
                             f"masked-LM head's transform uses the blocks' nonlinearity, leave it out or set it equal")
        for key in ("use_ffn_bias_in_mlm", "use_output_bias_in_mlm"):
            if getattr(self, key) is False:
                raise FieldError(key, "false is not supported: the masked-LM head has its biases; set true")
        if self.num_classes not in (None, 2):
            raise FieldError("num_classes", f"{self.num_classes} is not supported: the next-sentence head is 2-way")
        if self.label_smoothing:
            raise FieldError("label_smoothing", f"{self.label_smoothing} is not supported; set 0")
        nsp = not self.disable_nsp if self.disable_nsp is not None else (base.nsp_head if base else True)
        # Model Zoo's pooler takes the encoder's nonlinearity unless told
        pooler = self.pooler_nonlinearity or (None if base else self.encoder_nonlinearity or "gelu")
        if nsp and pooler not in (None, "tanh"):
            told = "" if self.pooler_nonlinearity else " (left out, it is encoder_nonlinearity's)"
            raise FieldError("pooler_nonlinearity", f"{pooler!r}{told} is not supported: the next-sentence pooler is "
                             f"tanh (BERT's); set pooler_nonlinearity: tanh, or disable_nsp: true")
        if self.mask_padding_in_positional_embed is not None:
            family = "roberta" if self.mask_padding_in_positional_embed else "bert"
        else:
            family = base.family if base else "bert"
        defaults = {} if base else {"block": "post_norm", "lm_head_bias": True, "type_vocab_size": 2 if nsp else 0,
                                    **_BERT_DEFAULTS}
        given = {"type_vocab_size": self.num_segments, "pad_token_id": self.pad_token_id,
                 "mlm_loss_weight": self.mlm_loss_weight}
        return defaults | o | {"family": family, "nsp_head": nsp} | {k: v for k, v in given.items() if v is not None}

    def _refuse_unsupported(self, encoder: bool) -> None:
        for key in ("use_pre_normalization", "norm_first"):  # decoder blocks are pre-norm, encoder blocks post-norm
            if getattr(self, key) is not None and getattr(self, key) == encoder:
                raise FieldError(key, f"{str(encoder).lower()} is not supported: {'encoder' if encoder else 'decoder'} "
                                 f"blocks are {'post' if encoder else 'pre'}-norm here; set {str(not encoder).lower()} "
                                 f"or leave it out")
        if not self.use_position_embedding:
            raise FieldError("use_position_embedding", "false is not supported; use position_embedding_type "
                             "learned or rotary")
        if self.embedding_layer_norm is not None and self.embedding_layer_norm != encoder:
            raise FieldError("embedding_layer_norm", f"{str(self.embedding_layer_norm).lower()} is not supported: "
                             f"{'encoders always' if encoder else 'decoders never'} normalize the embeddings; "
                             f"set {str(encoder).lower()}")
        for key in ("embedding_dropout_rate", "attention_dropout_rate", "residual_dropout_rate"):
            value, dropout = getattr(self, key), self._dropout()
            if dropout is None:  # the default: Model Zoo's BERT model's, or none
                dropout = _BERT_DEFAULTS["dropout"] if encoder and self._zoo_bert_defaults else 0.0
            if value is not None and value != dropout:
                raise FieldError(key, f"{value} differs from dropout_rate {dropout}; one dropout rate is used "
                                 f"everywhere, set {key} equal to dropout_rate")

    def _moe(self) -> dict[str, int | float]:
        """ModelConfig's expert fields from the `moe` section (none without it: a preset keeps its own)."""
        m = self.moe
        if m is None:
            return {}
        if not m.num_experts:
            return {"n_experts": 0}
        return {"n_experts": m.num_experts, "experts_per_token": m.top_k,
                "router_aux_loss_coef": m.load_balancing_loss_coef}

    def _attn_bias(self) -> bool | None:
        qkv, out = self.use_projection_bias_in_attention, self.use_ffn_bias_in_attention
        if qkv is not None and out is not None and qkv != out:
            raise FieldError("use_ffn_bias_in_attention", f"{out} differs from use_projection_bias_in_attention "
                             f"{qkv}; attention biases are all on or all off, set both the same")
        return qkv if qkv is not None else out

    def _rope_scaling(self) -> RopeScaling | None:
        zoo_keys = self.pos_scaling_type is not None or self.pos_scaling_factor not in (None, 1.0)
        if self.rope_scaling is not None and zoo_keys:
            raise FieldError("rope_scaling", "give either rope_scaling or pos_scaling_*, not both")
        if not zoo_keys:
            return self.rope_scaling
        if self.pos_scaling_type != "llama3":
            raise FieldError("pos_scaling_type", f"{self.pos_scaling_type!r} with pos_scaling_factor "
                             f"{self.pos_scaling_factor} is not supported; only 'llama3' scaling is")
        extra = self.pos_scaling_extra_args or PosScalingExtraArgs()
        return RopeScaling(factor=self.pos_scaling_factor or 1.0, **dataclasses.asdict(extra))


def _explicit(cfg: ModelConfig) -> ModelConfig:
    """The same config with defaulted sizes spelled out (d_ff None -> 4 * d_model, n_kv_head None -> n_head)."""
    return cfg.replace(d_ff=cfg.ffn_dim, n_kv_head=cfg.kv_heads)


_ZOO_KEY_FOR = {"d_model": "hidden_size", "n_head": "num_heads", "n_kv_head": "num_kv_groups",
                "n_layer": "num_hidden_layers", "d_ff": "filter_size", "max_seq_len": "max_position_embeddings",
                "head_dim": "head dim", "n_experts": "moe.num_experts", "experts_per_token": "moe.top_k",
                "router_aux_loss_coef": "moe.load_balancing_loss_coef"}


def _zoo_names(message: str) -> str:
    """Say ModelConfig's complaints in the YAML's words: 'd_model (100)' -> 'hidden_size (100)'."""
    message = re.sub(r"^model config '[^']*': ", "", message)
    return re.sub(r"\b(" + "|".join(_ZOO_KEY_FOR) + r")\b", lambda m: _ZOO_KEY_FOR[m.group(1)], message)


__all__ = ["ModelParams", "ExtraAttentionParams", "MoEParams", "PosScalingExtraArgs", "ZOO_FAMILY_NAMES"]
