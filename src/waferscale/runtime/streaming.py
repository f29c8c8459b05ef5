"""Weight-streaming execution: the model's units visit the device one at a time, weights stream in from MemoryX,
gradients stream back out. The model stays pure: units run through `torch.func.functional_call` with streamed
tensors in place of their (meta) parameters.

One step, with n units (embed, blocks, head) and fetch order 0, 1, ..., n-1, n-2, ..., 0:

    forward   for u in 0..n-2: wait for unit u's weights (prefetched while u-1 computed), start fetching the
              next unit, run every micro-batch through u, keep only u's outputs (the unit-boundary activations)
    backward  for u in n-1..0: the same prefetch; recompute u's forward with autograd on (the head runs its
              forward here for the first time), backpropagate each micro-batch, accumulate weight gradients in
              fp32 on the device, hand them to the gradient sink (asynchronous) and drop the weights

The device holds at most two units' weights (the one computing, the one arriving), their fp32 gradient buffers,
the boundary activations and one unit's autograd state. When the device budget holds every unit's autograd state
(`recompute=False`, chosen by `plan_device_memory` under recompute="auto"), the forward keeps each unit's graph
instead of recomputing it; saved weights are then swapped for a key by saved-tensor hooks and re-fetched for the
backward, so the weights still leave the device after each unit.

Peak device working set: on CUDA, `torch.cuda.max_memory_allocated`. On a CPU "device" there is no separate
allocator, so the executor counts what it holds in device copies (the `DeviceLedger`): streamed weight buffers,
gradient buffers, boundary activations and their gradients, and every tensor autograd saves for backward (counted
once per storage through saved-tensor hooks). Temporaries that live inside a single op are not counted.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from waferscale.errors import ConfigError
from waferscale.models.layers import CausalLM, lm_loss
from waferscale.runtime.executor import HALF_DTYPES, Executor, StepResult
from waferscale.runtime.memoryx import Lane, MemoryX, UnitLayout, build_layouts

__all__ = ["StreamingExecutor", "StreamingEngine", "LocalLink", "DeviceLedger", "build_skeleton",
           "plan_device_memory", "MemoryPlan", "Tracer"]


# ---- a model whose parameters are on the meta device (buffers such as rotary frequencies stay real) ------

@contextlib.contextmanager
def _params_on_meta():
    orig = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        orig(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = orig  # type: ignore[method-assign]


def build_skeleton(cfg: Any, device: torch.device | str = "cpu") -> CausalLM:
    """The model with meta parameters (no weight memory) and real buffers on `device`."""
    from waferscale.models.registry import FAMILY_CLASSES

    with _params_on_meta():
        model = FAMILY_CLASSES[cfg.family](cfg)  # torch.empty parameters never touch their pages
    for mod in model.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = b.to(device)
    return model


# ---- device memory accounting --------------------------------------------------------------------------

class DeviceLedger:
    """Bytes the executor holds on the device, by kind, with the peak of their sum. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: dict[str, int] = {}
        self.total = 0
        self.peak = 0
        self.peak_by_kind: dict[str, int] = {}

    def alloc(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.current[kind] = self.current.get(kind, 0) + nbytes
            self.total += nbytes
            if self.total > self.peak:
                self.peak = self.total
                self.peak_by_kind = dict(self.current)

    def free(self, kind: str, nbytes: int) -> None:
        self.alloc(kind, -nbytes)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


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
                      device_type: str, loss_target: Tensor | None) -> int:
    """Bytes autograd saves running `unit` once (meta tensors: shapes only), weights excluded."""
    weights = {e.local: torch.empty(e.shape, device="meta", dtype=(half if (half and e.half) else torch.float32),
                                    requires_grad=True) for e in lay.entries}
    wids = {id(w) for w in weights.values()}
    weights.update({n: b.to("meta") for n, b in unit.named_buffers()})
    total = [0]

    def pack(t: Tensor) -> Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in wids and id(t) not in wids and t is not x:
            total[0] += _nbytes(t)
        return t

    ctx = torch.autocast(device_type, dtype=half) if half else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        out = torch.func.functional_call(unit, weights, (x,))
        if loss_target is not None:
            lm_loss(out, loss_target)
    return total[0]


def plan_device_memory(skeleton: CausalLM, layouts: list[UnitLayout], *, batch: int, micro_batch: int,
                       seq_len: int, half: torch.dtype | None, device_type: str = "cpu") -> MemoryPlan:
    """The executor's device working set, from shapes (a meta-device dry run of the embedding, one block and
    the head)."""
    units = skeleton.units()
    n = len(units)
    hb = torch.empty((), dtype=half).element_size() if half else 4
    pay = [lay.payload_bytes(hb) for lay in layouts]
    order = list(range(n)) + list(range(n - 2, -1, -1))
    weights = max(pay[a] + pay[b] for a, b in zip(order, order[1:])) if n > 1 else pay[0]
    gbytes = [4 * (lay.n_big + lay.n_small) for lay in layouts]
    grads = max(gbytes[a] + gbytes[b] for a, b in zip(order[::-1], order[::-1][1:])) if n > 1 else gbytes[0]
    C = skeleton.config.d_model
    act = batch * seq_len * C * 4
    boundary = batch * seq_len * 8 + (n - 1) * act + 2 * act  # token ids, n-1 boundaries, 2 gradient buffers
    mb_ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    mb_act = torch.empty(micro_batch, seq_len, C, device="meta", requires_grad=True)
    per_unit = {}
    for u in sorted({0, min(1, n - 1), n - 1}):
        x = mb_ids if u == 0 else mb_act
        per_unit[u] = _saved_bytes_meta(units[u], layouts[u], x, half, device_type,
                                        mb_ids if u == n - 1 else None)
    saved = [per_unit[0]] + [per_unit[min(1, n - 1)]] * (n - 2) + [per_unit[n - 1]]
    n_mb = batch // micro_batch
    saved_all = sum(saved[:-1]) * n_mb + saved[-1]  # the head runs forward and backward together
    return MemoryPlan(weights, grads, boundary, max(saved), saved_all)


# ---- Chrome trace ------------------------------------------------------------------------------------------

class Tracer:
    """Spans on named lanes (main / prefetch / memoryx), written as a Chrome/Perfetto trace."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}

    def span(self, lane: str, name: str, start: float, end: float, **args: Any) -> None:
        with self._lock:
            tid = self._tids.setdefault(lane, len(self._tids) + 1)
            self.events.append({"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": (start - self.t0) * 1e6,
                                "dur": (end - start) * 1e6, "args": args})

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
                for lane, tid in self._tids.items()]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}))
        tmp.replace(path)
        return path


# ---- streamed weights on the device --------------------------------------------------------------------------

class DeviceUnit:
    """One unit's weights on the device: two flat buffers and per-parameter views into them."""

    def __init__(self, u: int, lay: UnitLayout, big: Tensor, small: Tensor) -> None:
        self.u, self.big, self.small = u, big, small
        self.views = {e.local: (big if e.half else small)[e.payload_offset:e.payload_offset + e.numel].view(e.shape)
                      for e in lay.entries}
        self.ptrs = {p: k for k, p in ((0, big.untyped_storage().data_ptr() if big.numel() else 0),
                                       (1, small.untyped_storage().data_ptr() if small.numel() else 0)) if p}
        self.nbytes = _nbytes(big) + _nbytes(small)


class _StreamIn(torch.autograd.Function):
    """Marks streamed weights for autograd; their gradients go to the engine's per-unit fp32 accumulator.
    Holds no tensor, so a kept graph never pins a unit's weights on the device."""

    @staticmethod
    def forward(ctx: Any, engine: "StreamingEngine", u: int, anchor: Tensor, *params: Tensor) -> tuple[Tensor, ...]:
        ctx.engine, ctx.u = engine, u
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.engine._accumulate_weight_grads(ctx.u, grads)
        return (None, None, None, *([None] * len(grads)))


# ---- links: where weights come from and gradients go --------------------------------------------------------

class LocalLink:
    """MemoryX in this process. On CUDA: pinned staging, a copy stream per direction, events."""

    def __init__(self, memoryx: MemoryX, device: torch.device) -> None:
        self.mx, self.device = memoryx, device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
            self._writer = Lane("grad-writeback")

    def fetch(self, u: int) -> tuple[Tensor, Tensor]:
        if not self.cuda:  # the device is host memory: the masters themselves where they are the payload,
            return self.mx.fetch_view(u) or self.mx.fetch(u)  # else a copy (and cast) out of them
        lay = self.mx.layouts[u]
        hb = torch.empty(lay.n_big, dtype=self.mx.stream_dtype, pin_memory=True)
        hs = torch.empty(lay.n_small, dtype=torch.float32, pin_memory=True)
        self.mx.fetch(u, hb, hs)
        with torch.cuda.stream(self.h2d):
            big = hb.to(self.device, non_blocking=True)
            small = hs.to(self.device, non_blocking=True)
        self.h2d.synchronize()  # this runs on the prefetch thread; the pinned buffers may now go
        return big, small

    def push(self, u: int, big: Tensor, small: Tensor) -> Future:
        if not self.cuda:
            return self.mx.push_grads(u, big, small)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        hb = torch.empty(big.shape, dtype=big.dtype, pin_memory=True)
        hs = torch.empty(small.shape, dtype=small.dtype, pin_memory=True)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(ev)
            hb.copy_(big, non_blocking=True)
            hs.copy_(small, non_blocking=True)
            big.record_stream(self.d2h)
            small.record_stream(self.d2h)
            done = torch.cuda.Event()
            done.record(self.d2h)

        def hand_over() -> None:
            done.synchronize()
            self.mx.push_grads(u, hb, hs).result()

        return self._writer.submit(hand_over)


# ---- the engine: one step of forward/backward over streamed units -------------------------------------------

class StreamingEngine:
    """Runs the per-unit schedule on one device for one worker; weights come from `link.fetch(u)` (called on
    the prefetch lane, in fetch order) and gradients go to `link.push(u, big, small)` (fp32, payload layout)."""

    def __init__(self, skeleton: CausalLM, link: Any, *, device: torch.device, half: torch.dtype | None,
                 recompute: bool, layouts: list[UnitLayout] | None = None) -> None:
        self.units = skeleton.units()
        self.cfg = skeleton.config
        self.layouts = layouts or build_layouts(skeleton)
        self.n = len(self.units)
        self.link, self.device, self.half, self.recompute = link, device, half, recompute
        self.ledger = DeviceLedger()
        self._prefetch = Lane("weight-prefetch")
        self._anchor = torch.empty(0, device=device, requires_grad=True)
        self._acc: dict[int, tuple[Tensor, Tensor]] = {}
        self._bwd_unit: DeviceUnit | None = None
        self._pack_unit: DeviceUnit | None = None
        self._pack_count: dict[int, int] | None = None
        self._pack_exclude: int = 0
        self.tracer: Tracer | None = None
        self.stats: dict[str, float] = {}
        self.reset_stats()  # (an engine that only evaluates, as SwarmX's rank 0, never resets them itself)

    # ---- weights ----
    def _fetch_task(self, u: int) -> DeviceUnit:
        t0 = time.perf_counter()
        big, small = self.link.fetch(u)
        dev = DeviceUnit(u, self.layouts[u], big, small)
        self.ledger.alloc("weights", dev.nbytes)
        t1 = time.perf_counter()
        self.stats["fetch_busy_s"] += t1 - t0
        self.stats["bytes_in"] += dev.nbytes
        if self.tracer:
            self.tracer.span("prefetch", f"fetch unit {u}", t0, t1, bytes=dev.nbytes)
        return dev

    def _start_fetches(self, order: list[int]) -> None:
        self._order = deque(order)
        self._inflight: Future | None = self._prefetch.submit(self._fetch_task, self._order.popleft())

    def _next_unit(self) -> DeviceUnit:
        t0 = time.perf_counter()
        assert self._inflight is not None
        dev = self._inflight.result()
        t1 = time.perf_counter()
        self.stats["wait_weights_s"] += t1 - t0
        if self.tracer and t1 - t0 > 1e-5:
            self.tracer.span("main", f"wait unit {dev.u}", t0, t1)
        self._inflight = self._prefetch.submit(self._fetch_task, self._order.popleft()) if self._order else None
        if self.device.type == "cuda":
            dev.big.record_stream(torch.cuda.current_stream(self.device))
            dev.small.record_stream(torch.cuda.current_stream(self.device))
        return dev

    def _release(self, dev: DeviceUnit) -> None:
        self.ledger.free("weights", dev.nbytes)

    # ---- saved-tensor hooks: weights become keys; activations are counted ----
    def _pack(self, t: Tensor) -> Any:
        dev = self._pack_unit
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if dev is not None and ptr in dev.ptrs:
            return ("w", dev.u, dev.ptrs[ptr], tuple(t.size()), t.stride(), t.storage_offset())
        counted = self._pack_count
        if counted is not None and ptr and ptr != self._pack_exclude and ptr not in counted:
            counted[ptr] = t.untyped_storage().nbytes()
        return t

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, tuple):
            _, u, k, size, stride, offset = packed
            dev = self._bwd_unit
            assert dev is not None and dev.u == u, "a unit's saved weights were asked for outside its backward"
            return (dev.big if k == 0 else dev.small).as_strided(size, stride, offset)
        return packed

    def _run(self, u: int, dev: DeviceUnit, inp: Tensor, target: Tensor | None) -> Tensor:
        """Unit u on `inp` with autograd through the streamed weights (when grad mode is on)."""
        lay = self.layouts[u]
        names = [e.local for e in lay.entries]
        if torch.is_grad_enabled():
            ws = _StreamIn.apply(self, u, self._anchor, *[dev.views[k] for k in names])
            params = dict(zip(names, ws))
        else:
            params = dev.views
        ctx = torch.autocast(self.device.type, dtype=self.half) if self.half else contextlib.nullcontext()
        with ctx:
            out = torch.func.functional_call(self.units[u], params, (inp,))
            if target is not None:
                return lm_loss(out, target)
        return out.float() if self.half and out.is_floating_point() else out

    def _accumulate_weight_grads(self, u: int, grads: tuple[Tensor, ...]) -> None:
        big, small, fresh = self._acc[u]
        for i, (e, g) in enumerate(zip(self.layouts[u].entries, grads)):
            if g is None:
                continue
            dst = (big if e.half else small)[e.payload_offset:e.payload_offset + e.numel]
            if i in fresh:  # first micro-batch: copy (the buffer starts uninitialised, no zeroing pass)
                dst.copy_(g.reshape(-1))
                fresh.discard(i)
            else:
                dst.add_(g.reshape(-1))

    # ---- one step ----
    def step(self, x: Tensor, y: Tensor, *, micro_batch: int, loss_divisor: float, loss_scale: float = 1.0
             ) -> float:
        """Forward and backward over the units for (x, y) (B, T); gradients of sum(micro-batch losses /
        loss_divisor) * loss_scale are pushed to the link per unit. Returns the (unscaled) loss sum."""
        n, led = self.n, self.ledger
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        xs, ys = x.split(micro_batch), y.split(micro_batch)
        nm = len(xs)
        track_rng = self.recompute and self.cfg.dropout > 0
        acts: list[list[Tensor]] = [list(xs)]
        led.alloc("activations", _nbytes(x))
        graphs: dict[tuple[int, int], tuple[Tensor, Tensor, dict[int, int]]] = {}
        rng: dict[tuple[int, int], Any] = {}
        self._start_fetches(list(range(n)) + list(range(n - 2, -1, -1)))
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

        # forward: units 0..n-2, keeping boundary activations (and, without recompute, each unit's graph)
        for u in range(n - 1):
            dev = self._next_unit()
            t0 = time.perf_counter()
            outs = []
            for m in range(nm):
                inp = acts[u][m]
                if self.recompute:
                    if track_rng:
                        rng[u, m] = _rng_state(self.device)
                    with torch.no_grad():
                        out = self._run(u, dev, inp, None)
                else:
                    leaf = inp.detach().requires_grad_(u > 0) if u > 0 else inp
                    count: dict[int, int] = {}
                    self._pack_unit, self._pack_count = dev, count
                    self._pack_exclude = inp.untyped_storage().data_ptr()
                    with hooks, torch.enable_grad():
                        out = self._run(u, dev, leaf, None)
                    self._pack_unit, self._pack_count = None, None
                    led.alloc("saved", sum(count.values()))
                    graphs[u, m] = (leaf, out, count)
                    out = out.detach()
                outs.append(out)
                led.alloc("activations", _nbytes(out))
            acts.append(outs)
            self._span("main", f"forward unit {u}", t0)
            self._release(dev)
            del dev

        # backward: units n-1..0 (the head's forward runs here), gradients out per unit
        loss_sum = torch.zeros((), device=self.device)
        grad_out: list[Tensor | None] = [None] * nm
        for u in range(n - 1, -1, -1):
            dev = self._next_unit()
            t0 = time.perf_counter()
            lay = self.layouts[u]
            self._acc[u] = (torch.empty(lay.n_big, dtype=torch.float32, device=self.device),
                            torch.empty(lay.n_small, dtype=torch.float32, device=self.device),
                            set(range(len(lay.entries))))
            acc_bytes = 4 * (lay.n_big + lay.n_small)
            led.alloc("gradients", acc_bytes)
            self._bwd_unit = dev
            new_grad: list[Tensor | None] = [None] * nm
            for m in range(nm):
                inp = acts[u][m]
                if u == n - 1 or self.recompute:
                    leaf = inp.detach().requires_grad_(True) if u > 0 else inp
                    count = {}
                    self._pack_unit, self._pack_count = dev, count
                    self._pack_exclude = inp.untyped_storage().data_ptr()
                    with hooks, torch.enable_grad(), _rng_restored(rng.get((u, m)), self.device):
                        out = self._run(u, dev, leaf, ys[m] if u == n - 1 else None)
                    self._pack_unit, self._pack_count = None, None
                    led.alloc("saved", sum(count.values()))
                else:
                    leaf, out, count = graphs.pop((u, m))
                with hooks:
                    if u == n - 1:
                        loss = out / loss_divisor
                        loss_sum += loss.detach()
                        (loss * loss_scale if loss_scale != 1.0 else loss).backward()
                    else:
                        torch.autograd.backward(out, grad_out[m])
                led.free("saved", sum(count.values()))
                del out
                if u > 0:
                    new_grad[m] = leaf.grad
                    led.alloc("activations", _nbytes(leaf.grad))
                del leaf
                if grad_out[m] is not None:
                    led.free("activations", _nbytes(grad_out[m]))
                    grad_out[m] = None
                led.free("activations", _nbytes(acts[u][m]))
                acts[u][m] = None  # type: ignore[call-overload]
            grad_out = new_grad
            self._bwd_unit = None
            big, small, fresh = self._acc.pop(u)
            for i in fresh:  # a weight that got no gradient (unused by this batch): zero, as autograd would give
                e = lay.entries[i]
                (big if e.half else small)[e.payload_offset:e.payload_offset + e.numel].zero_()
            self._span("main", f"backward unit {u}", t0)
            t1 = time.perf_counter()
            fut = self.link.push(u, big, small)
            fut.add_done_callback(lambda _f, b=acc_bytes: led.free("gradients", b))
            self.stats["bytes_out"] += acc_bytes
            self.stats["push_s"] += time.perf_counter() - t1
            self._release(dev)
            del dev, big, small
        return float(loss_sum)

    @torch.no_grad()
    def forward_loss(self, x: Tensor, y: Tensor) -> float:
        """Mean loss over (x, y) with streamed weights, no gradients."""
        x, y = x.to(self.device), y.to(self.device)
        self._start_fetches(list(range(self.n)))
        h = x
        for u in range(self.n):
            dev = self._next_unit()
            h = self._run(u, dev, h, y if u == self.n - 1 else None)
            self._release(dev)
        return float(h)

    def reset_stats(self) -> None:
        self.stats = {"wait_weights_s": 0.0, "fetch_busy_s": 0.0, "bytes_in": 0, "bytes_out": 0, "push_s": 0.0}

    def _span(self, lane: str, name: str, t0: float) -> None:
        if self.tracer:
            self.tracer.span(lane, name, t0, time.perf_counter())

    def close(self) -> None:
        self._prefetch.close()


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _rng_restored(state: tuple[Tensor, Tensor | None] | None, device: torch.device):
    """Replay the RNG a unit's forward saw (dropout masks match on recompute); leave the global RNG as it was."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


# ---- the executor ---------------------------------------------------------------------------------------------

def step_observability(stats: dict[str, float], *, step_s: float, tokens: int, flops: float,
                       weight_params: int) -> dict[str, Any]:
    """Per-step figures for metrics.jsonl. The no-stall condition (WSE.md): weights stream twice per step, so a
    step hides the stream behind compute when tokens >= (b/3) * F / BW per 6 FLOP/param/token, with b the
    bytes per streamed weight, F the achieved compute rate and BW the achieved streaming bandwidth."""
    compute = max(stats.get("compute_s", 0.0), 1e-9)
    bw = stats["bytes_in"] / stats["fetch_busy_s"] if stats.get("fetch_busy_s") else float("inf")
    b = stats["bytes_in"] / max(1, 2 * weight_params)  # bytes per streamed weight (two streams per step)
    f = flops / compute
    needed = (b / 3) * f / bw if math.isfinite(bw) else 0.0
    out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in stats.items()}
    out.update({"stream_bandwidth_Bps": bw if math.isfinite(bw) else None,
                "no_stall_tokens_needed": math.ceil(needed), "no_stall": tokens >= needed,
                "stall_fraction": stats.get("wait_weights_s", 0.0) / max(step_s, 1e-9)})
    return out


class MemoryXExecutor(Executor):
    """An executor whose weights and optimizer state live in MemoryX (`self.mx`): checkpoints go through it."""

    mx: MemoryX

    def model_for_checkpoint(self) -> nn.Module:
        return self.mx.checkpoint_module()

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
        self.half = HALF_DTYPES[half_dtype] if half_dtype else None
        self.micro_batch_size = micro_batch_size
        self.device_memory_bytes = device_memory_bytes
        self.recompute_option = recompute
        self.engine: StreamingEngine | None = None
        self._planned_for: tuple[int, int] | None = None
        self.plan: MemoryPlan | None = None
        self._trace_path: Path | None = None
        self.last_stats: dict[str, Any] = {}
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
        budget = self.device_memory_bytes
        if self.device.type == "cuda" and budget is None:
            budget = torch.cuda.get_device_properties(self.device).total_memory
        if budget is not None and plan.with_recompute > budget:
            raise ConfigError(f"--device_memory_mb {budget / 2**20:,.0f} is a budget smaller than one unit: "
                              f"streaming needs at least {plan.describe(plan.with_recompute)}; raise the budget "
                              f"or lower micro_batch_size / batch_size")
        rc = self.recompute_option
        recompute = (budget is not None and plan.without_recompute > budget) if rc == "auto" else bool(rc)
        self.plan = plan
        if self.engine is None:
            self.engine = StreamingEngine(self.skeleton, LocalLink(self.mx, self.device), device=self.device,
                                          half=self.half, recompute=recompute, layouts=self.mx.layouts)
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
        self.mx.take_stats()
        t0 = time.perf_counter()
        self.mx.begin_step(lr)
        scaler = self.mx.scaler
        loss = eng.step(x, y, micro_batch=mb, loss_divisor=B // mb, loss_scale=scaler.scale if scaler else 1.0)
        t_bwd = time.perf_counter()
        grad_norm, skipped = self.mx.end_backward()
        t1 = time.perf_counter()
        if tracer:
            tracer.span("main", "wait gradients / clip", t_bwd, t1)
            tracer.write(self._trace_path)
            self._trace_path, eng.tracer = None, None
        if not math.isfinite(loss) and not skipped:
            raise FloatingPointError(f"training loss became {loss}; lower the learning rate or enable "
                                     f"gradient clipping (optimizer.max_gradient_norm)")
        self.last_stats = self._observe(eng.stats, self.mx.take_stats(), t1 - t0, x.numel(), T)
        return StepResult(loss=loss, tokens=y.numel(), grad_norm=grad_norm, skipped=skipped,
                          stats=self.last_stats)

    def _observe(self, es: dict[str, float], ms: dict[str, float], step_s: float, tokens: int, T: int
                 ) -> dict[str, Any]:
        s = dict(es)
        s["compute_s"] = max(0.0, step_s - s["wait_weights_s"] - s["push_s"])
        s["grad_writeback_s"] = ms["grad_writeback_s"]
        s["optimizer_s"] = ms["optimizer_s"]
        s["bytes_in_place"] = ms["bytes_in_place"]  # of bytes_in: read where MemoryX keeps them (CPU device)
        s["peak_device_bytes"] = self.peak_device_bytes()
        s["recompute"] = bool(self.engine and self.engine.recompute)
        flops = self.skeleton.config.flops_per_token(T, training=True) * tokens * (4 / 3 if s["recompute"] else 1)
        return step_observability(s, step_s=step_s, tokens=tokens, flops=flops, weight_params=self._weight_params)

    def eval_loss(self, x: Tensor, y: Tensor) -> float:
        eng = self._ensure_engine(*x.shape) if self.engine is None else self.engine
        return eng.forward_loss(x, y)

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
        self.mx.close()
