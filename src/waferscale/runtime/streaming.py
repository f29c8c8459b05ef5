"""Weight streaming of a zoo language model on one system: the executor `wsc run --execution streaming` drives.

Around the streaming engine's schedule (`runtime/engine.py`): a skeleton model with meta parameters, the
device-memory plan (under recompute="auto", keep every unit's graph when the budget holds them all), the per-step
figures (no-stall condition) and the Executor interface, checkpoints through MemoryX.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from waferscale.errors import ConfigError
from waferscale.models.layers import CausalLM
from waferscale.models.registry import build
from waferscale.runtime.engine import StreamingEngine, fetch_order
from waferscale.runtime.executor import Executor, StepResult, check_loss, device_budget
from waferscale.runtime.links import LocalLink
from waferscale.runtime.layout import UnitLayout
from waferscale.runtime.memoryx import MemoryX
from waferscale.runtime.trace import Tracer
from waferscale.util.dtypes import half_dtype as torch_half_dtype

__all__ = ["StreamingExecutor", "MemoryXExecutor", "build_skeleton", "lm_engine", "plan_device_memory",
           "MemoryPlan", "step_observability"]


def build_skeleton(cfg: Any, device: torch.device | str = "cpu") -> CausalLM:
    """The model with meta parameters (no weight memory) and real buffers on `device`."""
    model = build(cfg, device="meta")
    model.init_buffers(device)
    return model


def lm_engine(skeleton: CausalLM, link: Any, layouts: list[UnitLayout], *, device: torch.device,
              half: torch.dtype | None, recompute: bool) -> StreamingEngine:
    """The streaming engine over a zoo LM's units, with the loss fused into the head (plus the model's auxiliary
    loss, a mixture of experts' load balancing) and fp32 activations between units."""
    n = len(layouts)
    return StreamingEngine(skeleton.units(), layouts, link, device=device, half=half, recompute=recompute,
                           loss_fn=skeleton.loss, float_boundaries=True, track_rng=[skeleton.config.dropout > 0] * n,
                           aux_fn=skeleton.aux_loss)


# ---- memory plan: does one unit fit; do all units' activations fit (no recompute) -------------------------

@dataclass
class MemoryPlan:
    weights: int  # two units' payloads at most
    grads: int  # fp32 gradient buffers: the unit accumulating and the one being written out
    boundary: int  # unit-boundary activations of the whole batch (and their gradients)
    saved_one: int  # largest one-unit, one-micro-batch autograd state
    saved_all: int  # every unit's autograd state for every micro-batch (keeping graphs, no recompute)

    @property
    def with_recompute(self) -> int:
        return self.weights + self.grads + self.boundary + self.saved_one

    @property
    def without_recompute(self) -> int:
        return self.weights + self.grads + self.boundary + self.saved_all

    def describe(self, need: int) -> str:
        mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
        return (f"{mib(need)} (weights {mib(self.weights)}, gradients {mib(self.grads)}, boundary activations "
                f"{mib(self.boundary)}, one unit's activations {mib(self.saved_one)})")


def _saved_bytes_meta(unit: nn.Module, lay: UnitLayout, x: Tensor, half: torch.dtype | None,
                      device_type: str, loss_target: Tensor | None, loss_fn: Any) -> int:
    """Bytes autograd saves running `unit` once (meta tensors: shapes only), weights excluded."""
    weights = {e.local: torch.empty(e.shape, device="meta", dtype=(half if (half and e.matrix) else torch.float32),
                                    requires_grad=True) for e in lay.entries}
    wids = {id(w) for w in weights.values()}
    weights.update({n: b.to("meta") for n, b in unit.named_buffers()})
    total = [0]

    def pack(t: Tensor) -> Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in wids and id(t) not in wids and t is not x:
            total[0] += t.nbytes
        return t

    ctx = torch.autocast(device_type, dtype=half) if half else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        out = torch.func.functional_call(unit, weights, (x,))
        if loss_target is not None:
            loss_fn(out, loss_target)
    return total[0]


def plan_device_memory(skeleton: CausalLM, layouts: list[UnitLayout], *, batch: int, micro_batch: int,
                       seq_len: int, half: torch.dtype | None, device_type: str = "cpu") -> MemoryPlan:
    """The executor's device working set, from shapes (a meta-device dry run of the embedding, one block and
    the head)."""
    units = skeleton.units()
    n = len(units)  # embedding, n_layer >= 1 blocks, head
    order = fetch_order(n)
    pay = [lay.payload_bytes(half.itemsize if half else 4) for lay in layouts]
    weights = max(pay[a] + pay[b] for a, b in zip(order, order[1:]))
    gbytes = [lay.payload_bytes(4) for lay in layouts]  # fp32
    grads = max(gbytes[a] + gbytes[b] for a, b in zip(order, order[1:]))
    C = skeleton.config.d_model
    act = batch * seq_len * C * 4
    boundary = batch * seq_len * 8 + (n - 1) * act + 2 * act  # token ids, n-1 boundaries, 2 gradient buffers
    mb_ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    mb_act = torch.empty(micro_batch, seq_len, C, device="meta", requires_grad=True)
    per_unit = {u: _saved_bytes_meta(units[u], layouts[u], mb_ids if u == 0 else mb_act, half, device_type,
                                     mb_ids if u == n - 1 else None, skeleton.loss) for u in (0, 1, n - 1)}
    saved = [per_unit[0]] + [per_unit[1]] * (n - 2) + [per_unit[n - 1]]
    n_mb = batch // micro_batch
    saved_all = sum(saved[:-1]) * n_mb + saved[-1]  # the head runs forward and backward together
    return MemoryPlan(weights, grads, boundary, max(saved), saved_all)


# ---- the executor ---------------------------------------------------------------------------------------------

def step_observability(stats: dict[str, float], *, step_s: float, tokens: int, flops: float,
                       weight_params: int) -> dict[str, Any]:
    """Per-step figures for metrics.jsonl. The no-stall condition (WSE.md): weights stream twice per step, so a
    step hides the stream behind compute when tokens >= (b/3) * F / BW per 6 FLOP/param/token, with b the
    bytes per streamed weight, F the achieved compute rate and BW the achieved streaming bandwidth."""
    bw = stats["bytes_in"] / stats["fetch_busy_s"] if stats.get("fetch_busy_s") else float("inf")
    b = stats["bytes_in"] / max(1, 2 * weight_params)  # bytes per streamed weight (two streams per step)
    f = flops / max(stats.get("compute_s", 0.0), 1e-9)
    needed = (b / 3) * f / bw if math.isfinite(bw) else 0.0
    out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in stats.items()}
    out.update({"stream_bandwidth_Bps": bw if math.isfinite(bw) else None,
                "no_stall_tokens_needed": math.ceil(needed), "no_stall": tokens >= needed,
                "stall_fraction": stats.get("wait_weights_s", 0.0) / max(step_s, 1e-9)})
    return out


class MemoryXExecutor(Executor):
    """An executor whose weights and optimizer state live in MemoryX (`self.mx`): checkpoints go through it."""

    mx: MemoryX

    def model_for_checkpoint(self) -> dict[str, Tensor]:
        return self.mx.checkpoint_state()

    def load_model_weights(self, weights: dict[str, Tensor], where: str) -> None:
        self.mx.load_weights(weights, where)

    def optimizer_state(self) -> dict[str, Any]:
        return self.mx.optimizer_state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.mx.load_optimizer_state_dict(state)


class StreamingExecutor(MemoryXExecutor):
    """Weight streaming on one device: MemoryX in host memory, units streamed through a `StreamingEngine`."""

    name = "streaming"

    def __init__(self, skeleton: CausalLM, memoryx: MemoryX, *, device: torch.device,
                 half_dtype: str | None = None, micro_batch_size: int | None = None,
                 device_memory_bytes: int | None = None, recompute: bool | str = "auto") -> None:
        self.skeleton, self.mx, self.device = skeleton, memoryx, device
        self.half = torch_half_dtype(half_dtype)
        self.micro_batch_size, self.device_memory_bytes = micro_batch_size, device_memory_bytes
        self.recompute_option = recompute
        self.engine: StreamingEngine | None = None
        self._planned_for: tuple[int, int] | None = None
        self._trace_path: Path | None = None
        self._weight_params = sum(lay.numel for lay in memoryx.layouts)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    # planning happens on the first batch (its shape decides the activations)
    def _ensure_engine(self, batch: int, seq_len: int) -> StreamingEngine:
        if self.engine is not None and self._planned_for == (batch, seq_len):
            return self.engine
        mb = self.micro_batch_size or batch
        plan = plan_device_memory(self.skeleton, self.mx.layouts, batch=batch, micro_batch=min(mb, batch),
                                  seq_len=seq_len, half=self.half, device_type=self.device.type)
        budget = device_budget(self.device, self.device_memory_bytes)
        if budget is not None and plan.with_recompute > budget:
            raise ConfigError(f"--device_memory_mb {budget / 2**20:,.0f} is a budget smaller than one unit: "
                              f"streaming needs at least {plan.describe(plan.with_recompute)}; raise the budget "
                              f"or lower micro_batch_size / batch_size")
        rc = self.recompute_option
        recompute = (budget is not None and plan.without_recompute > budget) if rc == "auto" else bool(rc)
        if self.engine is None:
            self.engine = lm_engine(self.skeleton, LocalLink(self.mx, self.device), self.mx.layouts,
                                    device=self.device, half=self.half, recompute=recompute)
        self.engine.recompute = recompute
        self._planned_for = (batch, seq_len)
        return self.engine

    def set_trace(self, path: str | Path) -> None:
        """Write a Chrome trace of the next train_step to `path`."""
        self._trace_path = Path(path)

    def train_step(self, x: Tensor, y: Tensor, lr: float) -> StepResult:
        B, T = x.shape
        mb = self.micro_batch_size or B
        if B % mb:
            raise ConfigError(f"micro_batch_size {mb} does not divide the batch of {B}")
        eng = self._ensure_engine(B, T)
        tracer = Tracer() if self._trace_path else None
        eng.tracer = tracer
        eng.reset_stats()
        eng.link.take_stats()
        self.mx.take_stats()
        t0 = time.perf_counter()
        self.mx.begin_step(lr)
        scaler = self.mx.scaler
        loss = eng.step(x, y, micro_batch=mb, loss_divisor=B // mb, loss_scale=scaler.scale if scaler else 1.0)
        t_bwd = time.perf_counter()
        eng.wait_pushes()
        grad_norm, skipped = self.mx.end_backward()
        t1 = time.perf_counter()
        if tracer:
            tracer.span("main", "wait gradients / clip", t_bwd, t1)
            tracer.write(self._trace_path)
            self._trace_path, eng.tracer = None, None
        check_loss(loss, skipped)
        stats = self._observe(eng.stats, self.mx.take_stats(), t1 - t0, x.numel(), T)
        return StepResult(loss=loss, tokens=y.numel(), grad_norm=grad_norm, skipped=skipped, stats=stats)

    def _observe(self, es: dict[str, float], ms: dict[str, float], step_s: float, tokens: int, T: int
                 ) -> dict[str, Any]:
        s = {**es, **self.engine.link.take_stats()}  # (bytes_in/out: the dense payloads; streamed/reduced: moved)
        s["compute_s"] = max(0.0, step_s - s["wait_weights_s"] - s["push_s"])
        # bytes_in_place: of bytes_in, read where MemoryX keeps them (CPU device)
        s.update({k: ms[k] for k in ("grad_writeback_s", "optimizer_s", "bytes_in_place")})
        s["peak_device_bytes"] = self.peak_device_bytes()
        s["recompute"] = bool(self.engine and self.engine.recompute)
        flops = self.skeleton.config.flops_per_token(T, training=True) * tokens * (4 / 3 if s["recompute"] else 1)
        return step_observability(s, step_s=step_s, tokens=tokens, flops=flops, weight_params=self._weight_params)

    def eval_loss(self, x: Tensor, y: Tensor) -> float:
        eng = self._ensure_engine(*x.shape) if self.engine is None else self.engine
        self.mx.sync_masks()  # (masks drawn or weights loaded since the last step)
        return float(eng.forward(x.to(self.device), target=y.to(self.device)))

    def peak_device_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.engine.ledger.peak if self.engine else 0

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"memoryx_ram_bytes": self.mx.ram_bytes(), "memoryx_flash_bytes": self.mx.flash_bytes(),
                               "memoryx_units_on_flash": self.mx.units_on_flash(), "update_policy": self.mx.policy}
        if self.engine is not None:
            out["recompute"] = self.engine.recompute
            out["peak_device_by_kind"] = self.engine.ledger.peak_by_kind
        if self.device_memory_bytes is not None:
            out["device_memory_budget_bytes"] = self.device_memory_bytes
        return out

    def close(self) -> None:
        self.mx.synchronize()
        if self.engine is not None:
            self.engine.close()
            self.engine.link.close()
        self.mx.close()
