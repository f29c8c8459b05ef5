"""The params file's sections as typed dataclasses (the legacy layout; `trainer_layout` maps the newer one onto
it), and reading / writing the whole file. Our extension keys:
    *_input.tokenizer     'char' | 'smollm2' | a tokenizer.json / HF dir / .gguf path (default 'char')
    *_input.val_fraction  share of the documents held out for validation (default 0.05)
    runconfig.execution   'auto' | 'resident' | 'streaming'
    runconfig.device      'auto' | 'cpu' | 'cuda'
(and those of the model section, see `params.model`).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from waferscale.errors import ConfigError
from waferscale.params.cluster_keys import CLUSTER_KEYS
from waferscale.models.mup import check_lr_adjustment
from waferscale.params.model import ModelParams
from waferscale.params.schedules import convert_learning_rate, normalize_learning_rate
from waferscale.params.trainer_layout import legacy_from_trainer
from waferscale.params.typed import (Ctx, FieldError, build_dataclass, check_fields, convert_value, non_negative,
                                     positive, show, to_plain)
from waferscale.params.yaml_lines import read_yaml
from waferscale.runtime import optim
from waferscale.sparse import configure
from waferscale.util.files import atomic_write_text


# ---- input -----------------------------------------------------------------------------------------------

def _convert_micro_batch(value: Any, path: str, ctx: Ctx, line: int | None) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("auto", "none", "explore")):
        return None  # no gradient accumulation
    return convert_value(value, int, path, ctx, line)


@dataclass
class InputParams:
    """`train_input` / `eval_input`. `batch_size` is the global batch in sequences per step, split across
    `runconfig.num_csx`; `micro_batch_size` (per system) accumulates gradients over smaller pieces."""

    data_dir: list[str]
    batch_size: int
    micro_batch_size: int | None = field(default=None, metadata={"convert": _convert_micro_batch})
    max_sequence_length: int | None = None  # tokens per sequence; None = the model's max_position_embeddings
    tokenizer: str = "char"
    shuffle: bool = True
    shuffle_seed: int = 0
    num_workers: int = 0
    # GptHDF5MapDataProcessor / GptHDF5DataProcessor: HDF5 examples (waferscale.data.hdf5) where data_dir holds
    # .h5 files; other supported names (text) and None: the token-stream loader on .txt/.jsonl/dirs/"shakespeare"
    data_processor: str | None = None
    drop_last: bool = True  # HDF5: how an epoch ends (waferscale.data.hdf5); a token stream has no epoch end
    val_fraction: float = 0.05
    # Model Zoo's BERT data keys: the WordPiece vocabulary (the tokenizer, instead of `tokenizer`) and whether it
    # lowercases; the masked-LM objective's share of masked positions and its cap per sequence (encoders)
    vocab_file: str | None = None
    do_lower: bool | None = None
    masked_lm_prob: float | None = None  # None: 0.15
    max_predictions_per_seq: int | None = None
    mask_whole_word: bool = False
    dynamic_mlm_scale: bool = False  # true: the loss is the mean over the batch's masked positions (see Params)
    # Model Zoo's T5 data keys (T5DynamicDataProcessor): its SentencePiece vocabulary, the sentinels the vocabulary
    # gains, the decoder's length (what span corruption of src_max_sequence_length inputs gives) and our span
    # corruption settings (T5's: 15% noise in spans of mean length 3)
    src_vocab_file: str | None = None
    extra_ids: int | None = None
    tgt_max_sequence_length: int | None = None
    noise_density: float | None = None  # None: 0.15
    mean_noise_span_length: float | None = None  # None: 3.0

    ALIASES: ClassVar[dict[str, str]] = {"whole_word_masking": "mask_whole_word", "src_data_dir": "data_dir",
                                         "src_max_sequence_length": "max_sequence_length"}
    IGNORED_KEYS: ClassVar[dict[str, str]] = {
        "repeat": "the loader always repeats",
        "vocab_size": "the model's vocab_size is the one used",
        "shuffle_buffer": "shuffled windows are drawn from the whole token stream",
        **dict.fromkeys(("prefetch_factor", "persistent_workers", "use_worker_cache"), "host data-loader tuning"),
        "pad_last": "a short last batch (HDF5, drop_last: false) is yielded short; token streams have none",
        "buckets": "sequence-length buckets for variable tensor shapes; sequences here are full windows",
    }

    def __post_init__(self) -> None:
        if isinstance(self.micro_batch_size, str):  # 'auto' when built in code
            self.micro_batch_size = _convert_micro_batch(self.micro_batch_size, "micro_batch_size",
                                                         Ctx("<InputParams>"), None)
        if isinstance(self.data_dir, (str, os.PathLike)):
            self.data_dir = [str(self.data_dir)]
        if not self.data_dir:
            raise FieldError("data_dir", "is empty; give a file, a directory or the builtin corpus 'shakespeare'")
        positive(self, "batch_size", "max_sequence_length", "micro_batch_size")
        non_negative(self, "num_workers")
        if self.data_processor is not None:
            from waferscale.data.hdf5 import check_data_processor

            try:
                check_data_processor(self.data_processor)
            except ConfigError as e:
                raise FieldError("data_processor", str(e).removeprefix("data_processor ")) from None
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise FieldError("micro_batch_size", f"{self.micro_batch_size} does not divide batch_size "
                             f"{self.batch_size}; pick a divisor, or 'auto' for no accumulation")
        if not 0.0 <= self.val_fraction < 1.0:
            raise FieldError("val_fraction", f"must be in [0, 1), got {self.val_fraction}")
        if self.vocab_file is not None and self.tokenizer != "char":
            raise FieldError("vocab_file", f"and tokenizer {self.tokenizer!r} both name the tokenizer; keep one")
        if self.do_lower is not None and self.vocab_file is None:
            raise FieldError("do_lower", "applies to a vocab_file's WordPiece tokenizer (a tokenizer.json "
                             "lowercases as its own normalizer says); give vocab_file, or leave do_lower out")
        positive(self, "max_predictions_per_seq")
        if self.masked_lm_prob is not None and not 0.0 < self.masked_lm_prob <= 1.0:
            raise FieldError("masked_lm_prob", f"must be in (0, 1], got {self.masked_lm_prob}")
        if self.noise_density is not None and not 0.0 < self.noise_density < 1.0:
            raise FieldError("noise_density", f"must be in (0, 1), got {self.noise_density}")
        if self.mean_noise_span_length is not None and self.mean_noise_span_length < 1.0:
            raise FieldError("mean_noise_span_length", f"must be >= 1, got {self.mean_noise_span_length}")
        if self.mask_whole_word:
            raise FieldError("mask_whole_word", "true (masking whole words) is not supported: tokens are masked "
                             "one by one; set false")

    @property
    def tokenizer_spec(self) -> str:
        """What `load_tokenizer` reads: the WordPiece vocab_file where given, else `tokenizer`."""
        return self.vocab_file or self.src_vocab_file or self.tokenizer


# ---- optimizer -------------------------------------------------------------------------------------------

OPTIMIZERS = tuple(optim.OPTIMIZERS)  # the optimizers the runtime builds
ADAFACTOR_KEYS = ("clip_threshold", "decay_rate", "beta1", "scale_parameter", "relative_step", "warmup_init")


@dataclass
class OptimizerParams:
    """The `optimizer` section. `learning_rate` is a constant, or a list of scheduler dicts run one after the
    other, each normalized: the canonical `scheduler` name first ('Linear', 'CosineDecay', ...; see
    `SCHEDULERS`), legacy spellings mapped, defaults filled in, unset optional keys left out."""

    optimizer_type: Literal[OPTIMIZERS]  # type: ignore[valid-type]  (any case, as Model Zoo: 'AdaFactor')
    learning_rate: float | list[dict[str, Any]] = field(metadata={"convert": convert_learning_rate})
    betas: tuple[float, float] = (0.9, 0.999)
    # None: the optimizer's default (runtime.optim.default_eps: cstorch's, 1e-6 for AdamW where torch has 1e-8)
    eps: float | tuple[float, float] | None = None
    weight_decay: float = 0.0  # not to biases nor LayerNorm parameters, as Model Zoo (zoo.lm.zoo_group_rules)
    momentum: float = 0.0  # SGD
    nesterov: bool = False  # SGD
    max_gradient_norm: float | None = None
    correct_bias: bool = True  # AdamW's bias correction (Cerebras' Adam always corrects)
    loss_scaling_factor: float | Literal["dynamic"] = 1.0
    initial_loss_scale: float | None = None  # dynamic loss scaling: start value (None = 2**15)
    steps_per_increase: int = 2000  # dynamic loss scaling: growth interval
    min_loss_scale: float | None = None
    max_loss_scale: float | None = None
    # Adafactor's keys (cstorch.optim.Adafactor's arguments, its defaults; see runtime.optim.Adafactor)
    clip_threshold: float = 1.0
    decay_rate: float = -0.8
    beta1: float | None = None
    scale_parameter: bool = True
    relative_step: bool = False
    warmup_init: bool = False
    # muP: {group: scale} multiplies the scheduled learning rate of a group of parameters (models/mup.py)
    adjust_learning_rate: dict[str, float] | None = None

    ALIASES: ClassVar[dict[str, str]] = {"weight_decay_rate": "weight_decay"}
    IGNORED_KEYS: ClassVar[dict[str, str]] = {
        "log_summaries": "metrics.jsonl always has loss, lr and grad norm",
        "disable_lr_steps_reset": "schedules are pure functions of the global step",
    }

    def __post_init__(self) -> None:
        check_fields(self)
        self.learning_rate = normalize_learning_rate(self.learning_rate)  # idempotent
        if self.adjust_learning_rate is not None:
            try:
                check_lr_adjustment(self.adjust_learning_rate)
            except ConfigError as e:
                raise FieldError("adjust_learning_rate", str(e).split(": ", 1)[1]) from None
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise FieldError("betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        non_negative(self, "weight_decay", "momentum")
        if self.eps is not None and min(self.eps if isinstance(self.eps, tuple) else (self.eps,)) < 0:
            raise FieldError("eps", f"must be >= 0, got {self.eps}")
        if self.max_gradient_norm is not None and self.max_gradient_norm <= 0:
            raise FieldError("max_gradient_norm", f"must be > 0 (or left out for no clipping), "
                             f"got {self.max_gradient_norm}")
        if not self.correct_bias and self.optimizer_type != "AdamW":
            raise FieldError("correct_bias", f"false applies to AdamW only (Cerebras' {self.optimizer_type} has no "
                             f"such option); use AdamW or leave correct_bias out")
        if self.loss_scaling_factor != "dynamic" and self.loss_scaling_factor <= 0:
            raise FieldError("loss_scaling_factor", f"must be > 0 or 'dynamic', got {self.loss_scaling_factor}")
        if self.nesterov and self.optimizer_type != "SGD":
            raise FieldError("nesterov", f"applies to SGD only, not {self.optimizer_type}")
        if self.optimizer_type != "Adafactor":
            for key in ADAFACTOR_KEYS:
                if getattr(self, key) != self.__dataclass_fields__[key].default:
                    raise FieldError(key, f"applies to Adafactor only, not {self.optimizer_type}")
        # Model Zoo schedules Adafactor's rate like any other (cstorch's Adafactor refuses relative_step and
        # warmup_init): a learning_rate is always given, so the step-derived rate would silently ignore it
        for key in ("relative_step", "warmup_init"):
            if getattr(self, key):
                raise FieldError(key, "true is not supported (as in Cerebras' Adafactor): the rate is "
                                 "optimizer.learning_rate's schedule, scaled by each parameter's RMS")
        try:
            optim.OptimizerSpec(optimizer_type=self.optimizer_type, eps=self.eps)
        except ConfigError as e:
            raise FieldError("eps", str(e).removeprefix("optimizer.eps: ")) from None
        if self.optimizer_type == "Adafactor" and (self.clip_threshold <= 0 or not (
                self.beta1 is None or 0.0 <= self.beta1 < 1.0)):
            raise FieldError("clip_threshold" if self.clip_threshold <= 0 else "beta1",
                             "must be > 0 (clip_threshold) and in [0, 1) or left out (beta1)")


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
    eval_frequency: int | None = None  # train_and_eval: also evaluate every this many steps (metrics.jsonl)
    # the run's defaults for the `wsc run` flags of the same names (a flag given wins; zoo.runner.prepare_run)
    mode: Literal["train", "eval", "train_and_eval"] | None = None
    checkpoint_path: str | None = None
    load_checkpoint_states: Literal["all", "model"] | None = None
    compile_only: bool = False
    validate_only: bool = False
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
        "log_summaries": "metrics.jsonl always has loss, lr and grad norm",
        "show_debug_metrics": "metrics.jsonl always has loss, lr and grad norm",
        "save_losses": "every logged loss is written to metrics.jsonl",
        "enable_distributed": "distributed runs follow num_csx",
        "multireplica": "a Cerebras compiler setting (replicas are the compiler's choice)",
        "disable_strict_checkpoint_loading": "checkpoints always load strictly: another architecture is an error",
        "num_wgt_servers": "one MemoryX process holds all the weights",
        "dist_backend": "SwarmX's processes always talk over gloo",
        **CLUSTER_KEYS,
    }

    def __post_init__(self) -> None:
        check_fields(self)
        positive(self, "max_steps", "eval_steps", "log_steps", "num_csx", "eval_frequency")
        positive(self, "device_memory_mb", "memoryx_ram_mb", what="a positive number of MiB")
        non_negative(self, "checkpoint_steps")


# ---- the whole file --------------------------------------------------------------------------------------

SECTIONS = ("train_input", "eval_input", "model", "optimizer", "sparsity", "runconfig")


def _convert_sparsity(value: Any, path: str, ctx: Ctx, line: int | None) -> Any:
    """The `sparsity` section, checked by building it (`waferscale.sparse.configure`); an error names the key
    and its line."""
    if value is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # `type` for `algorithm` is accepted
            configure(to_plain(value))
    except ConfigError as e:
        msg = str(e)
        m = re.match(r"(?:sparsity\.)?(\w+)", msg)
        key = re.search(r"unknown key (\w+)", msg) or m
        lines = getattr(value, "key_lines", {})
        raise ctx.error("" if msg.startswith("sparsity") else path, msg,
                        lines.get(key.group(1) if key else "", line)) from None
    return value


@dataclass
class Params:
    """One params file. Cross-section checks: the batch splits evenly over num_csx and micro-batches, and
    sequences fit the model's positions."""

    train_input: InputParams
    model: ModelParams
    optimizer: OptimizerParams
    runconfig: RunConfig
    eval_input: InputParams | None = None
    sparsity: Any = field(default=None, metadata={"convert": _convert_sparsity})  # float | mapping | list
    source: str | None = field(default=None, compare=False)  # the file it was loaded from
    # Model Zoo keys the file sets that change nothing here: key path -> why (`ignored_block` shows them)
    ignored: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for section in ("train_input", "eval_input"):
            inp: InputParams | None = getattr(self, section)
            if inp is None:
                continue
            check_batch_split(inp, self.runconfig.num_csx, section=section)
            cfg = self.model.to_model_config()
            max_len = cfg.max_seq_len
            masking = [k for k in ("masked_lm_prob", "max_predictions_per_seq", "dynamic_mlm_scale")
                       if getattr(inp, k) not in (None, False)]
            if masking and not cfg.is_encoder:
                raise FieldError(f"{section}.{masking[0]}", f"is a masked-LM setting, but the model ({cfg.family}) "
                                 f"is not an encoder (BERT, RoBERTa); leave it out")
            self._check_span_corruption(section, inp, cfg)
            if inp.max_sequence_length is not None and inp.max_sequence_length > max_len:
                raise FieldError(f"{section}.max_sequence_length", f"{inp.max_sequence_length} exceeds the "
                                 f"model's max_position_embeddings {max_len}; lower it or raise "
                                 f"model.max_position_embeddings")
        self._check_loss_scaling()
        self._check_loss_scale_keys()
        if self.eval_input is not None:
            self._check_eval_input(self.eval_input)
        mup_lr = self.model.lr_adjustment()
        if mup_lr:  # muP by base widths: Model Zoo's per-group learning rates; the file's own, given, win
            self.optimizer.adjust_learning_rate = mup_lr | (self.optimizer.adjust_learning_rate or {})
            try:
                check_lr_adjustment(self.optimizer.adjust_learning_rate)
            except ConfigError as e:
                raise FieldError("optimizer.adjust_learning_rate", f"{str(e).split(': ', 1)[1]} (with the groups "
                                 f"model.mup_base_hidden_size gives: {', '.join(mup_lr)})") from None
        if self.train_input.dynamic_mlm_scale:
            # Model Zoo then scales each batch's summed masked-LM loss by its sequences / masked positions (the mean
            # over the masked positions) and leaves mlm_loss_weight out: the mean is the encoder's loss without it
            self.model.mlm_loss_weight = None
        groups = self.sparsity if isinstance(self.sparsity, list) else [self.sparsity]
        for g in groups:
            update = g.get("update") if isinstance(g, Mapping) else None
            if isinstance(update, Mapping):
                first = min(update["steps"]) if "steps" in update else update.get("start", 0)
                if first >= self.runconfig.max_steps:
                    raise FieldError("sparsity.update", f"the first mask update (step {first}) comes after the run "
                                     f"ends (runconfig.max_steps {self.runconfig.max_steps}); lower update.start "
                                     f"or raise max_steps")

    def _check_loss_scaling(self) -> None:
        """A decoder's loss is the mean over its target tokens (windows have no padding). Model Zoo's `num_tokens`
        scaling is that mean and reads no loss_weight; `batch_size` scaling is loss_weight x the sum over the
        tokens / sequences, the same mean only when loss_weight = 1 / max_sequence_length."""
        m = self.model
        if m.loss_scaling == "num_tokens":
            if m.loss_weight != 1.0:
                self.ignored["model.loss_weight"] = "loss_scaling num_tokens: the loss is the mean over tokens"
            return
        seq = self.train_input.max_sequence_length or self.model.to_model_config().max_seq_len
        if abs(m.loss_weight * seq - 1.0) > 1e-6:
            raise FieldError("model.loss_weight", f"{m.loss_weight} with loss_scaling batch_size scales the loss "
                             f"to {m.loss_weight * seq:g} x the mean over tokens, which is not supported; set "
                             f"loss_weight to 1/max_sequence_length ({1 / seq:g}) or loss_scaling: num_tokens")

    def _check_loss_scale_keys(self) -> None:
        """Loss scaling guards float16's range only: bfloat16 (cbfloat16) and fp32 runs have none, so their
        loss-scale keys are listed as ignored; a float16 run scales dynamically from 2**16, doubling after 2000
        clean steps, or by a fixed loss_scaling_factor, and refuses the keys that would change that rule."""
        opt, fields = self.optimizer, OptimizerParams.__dataclass_fields__
        given = [k for k in ("loss_scaling_factor", "initial_loss_scale", "steps_per_increase", "min_loss_scale",
                             "max_loss_scale") if getattr(opt, k) != fields[k].default]
        if self.model.half_dtype != "float16":
            why = f"{self.model.half_dtype or 'fp32'} training needs no loss scaling"
            self.ignored.update({f"optimizer.{k}": why for k in given})
            return
        for k in given[1:] if given[:1] == ["loss_scaling_factor"] else given:
            raise FieldError(f"optimizer.{k}", "is not supported: float16 loss scaling starts at 2**16 and doubles "
                             "after 2000 clean steps (or is a fixed loss_scaling_factor); leave it out, or train "
                             "in bfloat16 (fp16_type: bfloat16), which needs no loss scaling")

    def _check_eval_input(self, ev: InputParams) -> None:
        """eval_input: its data_dir, batch_size and val_fraction are read; on HDF5 data its max_sequence_length is
        checked against the files; it reads the validation batches in order (shuffle is the training loader's). It
        reads with train_input's tokenizer, and its loader tuning changes no loss: those keys are listed."""
        tr = self.train_input
        if ev.tokenizer_spec != tr.tokenizer_spec and (ev.tokenizer != "char" or ev.vocab_file or ev.src_vocab_file):
            key = "vocab_file" if ev.vocab_file else "src_vocab_file" if ev.src_vocab_file else "tokenizer"
            self.ignored[f"eval_input.{key}"] = f"evaluation reads with train_input's tokenizer {tr.tokenizer_spec!r}"
        why = {"micro_batch_size": (ev.micro_batch_size is not None,
                                    "evaluation computes each batch's loss whole (accumulation gives the same loss)"),
               "num_workers": (ev.num_workers > 0, "evaluation batches are read in the main process")}
        self.ignored.update({f"eval_input.{k}": reason for k, (given, reason) in why.items() if given})

    @staticmethod
    def _check_span_corruption(section: str, inp: InputParams, cfg: Any) -> None:
        """T5's data keys belong to an encoder-decoder, whose encoder reads exactly max_seq_len tokens and whose
        decoder then reads the targets span corruption gives (tgt_max_sequence_length, if stated, must be that)."""
        from waferscale.data.span_corruption import compute_input_and_target_lengths

        keys = [k for k in ("src_vocab_file", "extra_ids", "tgt_max_sequence_length", "noise_density",
                            "mean_noise_span_length") if getattr(inp, k) is not None]
        if not cfg.is_encoder_decoder:
            if keys:
                raise FieldError(f"{section}.{keys[0]}", f"is a T5 span-corruption setting, but the model "
                                 f"({cfg.family}) is not an encoder-decoder; leave it out")
            return
        if inp.max_sequence_length not in (None, cfg.max_seq_len):
            raise FieldError(f"{section}.max_sequence_length", f"{inp.max_sequence_length} differs from the T5 "
                             f"model's encoder input length {cfg.max_seq_len} (src_max_position_embeddings / "
                             f"max_position_embeddings): span corruption makes inputs of exactly that length")
        targets = compute_input_and_target_lengths(cfg.max_seq_len, inp.noise_density or 0.15,
                                                   inp.mean_noise_span_length or 3.0)[1]
        if inp.tgt_max_sequence_length not in (None, targets):
            raise FieldError(f"{section}.tgt_max_sequence_length", f"{inp.tgt_max_sequence_length} differs from "
                             f"the {targets} targets span corruption of {cfg.max_seq_len} input tokens gives; set "
                             f"{targets} or leave it out")

    def to_dict(self) -> dict[str, Any]:
        """The legacy-layout dict (None-valued keys left out); `Params.from_dict(p.to_dict()) == p`."""
        return {name: to_plain(getattr(self, name)) for name in SECTIONS if getattr(self, name) is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "<dict>") -> "Params":
        return params_from_dict(d, source)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False, width=110)


def check_batch_split(inp: InputParams, num_csx: int, *, section: str = "train_input",
                      num_csx_name: str = "runconfig.num_csx") -> None:
    """The global batch splits evenly over `num_csx` systems, and each system's share over micro-batches."""
    if inp.batch_size % num_csx:
        raise FieldError(f"{section}.batch_size", f"{inp.batch_size} is not divisible by {num_csx_name} {num_csx}, "
                         f"so the global batch does not split evenly over the systems; use a multiple of {num_csx}")
    per_csx = inp.batch_size // num_csx
    if inp.micro_batch_size is not None and per_csx % inp.micro_batch_size:
        raise FieldError(f"{section}.micro_batch_size", f"{inp.micro_batch_size} does not divide the per-system "
                         f"batch {per_csx} (batch_size {inp.batch_size} / num_csx {num_csx}); pick a divisor of "
                         f"{per_csx}")


def load_params(path: str | Path, text: str | None = None) -> Params:
    """Read a params YAML (legacy or trainer layout), or its `text` read elsewhere (by a client of the
    appliance). Every problem is a ConfigError naming the file."""
    return params_from_dict(read_yaml(path, text), source=str(Path(path)))


def save_params(params: Params, path: str | Path) -> None:
    """Write the params as legacy-layout YAML atomically (temp file, then rename)."""
    atomic_write_text(path, params.to_yaml())


def params_from_dict(d: Any, source: str = "<dict>") -> Params:
    """Build Params from a parsed YAML mapping (legacy or trainer layout)."""
    ctx = Ctx(source)
    if not isinstance(d, Mapping):
        got = "an empty file" if d is None else show(d)
        raise ConfigError(f"{source}: the top level must be a mapping of sections ({', '.join(SECTIONS)}), "
                          f"got {got}")
    if "trainer" in d:
        if len(d) > 1:
            others = ", ".join(repr(k) for k in d if k != "trainer")
            raise ctx.error("", f"mixes the trainer layout with legacy sections {others}; use one layout")
        d = legacy_from_trainer(d["trainer"], ctx)
        ctx = Ctx(source, note=" (key path in the legacy layout the trainer: form maps to)", ignored=ctx.ignored)
    params = build_dataclass(Params, d, "", ctx)
    params.source = source
    params.ignored = ctx.ignored | params.ignored
    return params


def ignored_block(ignored: Mapping[str, str]) -> str:
    """What `wsc run`, `validate`, `compile --params` and `estimate --params` print first (a Params' `ignored`):
    one `ignored: key (reason)` line per key of the file that changes nothing here (empty when none)."""
    return "".join(f"ignored: {key} ({why})\n" for key, why in ignored.items())


__all__ = ["InputParams", "OptimizerParams", "RunConfig", "Params", "OPTIMIZERS", "SECTIONS", "CLUSTER_KEYS",
           "check_batch_split", "ignored_block", "load_params", "save_params", "params_from_dict"]
