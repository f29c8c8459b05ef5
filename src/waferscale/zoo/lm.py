"""`compile_lm_step`: a zoo language model's whole training step (forward, loss, backward, update) compiled
for a cstorch backend, as one call `executor.train_step(x, y, lr)`. This is what `wsc run` traces.

Because the step is known whole, it runs on the fused executors: resident ("CPU"/"GPU"), weight streaming
from MemoryX ("CSX"), and with `ClusterConfig(num_csx=N)` N SwarmX worker processes that receive the step's
shape and their rows of the batch (not copies of the script) while this process holds MemoryX."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from waferscale import sparse
from waferscale.models import CausalLM, ModelConfig, build
from waferscale.models.modelzoo_optim import weight_decay_exempt
from waferscale.models.mup import lr_adjustment
from waferscale.params import OptimizerParams
from waferscale.pytorch.backend import Backend
from waferscale.runtime.executor import Executor, ResidentExecutor
from waferscale.runtime.optim import build_optimizer, split_by_lr_scale
from waferscale.util import dtypes
from waferscale.zoo.optim import optimizer_spec

__all__ = ["compile_lm_step", "adjust_learning_rates", "zoo_group_rules"]


def adjust_learning_rates(opt: torch.optim.Optimizer, named_params: Iterable[tuple[str, Any]],
                          scales: Mapping[str, float]) -> None:
    """Split each param group of a new optimizer (no state yet) by its parameters' muP learning-rate scales
    (`optimizer.adjust_learning_rate`, models/mup.py), as Model Zoo's optimizer groups and cstorch's
    ScalePerParamLR do (`runtime.optim.split_by_lr_scale`)."""
    split_by_lr_scale(opt, {id(p): lr_adjustment(n, scales) for n, p in named_params})


def zoo_group_rules(model: nn.Module, optimizer: OptimizerParams
                    ) -> tuple[Callable[[str], float], Callable[[str], bool]]:
    """How a params file's run groups `model`'s parameters, as Model Zoo's `configure_param_groups` does, by name:
    each one's muP learning-rate scale and whether it takes weight decay (`weight_decay_exempt`: not biases nor
    torch LayerNorm parameters; RMSNorm gains do). The resident optimizer and MemoryX's copies of its groups
    (`runtime.memoryx.resident_groups`) are both split by these, so their indices agree."""
    scales = optimizer.adjust_learning_rate or {}
    exempt = weight_decay_exempt(model)
    return (lambda name: lr_adjustment(name, scales)), (lambda name: name not in exempt)


def compile_lm_step(model: CausalLM | None, cfg: ModelConfig, backend: Backend, optimizer: OptimizerParams, *,
                    half_dtype: str | None = None, micro_batch_size: int | None = None,
                    recompute: bool | str = "auto", swarmx_timeout_s: float = 300.0,
                    sparsity: Any = None) -> tuple[CausalLM, Executor]:
    """(the model the run reports on, its executor). `model` may be None: a streamed model is then
    initialised inside MemoryX unit by unit, never materialized whole. `sparsity`: a params file's sparsity
    section; resident, its masks are applied by hooks (cstorch.sparse's); streamed, by MemoryX."""
    group = sparse.configure(sparsity) if sparsity is not None else None
    device = backend.device
    spec = optimizer_spec(optimizer)
    budget = int(backend.device_memory_mb * 2**20) if backend.device_memory_mb is not None else None
    if not backend.is_csx:
        model = model if model is not None else build(cfg, device="cpu")
        model.to(device)
        opt = build_optimizer(model.named_parameters(), spec, zoo_group_rules(model, optimizer)[1])
        adjust_learning_rates(opt, model.named_parameters(), optimizer.adjust_learning_rate or {})
        if group is not None:
            sparse.sparsify_module(group, model)
            sparse.sparsify_optimizer(group, opt)
        resident = ResidentExecutor(model, opt, device=device, half_dtype=half_dtype,
                                    micro_batch_size=micro_batch_size, max_gradient_norm=optimizer.max_gradient_norm,
                                    loss_scaling_factor=optimizer.loss_scaling_factor)
        resident.sparsity = group
        return model, resident
    from waferscale.models.registry import META_THRESHOLD_PARAMS
    from waferscale.runtime.loss_scale import LossScaler
    from waferscale.runtime.memoryx import MemoryX
    from waferscale.runtime.streaming import StreamingExecutor, build_skeleton

    ram = int(backend.memoryx_ram_mb * 2**20) if backend.memoryx_ram_mb is not None else None
    # materialize on the CPU (the resident run's exact initial weights) unless that alone would break the budget
    if model is None and cfg.num_params <= META_THRESHOLD_PARAMS and (ram is None or 4 * cfg.num_params <= ram):
        model = build(cfg, device="cpu")
    stream_dtype = dtypes.half_dtype(half_dtype)
    scaler = LossScaler.from_config(optimizer.loss_scaling_factor) if half_dtype == "float16" else None
    source = model if model is not None else build_skeleton(cfg)
    lr_scale, decays = zoo_group_rules(source, optimizer)
    mx = MemoryX(source, spec, stream_dtype=stream_dtype, ram_budget_bytes=ram, flash_dir=backend.flash_dir,
                 pin_memory=device.type == "cuda", max_gradient_norm=optimizer.max_gradient_norm,
                 loss_scaler=scaler, lr_scale=lr_scale, decays=decays)
    del source, model
    if group is not None:
        mx.attach_sparsity(group)
    skeleton = build_skeleton(cfg, device)
    executor: Executor
    if backend.num_csx > 1:
        from waferscale.runtime.swarmx import SwarmXExecutor

        executor = SwarmXExecutor(skeleton, mx, num_csx=backend.num_csx, device=device, half_dtype=half_dtype,
                                  micro_batch_size=micro_batch_size, device_memory_bytes=budget,
                                  recompute=recompute, timeout_s=swarmx_timeout_s)
    else:
        executor = StreamingExecutor(skeleton, mx, device=device, half_dtype=half_dtype,
                                     micro_batch_size=micro_batch_size, device_memory_bytes=budget,
                                     recompute=recompute)
    executor.sparsity = group
    return skeleton, executor
