"""`cstorch.compile(model, backend)`: the callable that stands in for the model.

On "CPU"/"GPU" the model runs as it is, resident on that device. On "CSX" it runs by weight streaming:

    units      the model's streamable pieces, run one after another: `model.units()` where the model has it
               (every zoo model: embedding, each block, head), the children of an nn.Sequential, else the
               whole model as one unit. Define `units()` on your own model to stream it block by block.
    MemoryX    takes the fp32 weights (the model's parameters then alias its masters, so `model.state_dict()`
               is always the trained weights) and the optimizer state, and runs the update
    forward    unit u+1's weights are fetched while unit u computes; only unit-boundary activations are kept
    backward   in reverse, each unit's weights fetched again and its forward recomputed; its gradients go to
               MemoryX as soon as they are complete, where (without clipping or loss scaling) the update of
               that unit runs while the backward pass goes on

The optimizer is bound on the first call: the cstorch optimizer built over these parameters supplies the
hyperparameters, and its `step()` then completes MemoryX's update.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor, nn

from waferscale.errors import ConfigError
from waferscale.pytorch import amp as _amp
from waferscale.pytorch import distributed as _dist
from waferscale.pytorch.backend import Backend
from waferscale.runtime.memoryx import Lane, MemoryX, build_layouts
from waferscale.runtime.streaming import DeviceUnit as _Unit
from waferscale.runtime.streaming import _rng_restored, _rng_state

__all__ = ["CompiledModel", "compile", "model_units"]


def model_units(model: nn.Module) -> list[nn.Module]:
    """The pieces weight streaming runs one after another (see the module docstring)."""
    if hasattr(model, "units") and callable(model.units):
        return list(model.units())
    if isinstance(model, nn.Sequential) and len(model) > 0:
        return list(model)
    return [model]


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
        if not backend.is_csx:
            model.to(self.device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.backend.compile_only:
            raise ConfigError("this backend was made with compile_only=True: it compiles, it does not run steps")
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

    def units(self) -> list[nn.Module]:
        return model_units(self.model)

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
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        gx = ctx.runner.backward(ctx.saved, grad)
        ctx.saved = None
        return None, None, gx


class StreamRunner:
    """Weight streaming of one model: MemoryX on rank 0, the unit schedule on every system."""

    def __init__(self, model: nn.Module, backend: Backend, half: torch.dtype | None) -> None:
        from waferscale.pytorch.optim import find_optimizer, memoryx_optimizer_params

        self.model, self.backend, self.device, self.half = model, backend, backend.device, half
        self.units = model_units(model)
        covered = {id(p) for u in self.units for p in u.parameters()}
        missing = [n for n, p in model.named_parameters() if id(p) not in covered]
        if missing:
            raise ConfigError(f"the model's units() leave out parameters ({', '.join(missing[:3])}); every "
                              f"parameter must belong to a unit")
        self.optimizer = find_optimizer(model)
        self.layouts = build_layouts(model, self.units)
        self.n = len(self.units)
        stream_dtype = half or torch.float32
        self.mx: MemoryX | None = None
        if _dist.is_master():
            opt_params, vector_decay = memoryx_optimizer_params(self.optimizer, model)
            mib = lambda v: int(v * 2**20) if v is not None else None  # noqa: E731
            self.mx = MemoryX(model, opt_params, stream_dtype=stream_dtype, units=self.units,
                              ram_budget_bytes=mib(backend.memoryx_ram_mb), flash_dir=backend.flash_dir,
                              pin_memory=self.device.type == "cuda")
            if vector_decay:
                for opt in self.mx.optimizers:
                    for g in opt.param_groups if opt is not None else []:
                        g["weight_decay"] = vector_decay if g["name"] == "no_decay" else g["weight_decay"]
        self._alias_parameters()
        for buf_owner in model.modules():  # buffers (rope tables, norms' statistics) live on the device
            for k, b in list(buf_owner._buffers.items()):
                if b is not None:
                    buf_owner._buffers[k] = b.to(self.device)
        if _dist.world_size() > 1:
            self.link: Any = _dist.SwarmLink(self.mx, self.layouts, stream_dtype, self.device)
        else:
            from waferscale.runtime.streaming import LocalLink

            assert self.mx is not None
            self.link = LocalLink(self.mx, self.device)
        self._check_budget(stream_dtype)
        self._prefetch = Lane("weight-prefetch")
        self._queue: deque[Future] = deque()
        self._anchor = torch.empty(0, requires_grad=True)
        self._dropout = [any(isinstance(m, nn.Dropout) and m.p > 0 for m in unit.modules()) for unit in self.units]
        self._pending: list[Future] = []
        self.grads_pending = False  # gradients pushed since the last optimizer step
        self.max_gradient_norm: float | None = None
        self.scaler: Any = None
        self.last_grad_norm: float | None = None
        self.stats = {"wait_weights_s": 0.0, "bytes_in": 0, "bytes_out": 0, "steps": 0}
        self.peak_device_bytes = 0
        if self.optimizer is not None:
            self.optimizer._bind_stream(self)

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

    def _check_budget(self, stream_dtype: torch.dtype) -> None:
        mb = self.backend.device_memory_mb
        if mb is None:
            return
        item = torch.empty(0, dtype=stream_dtype).element_size()
        two = sorted((lay.payload_bytes(item) for lay in self.layouts), reverse=True)[:2]
        if sum(two) > mb * 2**20:
            raise ConfigError(f"device_memory_mb {mb:g} is a budget smaller than two units' weights "
                              f"({sum(two) / 2**20:,.1f} MiB): raise it, or split the model into more units")

    def synchronize(self) -> None:
        for f in self._pending:
            f.result()
        self._pending = []
        if self.mx is not None:
            self.mx.synchronize()

    # ---- fetching ----
    def _fetch(self, u: int) -> _Unit:
        big, small = self.link.fetch(u)
        return _Unit(u, self.layouts[u], big, small)

    def _enqueue(self, order: list[int]) -> None:
        for u in order:
            self._queue.append(self._prefetch.submit(self._fetch, u))

    def _next(self) -> _Unit:
        t0 = time.perf_counter()
        unit = self._queue.popleft().result()
        self.stats["wait_weights_s"] += time.perf_counter() - t0
        self.stats["bytes_in"] += unit.nbytes
        return unit

    def _drain(self) -> None:
        while self._queue:
            self._queue.popleft().result()

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.half) if self.half else contextlib.nullcontext()

    def _note_peak(self, *tensors: Tensor, held: int = 0) -> None:
        self.peak_device_bytes = max(self.peak_device_bytes, held + sum(t.numel() * t.element_size()
                                                                        for t in tensors if t is not None))

    # ---- forward ----
    def __call__(self, x: Tensor) -> Tensor:
        x = x.to(self.device)
        if torch.is_grad_enabled():
            return _Streamed.apply(self, self._anchor, x)
        return self.forward_eval(x)

    def forward_eval(self, x: Tensor) -> Tensor:
        self._drain()
        self._enqueue(list(range(self.n)))
        h = x
        for u in range(self.n):
            unit = self._next()
            with torch.no_grad(), self._autocast():
                h = torch.func.functional_call(self.units[u], unit.views, (h,))
            self._note_peak(h, held=2 * unit.nbytes)
        return h

    def forward_train(self, x: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """No graph except the last unit's; returns its output and what backward needs."""
        self._drain()
        n = self.n
        self._enqueue(list(range(n)))
        acts: list[Tensor] = [x]
        rng: dict[int, Any] = {}
        h = x
        last: dict[str, Any] = {}
        for u in range(n):
            unit = self._next()
            if u == n - 1:
                self._enqueue(list(range(n - 2, -1, -1)))  # backward's weights start arriving now
            if self._dropout[u]:
                rng[u] = _rng_state(self.device)
            if u < n - 1:
                with torch.no_grad(), self._autocast():
                    h = torch.func.functional_call(self.units[u], unit.views, (h,))
                acts.append(h)
            else:  # the last unit keeps its graph: backward starts from it without a second fetch
                with torch.enable_grad(), self._autocast():
                    xin = h.detach().requires_grad_(h.is_floating_point())
                    params = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in unit.views.items()}
                    h = torch.func.functional_call(self.units[u], params, (xin,))
                last = {"unit": unit, "x": xin, "params": params, "out": h}
            self._note_peak(*acts, h, held=2 * unit.nbytes)
        return h.detach(), {"acts": acts, "rng": rng, "last": last}

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
            self.mx.begin_step(self.optimizer.param_groups[0]["lr"])
        self.grads_pending = True

    def _push(self, u: int, grads: dict[str, Tensor | None]) -> None:
        lay = self.layouts[u]
        big = torch.zeros(lay.n_big, dtype=torch.float32, device=self.device)
        small = torch.zeros(lay.n_small, dtype=torch.float32, device=self.device)
        for e in lay.entries:
            g = grads.get(e.local)
            if g is not None:
                (big if e.half else small)[e.payload_offset:e.payload_offset + e.numel].copy_(g.reshape(-1))
        self.stats["bytes_out"] += big.numel() * 4 + small.numel() * 4
        self._pending.append(self.link.push(u, big, small))

    def backward(self, saved: dict[str, Any], grad: Tensor) -> Tensor | None:
        self._begin_gradients()
        acts, rng, last = saved["acts"], saved["rng"], saved["last"]
        n = self.n
        # the last unit: its graph was kept
        names = list(last["params"])
        inputs = ([last["x"]] if last["x"].requires_grad else []) + [last["params"][k] for k in names]
        got = torch.autograd.grad(last["out"], inputs, grad, allow_unused=True)
        g = got[0] if last["x"].requires_grad else None
        self._push(n - 1, dict(zip(names, got[-len(names):])))
        del last, got
        for u in range(n - 2, -1, -1):
            unit = self._next()
            x = acts[u]
            with torch.enable_grad(), self._autocast(), _rng_restored(rng.get(u), self.device):
                xin = x.detach().requires_grad_(x.is_floating_point() and u > 0)
                params = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in unit.views.items()}
                out = torch.func.functional_call(self.units[u], params, (xin,))
            names = list(params)
            inputs = ([xin] if xin.requires_grad else []) + [params[k] for k in names]
            got = torch.autograd.grad(out, inputs, g, allow_unused=True)
            self._note_peak(*acts[: u + 1], out, g, held=2 * unit.nbytes)
            g = got[0] if xin.requires_grad else None
            self._push(u, dict(zip(names, got[-len(names):])))
            acts[u + 1] = None  # type: ignore[call-overload]
            del out, got, params
        return g if acts[0].is_floating_point() and acts[0].requires_grad else None

    # ---- the optimizer step (called by the bound optimizer) ----
    def finish_step(self) -> tuple[float | None, bool]:
        """Wait for the gradients, then (rank 0) let MemoryX clip, unscale and update."""
        if not self.grads_pending:
            return None, False
        for f in self._pending:
            f.result()
        self._pending = []
        self.grads_pending = False
        self.stats["steps"] += 1
        if self.mx is None:
            return None, False
        norm, skipped = self.mx.end_backward()
        self.last_grad_norm = norm
        return norm, skipped

    def close(self) -> None:
        self.synchronize()
        self._drain()
        self._prefetch.close()
        if isinstance(self.link, _dist.SwarmLink):
            self.link.close()
        if self.mx is not None:
            self.mx.close()
