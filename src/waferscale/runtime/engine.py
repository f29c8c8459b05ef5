"""The streaming engine: a model's units visit the device one at a time, weights stream in over a link, gradients
stream back out. The one engine under both `wsc run` (the zoo's fused LM step) and the cstorch "CSX" backend.
The model stays pure: units run through `torch.func.functional_call` with streamed tensors in place of their
parameters.

Schedule of one training step with n units, fetch order 0, 1, ..., n-1, n-2, ..., 0:

    forward   for u in 0..n-2: wait for unit u's weights (prefetched while u-1 computed; the fetch of the next
              unit starts now), run every micro-batch through u, keep only u's outputs (the unit-boundary
              activations) -- or, with `recompute=False`, u's autograd graph too
    last unit the head runs forward and backward together: `step` computes the loss inside it; the cstorch
              path (`forward_train` / `backward`) returns its output with the graph kept and continues when the
              caller's loss calls backward
    backward  for u in n-2..0: the same prefetch; recompute u's forward with autograd on (replaying the RNG its
              forward saw, so dropout masks match), backpropagate each micro-batch, accumulate the weight
              gradients in fp32 on the device, hand them to the link (asynchronous) as soon as the unit is done,
              and drop the weights

A unit may return `(output, statistics)`: the output goes on to the next unit, the statistics (a small tensor,
e.g. a mixture of experts' router load) feed the step's auxiliary loss `aux_fn(statistics of every unit, in unit
order)`, computed per micro-batch once the forward is done; each unit's backward then adds the gradient of that
loss with respect to its statistics (exact for any `aux_fn`, even one coupling all units).

The link (`runtime/links.py`: MemoryX in this process, or SwarmX) supplies weights and takes gradients. The
device holds at most two units' weights, their gradient buffers, the boundary activations and one unit's autograd
state. With `recompute=False` saved weights are swapped for a key by saved-tensor hooks and re-fetched for the
backward, so the weights still leave the device after each unit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from waferscale.errors import ConfigError
from waferscale.runtime.lane import Lane
from waferscale.runtime.layout import UnitLayout
from waferscale.runtime.trace import Tracer

__all__ = ["StreamingEngine", "DeviceLedger", "DeviceUnit", "rng_state", "rng_restored", "fetch_order"]


def fetch_order(n: int) -> list[int]:
    """The units a training step fetches, in order: forward 0..n-1, then backward n-2..0 (the last unit's
    forward and backward run together)."""
    return list(range(n)) + list(range(n - 2, -1, -1))


class DeviceLedger:
    """Bytes the engine holds on the device, by kind, with the peak of their sum (thread-safe): the working set
    on a CPU "device", which has no allocator of its own. Weight and gradient buffers, boundary activations and
    their gradients, and what autograd saves (once per storage); not the temporaries inside one op."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: dict[str, int] = {}
        self.total = 0
        self.peak = 0
        self.peak_by_kind: dict[str, int] = {}

    def alloc(self, kind: str, n: int) -> None:
        with self._lock:
            self.current[kind] = self.current.get(kind, 0) + n
            self.total += n
            if self.total > self.peak:
                self.peak = self.total
                self.peak_by_kind = dict(self.current)

    def free(self, kind: str, n: int) -> None:
        self.alloc(kind, -n)


class DeviceUnit:
    """One unit's weights on the device: two flat buffers (matrices in the stream dtype, vectors in fp32) and
    per-parameter views into them."""

    def __init__(self, u: int, lay: UnitLayout, matrices: Tensor, vectors: Tensor) -> None:
        self.u, self.matrices, self.vectors = u, matrices, vectors
        self.views = {e.local: (matrices if e.matrix else vectors)[e.payload_offset:e.payload_offset + e.numel]
                      .view(e.shape) for e in lay.entries}
        self.ptrs = {p: k for k, p in ((0, matrices.untyped_storage().data_ptr() if matrices.numel() else 0),
                                       (1, vectors.untyped_storage().data_ptr() if vectors.numel() else 0)) if p}
        self.nbytes = matrices.nbytes + vectors.nbytes


def rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def rng_restored(state: tuple[Tensor, Tensor | None] | None, device: torch.device):
    """Replay the RNG a unit's forward saw (dropout masks match on recompute); leave the global RNG as it was."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class _StreamIn(torch.autograd.Function):
    """Marks streamed weights for autograd; their gradients go to the engine's per-unit fp32 accumulator.
    Holds no tensor, so a kept graph never pins a unit's weights on the device."""

    @staticmethod
    def forward(ctx: Any, engine: "StreamingEngine", u: int, anchor: Tensor, *params: Tensor) -> tuple[Tensor, ...]:
        ctx.engine, ctx.u = engine, u
        ctx.set_materialize_grads(False)  # a weight the unit did not use gets None, not zeros: it had no gradient
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.engine._accumulate_weight_grads(ctx.u, grads)
        return (None, None, None, *([None] * len(grads)))


def _split(out: Any) -> tuple[Tensor, Tensor | None]:
    """A unit's output and the statistics it returned beside it for the auxiliary loss (None if none)."""
    return out if isinstance(out, tuple) else (out, None)


def _leaf(x: Tensor, u: int) -> Tensor:
    """A unit's input as an autograd leaf: detached from the caller's graph, requiring grad where a gradient
    can flow (activations between units; the model's input only when it asked for one)."""
    if not x.is_floating_point() or (u == 0 and not x.requires_grad):
        return x
    return x.detach().requires_grad_(True)


class StreamingEngine:
    """The per-unit schedule on one device, fed by a link (`fetch` / `push`, see `runtime/links.py`).

    units        the model's units in execution order (`runtime.units.model_units`)
    takes_input  unit u is called `unit(h, x)` with the model's input x (units split from a traced forward)
    loss_fn      `loss_fn(last unit's output, target)` for the fused `step` and `forward(x, target=...)`
    aux_fn       `aux_fn(statistics)`: the fused step's auxiliary loss from what units return beside their output
    float_boundaries  under mixed precision, hand fp32 activations from unit to unit (the zoo's LM step)
    track_rng    per unit, whether its recompute replays the RNG its forward saw (default: every unit; dropout
                 may hide anywhere, in a module, a functional call or an attention kernel)
    """

    def __init__(self, units: Sequence[nn.Module], layouts: list[UnitLayout], link: Any, *, device: torch.device,
                 half: torch.dtype | None, recompute: bool = True, takes_input: bool = False,
                 loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None, float_boundaries: bool = False,
                 track_rng: Sequence[bool] | None = None,
                 aux_fn: Callable[[list[Tensor]], Tensor] | None = None) -> None:
        self.units = list(units)
        self.layouts = layouts
        self.n = len(self.units)
        self.link, self.device, self.half, self.recompute = link, device, half, recompute
        self.takes_input, self.loss_fn, self.float_boundaries = takes_input, loss_fn, float_boundaries
        self.aux_fn = aux_fn
        self.track_rng = list(track_rng) if track_rng is not None else [True] * self.n
        # batch norms count the batches they see: a recomputed forward must not count them twice
        self._norm_stats = [[m for m in unit.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
                            for unit in self.units]
        self._pending: dict[str, Any] | None = None  # a cstorch forward waiting for its backward
        self.ledger = DeviceLedger()
        self._prefetch = Lane("weight-prefetch")
        self._anchor = torch.empty(0, device=device, requires_grad=True)
        self._acc: dict[int, tuple[Tensor, Tensor, set[int]]] = {}
        self._inputs: tuple[Tensor, ...] = ()
        self._order: deque[int] = deque()
        self._inflight: Future | None = None
        self._bwd_unit: DeviceUnit | None = None
        self._pack_unit: DeviceUnit | None = None
        self._pack_count: dict[int, int] | None = None
        self._pack_exclude: int = 0
        self._pushes: list[tuple[Future, int]] = []  # gradients handed to the link, with their bytes
        self.tracer: Tracer | None = None
        self.stats: dict[str, float] = {}
        self.reset_stats()

    # ---- weights ----
    def _fetch_task(self, u: int) -> DeviceUnit:
        t0 = time.perf_counter()
        dev = DeviceUnit(u, self.layouts[u], *self.link.fetch(u))  # (matrices, vectors)
        self.ledger.alloc("weights", dev.nbytes)
        t1 = time.perf_counter()
        self.stats["fetch_busy_s"] += t1 - t0
        self.stats["bytes_in"] += dev.nbytes
        if self.tracer:
            self.tracer.span("prefetch", f"fetch unit {u}", t0, t1, bytes=dev.nbytes)
        return dev

    def _start_fetches(self, order: list[int]) -> None:
        """Start a schedule's fetches, after finishing those still queued from one that ended early (an evaluation
        cut short, a forward whose backward never came): every system must run the same fetches, in the same
        order. A fetch that failed ends the schedule (its error is raised once)."""
        self._drop_pending()
        while self._inflight is not None:
            try:
                dev = self._inflight.result()
            except BaseException:
                self._inflight, self._order = None, deque()
                raise
            self._release(dev)
            self._inflight = self._prefetch.submit(self._fetch_task, self._order.popleft()) if self._order else None
        self._order = deque(order)
        self._inflight = self._prefetch.submit(self._fetch_task, self._order.popleft())

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
            dev.matrices.record_stream(torch.cuda.current_stream(self.device))
            dev.vectors.record_stream(torch.cuda.current_stream(self.device))
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
            return (dev.matrices if k == 0 else dev.vectors).as_strided(size, stride, offset)
        return packed

    def _hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _run_keeping_graph(self, u: int, dev: DeviceUnit, inp: Tensor, target: Tensor | None = None,
                           rng: tuple[Tensor, Tensor | None] | None = None, recomputing: bool = False
                           ) -> tuple[Tensor, Tensor, dict[int, int]]:
        """Unit u with autograd on and its graph kept (for a recompute: replaying `rng`, leaving batch-norm
        statistics as they were). Returns (input leaf, output, bytes autograd saved per storage)."""
        leaf = _leaf(inp, u)
        count: dict[int, int] = {}
        self._pack_unit, self._pack_count = dev, count
        self._pack_exclude = inp.untyped_storage().data_ptr() if inp.numel() else 0
        try:
            with self._hooks(), torch.enable_grad(), rng_restored(rng, self.device), \
                    self._norm_stats_kept(u, recomputing):
                out = self._run(u, dev, leaf, target)
        finally:
            self._pack_unit, self._pack_count = None, None
        self.ledger.alloc("saved", sum(count.values()))
        return leaf, out, count

    # ---- one unit ----
    def _run(self, u: int, dev: DeviceUnit, inp: Tensor, target: Tensor | None) -> Tensor:
        """Unit u on `inp` with autograd through the streamed weights (when grad mode is on)."""
        names = [e.local for e in self.layouts[u].entries]
        if torch.is_grad_enabled():
            ws = _StreamIn.apply(self, u, self._anchor, *[dev.views[k] for k in names])
            params = dict(zip(names, ws))
        else:
            params = dev.views
        ctx = torch.autocast(self.device.type, dtype=self.half) if self.half else contextlib.nullcontext()
        with ctx:
            out = torch.func.functional_call(self.units[u], params, (inp, *self._inputs))
            if target is not None:
                assert self.loss_fn is not None, "a fused step needs the engine's loss_fn"
                return self.loss_fn(out, target)
        out, stats = _split(out)
        if self.float_boundaries and self.half and out.is_floating_point():
            out = out.float()
        return out if stats is None else (out, stats)

    def _accumulate_weight_grads(self, u: int, grads: tuple[Tensor, ...]) -> None:
        matrices, vectors, fresh = self._acc[u]
        for i, (e, g) in enumerate(zip(self.layouts[u].entries, grads)):
            if g is None:
                continue
            dst = (matrices if e.matrix else vectors)[e.payload_offset:e.payload_offset + e.numel]
            if i in fresh:  # first micro-batch: copy (the buffer starts uninitialised, no zeroing pass)
                dst.copy_(g.reshape(-1))
                fresh.discard(i)
            else:
                dst.add_(g.reshape(-1))

    def _open_gradients(self, u: int) -> int:
        # the plan holds two units' gradients on the device (`plan_device_memory`): the one the link may still be
        # taking and this one; older pushes are waited for first, so a lagging MemoryX holds back the backward
        # instead of letting gradient buffers pile up past the budget
        self._settle(keep=1)
        lay = self.layouts[u]
        self._acc[u] = (torch.empty(lay.n_matrices, dtype=torch.float32, device=self.device),
                        torch.empty(lay.n_vectors, dtype=torch.float32, device=self.device),
                        set(range(len(lay.entries))))
        acc_bytes = 4 * (lay.n_matrices + lay.n_vectors)
        self.ledger.alloc("gradients", acc_bytes)
        return acc_bytes

    def _push_gradients(self, u: int, acc_bytes: int) -> None:
        """Unit u's gradients are complete: zero what got none and hand them to the link, naming the entries that
        got none (a resident optimizer leaves a parameter without a gradient alone, and so must MemoryX)."""
        matrices, vectors, fresh = self._acc.pop(u)
        lay = self.layouts[u]
        for i in fresh:
            e = lay.entries[i]
            (matrices if e.matrix else vectors)[e.payload_offset:e.payload_offset + e.numel].zero_()
        t1 = time.perf_counter()
        fut = self.link.push(u, matrices, vectors, absent=frozenset(fresh))
        self._pushes.append((fut, acc_bytes))
        self.stats["bytes_out"] += acc_bytes
        self.stats["push_s"] += time.perf_counter() - t1

    def wait_pushes(self) -> None:
        """Wait until every gradient handed to the link has been taken (raises the link's failure, if any)."""
        self._settle(keep=0)

    def _settle(self, keep: int) -> None:
        """Wait for the oldest pushes until at most `keep` are outstanding, freeing their gradient buffers."""
        while len(self._pushes) > keep:
            fut, nbytes = self._pushes.pop(0)
            try:
                fut.result()
            finally:
                self.ledger.free("gradients", nbytes)

    # ---- a training step's forward over units 0..n-2, every micro-batch ----
    def _forward_units(self, xs: list[Tensor]) -> tuple[list[list[Tensor]], dict, dict, dict]:
        """Start the step's fetches, run units 0..n-2 on the micro-batches `xs`; returns (the activations
        entering each unit, the graphs kept without recompute, the RNG each recompute replays, the statistics
        units returned beside their output)."""
        acts: list[list[Tensor]] = [xs]
        graphs: dict[tuple[int, int], Any] = {}
        rng: dict[tuple[int, int], Any] = {}
        stats: dict[tuple[int, int], Tensor] = {}
        self.ledger.alloc("activations", sum(x.nbytes for x in xs))
        self._start_fetches(fetch_order(self.n))
        for u in range(self.n - 1):
            dev = self._next_unit()
            t0 = time.perf_counter()
            outs = []
            for m, inp in enumerate(acts[u]):
                if self.recompute:
                    if self.track_rng[u]:
                        rng[u, m] = rng_state(self.device)
                    with torch.no_grad():
                        out = self._run(u, dev, inp, None)
                else:
                    graphs[u, m] = self._run_keeping_graph(u, dev, inp)
                    out = graphs[u, m][1]
                out, s = _split(out)
                if s is not None:
                    stats[u, m] = s.detach()
                out = out.detach()
                outs.append(out)
                self.ledger.alloc("activations", out.nbytes)
            acts.append(outs)
            self._span("main", f"forward unit {u}", t0)
            self._release(dev)
            del dev
        return acts, graphs, rng, stats

    def _aux_gradients(self, stats: dict[tuple[int, int], Tensor], n_micro: int, divisor: float, scale: float
                       ) -> tuple[dict[tuple[int, int], Tensor], Tensor]:
        """Each micro-batch's auxiliary loss `aux_fn(its units' statistics)`: the gradient of sum(aux / divisor) *
        scale with respect to each unit's statistics (what the unit's backward adds), and that sum, unscaled."""
        grads: dict[tuple[int, int], Tensor] = {}
        total = torch.zeros((), device=self.device)
        if not stats:
            return grads, total
        assert self.aux_fn is not None, "units returned statistics, but the engine has no aux_fn"
        for m in range(n_micro):
            keys = sorted(k for k in stats if k[1] == m)
            leaves = [stats[k].requires_grad_(True) for k in keys]
            with torch.enable_grad():
                aux = self.aux_fn(leaves) / divisor
                grads.update(zip(keys, torch.autograd.grad(aux * scale, leaves)))
            total += aux.detach()
        return grads, total

    # ---- the backward over units `us` (descending), every micro-batch ----
    def _backward_units(self, us: Sequence[int], acts: list[list[Tensor]], graphs: dict, rng: dict,
                        grad_out: list[Tensor | None], fused: tuple[Sequence[Tensor], float, float] | None = None,
                        aux_grads: dict[tuple[int, int], Tensor] | None = None) -> Tensor:
        """`fused` = (targets, loss divisor, loss scale): the last unit computes the loss (its forward runs here
        for the first time) and backpropagates it. `aux_grads`: per (unit, micro-batch), the gradient of the
        auxiliary loss with respect to the statistics the unit returns. Returns the sum of the micro-batch
        losses (0 if not fused)."""
        loss_sum = torch.zeros((), device=self.device)
        for u in us:
            dev = self._next_unit()
            t0 = time.perf_counter()
            acc_bytes = self._open_gradients(u)
            self._bwd_unit = dev
            head = fused is not None and u == self.n - 1
            new_grad: list[Tensor | None] = [None] * len(grad_out)
            for m in range(len(grad_out)):
                inp = acts[u][m]
                if head or self.recompute:
                    leaf, out, count = self._run_keeping_graph(u, dev, inp, fused[0][m] if head else None,
                                                               rng.get((u, m)), recomputing=not head)
                else:
                    leaf, out, count = graphs.pop((u, m))
                with self._hooks():
                    if head:
                        loss = out / fused[1]
                        loss_sum += loss.detach()
                        (loss * fused[2] if fused[2] != 1.0 else loss).backward()
                        del loss
                    else:
                        out, stats = _split(out)
                        g = aux_grads.get((u, m)) if aux_grads else None
                        if g is None:
                            torch.autograd.backward(out, grad_out[m])
                        else:
                            torch.autograd.backward((out, stats), (grad_out[m], g))
                        del stats
                self.ledger.free("saved", sum(count.values()))
                del out
                new_grad[m] = self._take_input_grad(leaf)
                del leaf
                self._drop_boundary(acts, u, m, grad_out)
            grad_out[:] = new_grad
            self._bwd_unit = None
            self._span("main", f"backward unit {u}", t0)
            self._push_gradients(u, acc_bytes)
            self._release(dev)
            del dev
        return loss_sum

    @contextlib.contextmanager
    def _norm_stats_kept(self, u: int, recomputing: bool):
        """Around a recomputed forward: the batch norms' running statistics as the first forward left them."""
        norms = [m for m in self._norm_stats[u] if m.training and m.track_running_stats] if recomputing else []
        kept = [(m, {k: b.clone() for k, b in m._buffers.items() if b is not None}) for m in norms]
        try:
            yield
        finally:
            with torch.no_grad():
                for m, bufs in kept:
                    for k, b in bufs.items():
                        m._buffers[k].copy_(b)

    def _take_input_grad(self, leaf: Tensor) -> Tensor | None:
        if leaf.grad is not None:
            self.ledger.alloc("activations", leaf.grad.nbytes)
        return leaf.grad

    def _drop_boundary(self, acts: list[list[Tensor]], u: int, m: int, grad_out: list[Tensor | None]) -> None:
        if grad_out[m] is not None:
            self.ledger.free("activations", grad_out[m].nbytes)
            grad_out[m] = None
        self.ledger.free("activations", acts[u][m].nbytes)
        acts[u][m] = None  # type: ignore[call-overload]

    # ---- the zoo's fused step: loss inside the last unit, micro-batches ----
    def step(self, x: Tensor, y: Tensor, *, micro_batch: int, loss_divisor: float, loss_scale: float = 1.0
             ) -> float:
        """Forward and backward over the units for (x, y) (B, T); gradients of sum(micro-batch losses /
        loss_divisor) * loss_scale are pushed to the link per unit. Returns the (unscaled) loss sum."""
        assert not self.takes_input, "the fused step is for units called unit(h) (a zoo model's units())"
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        acts, graphs, rng, stats = self._forward_units(list(x.split(micro_batch)))
        aux_grads, aux_sum = self._aux_gradients(stats, len(acts[0]), loss_divisor, loss_scale)
        loss_sum = self._backward_units(range(self.n - 1, -1, -1), acts, graphs, rng, [None] * len(acts[0]),
                                        (y.split(micro_batch), loss_divisor, loss_scale), aux_grads)
        return float(loss_sum + aux_sum)

    # ---- the cstorch path: the caller computes the loss from the last unit's output ----
    def forward_train(self, x: Tensor, inputs: tuple[Tensor, ...] = ()) -> tuple[Tensor, dict[str, Any]]:
        """Units 0..n-2 without a graph, the last unit with its graph kept; returns its output (with grad) and
        what `backward` needs. The last unit's weights stay on the device until `backward` (or the next
        forward, which drops this one's pending backward)."""
        self._inputs = inputs
        acts, _, rng, _ = self._forward_units([x])  # (the CSX backend always recomputes: no graphs kept)
        u = self.n - 1
        dev = self._next_unit()
        self._bwd_unit = dev
        leaf, out, count = self._run_keeping_graph(u, dev, acts[u][0])
        self._pending = {"acts": acts, "rng": rng, "leaf": leaf, "dev": dev, "count": count, "inputs": inputs}
        return out, self._pending

    def _drop_pending(self) -> None:
        """A forward whose backward never came (an evaluation with gradients on): free what it held."""
        p, self._pending = self._pending, None
        if p is None:
            return
        self.ledger.free("saved", sum(p["count"].values()))
        self.ledger.free("activations", sum(a.nbytes for acts in p["acts"] for a in acts if a is not None))
        self._release(p["dev"])
        self._bwd_unit = None
        p.clear()

    def backward(self, saved: dict[str, Any], out: Tensor, grad: Tensor) -> Tensor | None:
        """Backpropagate `grad` (of `forward_train`'s output) through every unit, pushing each unit's gradients;
        returns the gradient of the model's input where it asked for one."""
        if saved is not self._pending or not saved:
            raise ConfigError("backward of a weight-streamed forward that is no longer the latest: with weight "
                              "streaming, call backward on each training forward before the next forward")
        self._pending = None
        self._inputs = saved["inputs"]
        u, acts, dev = self.n - 1, saved["acts"], saved["dev"]
        acc_bytes = self._open_gradients(u)
        self._bwd_unit = dev
        with self._hooks():
            torch.autograd.backward(out, grad)
        self._bwd_unit = None
        self.ledger.free("saved", sum(saved["count"].values()))
        grad_out = [self._take_input_grad(saved["leaf"])]
        self._drop_boundary(acts, u, 0, [None])
        self._push_gradients(u, acc_bytes)
        self._release(dev)
        rng = saved["rng"]
        saved.clear()
        try:
            self._backward_units(range(u - 1, -1, -1), acts, {}, rng, grad_out)
        finally:
            self._inputs = ()
        return grad_out[0]

    @torch.no_grad()
    def forward(self, x: Tensor, inputs: tuple[Tensor, ...] = (), target: Tensor | None = None) -> Tensor:
        """The model's output with streamed weights, no gradients; with `target`, the last unit's loss_fn."""
        self._inputs = inputs
        try:
            self._start_fetches(list(range(self.n)))
            for u in range(self.n):
                dev = self._next_unit()
                x = _split(self._run(u, dev, x, target if u == self.n - 1 else None))[0]
                self._release(dev)
            return x
        finally:
            self._inputs = ()

    def reset_stats(self) -> None:
        self.stats = {"wait_weights_s": 0.0, "fetch_busy_s": 0.0, "bytes_in": 0, "bytes_out": 0, "push_s": 0.0}

    def _span(self, lane: str, name: str, t0: float) -> None:
        if self.tracer:
            self.tracer.span(lane, name, t0, time.perf_counter())

    def close(self) -> None:
        """Stop: the rest of a schedule is not fetched (a failed or interrupted run), the prefetch lane ends."""
        self._order = deque()
        try:
            if self._inflight is not None:
                self._inflight.result()
        except BaseException:  # noqa: BLE001 - closing after a failure: the failure was raised where it happened
            pass
        finally:
            self._inflight = None
            self._prefetch.close()
