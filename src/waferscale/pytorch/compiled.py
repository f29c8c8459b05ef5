"""`cstorch.compile(model, backend)`: the callable that stands in for the model.

On "CPU"/"GPU" the model runs as it is, resident on that device. On "CSX" it runs by weight streaming on the
runtime's engine (`runtime/engine.py`, the one `wsc run` uses), over the model's units (`runtime/units.py`; the
docs/cstorch.md, "What streams"): unit u+1's weights are fetched while unit u computes and only unit-boundary
activations are kept; backward fetches each unit again, in reverse, recomputes its forward and sends its
gradients to MemoryX as soon as they are complete (where, without clipping or loss scaling, that unit's update
runs while the backward pass goes on). The model's parameters alias MemoryX's fp32 masters, so
`model.state_dict()` is always the trained weights; the cstorch optimizer built over them is bound on the first
call, and its `step()` completes MemoryX's update.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch import Tensor, nn

from waferscale import sparse
from waferscale.errors import ConfigError
from waferscale.pytorch import amp as _amp
from waferscale.pytorch import distributed as _dist
from waferscale.pytorch.backend import Backend
from waferscale.pytorch.optim import find_optimizer, memoryx_optimizer_params
from waferscale.runtime.engine import StreamingEngine
from waferscale.runtime.links import LocalLink, SwarmLink
from waferscale.runtime.layout import build_layouts
from waferscale.runtime.memoryx import MemoryX
from waferscale.runtime.units import StreamUnits, model_units

__all__ = ["CompiledModel", "compile", "model_units"]


def compile(model: nn.Module, backend: Backend | None = None) -> "CompiledModel":  # noqa: A001 - cstorch's name
    from waferscale.pytorch.backend import backend as current

    if not isinstance(model, nn.Module):
        raise ConfigError(f"cstorch.compile needs a torch.nn.Module, got {type(model).__name__}")
    b = backend or current()
    compiled = CompiledModel(model, b)
    if b.compile_only:
        compiled.write_wafer_plan()
    return compiled


class CompiledModel(nn.Module):
    def __init__(self, model: nn.Module, backend: Backend) -> None:
        super().__init__()
        self.model = model
        self.backend = backend
        self.device = backend.device
        self.runner: StreamRunner | None = None
        self._closed = False
        if not backend.is_csx:
            model.to(self.device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.backend.compile_only:
            raise ConfigError("this backend was made with compile_only=True: it compiles, it does not run steps")
        if self._closed:
            raise ConfigError("this compiled model was closed: compile the model again to run more steps")
        half = _amp.half_dtype()
        if not self.backend.is_csx:
            args = tuple(a.to(self.device) if isinstance(a, Tensor) else a for a in args)
            ctx = torch.autocast(self.device.type, dtype=half) if half is not None else contextlib.nullcontext()
            with ctx:
                return self.model(*args, **kwargs)
        if kwargs or len(args) != 1 or not isinstance(args[0], Tensor):
            raise ConfigError("a weight-streamed model takes one tensor argument (the first unit's input)")
        if self.runner is None:
            self.runner = StreamRunner(self.model, self.backend, half)
        return self.runner(args[0])

    def close(self) -> None:
        """Stop what running the model started: a weight-streamed model's engine lanes, weight link and MemoryX
        (their threads joined). The model keeps its trained weights; the compiled model runs no more steps.
        Idempotent; also `with cstorch.compile(model, backend) as compiled: ...`."""
        self._closed = True
        if self.runner is not None:
            self.runner.close()

    def __enter__(self) -> "CompiledModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def write_wafer_plan(self) -> None:
        """compile_only: place the model on a wafer (the compiler's plan, summary and picture in compile_dir)."""
        from waferscale.compiler.api import write_outputs
        from waferscale.compiler.compile import compile_model

        cfg = getattr(self.model, "config", None)
        example = (1, min(128, cfg.max_seq_len)) if hasattr(cfg, "max_seq_len") else None
        plan = compile_model(module=(self.model, example), mode="train")
        write_outputs(plan, self.backend.compile_dir)


# ---- weight streaming ------------------------------------------------------------------------------------

class _Streamed(torch.autograd.Function):
    """The whole streamed model as one autograd node: forward streams the units without a graph (keeping the
    last unit's), backward streams them again in reverse, recomputing."""

    @staticmethod
    def forward(ctx: Any, runner: "StreamRunner", anchor: Tensor, x: Tensor) -> Tensor:
        ctx.runner = runner
        out, ctx.saved = runner.forward_train(x)
        ctx.out = out
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        gx = ctx.runner.backward(ctx.saved, ctx.out, grad)
        ctx.saved = ctx.out = None
        return None, None, gx


class StreamRunner:
    """Weight streaming of one model for the cstorch API: MemoryX on rank 0, the engine's unit schedule on every
    system, the optimizer binding (clipping, loss scaling, the step) in between."""

    def __init__(self, model: nn.Module, backend: Backend, half: torch.dtype | None) -> None:
        self.model, self.backend, self.device = model, backend, backend.device
        self.split: StreamUnits = model_units(model)
        if self.split.report.how == "whole" and _dist.is_master():
            print(f"cstorch: the model streams as one unit: {self.split.report.reason}. Define units() on it to "
                  f"stream it piece by piece", file=sys.stderr)
        self.units = self.split.modules
        covered = {id(p) for u in self.units for p in u.parameters()}
        missing = [n for n, p in model.named_parameters() if id(p) not in covered]
        if missing:
            raise ConfigError(f"the model's units() leave out parameters ({', '.join(missing[:3])}); every "
                              f"parameter must belong to a unit")
        self.optimizer = find_optimizer(model)
        self.layouts = build_layouts(model, self.units)
        stream_dtype = half or torch.float32
        self.mx: MemoryX | None = None
        if _dist.is_master():
            opt_params, groups = memoryx_optimizer_params(self.optimizer, model)
            mib = lambda v: int(v * 2**20) if v is not None else None  # noqa: E731
            self.mx = MemoryX(model, opt_params, stream_dtype=stream_dtype, units=self.units,
                              ram_budget_bytes=mib(backend.memoryx_ram_mb), flash_dir=backend.flash_dir,
                              pin_memory=self.device.type == "cuda", groups=groups)
        self._alias_parameters()
        for unit in [model, *self.units]:  # buffers (rope tables, masks, norms' statistics) live on the device
            for owner in unit.modules():
                for k, b in list(owner._buffers.items()):
                    if b is not None:
                        owner._buffers[k] = b.to(self.device)
        cluster = _dist.cluster()
        if cluster is not None and cluster.world > 1:
            self.link: Any = SwarmLink(cluster, self.layouts, stream_dtype, self.device, self.mx, mean=True)
        else:
            assert self.mx is not None
            self.link = LocalLink(self.mx, self.device)
        self._check_budget(stream_dtype)
        self.engine = StreamingEngine(self.units, self.layouts, self.link, device=self.device, half=half,
                                      recompute=True, takes_input=self.split.takes_input)
        self._anchor = torch.empty(0, requires_grad=True)
        self.grads_pending = False  # gradients pushed since the last optimizer step
        self.max_gradient_norm: float | None = None
        self.scaler: Any = None
        self.last_grad_norm: float | None = None
        self.steps = 0
        if self.optimizer is not None:
            self.optimizer._bind_stream(self)
        self._n_sparse = 0
        self._sync_sparsity()

    # ---- set-up ----
    def _alias_parameters(self) -> None:
        """Point the model's parameters at MemoryX's masters (rank 0; no second copy of the weights) or at
        nothing (other systems hold no weights)."""
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            if self.mx is None:
                for p in params.values():
                    p.data = torch.empty(0, dtype=p.dtype)
                return
            for lay, store in zip(self.mx.layouts, self.mx.stores):
                flat = store.open("param")
                for e in lay.owned:
                    params[e.name].data = flat[e.offset:e.offset + e.numel].view(e.shape)
        self.model.register_state_dict_pre_hook(lambda *a, **k: self.synchronize())
        self.model.register_load_state_dict_pre_hook(lambda *a, **k: self.synchronize())
        # a state dict loaded into the aliased masters may hold weights the masks drop: pruned at the next call
        self.model.register_load_state_dict_post_hook(lambda *a: self.mx.weights_loaded())

    def _check_budget(self, stream_dtype: torch.dtype) -> None:
        mb = self.backend.device_memory_mb
        if mb is None:
            return
        two = sorted((lay.payload_bytes(stream_dtype.itemsize) for lay in self.layouts), reverse=True)[:2]
        if sum(two) > mb * 2**20:
            raise ConfigError(f"device_memory_mb {mb:g} is a budget smaller than two units' weights "
                              f"({sum(two) / 2**20:,.1f} MiB): raise it, or split the model into more units")

    def synchronize(self) -> None:
        _dist.guard("waiting for the gradients", self.engine.wait_pushes)
        if self.mx is not None:
            self.mx.synchronize()

    @property
    def stats(self) -> dict[str, float]:
        return {**self.engine.stats, **self.link.stats, "steps": self.steps}

    @property
    def n(self) -> int:
        return self.engine.n

    def _inputs(self, x: Tensor) -> tuple[Tensor, ...]:
        return (x,) if self.split.takes_input else ()

    def _sync_sparsity(self) -> None:
        """Sparsity applied to the model (`model.apply(sparsity)`): MemoryX takes over its masks (rank 0) and
        every system's link learns which units travel packed; masks loaded since the last step are taken."""
        groups = sparse.applied(self.model)
        if len(groups) != self._n_sparse:
            self._n_sparse = len(groups)
            whole = groups[0] if len(groups) == 1 else sparse.Group()
            for g in groups:
                g.streamed = True
                if whole is not g:
                    whole.extend(g)
            if self.mx is not None:
                self.mx.attach_sparsity(whole)
            names = set(whole.params)
            if isinstance(self.link, SwarmLink):
                self.link.sparse_units = {lay.index for lay in self.layouts
                                          if any(e.matrix and e.name in names for e in lay.entries)}
        if self.mx is not None:
            self.mx.sync_masks()

    # ---- forward ----
    def __call__(self, x: Tensor) -> Tensor:
        self._sync_sparsity()
        x = x.to(self.device)
        if torch.is_grad_enabled():
            return _Streamed.apply(self, self._anchor, x)
        return _dist.guard("streaming the weights for a forward pass",
                           lambda: self.engine.forward(x, self._inputs(x)))

    def forward_train(self, x: Tensor) -> tuple[Tensor, dict[str, Any]]:
        return _dist.guard("streaming the weights for a forward pass",
                           lambda: self.engine.forward_train(x, self._inputs(x)))

    # ---- backward ----
    def _begin_gradients(self) -> None:
        if self.grads_pending:
            if self.mx is not None and self.mx.policy == "eager":
                raise ConfigError("a second backward before optimizer.step(): with weight streaming, MemoryX "
                                  "updates each unit as its gradients arrive; call optimizer.step() after every "
                                  "backward (or accumulate inside one batch)")
            return
        if self.optimizer is None:
            raise ConfigError("backward on a weight-streamed model needs an optimizer: build a cstorch.optim "
                              "optimizer over model.parameters() before the first step")
        if self.mx is not None:
            self.mx.max_gradient_norm = self.max_gradient_norm
            self.mx.scaler = self.scaler.loss_scaler if self.scaler is not None else None
            self.mx.policy = "deferred" if (self.max_gradient_norm or self.scaler is not None) else "eager"
            # each group's rate as the user's scheduler set it (MemoryX's groups are the optimizer's, in order)
            self.mx.begin_step([g["lr"] or 0.0 for g in self.optimizer.param_groups])  # (None: relative_step)
        self.grads_pending = True

    def backward(self, saved: dict[str, Any], out: Tensor, grad: Tensor) -> Tensor | None:
        self._begin_gradients()
        return _dist.guard("streaming the weights and gradients of a backward pass",
                           lambda: self.engine.backward(saved, out, grad))

    # ---- the optimizer step (called by the bound optimizer) ----
    def finish_step(self) -> None:
        """Wait for the gradients, then (rank 0) let MemoryX clip, unscale and update."""
        if not self.grads_pending:
            return
        _dist.guard("reducing the gradients", self.engine.wait_pushes)
        self.grads_pending = False
        self.steps += 1
        if self.mx is not None:
            self.last_grad_norm, _skipped = self.mx.end_backward()

    def close(self) -> None:
        self.synchronize()
        self.engine.close()
        self.link.close()
        if self.mx is not None:
            self.mx.close()
