"""The Model Zoo runner behind `wsc run`: a params file -> a cstorch program (`waferscale.pytorch`), as Model
Zoo's `run.py` is one on `cerebras.pytorch`:

    cstorch.backend     "CSX" (weight streaming from MemoryX, `--num_csx N` systems over SwarmX) or the
                        resident "CPU"/"GPU", as `--execution` (or the budget, for auto) decides
    cstorch.compile     the model on that backend: a zoo model's whole training step (forward, loss, backward,
                        update) compiles to one executor call, `executor.train_step(x, y, lr)`
    @cstorch.trace      the step; `@cstorch.step_closure` writes its metrics line and progress,
                        `@cstorch.checkpoint_closure` saves on checkpoint steps
    DataExecutor        runs the steps over the batch loader

Per step: schedule (learning rate and batch are pure functions of the step, so resume is exact) -> execute ->
update (metrics.jsonl, progress bar, checkpoints), then evaluation and the summary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from tqdm import tqdm

import waferscale.pytorch as cstorch
from waferscale.params import Params, check_batch_split, load_params
from waferscale.params.schema import ignored_block
from waferscale.data import (BatchLoader, MaskedBatches, Masker, build_token_splits, eval_batches, load_tokenizer,
                             read_documents, tokenizer_with_mask)
from waferscale.data import hdf5
from waferscale.data.sentence_pairs import PairBatches, SentencePairs, pair_token_ids, tokenizer_with_pair_tokens
from waferscale.data.span_corruption import (T5_EXTRA_IDS, SpanCorruptedBatches, SpanCorruptor, sentinel_ids,
                                             tokenizer_with_sentinels)
from waferscale.errors import CheckpointError, ConfigError, DataError
from waferscale.models import CausalLM, ModelConfig, build
from waferscale.models.config import INITIALIZER_FIELDS
from waferscale.runtime import checkpoint as ckpt
from waferscale.runtime.executor import Executor, choose_execution, resolve_device
from waferscale.runtime.mdl import is_mdl
from waferscale.runtime.optim import build_schedule
from waferscale.runtime.perf import measured_peak_flops
from waferscale.util.files import atomic_dir, atomic_write_json, atomic_write_text
from waferscale.util.paths import cache_dir
from waferscale.zoo.lm import compile_lm_step
from waferscale.zoo.mdl import resident_param_index

MODES = ("train", "eval", "train_and_eval")


@dataclass
class RunOptions:
    """Command-line choices that override or complement the params YAML."""

    mode: str = "train"
    model_dir: Path = Path("model_dir")
    num_steps: int | None = None  # steps to run in this invocation
    max_steps: int | None = None  # total steps of the run (overrides runconfig.max_steps)
    eval_steps: int | None = None
    checkpoint_path: str | None = None  # resume/evaluate from this instead of the latest in model_dir
    load_checkpoint_states: str = "all"  # "all" or "model" (weights only, fresh optimizer and data position)
    device: str = "auto"
    execution: str = "auto"
    progress: bool = True
    num_csx: int = 1  # data-parallel systems (SwarmX worker processes) sharing one MemoryX
    device_memory_mb: float | None = None  # device budget the streaming executor respects (auto: resident if fits)
    memoryx_ram_mb: float | None = None  # MemoryX RAM tier budget; units beyond it go to flash_dir
    flash_dir: str | None = None  # MemoryX flash tier (default: model_dir/memoryx_flash when a RAM budget is set)
    trace: str | None = None  # write a Chrome trace of one training step here
    recompute: str = "auto"  # streaming: recompute each unit's forward in backward (auto: when the budget says so)
    swarmx_timeout_s: float = 300.0  # a SwarmX worker silent this long is declared dead or hung

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for flag in ("num_steps", "max_steps", "eval_steps", "device_memory_mb", "memoryx_ram_mb",
                     "swarmx_timeout_s"):
            v = getattr(self, flag)
            if v is not None and v <= 0:
                raise ConfigError(f"--{flag} must be positive, got {v}")
        if self.execution not in ("auto", "resident", "streaming"):
            raise ConfigError(f"--execution {self.execution!r} is not available; use auto, resident or streaming")
        if self.num_csx < 1:
            raise ConfigError(f"--num_csx must be at least 1 (the number of systems), got {self.num_csx}")
        if self.recompute not in ("auto", "always", "never"):
            raise ConfigError(f"--recompute must be auto, always or never, got {self.recompute!r}")


def prepare_run(params_path: str | Path, flags: dict[str, Any], text: str | None = None) -> tuple[Params, RunOptions]:
    """The params and options of `wsc run --params PATH` with `flags` (RunOptions' fields; None: unset), every
    check the run makes before it starts: what `wsc run` and `wsc validate` do first, and what the appliance
    does to a job at submit (`text`: the file's content, sent by the client)."""
    params = load_params(params_path, text)
    rc = params.runconfig
    num_csx = flags["num_csx"] if flags.get("num_csx") is not None else rc.num_csx
    model_dir = flags.get("model_dir") or rc.model_dir or "model_dir"
    known = {f.name for f in dataclasses.fields(RunOptions)}
    from_file = {"mode": rc.mode, "checkpoint_path": rc.checkpoint_path,
                 "load_checkpoint_states": rc.load_checkpoint_states}  # a flag given wins
    opts = RunOptions(**{k: v for k, v in (from_file | {k: v for k, v in flags.items() if v is not None}).items()
                         if k in known and v is not None}
                      | {"model_dir": Path(model_dir), "num_csx": num_csx})  # checks the flags
    check_batch_split(params.train_input, num_csx, num_csx_name="--num_csx")
    return params, opts


# ---- set-up: data, tokenizer, model ----------------------------------------------------------------

@dataclass
class Data:
    tokenizer: Any
    train: np.ndarray
    val: np.ndarray
    seq_len: int
    masker: Masker | None = None  # the objective: None, next-token prediction (decoders); a Masker, masked LM
    corruptor: SpanCorruptor | None = None  # encoder-decoders: span corruption (windows of seq_len tokens)
    pairs: SentencePairs | None = None  # BERT with the next-sentence head: masked sentence pairs (masker's draws)
    h5_train: hdf5.HDF5Examples | None = None  # HDF5 data (Model Zoo's layout): train and eval examples
    h5_eval: hdf5.HDF5Examples | None = None

    @property
    def packed_len(self) -> int:
        """Tokens of one example as the model reads it (span corruption: encoder inputs and decoder inputs)."""
        c = self.corruptor
        return self.seq_len if c is None else c.inputs_length + c.targets_length


def prepare_data(params: Params, cfg: ModelConfig, progress: bool) -> Data:
    """The token splits and the objective the model's family trains on: encoders read every position, so they
    predict masked tokens (dynamic masking from the run's seed), and BERT with the next-sentence head also tells a
    segment's continuation from a random one (BERT's pretraining objective on masked sentence pairs, from the run's
    seed); encoder-decoders (T5) write the spans dropped from their input (span corruption, from the run's seed);
    decoders predict the next token."""
    inp = params.train_input
    if uses_hdf5(inp):
        return prepare_hdf5_data(params, cfg)
    if inp.src_vocab_file is not None and not inp.src_vocab_file.endswith(".json"):
        raise ConfigError(f"train_input.src_vocab_file {inp.src_vocab_file!r}: Model Zoo's SentencePiece vocabulary "
                          "is not read; give a T5 tokenizer.json there (or as train_input.tokenizer), or 'char'")
    unused = {"train_input.num_workers": "text is tokenized once and read in the main process"} \
        if inp.num_workers else {}  # (the HDF5 reader's loader keys)
    if not inp.drop_last:
        unused["train_input.drop_last"] = "a token stream has no short last batch"
    ev_len = params.eval_input.max_sequence_length if params.eval_input is not None else None
    if ev_len not in (None, inp.max_sequence_length or cfg.max_seq_len):
        unused["eval_input.max_sequence_length"] = "evaluation reads windows of train_input's length"
    sys.stderr.write(ignored_block(unused))
    docs = read_documents(inp.data_dir)
    tok = load_tokenizer(inp.tokenizer_spec, text_for_char="".join(docs), lowercase=inp.do_lower)
    if cfg.is_encoder:
        tok = tokenizer_with_mask(tok)
    if cfg.nsp_head:
        tok = tokenizer_with_pair_tokens(tok)
    if cfg.is_encoder_decoder:
        tok = tokenizer_with_sentinels(tok, inp.extra_ids or T5_EXTRA_IDS)
    if tok.vocab_size > cfg.vocab_size:
        raise DataError(f"the {inp.tokenizer_spec!r} tokenizer has {tok.vocab_size} tokens but model.vocab_size is "
                        f"{cfg.vocab_size}; set model.vocab_size to at least {tok.vocab_size}")
    splits = build_token_splits(docs, tok, cache_dir() / "tokens", val_fraction=inp.val_fraction, progress=progress)
    val = splits.val
    if params.eval_input is not None and params.eval_input.data_dir != inp.data_dir:
        eval_splits = build_token_splits(read_documents(params.eval_input.data_dir), tok, cache_dir() / "tokens",
                                         val_fraction=params.eval_input.val_fraction, progress=progress)
        val = np.concatenate([eval_splits.train, eval_splits.val])
    if cfg.is_encoder_decoder:  # the encoder reads max_seq_len tokens: the windows are what corrupts to that many
        corruptor = SpanCorruptor(tuple(sentinel_ids(tok)), tok.eos_id, cfg.pad_token_id, cfg.max_seq_len,
                                  seed=params.runconfig.seed, noise_density=inp.noise_density or 0.15,
                                  mean_noise_span_length=inp.mean_noise_span_length or 3.0)
        return Data(tokenizer=tok, train=splits.train, val=val, seq_len=corruptor.tokens_length, corruptor=corruptor)
    seq_len = inp.max_sequence_length or cfg.max_seq_len
    if seq_len > cfg.max_seq_len:
        raise ConfigError(f"train_input.max_sequence_length {seq_len} exceeds the model's max_position_embeddings "
                          f"{cfg.max_seq_len}; lower it or raise model.max_position_embeddings")
    masker = pairs = None
    if cfg.is_encoder:
        specials = pair_token_ids(tok) if cfg.nsp_head else ()  # ([CLS], [SEP]): tokenizer_with_pair_tokens
        if specials and cfg.type_vocab_size < 2:
            raise ConfigError(f"the next-sentence objective reads two segments; the model has {cfg.type_vocab_size} "
                              "token types: set model.num_segments (type_vocab_size) to 2, or disable_nsp: true")
        masker = Masker(tok.mask_id, tok.vocab_size, seed=params.runconfig.seed,
                        probability=inp.masked_lm_prob or Masker.probability,
                        max_predictions=inp.max_predictions_per_seq, special_ids=specials)
        if specials:
            pairs = SentencePairs(*specials, cfg.vocab_size, masker, seq_len)
    return Data(tokenizer=tok, train=splits.train, val=val, seq_len=seq_len, masker=masker, pairs=pairs)


def uses_hdf5(inp: Any) -> bool:
    """Whether the input section reads HDF5: its data_dir holds .h5 files, or it names an HDF5 processor and a
    data_dir that is not text (a missing directory: the HDF5 reader's error says so). An HDF5 processor named on
    text (Model Zoo's configs pointed at the builtin corpus) trains on the text, and says so."""
    if hdf5.is_hdf5_dir(inp.data_dir):
        return True
    if inp.data_processor not in hdf5.HDF5_PROCESSORS:
        return False
    if any(d != "shakespeare" and not Path(d).expanduser().exists() for d in inp.data_dir):
        return True
    print(f"note: data_processor {inp.data_processor}: data_dir {', '.join(inp.data_dir)} holds text, read by the "
          "token-stream loader", file=sys.stderr)
    return False


def prepare_hdf5_data(params: Params, cfg: ModelConfig) -> Data:
    """HDF5 examples (Model Zoo's sample layout) for next-token prediction, checked cheaply first
    (`hdf5.validate_hdf5`); the tokenizer is the data's own (the tokenizer.json `wsc data_preprocess` writes beside
    the files) unless train_input.tokenizer names one, and only saved with checkpoints (the data is tokenized)."""
    inp, ev = params.train_input, params.eval_input
    if inp.data_processor in hdf5.TEXT_PROCESSORS or cfg.is_encoder or cfg.is_encoder_decoder:
        raise ConfigError(f"train_input.data_dir {', '.join(inp.data_dir)} holds HDF5 examples for next-token "
                          f"prediction (GptHDF5MapDataProcessor); model {cfg.name} with data_processor "
                          f"{inp.data_processor} trains on text: point data_dir at .txt/.jsonl files")
    train = hdf5.validate_hdf5(inp.data_dir, inp.max_sequence_length, cfg.vocab_size)
    if train.msl > cfg.max_seq_len:
        raise ConfigError(f"the HDF5 examples hold {train.msl} tokens, more than the model's max_position_embeddings "
                          f"{cfg.max_seq_len}; raise model.max_position_embeddings or preprocess a shorter length")
    evals = None  # HDF5 data has no held-out split: evaluation reads eval_input's files
    if ev is not None:
        evals = train if ev.data_dir == inp.data_dir else hdf5.validate_hdf5(
            ev.data_dir, ev.max_sequence_length or train.msl, cfg.vocab_size)
    spec, own = inp.tokenizer_spec, Path(inp.data_dir[0]).expanduser() / "tokenizer.json"
    tok = load_tokenizer(spec) if spec != "char" else (load_tokenizer(own) if own.is_file() else None)
    if tok is not None and tok.vocab_size > cfg.vocab_size:
        raise DataError(f"the data's tokenizer has {tok.vocab_size} tokens but model.vocab_size is {cfg.vocab_size}; "
                        f"set model.vocab_size to at least {tok.vocab_size}")
    empty = np.zeros(0, dtype=np.int32)
    return Data(tokenizer=tok, train=empty, val=empty, seq_len=train.msl, h5_train=train, h5_eval=evals)


def build_model(params: Params) -> CausalLM:
    if params.model.pretrained:
        from waferscale.models.pretrained import load_pretrained

        return load_pretrained(params.model.pretrained)
    return build(params.model.to_model_config(), device="cpu")


# ---- metrics file ------------------------------------------------------------------------------------

def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines past the resume step (left by a run that stopped after its last checkpoint)."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= last_step]
    atomic_write_text(path, "".join(ln + "\n" for ln in keep))


# ---- the run -------------------------------------------------------------------------------------------

def evaluate(executor: Executor, data: Data, batch_size: int, max_batches: int | None) -> tuple[float, int]:
    if data.h5_train is not None:
        if data.h5_eval is None:
            raise ConfigError("HDF5 training data has no held-out split; give eval_input with a data_dir of .h5 "
                              "files to evaluate on (Model Zoo's validation set, or `wsc data_preprocess` of text)")
        batches = hdf5.hdf5_eval_batches(data.h5_eval, batch_size, max_batches)
        return float(np.mean([executor.eval_loss(x, y) for x, y in batches])), len(batches)
    batches = eval_batches(data.val, batch_size, data.seq_len, max_batches or 10**9)
    if not batches:
        raise DataError(f"the validation split has {len(data.val)} tokens, fewer than one batch of "
                        f"{batch_size}x{data.seq_len + 1}; lower batch_size/max_sequence_length or raise val_fraction")
    if data.pairs is not None:
        batches = data.pairs.eval_batches(batches, data.val)
    elif data.masker is not None:
        batches = data.masker.eval_batches(batches)
    if data.corruptor is not None:
        batches = data.corruptor.eval_batches(batches)
    losses = [executor.eval_loss(x, y) for x, y in batches]
    return float(np.mean(losses)), len(batches)


def run(params: Params, opts: RunOptions, out: TextIO | None = None) -> dict[str, Any]:
    """Train and/or evaluate per `opts.mode`; returns the summary dict also written to model_dir/summary.json.
    out: where the log goes, default the sys.stdout of the call (not of the import: a caller may redirect it)."""
    out = out if out is not None else sys.stdout
    inp = params.train_input
    device = resolve_device(opts.device if opts.device != "auto" else params.runconfig.device)
    check_batch_split(inp, opts.num_csx, num_csx_name="--num_csx")
    # cheap checks first: the data paths, the tokenizer against the vocabulary and a batch's worth of tokens, before
    # any weights exist (a 70B config with a wrong data_dir fails in a second, having allocated nothing)
    model = build_model(params) if params.model.pretrained else None  # (a pretrained model's config is its file's)
    data = prepare_data(params, model.config if model is not None else params.model.to_model_config(),
                        opts.progress)
    if data.h5_train is None and inp.batch_size * data.seq_len + 1 > len(data.train):
        raise DataError(f"the training split has {len(data.train)} tokens, fewer than one batch of "
                        f"{inp.batch_size}x{data.seq_len}; add data or lower batch_size/max_sequence_length")
    if data.h5_train is not None:
        check_hdf5_split(data.h5_train, inp, opts.num_csx)
    torch.manual_seed(params.runconfig.seed)
    with cstorch.run_context():  # the backend, dtype and optimizers are this run's alone
        model, executor, why = build_executor(params, opts, device, model)
        try:
            return _run(params, opts, out, device, model, executor, why, data)
        finally:
            executor.close()


def hdf5_loader(examples: hdf5.HDF5Examples, inp: Any, vocab_size: int) -> hdf5.HDF5Batches:
    """The training batches of HDF5 data, as train_input's processor, shuffle, shuffle_seed, drop_last and
    num_workers say."""
    return hdf5.HDF5Batches(examples, inp.batch_size, shuffle=inp.shuffle, seed=inp.shuffle_seed,
                            drop_last=inp.drop_last, processor=inp.data_processor or hdf5.MAP,
                            num_workers=inp.num_workers, vocab_size=vocab_size)


def check_hdf5_split(examples: hdf5.HDF5Examples, inp: Any, num_csx: int) -> None:
    """A short last batch (drop_last false) must split over the systems and micro-batches, as full ones do."""
    short = hdf5.short_batch_rows(examples.n, inp.batch_size, inp.drop_last)
    if short and (short % num_csx or (inp.micro_batch_size and (short // num_csx) % inp.micro_batch_size)):
        raise ConfigError(f"drop_last: false leaves a last batch of {short} of the {examples.n} examples each "
                          f"epoch, which does not split over {num_csx} system(s) and micro_batch_size "
                          f"{inp.micro_batch_size}; set drop_last: true or a batch_size that divides {examples.n}")


def build_executor(params: Params, opts: RunOptions, device: torch.device,
                   model: CausalLM | None = None) -> tuple[CausalLM, Executor, str]:
    """The model (real for resident runs, parameters on meta for streaming ones; `model`: a pretrained one, loaded)
    and its executor: the run's cstorch backend, and its training step compiled for it. Each flag, if given, wins
    over its runconfig key."""
    inp, opt, rc = params.train_input, params.optimizer, params.runconfig
    cfg = model.config if model is not None else params.model.to_model_config()
    device_mb = opts.device_memory_mb if opts.device_memory_mb is not None else rc.device_memory_mb
    ram_mb = opts.memoryx_ram_mb if opts.memoryx_ram_mb is not None else rc.memoryx_ram_mb
    budget = int(device_mb * 2**20) if device_mb is not None else None
    kind, why = choose_execution(opts.execution if opts.execution != "auto" else rc.execution,
                                 num_params=cfg.num_params, optimizer_type=opt.optimizer_type, momentum=opt.momentum,
                                 device=device, device_memory_bytes=budget, num_csx=opts.num_csx)
    backend = cstorch.backend(
        "CSX" if kind == "streaming" else ("GPU" if device.type == "cuda" else "CPU"), artifact_dir=opts.model_dir,
        device=str(device), device_memory_mb=device_mb, memoryx_ram_mb=ram_mb, flash_dir=opts.flash_dir or rc.flash_dir,
        cluster_config=cstorch.distributed.ClusterConfig(num_csx=opts.num_csx, timeout_s=opts.swarmx_timeout_s),
        spawn_script_copies=False)  # the workers run the compiled step, not copies of `wsc run`
    recompute = {"auto": "auto", "always": True, "never": False}[opts.recompute]
    try:
        model, executor = compile_lm_step(model, cfg, backend, opt, half_dtype=params.model.half_dtype,
                                          micro_batch_size=inp.micro_batch_size, recompute=recompute,
                                          swarmx_timeout_s=opts.swarmx_timeout_s, sparsity=params.sparsity)
    except ConfigError as e:  # a filter that matches none of the model's parameters: point at it in the file
        line = getattr(params.sparsity, "key_lines", {}).get("param_filter")
        if "param_filter" not in str(e) or line is None:
            raise
        raise ConfigError(f"{params.source}:{line}: {e}") from None
    return model, executor, why


def _run(params: Params, opts: RunOptions, out: TextIO, device: torch.device, model: CausalLM, executor: Executor,
         why: str, data: Data) -> dict[str, Any]:
    rc, inp, cfg = params.runconfig, params.train_input, model.config
    model_dir, max_steps = Path(opts.model_dir), opts.max_steps or rc.max_steps
    schedule = build_schedule(params.optimizer.learning_rate)
    loader: BatchLoader | MaskedBatches | PairBatches | SpanCorruptedBatches | hdf5.HDF5Batches = BatchLoader(
        data.train, inp.batch_size, data.seq_len, seed=inp.shuffle_seed, shuffle=inp.shuffle) \
        if data.h5_train is None else hdf5_loader(data.h5_train, inp, cfg.vocab_size)
    if data.pairs is not None:
        loader = PairBatches(loader, data.pairs)
    elif data.masker is not None:
        loader = MaskedBatches(loader, data.masker)
    if data.corruptor is not None:
        loader = SpanCorruptedBatches(loader, data.corruptor)

    # resume: an explicit checkpoint, else the latest one in model_dir
    start_step = 0
    index = resident_param_index(cfg, params.optimizer)  # each parameter's index in the optimizer's state
    source = opts.checkpoint_path or ckpt.latest_checkpoint(model_dir)
    if source is not None:
        # a Cerebras .mdl's names are mapped for cfg, its optimizer state renumbered to our optimizer's indices
        source = ckpt.resolve_checkpoint_path(source)  # (a model_dir: its latest, which may be a .mdl)
        zoo_states = opts.load_checkpoint_states == "all" and source.suffix != ".json" and is_mdl(source)
        c = ckpt.load_checkpoint(source, model_config=cfg, optimizer_index=index if zoo_states else None,
                                 lr_scales=params.optimizer.adjust_learning_rate)
        # initializers only shape a fresh model's weights: a checkpoint's are the weights
        inits = {k: getattr(cfg, k) for k in INITIALIZER_FIELDS}
        if c.model_config is not None and ModelConfig.from_dict(c.model_config).replace(name=cfg.name, **inits) != cfg:
            raise CheckpointError(f"{c.path} was written for another architecture "
                                  f"({c.model_config.get('name')}); use another --model_dir or --checkpoint_path")
        executor.load_model_weights(c.model, str(c.path))
        if executor.sparsity is not None and not any(k.endswith("_mask") for k in c.model):
            executor.sparsity.redraw()  # sparse training from dense weights: masks from the loaded weights
        if opts.load_checkpoint_states == "all":
            if (state := c.optimizer_state()) is not None:
                if "param_groups" not in state:  # a Model Zoo checkpoint's: the groups (hyper-parameters) are ours
                    state = {**executor.optimizer_state(), "state": state["state"]}
                else:  # a cstorch script's, grouped otherwise: by its parameter names
                    state = ckpt.regroup_optimizer_state(state, executor.optimizer_state(), index, str(c.path))
                executor.load_optimizer_state(state)
            loader.load_state_dict(c.state.get("data", {"step": c.step}))
            if executor.sparsity is not None and "sparsity" in c.state:
                executor.sparsity.load_state_dict(c.state["sparsity"])
            if c.rng_state is not None:
                torch.set_rng_state(c.rng_state)
            start_step = c.step
        print(f"resumed from {c.path} (step {c.step})", file=out)
        if c.state.get("note"):
            print(f"note: {c.path}: {c.state['note']}", file=out)
    elif opts.mode == "eval":
        raise CheckpointError(f"--mode eval needs a checkpoint: none in {model_dir}; pass --checkpoint_path")

    end_step = max_steps if opts.num_steps is None else min(max_steps, start_step + opts.num_steps)
    if opts.mode != "eval" and start_step >= max_steps:
        print(f"model_dir {model_dir} is already at step {start_step} of max_steps {max_steps}: nothing to train "
              f"(raise --max_steps to continue)", file=out)

    model_dir.mkdir(parents=True, exist_ok=True)
    if data.tokenizer is not None and not (model_dir / "tokenizer").exists():  # saved once, by the first run
        with atomic_dir(model_dir / "tokenizer") as tmp:
            data.tokenizer.save(tmp)
    metrics_path = model_dir / "metrics.jsonl"
    truncate_metrics(metrics_path, start_step)

    def save(step: int) -> Path:
        weights = executor.model_for_checkpoint()
        if not isinstance(weights, torch.nn.Module):  # (MemoryX's: each tensor once)
            weights = ckpt.with_tied_names(weights, model)
        return ckpt.save_checkpoint(model_dir, step, weights, cfg.to_dict(),
                                    optimizer_state=ckpt.name_optimizer_state(executor.optimizer_state(), index),
                                    extra={"data": loader.state_dict(), "tokenizer": "tokenizer",
                                           "seq_len": data.seq_len, "executor": executor.name,
                                           **({"sparsity": executor.sparsity.state_dict()}
                                              if executor.sparsity is not None else {})})

    summary: dict[str, Any] = {"model": cfg.name, "params": model.num_params(), "device": str(device),
                               "executor": executor.name, "execution_reason": why, "num_csx": opts.num_csx,
                               "mode": opts.mode, "seq_len": data.seq_len,
                               "batch_size": inp.batch_size, "start_step": start_step}
    stream_totals: dict[str, float] = {}
    eval_steps = opts.eval_steps or rc.eval_steps
    eval_bs = params.eval_input.batch_size if params.eval_input else inp.batch_size
    every_eval = rc.eval_frequency if opts.mode == "train_and_eval" else None  # also during training, in its line
    trace_step = start_step + (2 if end_step - start_step >= 2 else 1)
    last_ckpt: Path | None = None
    if opts.mode in ("train", "train_and_eval") and end_step > start_step:
        if rc.save_initial_checkpoint and start_step == 0:
            save(0)
        bar = tqdm(total=end_step - start_step, desc="train", unit="step", disable=not opts.progress,
                   dynamic_ncols=True, file=sys.stderr)
        t_run = time.perf_counter()
        acc: dict[str, Any] = {"tokens": 0, "time": 0.0, "loss": float("nan")}
        steps = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: loader),
                                                num_steps=end_step - start_step, start_step=start_step,
                                                checkpoint_steps=rc.checkpoint_steps or end_step)

        @cstorch.trace
        def train_step(x: torch.Tensor, y: torch.Tensor, lr: float) -> Any:
            return executor.train_step(x, y, lr)  # the compiled step: forward, loss, backward, update

        @cstorch.step_closure
        def record(step: int, r: Any, lr: float, dt: float) -> None:
            acc["tokens"] += r.tokens
            acc["time"] += dt
            acc["loss"] = r.loss
            line = {"step": step, "loss": r.loss, "lr": lr, "tokens_per_s": r.tokens / dt,
                    "elapsed_s": time.perf_counter() - t_run}
            if r.grad_norm is not None:
                line["grad_norm"] = r.grad_norm
            if r.skipped:
                line["skipped"] = True
            if executor.sparsity is not None:  # target and actual (from the masks) over the sparse weights
                line.update(executor.sparsity.figures())
            if r.stats:
                line.update(r.stats)
                accumulate_stream_stats(stream_totals, r.stats)
            if every_eval and step % every_eval == 0 and step != end_step:  # (the last step's evaluation follows)
                line["eval_loss"], line["eval_batches"] = evaluate(executor, data, eval_bs, eval_steps)
            if step % rc.log_steps == 0 or step == end_step or "eval_loss" in line:  # Model Zoo's logging rule
                metrics.write(json.dumps(line) + "\n")
                metrics.flush()
            bar.set_postfix(loss=f"{r.loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{acc['tokens'] / acc['time']:,.0f}")
            bar.update(1)

        @cstorch.checkpoint_closure
        def checkpoint(step: int) -> None:
            if step != end_step:  # (the last step's checkpoint is written after the loop)
                save(step)

        try:
            with open(metrics_path, "a") as metrics:
                for x, y in steps:
                    step = steps.user_iteration
                    lr = schedule(step - 1)  # schedule
                    traced = opts.trace and step == trace_step
                    if traced and hasattr(executor, "set_trace"):
                        executor.set_trace(opts.trace)
                    t0 = time.perf_counter()
                    r = train_step(x, y, lr)  # execute
                    dt = time.perf_counter() - t0
                    if traced and not hasattr(executor, "set_trace"):
                        trace_whole_step(executor, opts.trace, t0, t0 + dt)
                    record(step, r, lr, dt)  # update
                    checkpoint(step)
        finally:  # (also when a step fails: its prefetch threads end)
            bar.close()
            if isinstance(loader, hdf5.HDF5Batches):
                loader.close()
        last_ckpt = save(end_step)
        tps = acc["tokens"] / acc["time"]
        dtype = torch.float32 if executor.half is None else executor.half
        systems, threads = getattr(executor, "systems_threads", (1, None))
        peak = systems * measured_peak_flops(device.type, dtype, threads=threads)  # N systems: N times theirs
        flops_tok = cfg.flops_per_token(data.packed_len, training=True)
        summary.update({"steps": end_step - start_step, "final_step": end_step, "final_loss": acc["loss"],
                        "tokens": acc["tokens"], "train_time_s": acc["time"], "tokens_per_s": tps,
                        "model_flops_per_token": flops_tok, "achieved_flops": tps * flops_tok,
                        "peak_flops_measured": peak, "peak_systems": systems, "mfu": tps * flops_tok / peak})
        if stream_totals:
            summary["streaming"] = summarize_stream_stats(stream_totals, end_step - start_step)
        if executor.sparsity is not None:
            summary["sparsity"] = executor.sparsity.figures()
        if opts.trace:
            summary["trace"] = opts.trace
    if opts.mode in ("eval", "train_and_eval"):
        eval_loss, n = evaluate(executor, data, eval_bs, eval_steps)
        summary.update({"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50.0)),
                        "eval_batches": n})
    summary.update(executor.summary())
    summary.update({"peak_memory_bytes": executor.peak_device_bytes(),
                    "checkpoint": str(last_ckpt) if last_ckpt else (str(source) if source else None)})
    atomic_write_json(model_dir / "summary.json", summary, indent=2)
    print_summary(summary, model_dir, out)
    return summary


# ---- observability: per-step streaming figures, their totals, one traced step --------------------------------

_SUMMED = ("wait_weights_s", "compute_s", "grad_writeback_s", "optimizer_s", "fetch_busy_s", "bytes_in", "bytes_out",
           "bytes_in_place", "bytes_streamed", "bytes_reduced")


def accumulate_stream_stats(totals: dict[str, float], stats: dict[str, Any]) -> None:
    for k in _SUMMED:
        totals[k] = totals.get(k, 0) + stats.get(k, 0)
    totals["no_stall_steps"] = totals.get("no_stall_steps", 0) + bool(stats.get("no_stall"))
    totals["no_stall_tokens_needed"] = max(totals.get("no_stall_tokens_needed", 0),
                                           stats.get("no_stall_tokens_needed", 0))


def summarize_stream_stats(totals: dict[str, float], steps: int) -> dict[str, Any]:
    busy = totals["fetch_busy_s"]
    return {**totals, "stream_bandwidth_Bps": totals["bytes_in"] / busy if busy else None, "steps": steps}


def trace_whole_step(executor: Executor, path: str, t0: float, t1: float) -> None:
    """For executors without their own trace (no `set_trace`): one span for the whole step."""
    from waferscale.runtime.trace import Tracer

    tr = Tracer()
    tr.t0 = t0
    tr.span("main", f"{executor.name} train_step", t0, t1)
    tr.write(path)


def print_summary(s: dict[str, Any], model_dir: Path, out: TextIO) -> None:
    rows = [("model", f"{s['model']}  ({s['params'] / 1e6:.2f}M params, {s['executor']} on {s['device']})"),
            ("mode", s["mode"])]
    if "steps" in s:
        rows += [("steps", f"{s['start_step']} -> {s['final_step']}  (batch {s['batch_size']} x {s['seq_len']} tokens)"),
                 ("final loss", f"{s['final_loss']:.4f}"),
                 ("throughput", f"{s['tokens_per_s']:,.0f} tokens/s  ({s['train_time_s']:.1f} s of training)"),
                 ("MFU", f"{100 * s['mfu']:.1f}% of the measured matmul peak of "
                         f"{'this host' if s.get('peak_systems', 1) == 1 else str(s['peak_systems']) + ' systems'} "
                         f"({s['peak_flops_measured'] / 1e9:,.0f} GFLOP/s); {s['achieved_flops'] / 1e9:,.1f} GFLOP/s achieved")]
    if "eval_loss" in s:
        rows += [("eval", f"loss {s['eval_loss']:.4f}, perplexity {s['eval_perplexity']:.2f} "
                          f"({s['eval_batches']} batches)")]
    if "streaming" in s:
        st = s["streaming"]
        bw = f"{st['stream_bandwidth_Bps'] / 1e9:,.2f} GB/s" if st.get("stream_bandwidth_Bps") else "n/a"
        in_place = ""
        if st.get("bytes_in_place"):  # the CPU device shares host memory: RAM-tier fp32 weights need no copy
            in_place = f"; {st['bytes_in_place'] / 2**20:,.1f} MiB of it read in place from MemoryX's RAM"
            if st["bytes_in_place"] >= st["bytes_in"]:
                bw = "no copy"
        if "sparsity" in s:  # masked units travel packed: what the links moved against the dense payloads
            in_place += (f"; sparse {100 * s['sparsity']['sparsity']:.0f}%: moved {st['bytes_streamed'] / 2**20:,.1f} "
                         f"MiB in, {st['bytes_reduced'] / 2**20:,.1f} MiB out")
        rows += [("execution", s.get("execution_reason", "")),
                 ("streamed", f"in {st['bytes_in'] / 2**20:,.1f} MiB, out {st['bytes_out'] / 2**20:,.1f} MiB at "
                              f"{bw}{in_place}"),
                 ("step time", f"waiting for weights {st['wait_weights_s']:.2f} s, compute {st['compute_s']:.2f} s, "
                               f"gradient write-back {st['grad_writeback_s']:.2f} s, optimizer {st['optimizer_s']:.2f} s"),
                 ("no stall", f"{st['no_stall_steps']} of {st['steps']} steps (needs >= "
                              f"{st['no_stall_tokens_needed']:,} tokens/step at the measured rates)")]
    rows += [("peak memory", f"{s['peak_memory_bytes'] / 2**20:,.1f} MiB"
                             + (" (device working set)" if s.get("executor") != "resident" else "")),
             ("checkpoint", str(s["checkpoint"])), ("outputs", f"{model_dir}/metrics.jsonl, {model_dir}/summary.json")]
    width = max(len(k) for k, _ in rows)
    print("", file=out)
    print("=" * 78, file=out)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}", file=out)
    print("=" * 78, file=out)
