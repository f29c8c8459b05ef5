"""The newer trainer layout, `trainer: {init: {...}, fit: {...}}` (cszoo), mapped onto the legacy sections.

A useful subset is mapped: init.{backend, model_dir, seed, model, optimizer, schedulers, precision, loop,
checkpoint, logging, callbacks, sparsity} and fit.{train_dataloader, val_dataloader, ckpt_path}. Unknown keys are
errors, as everywhere; error key paths then refer to the legacy layout. A list of trainers (multi-phase) is
refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from waferscale.params.cluster_keys import CLUSTER_KEYS
from waferscale.params.typed import Ctx, expect_keys, show, unknown_key
from waferscale.params.yaml_lines import LinedDict


def legacy_from_trainer(trainer: Any, ctx: Ctx) -> dict[str, Any]:
    """Map `trainer: {init, fit}` (cszoo) onto the legacy sections. Unknown keys are errors, as everywhere."""
    if isinstance(trainer, list):
        if len(trainer) != 1:
            raise ctx.error("trainer", f"a list of {len(trainer)} trainers (multi-phase training) is not "
                            f"supported; split it into one params file per phase")
        trainer = trainer[0].get("trainer", trainer[0]) if isinstance(trainer[0], Mapping) else trainer[0]
    expect_keys(trainer, "trainer", ("init", "fit", "validate", "validate_all"), ctx)
    init, fit = trainer.get("init") or {}, trainer.get("fit") or {}
    expect_keys(init, "trainer.init", ("backend", "model_dir", "seed", "device", "model", "optimizer",
                                        "schedulers", "precision", "loop", "checkpoint", "logging", "callbacks",
                                        "sparsity", "loggers"), ctx)
    expect_keys(fit, "trainer.fit", ("train_dataloader", "val_dataloader", "ckpt_path"), ctx)

    model = dict(init.get("model") or {})
    optimizer: dict[str, Any] = {}
    run: dict[str, Any] = {}
    out: dict[str, Any] = {"model": model, "optimizer": optimizer, "runconfig": run}
    # each legacy key's line in the file, so that errors about it point there
    lines: dict[str, dict[Any, int]] = {"model": dict(_lines(init.get("model"))), "optimizer": {}, "runconfig": {}}

    opt = init.get("optimizer")
    if opt is not None:
        if not isinstance(opt, Mapping) or len(opt) != 1:
            raise ctx.error("trainer.init.optimizer", f"expected one mapping like {{AdamW: {{...}}}}, got "
                            f"{show(opt)}")
        ((name, kwargs),) = opt.items()
        optimizer.update({"optimizer_type": name, **(kwargs or {})})
        lines["optimizer"].update({**_lines(kwargs), "optimizer_type": _lines(opt).get(name)})
    if "schedulers" in init:
        optimizer["learning_rate"] = _trainer_schedulers(init["schedulers"], ctx)
        lines["optimizer"]["learning_rate"] = _lines(init).get("schedulers")

    precision = dict(init.get("precision") or {})
    lines["optimizer"].update(_lines(init.get("precision")))
    expect_keys(precision, "trainer.init.precision", ("enabled", "fp16_type", "loss_scaling_factor",
                                                       "max_gradient_norm", "initial_loss_scale",
                                                       "steps_per_increase", "min_loss_scale", "max_loss_scale",
                                                       "log_loss_scale", "precision_opt_level"), ctx)
    for key, model_key in (("enabled", "mixed_precision"), ("fp16_type", "fp16_type")):
        if key in precision:
            model[model_key] = precision.pop(key)
    optimizer.update({k: v for k, v in precision.items() if k not in _IGNORED_PRECISION})
    for key in _IGNORED_PRECISION.keys() & precision.keys():
        ctx.ignored[f"trainer.init.precision.{key}"] = _IGNORED_PRECISION[key]

    backend = init.get("backend") or {}
    expect_keys(backend, "trainer.init.backend", ("backend_type", "cluster_config", "compile_dir",
                                                   "artifact_dir"), ctx)
    device = {"csx": None, "cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}
    if "backend_type" in backend:
        kind = str(backend["backend_type"]).lower()
        if kind not in device:
            raise ctx.error("trainer.init.backend.backend_type", f"expected CSX, CPU or GPU, got {show(kind)}")
        if device[kind]:
            run["device"] = device[kind]
    cluster = backend.get("cluster_config") or {}
    expect_keys(cluster, "trainer.init.backend.cluster_config", ("num_csx", *CLUSTER_KEYS), ctx)
    run.update(cluster)  # num_csx; the cluster's own keys are listed as ignored by the runconfig
    for key in ("compile_dir", "artifact_dir"):
        if key in backend:
            ctx.ignored[f"trainer.init.backend.{key}"] = "compile artifacts and plans go to model_dir"
    for key, why in (("loggers", "metrics go to model_dir/metrics.jsonl"),):
        if key in init:
            ctx.ignored[f"trainer.init.{key}"] = why
    for key in ("validate", "validate_all"):
        if key in trainer:
            ctx.ignored[f"trainer.{key}"] = "evaluation reads fit.val_dataloader: wsc run --mode eval"
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
        expect_keys(values, f"trainer.init.{section}", tuple(mapping), ctx)
        run.update({mapping[k]: v for k, v in values.items() if mapping[k]})
        lines["runconfig"].update({mapping[k]: line for k, line in _lines(values).items() if mapping.get(k)})
        if "log_level" in values:
            ctx.ignored[f"trainer.init.{section}.log_level"] = "wsc prints progress and errors only"

    micro_batch = _callbacks(init.get("callbacks") or [], run, ctx)
    if init.get("sparsity") is not None:
        out["sparsity"] = init["sparsity"]

    if "train_dataloader" in fit:
        out["train_input"] = dict(fit["train_dataloader"])
        lines["train_input"] = dict(_lines(fit["train_dataloader"]))
        if micro_batch is not None:
            out["train_input"].setdefault("micro_batch_size", micro_batch)
    val = fit.get("val_dataloader")
    if isinstance(val, list):
        val = val[0] if val else None
    if val is not None:
        out["eval_input"] = dict(val)
        lines["eval_input"] = dict(_lines(val))
    if "ckpt_path" in fit:
        run["checkpoint_path"] = fit["ckpt_path"]
    lines["runconfig"].update({k: line for k, line in _lines(init).items() if k in ("model_dir", "seed")})
    return {name: _lined(section, lines.get(name, {})) if isinstance(section, dict) else section
            for name, section in out.items()}


def _lines(mapping: Any) -> dict[Any, int]:
    """The (1-based) line of each key of a mapping read from the file (none for one built in code)."""
    return getattr(mapping, "key_lines", {})


def _lined(section: dict[str, Any], lines: dict[Any, int]) -> LinedDict:
    """A legacy section that keeps the file's line of each of its keys (what error messages point at)."""
    out = LinedDict(section)
    out.key_lines = {k: line for k, line in lines.items() if k in section and line is not None}
    return out


_IGNORED_PRECISION = {"log_loss_scale": "metrics.jsonl has no loss-scale column",
                      "precision_opt_level": "a Cerebras compiler setting"}
# the callbacks a trainer's `init.callbacks` may list, and what each becomes (see `_callbacks`)
_FLAG_CALLBACKS = ("GlobalFlags", "ScopedTrainFlags", "ScopedValidateFlags")
_IGNORED_CALLBACKS = {"ComputeNorm": "metrics.jsonl always has the gradient norm"}


def _callbacks(callbacks: Any, run: dict[str, Any], ctx: Ctx) -> Any:
    """The trainer's callbacks onto the legacy runconfig (Model Zoo's own legacy mapping): a flag callback's
    `csx.performance.micro_batch_size` is the micro-batch (returned), its `csx.debug.*` cluster keys become the
    runconfig keys of the same names (accepted and listed as ignored there); `LoadCheckpointStates` sets
    runconfig.load_checkpoint_states. Any other callback or flag is an error naming it."""
    if not isinstance(callbacks, list):
        raise ctx.error("trainer.init.callbacks", f"expected a list of callbacks, got {show(callbacks)}")
    known = (*_FLAG_CALLBACKS, *_IGNORED_CALLBACKS, "LoadCheckpointStates")
    micro_batch = None
    for i, callback in enumerate(callbacks):
        path = f"trainer.init.callbacks[{i}]"
        if not isinstance(callback, Mapping) or len(callback) != 1:
            raise ctx.error(path, f"expected one mapping like {{GlobalFlags: {{...}}}}, got {show(callback)}")
        ((name, args),) = callback.items()
        if name not in known:
            raise unknown_key(ctx, path, name, known, getattr(callback, "key_lines", {}).get(name))
        if name in _IGNORED_CALLBACKS:
            ctx.ignored[f"{path}.{name}"] = _IGNORED_CALLBACKS[name]
        elif name == "LoadCheckpointStates":
            expect_keys(args or {}, f"{path}.{name}", ("load_checkpoint_states",), ctx)
            run.update(args or {})
        else:
            if not isinstance(args or {}, Mapping):
                raise ctx.error(f"{path}.{name}", f"expected a mapping of flags, got {show(args)}")
            for flag, value in (args or {}).items():
                if flag == "csx.performance.micro_batch_size":
                    if name != "ScopedValidateFlags":  # evaluation's micro-batch changes no result
                        micro_batch = value
                elif str(flag).startswith("csx.debug.") and flag.removeprefix("csx.debug.") in CLUSTER_KEYS:
                    run[flag.removeprefix("csx.debug.")] = value
                else:
                    raise ctx.error(f"{path}.{name}.{flag}", "is not supported: the flags taken are "
                                    "csx.performance.micro_batch_size and the cluster's csx.debug.* keys ("
                                    + ", ".join(CLUSTER_KEYS) + ")", getattr(args, "key_lines", {}).get(flag))
    return micro_batch


def _trainer_schedulers(value: Any, ctx: Ctx) -> list[dict[str, Any]]:
    """[{LinearLR: {...}}, {SequentialLR: {schedulers: [...]}}] -> legacy [{scheduler: Linear, ...}, ...]."""
    items = value if isinstance(value, list) else [value]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        path = f"trainer.init.schedulers[{i}]"
        if not isinstance(item, Mapping) or len(item) != 1:
            raise ctx.error(path, f"expected one mapping like {{CosineDecayLR: {{...}}}}, got {show(item)}")
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


__all__ = ["legacy_from_trainer"]
