"""The runtime interface: an Executor runs one training step of a model on the hardware at hand (the zoo
runner owns the loop and never looks inside one). `ResidentExecutor` keeps the whole model, its gradients and
optimizer state on the device; the streaming executors hold the weights in MemoryX."""

from __future__ import annotations

import contextlib
import math
import resource
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from waferscale.errors import CheckpointError, ConfigError
from waferscale.models.layers import CausalLM
from waferscale.runtime import checkpoint
from waferscale.runtime.loss_scale import LossScaler
from waferscale.runtime.optim import set_lr
from waferscale.util.dtypes import half_dtype as torch_half_dtype


@dataclass
class StepResult:
    """What one training step reports. `loss` is the mean over the step's tokens (all micro-batches)."""

    loss: float
    tokens: int
    grad_norm: float | None = None
    skipped: bool = False  # fp16 overflow: the update was skipped and the loss scale lowered
    stats: dict[str, Any] | None = None  # executor-specific per-step figures (streaming: waits, bytes, ...)


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but no CUDA device is available; use --device cpu")
    return torch.device(name)


def device_budget(device: torch.device, device_memory_bytes: int | None) -> int | None:
    """The device memory budget: --device_memory_mb, else on CUDA the GPU's memory, else none (a CPU host)."""
    if device_memory_bytes is None and device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return device_memory_bytes


def check_loss(loss: float, skipped: bool) -> None:
    """A step's loss must be finite, unless fp16 overflow skipped the update (the loss scale is lowered)."""
    if not math.isfinite(loss) and not skipped:
        raise FloatingPointError(f"training loss became {loss}; lower the learning rate or enable "
                                 f"gradient clipping (optimizer.max_gradient_norm)")


class Executor(ABC):
    name: str = "executor"
    sparsity: Any = None  # the waferscale.sparse Group whose masks this run applies, if any

    @abstractmethod
    def train_step(self, x: Tensor, y: Tensor, lr: float) -> StepResult:
        """One optimizer step on the global (per-worker) batch x, y: (B, T) token ids."""

    @abstractmethod
    def eval_loss(self, x: Tensor, y: Tensor) -> float:
        """Mean loss on one batch, no gradients."""

    @abstractmethod
    def model_for_checkpoint(self) -> torch.nn.Module | dict[str, Tensor]:
        """A module whose state dict holds the current fp32 weights, or that state dict."""

    @abstractmethod
    def optimizer_state(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_optimizer_state(self, state: dict[str, Any]) -> None: ...

    @abstractmethod
    def peak_device_bytes(self) -> int: ...

    def summary(self) -> dict[str, Any]:
        return {}

    def load_model_weights(self, weights: dict[str, Tensor], where: str) -> None:
        """Copy checkpoint weights in (refusing another architecture)."""
        checkpoint.load_model_weights(self.model_for_checkpoint(), weights, where)

    def close(self) -> None:
        """Finish pending work (asynchronous updates, worker processes)."""


class ResidentExecutor(Executor):
    """The whole model lives on one device; mixed precision by autocast; accumulation over micro-batches."""

    name = "resident"

    def __init__(self, model: CausalLM, optimizer: torch.optim.Optimizer, *, device: torch.device,
                 half_dtype: str | None = None, micro_batch_size: int | None = None,
                 max_gradient_norm: float | None = None, loss_scaling_factor: float | str = 1.0) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.half = torch_half_dtype(half_dtype)
        self.micro_batch_size, self.max_gradient_norm = micro_batch_size, max_gradient_norm
        self.scaler: torch.amp.GradScaler | None = None
        if self.half == torch.float16:  # bf16 has fp32's range and needs no loss scaling
            rule = LossScaler.from_config(loss_scaling_factor)
            self.scaler = torch.amp.GradScaler(device.type, init_scale=rule.scale, growth_interval=rule.growth_interval)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.half is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.half)

    def train_step(self, x: Tensor, y: Tensor, lr: float) -> StepResult:
        set_lr(self.optimizer, lr)
        self.model.train()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        mb = self.micro_batch_size or x.shape[0]
        n_micro = x.shape[0] // mb
        total = torch.zeros((), device=self.device)
        for xs, ys in zip(x.split(mb), y.split(mb)):  # gradient accumulation: each carries 1/n of the mean loss
            with self._autocast():
                logits, aux = self.model.forward_aux(xs)  # aux: a mixture of experts' load balancing, per micro-batch
                loss = self.model.loss(logits, ys)
                loss = (loss if aux is None else loss + aux) / n_micro
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = None
        if self.max_gradient_norm:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_gradient_norm))
        skipped = False
        if self.scaler:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_value = float(total)
        check_loss(loss_value, skipped)
        return StepResult(loss=loss_value, tokens=y.numel(), grad_norm=grad_norm, skipped=skipped)

    @torch.no_grad()
    def eval_loss(self, x: Tensor, y: Tensor) -> float:
        self.model.eval()
        x, y = x.to(self.device), y.to(self.device)
        with self._autocast():
            return float(self.model.loss(self.model.forward_aux(x)[0], y))  # the units' output, as training's

    def model_for_checkpoint(self) -> torch.nn.Module:
        return self.model

    def optimizer_state(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        if self.scaler is not None:
            state = {**state, "grad_scaler": self.scaler.state_dict()}
        return state

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        scaler = state.pop("grad_scaler", None)
        given = [len(g["params"]) for g in state.get("param_groups", [])]
        sizes = [len(g["params"]) for g in self.optimizer.param_groups]
        if given != sizes:  # (torch refuses too, without saying why)
            raise CheckpointError(f"the optimizer state's param groups hold {given} parameters, this run's {sizes}: "
                                  f"it was grouped otherwise (another weight-decay split or other "
                                  f"optimizer.adjust_learning_rate groups); load its weights only, or resume with "
                                  f"the grouping it was written with")
        self.optimizer.load_state_dict(state)
        if scaler is not None and self.scaler is not None:
            self.scaler.load_state_dict(scaler)

    def peak_device_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the host's peak RSS (Linux: KiB)


# ---- choosing and building an executor -----------------------------------------------------------------

def choose_execution(execution: str, *, num_params: int, optimizer_type: str, momentum: float,
                     device: torch.device, device_memory_bytes: int | None, num_csx: int = 1) -> tuple[str, str]:
    """("resident" | "streaming", why). auto: resident when weights + gradients + optimizer state fit the device
    budget (--device_memory_mb; on CUDA the GPU's memory; on a CPU without a budget, always), else streaming.
    Several systems (--num_csx > 1) always stream: MemoryX holds the weights and SwarmX feeds every system."""
    from waferscale.runtime.memoryx import state_bytes_per_param

    need = num_params * state_bytes_per_param(optimizer_type, momentum)  # fp32 weights, gradients, optimizer state
    if num_csx > 1:
        if execution == "resident":
            raise ConfigError(f"--num_csx {num_csx} runs data-parallel through SwarmX with weight streaming; "
                              f"use --execution streaming or auto")
        return "streaming", f"--num_csx {num_csx}: weights stream from MemoryX through SwarmX"
    if execution != "auto":
        return execution, f"--execution {execution}"
    budget = device_budget(device, device_memory_bytes)
    if budget is None:
        return "resident", "auto: no device memory budget on a CPU host"
    fits = need <= budget
    return ("resident" if fits else "streaming",
            f"auto: weights + gradients + optimizer state ({need / 2**20:,.0f} MiB) {'fit' if fits else 'exceed'} "
            f"the device budget ({budget / 2**20:,.0f} MiB)")
