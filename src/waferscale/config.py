"""Params YAML <-> typed dataclasses, in the Cerebras Model Zoo layout.

Two layouts are accepted:

* the **legacy layout** (the seed's era): top-level sections `train_input`, `eval_input`, `model`,
  `optimizer`, `sparsity`, `runconfig`;
* the newer **trainer layout**, `trainer: {init: {...}, fit: {...}}` (cszoo). A useful subset is mapped onto
  the legacy layout (see `_legacy_from_trainer`): init.{backend, model_dir, seed, model, optimizer, schedulers,
  precision, loop, checkpoint, logging, callbacks, sparsity} and fit.{train_dataloader, val_dataloader,
  ckpt_path}. Error key paths then refer to the legacy layout. A list of trainers (multi-phase) is refused.

Every section is a typed dataclass built by one generic helper (`_build`) that walks the YAML mapping with
key paths, so every user mistake becomes a `ConfigError` of the form

    configs/x.yaml:12: optimizer.learning_rate[1].schedular: unknown key 'schedular' (did you mean 'scheduler'?)

Value checks live in each dataclass's `__post_init__` (raising `FieldError`, which the helper turns into a
ConfigError with the file, line and key path), so objects built in code are validated the same way.

Our extensions to the Model Zoo keys (all optional):
    model.name            a zoo preset to start from ('gpt-mini', 'gpt3-1.3b', 'llama2-70b', ...); explicit Model
                          Zoo keys override it. Model Zoo family names ('llama', 'gpt3', ...) are labels only.
    model.pretrained      weights to start from: a zoo name whose weights ship as an asset
                          ('smollm2-135m-instruct'), a Hugging Face model dir, or a .gguf file
    model.rope_scaling    {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}
                          (same meaning as Model Zoo's pos_scaling_type: llama3 + pos_scaling_*)
    *_input.tokenizer     'char' | 'smollm2' | a tokenizer.json / HF dir / .gguf path (default 'char')
    *_input.val_fraction  share of the documents held out for validation (default 0.05)
    runconfig.execution   'auto' | 'resident' | 'streaming'
    runconfig.device      'auto' | 'cpu' | 'cuda'

Model Zoo keys accepted for compatibility but ignored are listed, with the reason, in each class's
`IGNORED_KEYS`; `Params.ignored` names the ones a file used. Legacy spellings are mapped by `ALIASES`
(`weight_decay_rate` -> `weight_decay`, `save_checkpoint_steps` -> `checkpoint_steps`, scheduler `steps` /
`decay_steps` -> `total_iters`, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from waferscale.errors import ConfigError
from waferscale.models.config import ModelConfig, RopeScaling


class FieldError(ConfigError):
    """A bad value in one field, raised by a `__post_init__`; `_build` adds the file, line and key path."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message


# ---- input -----------------------------------------------------------------------------------------------

@dataclass
class InputParams:
    """`train_input` / `eval_input`. `batch_size` is the global batch in sequences per step, split across
    `runconfig.num_csx`; `micro_batch_size` (per system) accumulates gradients over smaller pieces."""

    data_dir: list[str]
    batch_size: int
    micro_batch_size: int | None = field(default=None, metadata={"convert": "_convert_micro_batch"})
    max_sequence_length: int | None = None  # tokens per sequence; None = the model's max_position_embeddings
    tokenizer: str = "char"
    shuffle: bool = True
    shuffle_seed: int = 0
    num_workers: int = 0
    data_processor: str | None = None  # recorded; our loader reads .txt/.jsonl/dirs/"shakespeare" itself
    val_fraction: float = 0.05

    IGNORED_KEYS: ClassVar[dict[str, str]] = {
        "prefetch_factor": "host data-loader tuning",
        "persistent_workers": "host data-loader tuning",
        "use_worker_cache": "host data-loader tuning",
        "repeat": "the loader always repeats",
        "drop_last": "partial batches are always dropped",
        "vocab_size": "the model's vocab_size is the one used",
        "pad_last": "partial batches are always dropped",
    }

    def __post_init__(self) -> None:
        if isinstance(self.micro_batch_size, str):  # 'auto' when built in code
            self.micro_batch_size = _convert_micro_batch(self.micro_batch_size, "micro_batch_size",
                                                         _Ctx("<InputParams>"), None)
        if isinstance(self.data_dir, (str, os.PathLike)):
            self.data_dir = [str(self.data_dir)]
        if not self.data_dir:
            raise FieldError("data_dir", "is empty; give a file, a directory or the builtin corpus 'shakespeare'")
        _positive(self, "batch_size", "max_sequence_length")
        if self.micro_batch_size is not None:
            _positive(self, "micro_batch_size")
            if self.batch_size % self.micro_batch_size:
                raise FieldError("micro_batch_size", f"{self.micro_batch_size} does not divide batch_size "
                                 f"{self.batch_size}; pick a divisor, or 'auto' for no accumulation")
        if self.num_workers < 0:
            raise FieldError("num_workers", f"must be >= 0, got {self.num_workers}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise FieldError("val_fraction", f"must be in [0, 1), got {self.val_fraction}")


# ---- model -----------------------------------------------------------------------------------------------

@dataclass
class ExtraAttentionParams:
    num_kv_groups: int | None = None  # key/value heads (grouped-query attention); None = num_heads


@dataclass
class PosScalingExtraArgs:
    """Model Zoo's `pos_scaling_extra_args` for `pos_scaling_type: llama3`."""

    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


# Model Zoo model names (trainer layout `model.name`) that say which family, not which preset.
ZOO_FAMILY_NAMES = ("gpt2", "gpt3", "gptj", "gpt-neox", "gpt_neox", "llama", "mistral", "falcon", "bloom",
                    "starcoder", "santacoder", "btlm", "jais", "mpt", "qwen2")
_NONLINEARITY = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh", "relu": "relu",
                 "swiglu": "swiglu"}
_HALF_DTYPE = {"bfloat16": "bfloat16", "cbfloat16": "bfloat16", "float16": "float16"}


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
    # structure
    position_embedding_type: Literal["learned", "rotary"] | None = None
    share_embedding_weights: bool | None = None
    nonlinearity: Literal["gelu", "gelu_new", "gelu_tanh", "relu", "swiglu"] | None = None
    norm_type: Literal["layernorm", "rmsnorm"] | None = None
    layer_norm_epsilon: float | None = None
    rope_theta: float | None = None
    rotary_dim: int | None = None  # must equal the head dim (partial rotary is not supported)
    rope_scaling: RopeScaling | None = None
    pos_scaling_type: Literal["llama3", "linear"] | None = None
    pos_scaling_factor: float | None = None
    pos_scaling_extra_args: PosScalingExtraArgs | None = None
    use_projection_bias_in_attention: bool | None = None  # q/k/v biases
    use_ffn_bias_in_attention: bool | None = None  # attention output-projection bias
    use_ffn_bias: bool | None = None
    use_bias_in_output: bool = False
    use_position_embedding: bool = True
    embedding_layer_norm: bool = False
    attention_type: Literal["scaled_dot_product"] = "scaled_dot_product"
    # regularization and init
    dropout_rate: float | None = None
    embedding_dropout_rate: float | None = None
    attention_dropout_rate: float | None = None
    initializer_range: float | None = None
    # loss and precision
    loss_scaling: Literal["num_tokens", "batch_size"] = "num_tokens"
    loss_weight: float = 1.0
    mixed_precision: bool = False
    fp16_type: Literal["bfloat16", "float16", "cbfloat16"] | None = None  # None: float16 (Model Zoo's default)
    use_bfloat16: bool = False  # legacy spelling of fp16_type: bfloat16

    ALIASES: ClassVar[dict[str, str]] = {"num_attention_heads": "num_heads", "intermediate_size": "filter_size"}
    IGNORED_KEYS: ClassVar[dict[str, str]] = {
        "attention_module": "attention is always multi-head / grouped-query as num_kv_groups says",
        "attention_softmax_fp32": "softmax always runs in fp32",
        "attention_kernel": "kernel choice is the compiler's",
        "precision_opt_level": "a Cerebras compiler setting",
        "boundary_casting": "a Cerebras compiler setting",
        "tf_summary": "TensorFlow-only",
        "dropout_seed": "dropout follows runconfig.seed",
        "initializer": "weights use normal(0, initializer_range)",
        "embedding_initializer": "weights use normal(0, initializer_range)",
        "output_layer_initializer": "weights use normal(0, initializer_range)",
        "use_pre_normalization": "blocks are always pre-norm",
        "norm_first": "blocks are always pre-norm",
        "fixed_sparse_attention": "dense attention only",
    }

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.name is not None:
            self.name = self.name.strip()
        self.to_model_config()  # every shape check, now rather than at run time

    @property
    def half_dtype(self) -> str | None:
        """'bfloat16' | 'float16' for mixed precision, None for fp32. cbfloat16 is bfloat16 on a host."""
        if not self.mixed_precision:
            return None
        return _HALF_DTYPE[self.fp16_type or ("bfloat16" if self.use_bfloat16 else "float16")]

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

        self._refuse_unsupported()
        kv = self.extra_attention_params.num_kv_groups if self.extra_attention_params else None
        zoo = {  # ModelConfig field <- Model Zoo key
            "vocab_size": self.vocab_size, "d_model": self.hidden_size, "n_layer": self.num_hidden_layers,
            "n_head": self.num_heads, "n_kv_head": kv, "d_ff": self.filter_size,
            "max_seq_len": self.max_position_embeddings, "position": self.position_embedding_type,
            "tie_embeddings": self.share_embedding_weights, "activation": _NONLINEARITY.get(self.nonlinearity or ""),
            "norm": self.norm_type, "norm_eps": self.layer_norm_epsilon, "rope_theta": self.rope_theta,
            "rope_scaling": self._rope_scaling(), "attn_bias": self._attn_bias(), "mlp_bias": self.use_ffn_bias,
            "dropout": self.dropout_rate, "init_std": self.initializer_range,
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
        o["family"] = "llama" if activation == "swiglu" else "gpt"
        try:
            cfg = ModelConfig(name=self.name or "custom", **o) if preset is None else \
                registry.config_from_name(self.name, **o)  # type: ignore[arg-type]
        except ValueError as e:  # ModelConfig's own shape checks, in Model Zoo's key names
            raise FieldError("", _zoo_names(str(e))) from None
        if preset is None and self.name is None:  # name an explicit shape after the preset it equals, if any
            cfg = next((p for p in registry.PRESETS.values() if _explicit(cfg.replace(name=p.name)) == _explicit(p)),
                       cfg)
        if self.rotary_dim is not None and cfg.position == "rotary" and self.rotary_dim != cfg.head_dim:
            raise FieldError("rotary_dim", f"{self.rotary_dim} differs from the head dim {cfg.head_dim} "
                             f"(hidden_size / num_heads); partial rotary embeddings are not supported")
        return cfg

    def _refuse_unsupported(self) -> None:
        if self.use_bias_in_output:
            raise FieldError("use_bias_in_output", "true is not supported (the LM head has no bias); set false")
        if not self.use_position_embedding:
            raise FieldError("use_position_embedding", "false is not supported; use position_embedding_type "
                             "learned or rotary")
        if self.embedding_layer_norm:
            raise FieldError("embedding_layer_norm", "true is not supported; set false")
        for key in ("embedding_dropout_rate", "attention_dropout_rate"):
            value, dropout = getattr(self, key), self.dropout_rate or 0.0
            if value is not None and value != dropout:
                raise FieldError(key, f"{value} differs from dropout_rate {dropout}; one dropout rate is used "
                                 f"everywhere, set {key} equal to dropout_rate")

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


# ---- optimizer -------------------------------------------------------------------------------------------

OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Lamb", "Lion")


@dataclass
class OptimizerParams:
    """The `optimizer` section. `learning_rate` is a constant, or a list of scheduler dicts run one after the
    other, each normalized: the canonical `scheduler` name first ('Linear', 'CosineDecay', ...; see
    `SCHEDULERS`), legacy spellings mapped, defaults filled in, unset optional keys left out."""

    optimizer_type: Literal[OPTIMIZERS]  # type: ignore[valid-type]
    learning_rate: float | list[dict[str, Any]] = field(metadata={"convert": "_convert_learning_rate"})
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6  # cstorch's AdamW default (torch's is 1e-8)
    weight_decay: float = 0.0  # applied to parameters with ndim >= 2 only (see runtime.optim.build_optimizer)
    momentum: float = 0.0  # SGD
    nesterov: bool = False  # SGD
    max_gradient_norm: float | None = None
    correct_bias: bool = True  # Adam/AdamW bias correction; false is refused (not implemented)
    loss_scaling_factor: float | Literal["dynamic"] = 1.0
    initial_loss_scale: float | None = None  # dynamic loss scaling: start value (None = 2**15)
    steps_per_increase: int = 2000  # dynamic loss scaling: growth interval
    min_loss_scale: float | None = None
    max_loss_scale: float | None = None

    ALIASES: ClassVar[dict[str, str]] = {"weight_decay_rate": "weight_decay"}
    IGNORED_KEYS: ClassVar[dict[str, str]] = {
        "log_summaries": "metrics.jsonl always has loss, lr and grad norm",
        "disable_lr_steps_reset": "schedules are pure functions of the global step",
    }

    def __post_init__(self) -> None:
        _check_fields(self)
        self.learning_rate = normalize_learning_rate(self.learning_rate)  # idempotent
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise FieldError("betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        for key in ("eps", "weight_decay", "momentum"):
            if getattr(self, key) < 0:
                raise FieldError(key, f"must be >= 0, got {getattr(self, key)}")
        if self.max_gradient_norm is not None and self.max_gradient_norm <= 0:
            raise FieldError("max_gradient_norm", f"must be > 0 (or left out for no clipping), "
                             f"got {self.max_gradient_norm}")
        if not self.correct_bias and self.optimizer_type in ("Adam", "AdamW"):
            raise FieldError("correct_bias", "false (Adam without bias correction) is not implemented; "
                             "set correct_bias: true")
        if self.loss_scaling_factor != "dynamic" and self.loss_scaling_factor <= 0:
            raise FieldError("loss_scaling_factor", f"must be > 0 or 'dynamic', got {self.loss_scaling_factor}")
        if self.nesterov and self.optimizer_type != "SGD":
            raise FieldError("nesterov", f"applies to SGD only, not {self.optimizer_type}")


# ---- learning-rate schedulers (schema only; the math is in runtime/optim.py) ------------------------------

class _Phase:
    """Base of the scheduler schemas: legacy Model Zoo spellings of the phase length."""

    ALIASES: ClassVar[dict[str, str]] = {"steps": "total_iters", "decay_steps": "total_iters"}


@dataclass
class ConstantLR(_Phase):
    learning_rate: float
    total_iters: int | None = None  # required unless it is the last phase

    ALIASES: ClassVar[dict[str, str]] = {"steps": "total_iters", "val": "learning_rate"}


@dataclass
class LinearLR(_Phase):
    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int


@dataclass
class PolynomialLR(_Phase):
    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int
    power: float = 1.0


@dataclass
class CosineDecayLR(_Phase):
    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int


@dataclass
class CosineAnnealingLR(_Phase):
    initial_learning_rate: float
    T_max: int
    eta_min: float = 0.0
    total_iters: int | None = None  # phase length inside a sequence


@dataclass
class ExponentialLR(_Phase):
    initial_learning_rate: float
    total_iters: int  # the decay period: lr = initial * decay_rate ** (step / total_iters)
    decay_rate: float
    staircase: bool = False


@dataclass
class InverseExponentialTimeDecayLR(_Phase):
    initial_learning_rate: float
    step_exponent: float
    total_iters: int
    decay_rate: float
    staircase: bool = False


@dataclass
class InverseSquareRootDecayLR(_Phase):
    initial_learning_rate: float = 1.0
    scale: float = 1.0
    warmup_steps: int = 1
    total_iters: int | None = None


@dataclass
class StepLR(_Phase):
    initial_learning_rate: float
    step_size: int
    gamma: float
    total_iters: int | None = None


@dataclass
class MultiStepLR(_Phase):
    initial_learning_rate: float
    gamma: float
    milestones: list[int]
    total_iters: int | None = None


@dataclass
class PiecewiseConstantLR(_Phase):
    learning_rates: list[float]
    milestones: list[int]  # one fewer than learning_rates, increasing
    total_iters: int | None = None

    def __post_init__(self) -> None:
        if len(self.learning_rates) != len(self.milestones) + 1:
            raise FieldError("milestones", f"needs one entry fewer than learning_rates "
                             f"({len(self.learning_rates)}), got {len(self.milestones)}")
        if any(b <= a for a, b in zip(self.milestones, self.milestones[1:])):
            raise FieldError("milestones", f"must increase, got {self.milestones}")


_SCHEDULER_CLASSES = (ConstantLR, LinearLR, PolynomialLR, CosineDecayLR, CosineAnnealingLR, ExponentialLR,
                      InverseExponentialTimeDecayLR, InverseSquareRootDecayLR, StepLR, MultiStepLR,
                      PiecewiseConstantLR)
# canonical name (Model Zoo's legacy spelling, without the "LR" suffix) -> schema
SCHEDULERS: dict[str, type] = {cls.__name__.removesuffix("LR"): cls for cls in _SCHEDULER_CLASSES}
_SCHEDULER_ALIASES = {"polynomialdecay": "Polynomial", "cosine": "CosineDecay", "inversetimedecay":
                      "InverseExponentialTimeDecay", "exponentialdecay": "Exponential"}


def canonical_scheduler(name: str) -> str | None:
    """'cosinedecaylr', 'CosineDecay', 'CosineDecayLR' -> 'CosineDecay'; None when unknown."""
    key = name.strip().lower()
    key = key[:-2] if key.endswith("lr") and key != "lr" else key
    by_lower = {n.lower(): n for n in SCHEDULERS}
    return by_lower.get(key) or _SCHEDULER_ALIASES.get(key)


def normalize_learning_rate(value: Any, path: str = "optimizer.learning_rate", source: str | None = None
                            ) -> float | list[dict[str, Any]]:
    """Validate a `learning_rate` (a number, one scheduler dict, or a list of them) -> float | list[dict]."""
    return _convert_learning_rate(value, path, _Ctx(source or "<params>"), None)


# ---- runconfig -------------------------------------------------------------------------------------------

@dataclass
class RunConfig:
    """The `runconfig` section: how long to run, when to log, evaluate and checkpoint, and where. Command-line
    flags (--max_steps, --num_csx, --model_dir, ...) override these."""

    max_steps: int
    eval_steps: int | None = None  # batches per evaluation; None = the whole validation split
    checkpoint_steps: int | None = None  # 0 or None = a checkpoint at the end only
    log_steps: int = 1
    seed: int = 1
    save_initial_checkpoint: bool = False
    num_csx: int = 1
    model_dir: str | None = None
    execution: Literal["auto", "resident", "streaming"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    eval_frequency: int | None = None  # train_and_eval: evaluate every this many steps (None = at the end)
    mode: Literal["train", "eval", "train_and_eval", "eval_all"] = "train"
    checkpoint_path: str | None = None
    load_checkpoint_states: str | None = None  # "all" | "model" | comma list, as Model Zoo
    disable_strict_checkpoint_loading: bool = False
    num_wgt_servers: int | None = None
    compile_only: bool = False
    validate_only: bool = False
    dist_backend: Literal["nccl", "gloo"] | None = None
    # weight streaming (runtime/streaming.py, runtime/memoryx.py); the command-line flags of the same names win
    device_memory_mb: float | None = None  # device budget; execution auto streams when the model does not fit
    memoryx_ram_mb: float | None = None  # MemoryX RAM tier; units beyond it live in flash_dir
    flash_dir: str | None = None  # MemoryX flash tier (default: model_dir/memoryx_flash when memoryx_ram_mb is set)

    ALIASES: ClassVar[dict[str, str]] = {"save_checkpoint_steps": "checkpoint_steps", "num_steps": "max_steps"}
    IGNORED_KEYS: ClassVar[dict[str, str]] = {
        "save_summary_steps": "metrics are written every log_steps",
        "use_cs_grad_accum": "accumulation follows micro_batch_size",
        "precision_opt_level": "a Cerebras compiler setting",
        "keep_checkpoint_max": "all checkpoints are kept",
        "python_paths": "appliance-mode setting",
        "mount_dirs": "appliance-mode setting",
        "credentials_path": "appliance-mode setting",
        "mgmt_address": "appliance-mode setting",
        "job_labels": "appliance-mode setting",
        "num_workers_per_csx": "appliance-mode setting",
        "log_summaries": "metrics.jsonl always has loss, lr and grad norm",
        "enable_distributed": "distributed runs follow num_csx",
    }

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive(self, "max_steps", "eval_steps", "log_steps", "num_csx", "eval_frequency")
        for key in ("device_memory_mb", "memoryx_ram_mb"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise FieldError(key, f"must be a positive number of MiB, got {value}")
        for key in ("checkpoint_steps", "num_wgt_servers"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise FieldError(key, f"must be >= 0, got {value}")


# ---- the whole file --------------------------------------------------------------------------------------

SECTIONS = ("train_input", "eval_input", "model", "optimizer", "sparsity", "runconfig")


@dataclass
class Params:
    """One params file. Cross-section checks: the batch splits evenly over num_csx and micro-batches, and
    sequences fit the model's positions."""

    train_input: InputParams
    model: ModelParams
    optimizer: OptimizerParams
    runconfig: RunConfig
    eval_input: InputParams | None = None
    sparsity: dict[str, Any] | None = None
    source: str | None = field(default=None, compare=False)  # the file it was loaded from
    ignored: list[str] = field(default_factory=list, compare=False)  # Model Zoo keys present but ignored

    def __post_init__(self) -> None:
        num_csx = self.runconfig.num_csx
        for section in ("train_input", "eval_input"):
            inp: InputParams | None = getattr(self, section)
            if inp is None:
                continue
            if inp.batch_size % num_csx:
                raise FieldError(f"{section}.batch_size", f"{inp.batch_size} is not divisible by "
                                 f"runconfig.num_csx {num_csx}; the global batch is split evenly across systems")
            per_csx = inp.batch_size // num_csx
            if inp.micro_batch_size is not None and per_csx % inp.micro_batch_size:
                raise FieldError(f"{section}.micro_batch_size", f"{inp.micro_batch_size} does not divide the "
                                 f"per-system batch {per_csx} (batch_size {inp.batch_size} / num_csx {num_csx})")
            max_len = self.model.to_model_config().max_seq_len
            if inp.max_sequence_length is not None and inp.max_sequence_length > max_len:
                raise FieldError(f"{section}.max_sequence_length", f"{inp.max_sequence_length} exceeds the "
                                 f"model's max_position_embeddings {max_len}; lower it or raise "
                                 f"model.max_position_embeddings")

    def to_dict(self) -> dict[str, Any]:
        """The legacy-layout dict (None-valued keys left out); `Params.from_dict(p.to_dict()) == p`."""
        return {name: _to_plain(getattr(self, name)) for name in SECTIONS if getattr(self, name) is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "<dict>") -> "Params":
        return params_from_dict(d, source)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False, width=110)


def load_params(path: str | Path) -> Params:
    """Read a params YAML (legacy or trainer layout). Every problem is a ConfigError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such params file; check the --params path") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a params YAML file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the params file ({e})") from None
    try:
        data = yaml.load(text, Loader=_make_loader(str(path)))  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        raise ConfigError(f"{where}: malformed YAML: {problem}" + (f" ({context})" if context else "")) from None
    return params_from_dict(data, source=str(path))


def save_params(params: Params, path: str | Path) -> None:
    """Write the params as legacy-layout YAML atomically (temp file, then rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(params.to_yaml(), encoding="utf-8")
    os.replace(tmp, path)


def params_from_dict(d: Any, source: str = "<dict>") -> Params:
    """Build Params from a parsed YAML mapping (legacy or trainer layout)."""
    ctx = _Ctx(source)
    if not isinstance(d, Mapping):
        got = "an empty file" if d is None else _show(d)
        raise ConfigError(f"{source}: the top level must be a mapping of sections ({', '.join(SECTIONS)}), "
                          f"got {got}")
    if "trainer" in d:
        if len(d) > 1:
            others = ", ".join(repr(k) for k in d if k != "trainer")
            raise ctx.error("", f"mixes the trainer layout with legacy sections {others}; use one layout")
        d = _legacy_from_trainer(d["trainer"], ctx)
        ctx = _Ctx(source, note=" (key path in the legacy layout the trainer: form maps to)")
    params = _build(Params, d, "", ctx)
    params.source = source
    params.ignored = ctx.ignored
    return params


# ---- the generic "typed dataclass from a mapping, with key paths" helper ----------------------------------

class _LinedDict(dict):
    """A YAML mapping that remembers the (1-based) line of each key, for error messages."""

    key_lines: dict[Any, int]


def _make_loader(source: str) -> type[yaml.SafeLoader]:
    class Loader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> _LinedDict:
        loader.flatten_mapping(node)
        out = _LinedDict()
        out.key_lines = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in out:
                raise ConfigError(f"{source}:{line}: duplicate key {key!r} (first on line {out.key_lines[key]}); "
                                  f"keep one")
            out[key] = loader.construct_object(value_node, deep=True)
            out.key_lines[key] = line
        return out

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    # YAML 1.1 reads `1e-3` (no dot) as a string; read it as the number everyone means.
    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))
    return Loader


@dataclass
class _Ctx:
    source: str
    note: str = ""
    ignored: list[str] = field(default_factory=list)

    def error(self, path: str, message: str, line: int | None = None) -> ConfigError:
        where = f"{self.source}:{line}" if line else self.source
        return ConfigError(f"{where}: {path}: {message}{self.note}" if path else f"{where}: {message}{self.note}")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _build(cls: type, data: Any, path: str, ctx: _Ctx, line: int | None = None) -> Any:
    """Build dataclass `cls` from mapping `data` found at key path `path`, checking keys and types."""
    if not isinstance(data, Mapping):
        raise ctx.error(path, f"expected a mapping of {_known_keys(cls)}, got {_show(data)}", line)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in ("source", "ignored")}
    aliases: dict[str, str] = getattr(cls, "ALIASES", {})
    ignored: dict[str, str] = getattr(cls, "IGNORED_KEYS", {})
    lines: dict[Any, int] = getattr(data, "key_lines", {})
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key_path, key_line = _join(path, key), lines.get(key, line)
        name = aliases.get(key, key)
        if name in fields:
            if name in kwargs:
                raise ctx.error(key_path, f"gives {name!r} a second time (as {key!r}); keep one", key_line)
            kwargs[name] = _convert(value, hints[name], key_path, ctx, key_line, fields[name])
        elif key in ignored:
            ctx.ignored.append(key_path)
        else:
            known = sorted(set(fields) | set(aliases) | set(ignored))
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ctx.error(key_path, f"unknown key {key!r}{hint}; known keys here: {', '.join(known)}", key_line)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        where = f"under {path}" if path else "at the top level"
        also = f" (also missing: {', '.join(missing[1:])})" if missing[1:] else ""
        raise ctx.error(path, f"missing required key {missing[0]!r}{also}; add `{missing[0]}: ...` {where}", line)
    try:
        return cls(**kwargs)
    except FieldError as e:
        first = e.key.split(".")[0]
        raise ctx.error(_join(path, e.key) if e.key else path, e.message, lines.get(first, line)) from None


def _convert(value: Any, tp: Any, path: str, ctx: _Ctx, line: int | None, f: dataclasses.Field | None = None
             ) -> Any:
    """Check `value` against the annotation `tp` and return it in canonical form."""
    if f is not None and "convert" in f.metadata:
        return globals()[f.metadata["convert"]](value, path, ctx, line)
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return _plain(value)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        if len(options) == 1:
            return _convert(value, options[0], path, ctx, line)
        for option in options:
            try:
                return _convert(value, option, path, ctx, line)
            except ConfigError:
                continue
        raise ctx.error(path, f"expected {_type_name(tp)}, got {_show(value)}", line)
    if value is None:
        raise ctx.error(path, f"expected {_type_name(tp)}, got nothing (null); give a value or leave the key out",
                        line)
    if origin is Literal:
        if isinstance(value, str):
            for choice in args:
                if value.strip().lower() == str(choice).lower():
                    return choice
        raise ctx.error(path, f"expected one of {', '.join(repr(a) for a in args)}, got {_show(value)}", line)
    if origin is list:
        (item_tp,) = args
        if isinstance(value, str) and item_tp is str:
            value = [value]
        if not isinstance(value, list):
            raise ctx.error(path, f"expected {_type_name(tp)}, got {_show(value)}", line)
        return [_convert(v, item_tp, f"{path}[{i}]", ctx, line) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ctx.error(path, f"expected {_type_name(tp)}, got {_show(value)}", line)
        return tuple(_convert(v, a, f"{path}[{i}]", ctx, line) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ctx.error(path, f"expected a mapping, got {_show(value)}", line)
        return _plain(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, ctx, line)
    ok = {bool: isinstance(value, bool),
          int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, str)}.get(tp)
    if ok is None:
        raise TypeError(f"config helper: unsupported annotation {tp!r} at {path}")
    if not ok:
        raise ctx.error(path, f"expected {_type_name(tp)}, got {_show(value)}", line)
    return float(value) if tp is float else value


def _convert_micro_batch(value: Any, path: str, ctx: _Ctx, line: int | None) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("auto", "none", "explore")):
        return None  # no gradient accumulation
    return _convert(value, int, path, ctx, line)


def _convert_learning_rate(value: Any, path: str, ctx: _Ctx, line: int | None) -> float | list[dict[str, Any]]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ctx.error(path, f"must be >= 0, got {value}", line)
        return float(value)
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ctx.error(path, f"expected a number, a scheduler mapping or a non-empty list of them, got "
                        f"{_show(value)}", line)
    phases = [_scheduler_dict(item, f"{path}[{i}]", ctx, line) for i, item in enumerate(value)]
    for i, phase in enumerate(phases[:-1]):
        if phase.get("total_iters") is None:
            raise ctx.error(f"{path}[{i}].total_iters", f"is required for every phase but the last (a "
                            f"{phase['scheduler']} phase followed by another needs its length in steps)", line)
    return phases


def _scheduler_dict(item: Any, path: str, ctx: _Ctx, line: int | None) -> dict[str, Any]:
    line = getattr(item, "key_lines", {}).get("scheduler", line)
    if not isinstance(item, Mapping):
        raise ctx.error(path, f"expected a scheduler mapping like {{scheduler: Linear, ...}}, got {_show(item)}",
                        line)
    if "scheduler" not in item:
        for key in item:  # a misspelt 'scheduler' is the likely cause
            if difflib.get_close_matches(str(key), ["scheduler"], n=1, cutoff=0.6):
                raise ctx.error(_join(path, key), f"unknown key {key!r} (did you mean 'scheduler'?)",
                                getattr(item, "key_lines", {}).get(key, line))
        raise ctx.error(path, f"missing required key 'scheduler' (one of {', '.join(SCHEDULERS)})", line)
    name = item["scheduler"]
    canonical = canonical_scheduler(name) if isinstance(name, str) else None
    if canonical is None:
        close = difflib.get_close_matches(str(name).lower(), [n.lower() for n in SCHEDULERS], n=1)
        hint = f" (did you mean {canonical_scheduler(close[0])!r}?)" if close else ""
        raise ctx.error(_join(path, "scheduler"), f"unknown scheduler {name!r}{hint}; known: "
                        f"{', '.join(SCHEDULERS)} (an 'LR' suffix is fine)", line)
    rest = _LinedDict({k: v for k, v in item.items() if k != "scheduler"})
    rest.key_lines = getattr(item, "key_lines", {})
    spec = _build(SCHEDULERS[canonical], rest, path, ctx, line)
    return {"scheduler": canonical, **{k: v for k, v in dataclasses.asdict(spec).items() if v is not None}}


def _explicit(cfg: ModelConfig) -> ModelConfig:
    """The same config with defaulted sizes spelled out (d_ff None -> 4 * d_model, n_kv_head None -> n_head)."""
    return cfg.replace(d_ff=cfg.ffn_dim, n_kv_head=cfg.kv_heads)


_ZOO_KEY_FOR = {"d_model": "hidden_size", "n_head": "num_heads", "n_kv_head": "num_kv_groups",
                "n_layer": "num_hidden_layers", "d_ff": "filter_size", "max_seq_len": "max_position_embeddings",
                "head_dim": "head dim"}


def _zoo_names(message: str) -> str:
    """Say ModelConfig's complaints in the YAML's words: 'd_model (100)' -> 'hidden_size (100)'."""
    message = re.sub(r"^model config '[^']*': ", "", message)
    return re.sub(r"\b(" + "|".join(_ZOO_KEY_FOR) + r")\b", lambda m: _ZOO_KEY_FOR[m.group(1)], message)


def _check_fields(obj: Any) -> None:
    """For objects built in code (`_build` already did this for YAML): build nested dataclass fields given as
    mappings, and check every Literal-typed field's value."""
    hints = get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        tp, value = hints[f.name], getattr(obj, f.name)
        options = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)
        nested = [a for a in options if dataclasses.is_dataclass(a)]
        if nested and isinstance(value, Mapping):
            setattr(obj, f.name, _build(nested[0], value, f.name, _Ctx(f"<{type(obj).__name__}>")))
        literals = [a for a in options if get_origin(a) is Literal]
        if value is None or not literals or len(literals) + (type(None) in options) != len(options):
            continue  # not a pure choice field (e.g. float | 'dynamic' is checked by hand)
        choices = get_args(literals[0])
        canonical = [c for c in choices if isinstance(value, str) and c.lower() == value.strip().lower()]
        if not canonical:
            raise FieldError(f.name, f"expected one of {', '.join(map(repr, choices))}, got {value!r}")
        setattr(obj, f.name, canonical[0])  # case-insensitive, as in YAML: 'adamw' -> 'AdamW'


def _positive(obj: Any, *keys: str) -> None:
    for key in keys:
        value = getattr(obj, key)
        if value is not None and value <= 0:
            raise FieldError(key, f"must be a positive integer, got {value}")


def _plain(value: Any) -> Any:
    """YAML containers -> plain dicts/lists (drops line bookkeeping)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _to_plain(value: Any) -> Any:
    """Dataclasses -> dicts without None-valued fields (every optional field defaults to None)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if f.compare and v is not None:
                out[f.name] = _to_plain(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _known_keys(cls: type) -> str:
    names = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("source", "ignored")]
    return f"{cls.__name__} keys ({', '.join(names[:8])}{', ...' if len(names) > 8 else ''})"


def _type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is tuple:
        return f"a list of {len(args)} {_type_name(args[0]).removeprefix('a ')}s"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            dict: "a mapping"}.get(tp, getattr(tp, "__name__", str(tp)))


def _show(value: Any) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            type(None): "null"}.get(type(value), "a mapping" if isinstance(value, Mapping) else type(value).__name__)
    text = repr(_plain(value))
    return f"{text[:60] + '...' if len(text) > 60 else text} ({kind})"


# ---- the trainer layout -> the legacy layout --------------------------------------------------------------

def _legacy_from_trainer(trainer: Any, ctx: _Ctx) -> dict[str, Any]:
    """Map `trainer: {init, fit}` (cszoo) onto the legacy sections. Unknown keys are errors, as everywhere."""
    if isinstance(trainer, list):
        if len(trainer) != 1:
            raise ctx.error("trainer", f"a list of {len(trainer)} trainers (multi-phase training) is not "
                            f"supported; split it into one params file per phase")
        trainer = trainer[0].get("trainer", trainer[0]) if isinstance(trainer[0], Mapping) else trainer[0]
    _expect_keys(trainer, "trainer", ("init", "fit", "validate", "validate_all"), ctx)
    init, fit = trainer.get("init") or {}, trainer.get("fit") or {}
    _expect_keys(init, "trainer.init", ("backend", "model_dir", "seed", "device", "model", "optimizer",
                                        "schedulers", "precision", "loop", "checkpoint", "logging", "callbacks",
                                        "sparsity", "loggers"), ctx)
    _expect_keys(fit, "trainer.fit", ("train_dataloader", "val_dataloader", "ckpt_path"), ctx)

    model = dict(init.get("model") or {})
    optimizer: dict[str, Any] = {}
    run: dict[str, Any] = {}
    out: dict[str, Any] = {"model": model, "optimizer": optimizer, "runconfig": run}

    opt = init.get("optimizer")
    if opt is not None:
        if not isinstance(opt, Mapping) or len(opt) != 1:
            raise ctx.error("trainer.init.optimizer", f"expected one mapping like {{AdamW: {{...}}}}, got "
                            f"{_show(opt)}")
        ((name, kwargs),) = opt.items()
        optimizer.update({"optimizer_type": name, **(kwargs or {})})
    if "schedulers" in init:
        optimizer["learning_rate"] = _trainer_schedulers(init["schedulers"], ctx)

    precision = dict(init.get("precision") or {})
    _expect_keys(precision, "trainer.init.precision", ("enabled", "fp16_type", "loss_scaling_factor",
                                                       "max_gradient_norm", "initial_loss_scale",
                                                       "steps_per_increase", "min_loss_scale", "max_loss_scale",
                                                       "log_loss_scale", "precision_opt_level"), ctx)
    if "enabled" in precision:
        model["mixed_precision"] = precision.pop("enabled")
    if "fp16_type" in precision:
        model["fp16_type"] = precision.pop("fp16_type")
    precision.pop("log_loss_scale", None)
    precision.pop("precision_opt_level", None)
    optimizer.update(precision)

    backend = init.get("backend") or {}
    _expect_keys(backend, "trainer.init.backend", ("backend_type", "cluster_config", "compile_dir",
                                                   "artifact_dir"), ctx)
    device = {"csx": None, "cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}
    if "backend_type" in backend:
        kind = str(backend["backend_type"]).lower()
        if kind not in device:
            raise ctx.error("trainer.init.backend.backend_type", f"expected CSX, CPU or GPU, got {_show(kind)}")
        if device[kind]:
            run["device"] = device[kind]
    if "num_csx" in (backend.get("cluster_config") or {}):
        run["num_csx"] = backend["cluster_config"]["num_csx"]
    if "device" in init:
        run["device"] = {"gpu": "cuda"}.get(str(init["device"]).lower(), init["device"])
    for key in ("model_dir", "seed"):
        if key in init:
            run[key] = init[key]
    for section, mapping in (("loop", {"max_steps": "max_steps", "num_steps": "max_steps",
                                       "eval_steps": "eval_steps", "eval_frequency": "eval_frequency"}),
                             ("checkpoint", {"steps": "checkpoint_steps",
                                             "save_initial_checkpoint": "save_initial_checkpoint",
                                             "disable_strict_checkpoint_loading":
                                                 "disable_strict_checkpoint_loading"}),
                             ("logging", {"log_steps": "log_steps", "log_level": None})):
        values = init.get(section) or {}
        _expect_keys(values, f"trainer.init.{section}", tuple(mapping), ctx)
        run.update({mapping[k]: v for k, v in values.items() if mapping[k]})

    micro_batch = None
    for callback in init.get("callbacks") or []:  # only the micro-batch flag matters on a host
        for flags in (callback or {}).values() if isinstance(callback, Mapping) else ():
            if isinstance(flags, Mapping) and "csx.performance.micro_batch_size" in flags:
                micro_batch = flags["csx.performance.micro_batch_size"]
    if init.get("sparsity") is not None:
        out["sparsity"] = init["sparsity"]

    if "train_dataloader" in fit:
        out["train_input"] = dict(fit["train_dataloader"])
        if micro_batch is not None:
            out["train_input"].setdefault("micro_batch_size", micro_batch)
    val = fit.get("val_dataloader")
    if isinstance(val, list):
        val = val[0] if val else None
    if val is not None:
        out["eval_input"] = dict(val)
    if "ckpt_path" in fit:
        run["checkpoint_path"] = fit["ckpt_path"]
    return out


def _trainer_schedulers(value: Any, ctx: _Ctx) -> list[dict[str, Any]]:
    """[{LinearLR: {...}}, {SequentialLR: {schedulers: [...]}}] -> legacy [{scheduler: Linear, ...}, ...]."""
    items = value if isinstance(value, list) else [value]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        path = f"trainer.init.schedulers[{i}]"
        if not isinstance(item, Mapping) or len(item) != 1:
            raise ctx.error(path, f"expected one mapping like {{CosineDecayLR: {{...}}}}, got {_show(item)}")
        ((name, kwargs),) = item.items()
        kwargs = dict(kwargs or {})
        if str(name).lower() in ("sequentiallr", "sequential"):
            phases = _trainer_schedulers(kwargs.pop("schedulers", []), ctx)
            milestones = kwargs.pop("milestones", None)
            if kwargs:
                raise ctx.error(path, f"unknown SequentialLR key(s) {', '.join(map(repr, kwargs))}")
            lengths = [p.get("total_iters") or p.get("steps") or p.get("decay_steps") for p in phases[:-1]]
            if milestones is not None and None not in lengths:
                cumulative = [sum(lengths[: j + 1]) for j in range(len(lengths))]
                if list(milestones) != cumulative:
                    raise ctx.error(f"{path}.milestones", f"{list(milestones)} disagree with the phases' "
                                    f"total_iters (cumulative {cumulative}); drop milestones or fix them")
            out.extend(phases)
        else:
            out.append({"scheduler": name, **kwargs})
    return out


def _expect_keys(mapping: Any, path: str, known: tuple[str, ...], ctx: _Ctx) -> None:
    if not isinstance(mapping, Mapping):
        raise ctx.error(path, f"expected a mapping, got {_show(mapping)}")
    for key in mapping:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ctx.error(_join(path, key), f"unknown key {key!r}{hint}; known keys here: {', '.join(known)}",
                            getattr(mapping, "key_lines", {}).get(key))


__all__ = ["ConfigError", "FieldError", "InputParams", "ModelParams", "OptimizerParams", "RunConfig", "Params",
           "SCHEDULERS", "OPTIMIZERS", "canonical_scheduler", "normalize_learning_rate", "load_params",
           "params_from_dict", "save_params"]
