"""`wsc`: one table of commands (`build_parser`; docs/cli.md shows their flags). Each
command is a function of the parsed arguments. Bad input prints one `error:` line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from waferscale.errors import ConfigError, UserError

if TYPE_CHECKING:
    from waferscale.compiler import Plan
    from waferscale.data import Tokenizer
    from waferscale.models.t5 import T5
    from waferscale.params import Params
    from waferscale.serve.speculative import NgramSpeculation

EXIT_USAGE = 2


# ---- commands ------------------------------------------------------------------------------------------

def cmd_run(a: argparse.Namespace) -> int:
    from waferscale.runtime import swarmx
    from waferscale.runtime.cluster import SwarmXFailure
    from waferscale.zoo.runner import RunOptions, prepare_run, run

    if swarmx.is_worker_rank():  # under torchrun, ranks >= 1 are SwarmX workers fed by rank 0
        return swarmx.worker_main(timeout_s=a.swarmx_timeout_s)
    flags = {f.name: getattr(a, f.name) for f in dataclasses.fields(RunOptions) if hasattr(a, f.name)}
    params, opts = prepare_run(a.params, flags | {"progress": not a.no_progress})
    _say_ignored(params)
    num_csx, model_dir = opts.num_csx, opts.model_dir
    if a.validate_only or params.runconfig.validate_only:  # the params and the flags, as the run would read them
        cfg = params.model.to_model_config()
        active = f", {cfg.num_active_params / 1e6:,.1f}M active per token" if cfg.n_experts else ""
        print(f"{a.params}: valid ({cfg.num_params / 1e6:,.1f}M-parameter model{active})")
        return 0
    if a.compile_only or params.runconfig.compile_only:
        # the wafer plan of the run's training step: what `wsc compile --params --mode train` writes
        from waferscale.compiler import compile_model
        from waferscale.zoo.wafer import params_graph

        plan = compile_model(graph=params_graph(params), target=a.target, systems=num_csx, mode="train",
                             sparsity=_params_sparsity(params))
        _report_plan(plan, Path(model_dir), as_json=False)
        return 0
    try:
        run(params, opts)
    except SwarmXFailure as e:  # not bad input: a system died or hung; the checkpoints are intact
        print(f"error: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no interpreter teardown: a collective the failure left pending aborts it (SIGABRT)
    return 0


def cmd_data_preprocess(a: argparse.Namespace) -> int:
    from waferscale.data.preprocess import cmd_data_preprocess as preprocess

    return preprocess(a)


def cmd_generate(a: argparse.Namespace) -> int:
    from waferscale.runtime.generation import load_for_generation
    from waferscale.serve.llm import LLM, SamplingParams

    if (a.model is None) == (a.checkpoint is None):
        raise ConfigError("give exactly one of --model NAME or --checkpoint PATH")
    if (a.prompt is None) == (a.chat is None):
        raise ConfigError("give exactly one of --prompt TEXT or --chat TEXT")
    if a.max_new_tokens <= 0:
        raise ConfigError(f"--max_new_tokens must be positive, got {a.max_new_tokens}")
    if a.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {a.temperature}")
    if a.top_p is not None and not 0 < a.top_p <= 1:
        raise ConfigError(f"--top_p must be in (0, 1], got {a.top_p}")
    if a.top_k is not None and a.top_k < 0:
        raise ConfigError(f"--top_k must be >= 0 (0 turns it off), got {a.top_k}")
    speculative = _speculation(a)
    model, tok, note = load_for_generation(_source(a.model or a.checkpoint, a), tokenizer=a.tokenizer,
                                           device=a.device, keep_quantized=a.dtype != "fp32")
    if note:
        print(note, file=sys.stderr)
    if a.dtype not in ("auto", "fp32") and (model.config.is_encoder or model.config.is_encoder_decoder):
        raise ConfigError(f"--dtype {a.dtype} applies to the serving engine's decoders; {model.config.name} runs "
                          "outside it, in float32: pass --dtype fp32 or auto")
    if speculative is not None and (model.config.is_encoder or model.config.is_encoder_decoder):
        raise ConfigError(f"--speculative runs in the serving engine's decoders; {model.config.name} runs outside "
                          "it: drop --speculative")
    if model.config.is_encoder:  # an encoder fills the prompt's mask tokens instead (transformers' fill-mask, top 1)
        from waferscale.runtime.fill_mask import fill_mask

        if a.chat is not None:
            raise ConfigError(f"{model.config.name} is an encoder: it fills the mask tokens of --prompt, it does not "
                              "chat")
        print(fill_mask(model, tok, a.prompt))
        return 0
    if a.chat is not None:
        messages = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": a.chat}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
    else:
        text = a.prompt
    if model.config.is_encoder_decoder:
        return _generate_seq2seq(model, tok, text, a)
    ids = tok.encode(text)
    params = SamplingParams(temperature=a.temperature, top_p=1.0 if a.top_p is None else a.top_p,
                            top_k=a.top_k or 0, seed=a.seed, max_tokens=a.max_new_tokens)
    with LLM(model, tok, max_model_len=len(ids) + a.max_new_tokens, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype,
             speculative=speculative) as llm:  # the serving engine
        from waferscale.serve import kernels

        if llm.engine.kernel_path.startswith("off") and kernels.unavailable_reason():  # not silently slower
            print(f"C kernels: {llm.engine.kernel_path}; decoding through torch, several times slower",
                  file=sys.stderr)
        pieces = llm.stream(ids, params)  # (checks the prompt fits the context)
        if a.chat is None:
            sys.stdout.write(text)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _generate_seq2seq(model: "T5", tok: "Tokenizer", prompt: str, a: argparse.Namespace) -> int:
    """An encoder-decoder (T5) reads the prompt, with the special tokens its tokenizer's post-processor adds (T5's:
    a trailing `</s>`), and writes its answer, sampled as the serving engine samples (serve/seq2seq.py)."""
    from waferscale.serve.sampling import SamplingParams
    from waferscale.serve.seq2seq import generate_seq2seq

    params = SamplingParams(temperature=a.temperature, top_k=a.top_k or 0, top_p=1.0 if a.top_p is None else a.top_p,
                            seed=a.seed, max_tokens=a.max_new_tokens)
    out = generate_seq2seq(model, tok.encode(prompt, add_special_tokens=True), params,
                           [tok.eos_id] if tok.eos_id is not None else [], vocab_limit=tok.vocab_size)
    sys.stdout.write(tok.decode(out) + "\n")
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    from waferscale.runtime.generation import load_for_generation
    from waferscale.models.hf import save_hf_dir

    if a.format not in ("hf", "gguf"):
        raise ConfigError(f"--format {a.format!r} is not supported; use --format hf or gguf")
    if (a.model is None) == (a.checkpoint is None):
        raise ConfigError("give exactly one of --model NAME or --checkpoint PATH")
    if a.format == "gguf":
        from waferscale.serve.export_gguf import export_gguf

        source = _source(a.model or a.checkpoint, a)
        if source.path is None:
            raise ConfigError(f"{source.spec} is a zoo name without weights: export a checkpoint, a .gguf or a "
                              "Hugging Face directory")
        src = source.path
        stats = export_gguf(src, Path(a.out), a.dtype)
        print(f"wrote {a.out}: {stats['tensors']} tensors ({stats['requantized']} requantized to {a.dtype}), "
              f"{stats['bytes'] / 1e6:.1f} MB, metadata and tokenizer from {src}")
        return 0
    if a.dtype != "auto":
        raise ConfigError("--dtype applies to --format gguf (a Hugging Face export writes float32 weights)")
    model, tok, _ = load_for_generation(_source(a.model or a.checkpoint, a), tokenizer=None, device="cpu",
                                        need_tokenizer=False)
    save_hf_dir(model, Path(a.out), tokenizer=tok)
    print(f"wrote a Hugging Face checkpoint of {model.config.name} to {a.out}")
    return 0


def cmd_plot(a: argparse.Namespace) -> int:
    from waferscale.plots import plot_loss

    out = plot_loss(Path(a.model_dir), Path(a.out) if a.out else None)
    print(f"wrote {out}")
    return 0


def _load_params(path: str) -> "Params":
    """A params file, as `wsc compile --params` and `wsc estimate --params` read it, its ignored keys said first."""
    from waferscale.params import load_params

    params = load_params(path)
    _say_ignored(params)
    return params


def _say_ignored(params: "Params") -> None:
    """The file's keys that change nothing here, one `ignored: key (reason)` line each, on stderr (stdout may be
    --json)."""
    from waferscale.params.schema import ignored_block

    sys.stderr.write(ignored_block(params.ignored))


def _params_sparsity(params: "Params") -> dict[str, float] | None:
    """A params file's `sparsity:` section as the compiler takes it: zeros per matrix at the run's last step."""
    if params.sparsity is None:
        return None
    from waferscale.compiler.capture import section_sparsity
    from waferscale.params.typed import to_plain

    return section_sparsity(params.model.to_model_config(), to_plain(params.sparsity), params.runconfig.max_steps)


def _report_plan(plan: "Plan", out: Path | None, as_json: bool) -> None:
    """Write plan.json, wafer.png, wafer.svg and trace.json into `out` (if given), then print the plan."""
    from waferscale.compiler import plan_json, plan_summary, write_outputs

    written = write_outputs(plan, out) if out is not None else []
    if as_json:
        print(json.dumps(plan_json(plan), indent=1))
    else:
        print(plan_summary(plan))
        for p in written:
            print(f"wrote {p}")


def cmd_compile(a: argparse.Namespace) -> int:
    from waferscale.compiler import compile_model
    from waferscale.compiler.speculative import speculation
    from waferscale.fabric.assumptions import parse_assume
    from waferscale.fabric.presets import parse_pes

    if (a.model is None) == (a.params is None):
        raise ConfigError("give exactly one of --model NAME or --params P.yaml")
    if not 0.0 <= a.defects < 1.0:
        raise ConfigError(f"--defects must be a rate in [0, 1), got {a.defects}")
    graph, sparsity = None, a.sparsity  # --sparsity overrides a params file's sparsity section
    if a.params:
        from waferscale.zoo.wafer import params_graph

        params = _load_params(a.params)
        graph = params_graph(params)
        sparsity = sparsity if sparsity is not None else _params_sparsity(params)
    if a.model:  # whatever names it (runtime/source.py), captured once for the plan and every recompile
        from waferscale.runtime.source import resolve

        graph, a.model = resolve(a.model).graph(), None
    request = dict(model=a.model, graph=graph, target=a.target,
                   systems=a.systems, pes=parse_pes(a.pes) if a.pes else None, mode=a.mode,
                   batch_size=a.batch_size, seq_len=a.seq_len, prompt_len=a.prompt_len,
                   context_len=a.context_len, users=a.users, defects=a.defects, seed=a.seed,
                   clock_hz=a.clock_hz, sparsity=sparsity, activation_sparsity=a.activation_sparsity,
                   assume=parse_assume(a.assume), layout=a.layout,
                   speculative=speculation(a.speculative, a.draft_model, a.num_speculative_tokens, a.acceptance))
    plan = compile_model(**request)
    if a.sensitivity is not None:
        from waferscale.compiler.sensitivity import sensitivity

        plan.extra["sensitivity"] = sensitivity(request, plan, a.sensitivity)
    _report_plan(plan, Path(a.out) if a.out else None, as_json=a.json)
    return 0


def cmd_estimate(a: argparse.Namespace) -> int:
    from waferscale.compiler import estimate_memory, estimate_table

    if (a.model is None) == (a.params is None):
        raise ConfigError("give exactly one of --model NAME or --params P.yaml")
    from waferscale.zoo.wafer import params_graph

    graph = params_graph(_load_params(a.params)) if a.params else None
    d = estimate_memory(model=a.model, graph=graph, target=a.target, mixed_precision=not a.fp32,
                        batch_size=a.batch_size, seq_len=a.seq_len, systems=a.systems)
    print(json.dumps(d, indent=1) if a.json else estimate_table(d))
    return 0


def cmd_kernel(a: argparse.Namespace) -> int:
    from waferscale.fabric.kernel_run import format_kernel_report, run_kernel
    from waferscale.fabric.presets import parse_pes

    if not 0.0 <= a.defects < 1.0:
        raise ConfigError(f"--defects must be a rate in [0, 1), got {a.defects}")
    if a.density is not None and not 0.0 < a.density <= 1.0:
        raise ConfigError(f"--density must be in (0, 1], got {a.density}")
    sparsity = a.sparsity if a.density is None else 1.0 - a.density
    d = run_kernel(a.kind, m=a.m, k=a.k, n=a.n, target=a.target, pes=parse_pes(a.pes) if a.pes else None,
                   defects=a.defects, seed=a.seed, verify=a.verify, sparsity=sparsity, clock_hz=a.clock_hz,
                   algo=a.algo, fan_in=a.fan_in, dtype=a.dtype)
    print(json.dumps(d, indent=1) if a.json else format_kernel_report(d))
    return 1 if a.verify and not d.get("verified") else 0


def cmd_sparsity_report(a: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from waferscale.compiler.capture import measure_sparsity
    from waferscale.compiler.sparsity import report_figure, report_table
    from waferscale.runtime.generation import load_for_generation
    from waferscale.util.files import atomic_write_bytes

    if (a.model is None) == (a.checkpoint is None):
        raise ConfigError("give exactly one of --model NAME or --checkpoint PATH")
    for flag in ("batch_size", "seq_len"):
        if getattr(a, flag) <= 0:
            raise ConfigError(f"--{flag} must be a positive integer, got {getattr(a, flag)}")
    if not a.threshold > 0:
        raise ConfigError(f"--threshold must be positive, got {a.threshold}")
    model, tok, _ = load_for_generation(_source(a.model or a.checkpoint, a), tokenizer=None, device="cpu",
                                        need_tokenizer=False)
    cfg, n = model.config, a.batch_size * a.seq_len
    if a.seq_len > cfg.max_seq_len:
        raise ConfigError(f"--seq_len {a.seq_len} exceeds {cfg.name}'s context of {cfg.max_seq_len}")
    if a.data is None:
        ids, source = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(a.seed)), \
            f"random token ids, seed {a.seed}"
    else:
        path = Path(a.data)
        if not path.is_file():
            raise ConfigError(f"--data {a.data}: no such file")
        if path.suffix == ".npy":
            try:
                ids = torch.as_tensor(np.load(path).reshape(-1).astype(np.int64))
            except (ValueError, OSError) as e:
                raise ConfigError(f"--data {a.data}: not a .npy array of token ids ({e})") from None
        elif tok is None:
            raise ConfigError(f"--data {a.data}: {cfg.name} has no tokenizer to read text with; give a .npy of ids")
        else:
            ids = torch.tensor(tok.encode(path.read_text(encoding="utf-8", errors="replace")))
        if len(ids) < n or int(ids.max()) >= cfg.vocab_size or int(ids.min()) < 0:
            raise ConfigError(f"--data {a.data}: needs {n:,} token ids in [0, {cfg.vocab_size}) for --batch_size "
                              f"{a.batch_size} x --seq_len {a.seq_len}, has {len(ids):,}")
        source = str(path)
    rep = {"model": cfg.name, "activation": cfg.activation, "threshold": a.threshold,
           "sample": {"batch": a.batch_size, "seq_len": a.seq_len, "source": source},
           "layers": measure_sparsity(model, ids[:n].reshape(a.batch_size, a.seq_len), a.threshold)}
    print(json.dumps(rep, indent=1) if a.json else report_table(rep))
    if a.plot:
        import io

        import matplotlib.pyplot as plt

        fig, buf = report_figure(rep), io.BytesIO()
        fig.savefig(buf, format="png", dpi=140)
        plt.close(fig)
        atomic_write_bytes(a.plot, buf.getvalue())
        print(f"wrote {a.plot}", file=sys.stderr if a.json else sys.stdout)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from waferscale.serve.server import serve

    engine_kw = {"enable_prefix_caching": a.enable_prefix_caching, "dtype": a.dtype, "speculative": _speculation(a),
                 "kv_cache_dtype": a.kv_cache_dtype}
    if a.tokenizer is not None:
        engine_kw["tokenizer"] = a.tokenizer
    if a.max_num_seqs is not None:
        engine_kw["max_num_seqs"] = a.max_num_seqs
    serve(model=_source(a.model, a), host=a.host, port=a.port, api_key=a.api_key, stages=a.stages, target=a.target,
          systems=a.systems, engine_kw=engine_kw)
    return 0


def cmd_models(a: argparse.Namespace) -> int:
    from waferscale.models import PRESETS
    from waferscale.models.registry import ALIASES

    print(f"{'name':<16} {'family':<6} {'params':>10} {'layers':>6} {'d_model':>7} {'heads':>9} {'ctx':>7}")
    for name, c in PRESETS.items():
        heads = f"{c.n_head}/{c.kv_heads}" if c.kv_heads != c.n_head else str(c.n_head)
        print(f"{name:<16} {c.family:<6} {c.num_params / 1e6:>9,.1f}M {c.n_layer:>6} {c.d_model:>7} {heads:>9} "
              f"{c.max_seq_len:>7}")
    print("aliases: " + ", ".join(f"{k} -> {v}" for k, v in ALIASES.items()))
    return 0


# ---- the table -----------------------------------------------------------------------------------------

def _run_flags(p: argparse.ArgumentParser, params_positional: bool = False, params_required: bool = True) -> None:
    if params_positional:
        p.add_argument("params", help="params YAML (Model Zoo layout)")
    else:
        p.add_argument("-p", "--params", required=params_required, help="params YAML (Model Zoo layout)")
        p.add_argument("-m", "--mode", default=None, choices=["train", "eval", "train_and_eval"],
                       help="default: runconfig.mode, else train")
    p.add_argument("-o", "--model_dir", default=None, help="where checkpoints and metrics go (default: runconfig)")
    p.add_argument("--num_csx", type=int, default=None, help="data-parallel systems (default: runconfig.num_csx)")
    p.add_argument("--num_steps", type=int, default=None, help="steps to run in this invocation")
    p.add_argument("--max_steps", type=int, default=None, help="total steps of the run (overrides runconfig)")
    p.add_argument("--eval_steps", type=int, default=None, help="evaluation batches")
    p.add_argument("--checkpoint_path", default=None, help="resume or evaluate from this checkpoint")
    p.add_argument("--load_checkpoint_states", default=None, choices=["all", "model"],
                   help="default: runconfig.load_checkpoint_states, else all")
    p.add_argument("--num_wgt_servers", type=int, default=0, help="accepted for compatibility (0 = auto)")
    p.add_argument("--compile_only", action="store_true",
                   help="write the wafer plan of the training step (plan.json, wafer.png/.svg, trace.json) to "
                        "MODEL_DIR and print its projection, without running")
    p.add_argument("--validate_only", action="store_true", help="check the params file and the flags, then stop")
    p.add_argument("--target", default="wse3", help="--compile_only: the wafer to compile for (wse1 | wse2 | wse3)")
    p.add_argument("--logging", default="INFO", help="accepted for compatibility")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--execution", default="auto", choices=["auto", "resident", "streaming"],
                   help="auto: resident if weights + gradients + optimizer state fit the device budget, else streaming")
    p.add_argument("--device_memory_mb", type=float, default=None, help="device memory budget (streaming respects it)")
    p.add_argument("--memoryx_ram_mb", type=float, default=None,
                   help="MemoryX RAM budget; units beyond it live on flash (--flash_dir)")
    p.add_argument("--flash_dir", default=None, help="MemoryX flash tier directory (default MODEL_DIR/memoryx_flash)")
    p.add_argument("--recompute", default="auto", choices=["auto", "always", "never"],
                   help="streaming: recompute each unit's forward in backward (auto: when the budget needs it)")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of one training step to this file")
    p.add_argument("--swarmx_timeout_s", type=float, default=300.0,
                   help="--num_csx > 1: a worker silent this long is reported dead or hung")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    for flag in ("--dist_addr", "--dist_backend", "--init_method"):
        p.add_argument(flag, default=None, help="accepted for compatibility with Model Zoo's GPU runs")


def _model_source_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a packaged or zoo name (see `wsc models`), a HF dir, a .gguf file "
                   "or a checkpoint")
    p.add_argument("--checkpoint", default=None, help="a checkpoint (wsc run's, cstorch.save's or a .mdl), or a "
                   "model_dir (its latest)")
    _config_flag(p)


def _config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="PARAMS.yaml", help="the params file a checkpoint without its "
                   "own architecture (a .mdl, a cstorch script's) was trained with")


def _source(spec: str, a: argparse.Namespace) -> Any:
    """The ModelSource `spec` names (runtime/source.py), --config giving the architecture of a checkpoint that
    does not carry its own."""
    from waferscale.runtime.source import resolve

    if a.config is None:
        return resolve(spec)
    from waferscale.params import load_params

    return resolve(spec, config=load_params(a.config).model.to_model_config())


def _speculative_flags(p: argparse.ArgumentParser) -> None:
    """The serving engine's speculative decoding (vLLM's ngram method and option names)."""
    p.add_argument("--speculative", default=None, metavar="ngram",
                   help="speculative decoding: ngram drafts the tokens that followed the text's last n-gram where it "
                        "occurred before (prompt lookup), and the model verifies them in one pass")
    p.add_argument("--num-speculative-tokens", "--num_speculative_tokens", dest="num_speculative_tokens", type=int,
                   default=None, metavar="K", help="tokens drafted per step")
    p.add_argument("--prompt-lookup-max", "--prompt_lookup_max", dest="prompt_lookup_max", type=int, default=None,
                   metavar="N", help="the longest n-gram looked up (default 5, or --prompt_lookup_min)")
    p.add_argument("--prompt-lookup-min", "--prompt_lookup_min", dest="prompt_lookup_min", type=int, default=None,
                   metavar="M", help="the shortest n-gram looked up (default 5, or --prompt_lookup_max)")


def _speculation(a: argparse.Namespace) -> "NgramSpeculation | None":
    from waferscale.serve.speculative import speculation

    return speculation(a.speculative, a.num_speculative_tokens, a.prompt_lookup_max, a.prompt_lookup_min)


def _dtype_flag(p: argparse.ArgumentParser) -> None:
    from waferscale.serve.file_weights import DTYPES

    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the precision the weight matrices run in: auto = a GGUF file's own (its Q4_1, Q8_0, ... "
                        "blocks, read in place by the kernels), float32 for other checkpoints; any other "
                        "requantizes at load")


def _kv_cache_dtype_flag(p: argparse.ArgumentParser) -> None:
    from waferscale.serve.kv import KV_CACHE_DTYPES

    p.add_argument("--kv-cache-dtype", "--kv_cache_dtype", dest="kv_cache_dtype", default="auto",
                   choices=KV_CACHE_DTYPES,
                   help="the KV cache's element type: auto = fp16 when the weights run narrower than float32 (a "
                        "GGUF's Q4_1, Q8_0, ... or --dtype q8_0, ...: as llama.cpp), else the weights' own (fp32); "
                        "fp16 halves the bytes attention reads")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wsc", description="waferscale: the Cerebras wafer-scale system, in software")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
        "run": (cmd_run, "train / evaluate from a params YAML (Model Zoo run.py flags)"),
        "fit": (cmd_run, "train_and_eval (cszoo fit form)"),
        "validate": (cmd_run, "check a params YAML"),
        "generate": (cmd_generate, "sample text from a zoo model or a checkpoint"),
        "export": (cmd_export, "write a checkpoint in another format (Hugging Face)"),
        "plot": (cmd_plot, "draw a run's loss curve to a PNG"),
        "models": (cmd_models, "list the model zoo"),
        "compile": (cmd_compile, "place a model on one or more wafers and project its speed"),
        "estimate": (cmd_estimate, "memory table: weights, gradients, optimizer state, activations vs wafer SRAM"),
        "serve": (cmd_serve, "OpenAI-compatible inference server with a playground at /"),
        "kernel": (cmd_kernel, "run a fabric kernel's cycle model (and verify it tile by tile)"),
        "sparsity-report": (cmd_sparsity_report, "weight and activation sparsity per layer of a model, with a plot"),
        "data_preprocess": (cmd_data_preprocess, "text -> Model Zoo's HDF5 training data (cszoo data_preprocess)"),
    }
    for name, (fn, help_) in commands.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        if name == "run":
            _run_flags(p)
        elif name == "fit":
            _run_flags(p, params_positional=True)
            p.set_defaults(mode="train_and_eval")
        elif name == "validate":
            _run_flags(p, params_positional=True)
            p.set_defaults(validate_only=True)
        elif name == "data_preprocess":
            from waferscale.data.preprocess import add_flags

            add_flags(p)
        elif name == "generate":
            _model_source_flags(p)
            p.add_argument("--prompt", default=None, help="raw text to continue (an encoder: text whose mask tokens "
                                                          "it fills, e.g. \"Paris is the [MASK] of France.\")")
            p.add_argument("--chat", default=None, help="a user message, wrapped in the model's chat template")
            p.add_argument("--system", default=None, help="system message for --chat")
            p.add_argument("--tokenizer", default=None, help="tokenizer for a zoo model without one (e.g. smollm2)")
            p.add_argument("--max_new_tokens", type=int, default=100)
            p.add_argument("--temperature", type=float, default=0.8)
            p.add_argument("--top_k", type=int, default=None)
            p.add_argument("--top_p", type=float, default=None)
            p.add_argument("--seed", type=int, default=None)
            p.add_argument("--device", default="auto")
            _dtype_flag(p)
            _kv_cache_dtype_flag(p)
            _speculative_flags(p)
        elif name == "export":
            _model_source_flags(p)
            p.add_argument("--format", default="hf", help="hf (a directory) or gguf (a file, from a .gguf source)")
            p.add_argument("--out", required=True, help="output directory (hf) or file (gguf)")
            _dtype_flag(p)
        elif name == "compile":
            p.add_argument("--model", default=None, help="a zoo name (see `wsc models`)")
            p.add_argument("--params", default=None, help="a params YAML (Model Zoo layout)")
            p.add_argument("--target", default="wse3", help="wse1 | wse2 | wse3")
            p.add_argument("--systems", type=int, default=1, help="number of wafers (CS systems)")
            p.add_argument("--pes", default=None, help="the ROWSxCOLS mesh a layer runs on: the pipelined layout "
                                                       "carves its regions from one such mesh; the model-parallel "
                                                       "layout runs each layer on a window of this size, the "
                                                       "windows spread over the whole wafer")
            p.add_argument("--layout", default="auto", choices=["auto", "pipelined", "model_parallel"],
                           help="a decoder's inference layout: one pipelined region per layer, each layer "
                                "model-parallel across a mesh, or auto (both compared, the better kept)")
            p.add_argument("--mode", default="inference", choices=["inference", "train"])
            p.add_argument("--batch_size", type=int, default=None)
            p.add_argument("--seq_len", type=int, default=None)
            p.add_argument("--prompt_len", type=int, default=None)
            p.add_argument("--context_len", type=int, default=None)
            p.add_argument("--users", type=int, default=None, help="users in flight (inference)")
            p.add_argument("--defects", type=float, default=0.0, help="random defect rate in [0, 1)")
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--clock_hz", type=float, default=None, help="override the assumed clock")
            p.add_argument("--assume", action="append", default=[], metavar="NAME=VALUE",
                           help="change one of the target's unpublished hardware assumptions (repeatable; the plan's "
                                "assumptions.unpublished lists them)")
            p.add_argument("--sensitivity", type=float, nargs="?", const=10.0, default=None, metavar="PCT",
                           help="recompile with each unpublished assumption at -PCT%% and +PCT%% (default 10) and "
                                "show how the headline figures move")
            p.add_argument("--speculative", default=None, metavar="draft|ngram",
                           help="project speculative decoding: a draft model sharing the wafer (--draft_model) or "
                                "prompt lookup (ngram: drafts cost nothing on the wafer)")
            p.add_argument("--draft_model", default=None, help="--speculative draft: a smaller zoo model, same "
                                                               "vocabulary")
            p.add_argument("--num_speculative_tokens", type=int, default=None, metavar="K",
                           help="tokens drafted per verification round")
            p.add_argument("--acceptance", type=float, default=None, metavar="A",
                           help="probability that a draft token is accepted (i.i.d.), in [0, 1)")
            p.add_argument("--out", default=None, help="write plan.json, wafer.png, wafer.svg, trace.json here")
            p.add_argument("--json", action="store_true")
            p.add_argument("--sparsity", type=float, default=None,
                           help="fraction of zero weights in the blocks' matrices (overrides a params file's section)")
            p.add_argument("--activation_sparsity", default=None,
                           help="fraction of zeros entering each FFN down-projection: a number, one per layer "
                                "(a,b,...), or a JSON file (`wsc sparsity-report --json`)")
        elif name == "sparsity-report":
            _model_source_flags(p)
            p.add_argument("--data", default=None, help="a UTF-8 text file (tokenized with the model's tokenizer) "
                                                       "or a .npy of token ids; default: random token ids")
            p.add_argument("--batch_size", type=int, default=4)
            p.add_argument("--seq_len", type=int, default=128)
            p.add_argument("--threshold", type=float, default=1e-2, help="|a| below this counts as near zero")
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--plot", default="sparsity_report.png", help="PNG path ('' for none)")
            p.add_argument("--json", action="store_true")
        elif name == "estimate":
            p.add_argument("--model", default=None)
            p.add_argument("--params", default=None)
            p.add_argument("--target", default="wse3")
            p.add_argument("--fp32", action="store_true", help="no mixed precision")
            p.add_argument("--batch_size", type=int, default=None, help="sequences per step (default: the params "
                                                                         "file's, else as wsc compile)")
            p.add_argument("--seq_len", type=int, default=None)
            p.add_argument("--systems", type=int, default=1, help="the batch splits over this many systems")
            p.add_argument("--json", action="store_true")
        elif name == "kernel":
            p.add_argument("kind", choices=["gemv", "gemm", "spmv", "allreduce"])
            p.add_argument("--m", type=int, required=True)
            p.add_argument("--k", type=int, required=True)
            p.add_argument("--n", type=int, default=None)
            p.add_argument("--target", default="wse2")
            p.add_argument("--pes", default=None, help="ROWSxCOLS mesh, e.g. 8x8")
            p.add_argument("--defects", type=float, default=0.0)
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--sparsity", type=float, default=0.9, help="spmv: fraction of zero weights")
            p.add_argument("--density", type=float, default=None, help="spmv: fraction of non-zero weights "
                                                                          "(1 - --sparsity)")
            p.add_argument("--clock_hz", type=float, default=None)
            p.add_argument("--dtype", default=None, help="fp16 | bf16 | fp32: the PEs' precision (default fp16; "
                                                         "allreduce: fp32, the only one it models)")
            p.add_argument("--algo", default=None, help="allreduce: chain | tree | 2d | center (default 2d); gemm: "
                                                        "summa | "
                                                        "cannon | cannon_folded (W, X, Y in 2D blocks; default: "
                                                        "W stationary, the n vectors streamed); gemv: chain | ktree | "
                                                        "phases "
                                                        "(x already on its column, y all-reduced along the rows; "
                                                        "default: x streamed into stationary W)")
            p.add_argument("--fan_in", type=int, default=None, help="gemv --algo ktree: PEs per reduction group "
                                                                    "(default 2); gemv --algo phases: the number "
                                                                    "of phases (default 2); allreduce --algo "
                                                                    "center: phases per axis (default 1)")
            p.add_argument("--verify", action="store_true", help="run the tile-level execution and check it")
            p.add_argument("--json", action="store_true")
        elif name == "serve":
            p.add_argument("--model", default="smollm2-135m-instruct", help="a packaged name, a HF dir, a .gguf or a "
                           "checkpoint (wsc run's, cstorch.save's or a .mdl), or a model_dir")
            _config_flag(p)
            p.add_argument("--tokenizer", default=None, help="a tokenizer name or path, instead of the model's own "
                           "(needed for a checkpoint with none beside it)")
            p.add_argument("--host", default="127.0.0.1")
            p.add_argument("--port", type=int, default=8000)
            p.add_argument("--api-key", "--api_key", dest="api_key", default=None,
                           help="require this bearer key (default: $WSC_API_KEY, else none)")
            p.add_argument("--stages", type=int, default=1, help="pipeline stages (layers split across workers)")
            p.add_argument("--target", default=None, help="show wafer projections for wse1|wse2|wse3")
            p.add_argument("--systems", type=int, default=1, help="wafers for the projection")
            p.add_argument("--max-num-seqs", "--max_num_seqs", dest="max_num_seqs", type=int, default=None,
                           help="sequences the engine decodes together (default 64)")
            _dtype_flag(p)
            _kv_cache_dtype_flag(p)
            p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                           action=argparse.BooleanOptionalAction, default=True,
                           help="reuse the KV of full blocks a request shares with earlier ones (vLLM's automatic "
                                "prefix caching; not with sliding-window attention)")
            _speculative_flags(p)
        elif name == "plot":
            p.add_argument("model_dir")
            p.add_argument("--out", default=None, help="PNG path (default MODEL_DIR/loss.png)")
    from waferscale.cli.appliance import register

    register(sub, _run_flags)
    from waferscale.cli.checkpoint import register as register_checkpoint

    register_checkpoint(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
