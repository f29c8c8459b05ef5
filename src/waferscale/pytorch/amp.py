"""`cstorch.amp`: the half dtype, loss scaling, and the one-call optimizer step.

With weight streaming the same calls drive MemoryX: weights stream in the half dtype over fp32 masters,
and the loss scale, the overflow check, the unscale and the clipping happen there."""

from __future__ import annotations

from typing import Any

import torch

from waferscale.errors import ConfigError
from waferscale.pytorch import context
from waferscale.runtime.loss_scale import LossScaler
from waferscale.util import dtypes

__all__ = ["set_half_dtype", "get_half_dtype", "half_dtype", "GradScaler", "optimizer_step"]

def set_half_dtype(value: str | torch.dtype | None) -> None:
    """"float16", "bfloat16" or "cbfloat16" (computed as bfloat16 here); None or "float32" for full precision."""
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if value is not None and value != "float32" and value not in dtypes.HALF_DTYPES:
        raise ConfigError(f"half dtype {value!r} is not one of {', '.join(dtypes.HALF_DTYPES)}")
    context.current().half = dtypes.half_dtype(value)


def half_dtype() -> torch.dtype | None:
    return context.current().half


get_half_dtype = half_dtype


class GradScaler:
    """Loss scaling: `loss_scale="dynamic"` (halve on overflow and skip the step, double after
    `steps_per_increase` clean steps) or a fixed number. `max_gradient_norm`: the unscaled gradients' global norm
    is clipped to it before the step (as Cerebras' GradScaler does); with weight streaming MemoryX clips, which
    `optimizer_step` arranges. Any other argument is a TypeError, not silently ignored."""

    def __init__(self, loss_scale: float | str = "dynamic", init_scale: float | None = None,
                 steps_per_increase: int = 2000, min_loss_scale: float | None = None,
                 max_loss_scale: float | None = None, max_gradient_norm: float | None = None) -> None:
        if max_gradient_norm is not None and not max_gradient_norm > 0:
            raise ConfigError(f"max_gradient_norm must be positive, got {max_gradient_norm}")
        self.max_gradient_norm = max_gradient_norm
        if loss_scale == "dynamic":
            self.loss_scaler = LossScaler(init_scale or 2.0 ** 15, steps_per_increase)
        elif isinstance(loss_scale, (int, float)) and loss_scale > 0:
            self.loss_scaler = LossScaler(float(loss_scale), 2 ** 31 - 1)
        else:
            raise ConfigError(f'loss_scale must be "dynamic" or a positive number, got {loss_scale!r}')
        self.min_loss_scale, self.max_loss_scale = min_loss_scale, max_loss_scale
        self._found_inf: bool | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scaler.scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if getattr(optimizer, "_stream", None) is not None:
            return  # MemoryX unscales
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        inv = 1.0 / self.loss_scaler.scale
        with torch.no_grad():
            for gr in grads:
                gr.mul_(inv)
        self._found_inf = not all(bool(torch.isfinite(gr).all()) for gr in grads)
        if self.max_gradient_norm and not self._found_inf:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.max_gradient_norm)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        stream = getattr(optimizer, "_stream", None)
        if stream is not None:
            if self.max_gradient_norm and getattr(stream, "max_gradient_norm", None) != self.max_gradient_norm:
                raise ConfigError("GradScaler(max_gradient_norm=...) with weight streaming: MemoryX clips, and it "
                                  "must know before backward; use cstorch.amp.optimizer_step(loss, optimizer, "
                                  "grad_scaler) for the step")
            optimizer.step()
            return
        if self._found_inf is None:
            self.unscale_(optimizer)
        if not self._found_inf:
            optimizer.step()

    def update(self) -> None:
        if self._found_inf is not None:  # (with streaming MemoryX has updated the scale)
            self.loss_scaler.update(self._found_inf)
            self._found_inf = None
        s = self.loss_scaler
        if self.min_loss_scale is not None:
            s.scale = max(s.scale, self.min_loss_scale)
        if self.max_loss_scale is not None:
            s.scale = min(s.scale, self.max_loss_scale)

    def state_dict(self) -> dict[str, Any]:
        return self.loss_scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_scaler.load_state_dict(state)


def optimizer_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, grad_scaler: GradScaler | None = None,
                   max_gradient_norm: float | None = None) -> None:
    """backward, (unscale,) clip the global gradient norm, step, zero the gradients."""
    if max_gradient_norm is not None and max_gradient_norm <= 0:
        raise ConfigError(f"max_gradient_norm must be positive, got {max_gradient_norm}")
    if max_gradient_norm is None and grad_scaler is not None:
        max_gradient_norm = grad_scaler.max_gradient_norm  # (the scaler's own, as Cerebras' GradScaler takes it)
    stream = getattr(optimizer, "_stream", None)
    if stream is not None and not stream.grads_pending:  # MemoryX clips and unscales: tell it before backward
        stream.max_gradient_norm, stream.scaler = max_gradient_norm, grad_scaler
    (grad_scaler.scale(loss) if grad_scaler else loss).backward()
    if stream is not None:
        optimizer.step()
        if grad_scaler is not None:
            grad_scaler.update()
        return
    if grad_scaler is not None:
        grad_scaler.unscale_(optimizer)  # (clips to the scaler's max_gradient_norm when it has one)
    if max_gradient_norm and (grad_scaler is None or max_gradient_norm != grad_scaler.max_gradient_norm):
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_gradient_norm)
    if grad_scaler is not None:
        grad_scaler.step(optimizer)
        grad_scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad()
