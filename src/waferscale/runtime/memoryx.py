"""MemoryX: the weight store outside the device. fp32 master weights, gradients and optimizer state per unit
(a unit stores the parameters it is the first to use: `runtime/layout.py`).

    tiers       RAM (pinned when the device is CUDA) for the first units that fit `ram_budget_bytes`, flash
                (files under `flash_dir`, memory-mapped only while a unit is being read or updated) for the rest
    layout      per unit one flat fp32 buffer per slot ("param", "grad", and one per optimizer state tensor such
                as "exp_avg"); parameters are views, matrices first (they stream in the half dtype) then vectors
    optimizer   one optimizer per unit, the resident run's class (`runtime.optimizers`: Cerebras' update rules),
                its param groups copies of the resident run's (`resident_groups`: the weight-decay split, by
                dimension or by a given rule such as Model Zoo's, and muP's per-group learning-rate scales); it
                runs on a worker thread ("lane")
    leaves      the optimizer steps each run of a unit's parameters that share a group as one flat tensor (split by
                dimension, without muP: its matrices, then its vectors), until one of the unit's parameters goes
                without a gradient in a step (an expert its router gave no token, a head the objective does not
                use): from then on the unit has one leaf per parameter, each with its own state, made lazily at
                its first step (a parameter first stepped later starts afresh then), so it is skipped as the
                resident optimizer skips it and its step count (Adam's beta powers) is its own; its
                parameter-shaped state tensors live in the unit's slots like the flat ones. A checkpoint whose
                parameters of one unit differ in step count or in having state loads per parameter alike
    Adafactor   steps each parameter whole (its second moment is factored over the parameter's rows and columns
                and its rate scales by the parameter's RMS), so it has one leaf per parameter from the start; its
                parameter-shaped state (`exp_avg`, with beta1) is a slot, the factored row and column averages
                and the vectors' `exp_avg_sq` stay with the optimizer in RAM (a few values per row and column);
                masks (weight sparsity) are refused: they cannot prune a factored average

When does a unit update? Gradient clipping by global norm and fp16 overflow checks need every gradient of the
step before any update, so MemoryX picks one of two exact policies:

    eager     no clipping, no loss scaling: unit u updates as soon as its gradients are complete (during the
              rest of the backward pass; tied gradients complete when their owner, which comes last, arrives)
    deferred  clipping or fp16: gradients stay in MemoryX while squared norms and finiteness accumulate per unit
              as they arrive (overlapping backward); when backward ends the clip coefficient
              min(1, max_norm / (norm + 1e-6)) (torch's clip_grad_norm_) and the skip decision are known, and the
              updates run unit by unit in forward order, overlapping the next step's forward: fetching unit u
              for step t+1 waits only for unit u's update.

Both give the resident executor's numbers (same optimizer class, same per-element arithmetic).

Masks (weight sparsity): the master weights are zero where their masks drop them, at every step: MemoryX
prunes them (and the optimizer state) when it takes masks (`sync_masks`: a new group, a mask update, a
checkpoint's masks, loaded weights; every step and evaluation begins with it) and after every update. So the
dense payload of a masked unit is its packed payload expanded, and a device that shares host memory computes
from the masters themselves (`fetch_view`), sparse or not. Gradients of masked weights are zeroed as they are
written (`_accumulate`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from waferscale.errors import ConfigError
from waferscale.runtime.lane import Lane, done_future
from waferscale.runtime.layout import ParamEntry, UnitLayout, build_layouts
from waferscale.runtime.loss_scale import LossScaler
from waferscale.runtime.memoryx_state import OptimizerStateIO
from waferscale.runtime.sparse_stream import PackedUnit, UnitMasks, expand, kept_only
from waferscale.runtime.tiers import FlashDir, UnitStore, return_freed_memory_to_os
from waferscale.sparse import Group
from waferscale.runtime.optim import OPTIMIZERS, build_optimizer, split_by_lr_scale

__all__ = ["MemoryX", "STATE_SLOTS", "resident_groups", "state_bytes_per_param"]

# optimizer state tensors with the parameter's shape, per optimizer (for sizing the RAM tier up front);
# Adafactor's second moment is factored (rows + columns of each matrix, not counted), its exp_avg needs beta1
STATE_SLOTS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "SGD": 1, "RMSprop": 2, "Adagrad": 1,
               "Lion": 1, "Lamb": 2, "Adafactor": 0, "ASGD": 1, "Adadelta": 2, "Rprop": 2}


def state_bytes_per_param(optimizer_type: str, momentum: float = 0.0, beta1: float | None = None) -> int:
    """fp32 master weight + gradient + optimizer state per parameter (SGD without momentum keeps no state,
    Adafactor with beta1 keeps one)."""
    slots = 0 if optimizer_type == "SGD" and not momentum else STATE_SLOTS.get(optimizer_type, 2)
    return 4 * (2 + slots + (optimizer_type == "Adafactor" and beta1 is not None))


def resident_groups(model: nn.Module, spec: Any, lr_scale: Callable[[str], float] | None,
                    decays: Callable[[str], bool] | None = None
                    ) -> tuple[list[dict[str, Any]], dict[str, int], dict[str, int]]:
    """The param groups the resident run builds over `model`'s parameters (`build_optimizer`, weight decay split by
    `decays` where given, then split by `lr_scale`, muP's): each group's hyper-parameters, each parameter's group
    and its index in the resident optimizer's state dict (groups in order), by name. Built over meta stand-ins:
    nothing is allocated."""
    stand_ins = [(n, torch.empty(p.shape, device="meta", requires_grad=True)) for n, p in model.named_parameters()]
    opt = build_optimizer(stand_ins, spec, decays)
    if lr_scale is not None:
        split_by_lr_scale(opt, {id(t): lr_scale(n) for n, t in stand_ins})
    name = {id(t): n for n, t in stand_ins}
    hyper, group_of, index = [], {}, {}
    for g, group in enumerate(opt.param_groups):
        hyper.append({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            group_of[name[id(p)]] = g
            index[name[id(p)]] = len(index)
    return hyper, group_of, index


# ---- the store -------------------------------------------------------------------------------------------

class MemoryX(OptimizerStateIO):
    """fp32 master weights + gradients + optimizer state of a CausalLM, per unit, in RAM and flash.

    Thread model: `fetch` runs on the caller's (prefetch) thread and only reads; gradient write-back and
    updates run in order on MemoryX's own lane. `fetch(u)` waits for unit u's pending update (and its tied
    owner's), which is all the synchronisation the streaming executor needs.
    """

    def __init__(self, model: nn.Module, optimizer: Any, *, stream_dtype: torch.dtype | None = None,
                 ram_budget_bytes: int | None = None, flash_dir: str | Path | None = None,
                 pin_memory: bool = False, max_gradient_norm: float | None = None,
                 loss_scaler: LossScaler | None = None, units: list[nn.Module] | None = None,
                 lr_scale: Callable[[str], float] | None = None, decays: Callable[[str], bool] | None = None,
                 groups: tuple[list[dict[str, Any]], dict[str, int], dict[str, int]] | None = None) -> None:
        """model: a CausalLM, on CPU (weights are copied in) or with meta parameters (weights are initialised
        by the model's `init_parameter`, unit by unit); any other nn.Module with CPU weights and its `units`.
        optimizer: a `runtime.optim.OptimizerSpec` (what to build and its hyper-parameters). lr_scale: each
        parameter's learning-rate scale by name (muP's `adjust_learning_rate`), as the resident run's groups;
        decays: whether each takes weight decay, by name (default: matrices do, `runtime.optim.param_groups`).
        groups: a user's own param groups instead (a cstorch optimizer's: `cstorch.optim.memoryx_groups`), as
        `resident_groups` returns them; their rates then come each step from `begin_step`, one per group."""
        if optimizer.optimizer_type == "Lamb":
            raise ConfigError("Lamb scales each parameter's update by its own trust ratio, which MemoryX's per-unit "
                              "fused update does not compute yet: use AdamW, Adam, SGD or Lion with weight "
                              "streaming, or --execution resident")
        self.stream_dtype = stream_dtype or torch.float32  # dtype of streamed matrices
        self.max_gradient_norm = max_gradient_norm
        self.scaler = loss_scaler
        # the resident run's param groups: each parameter's group and state-dict index (checkpoints interchange)
        self._hyper, self._group_of, index = groups or resident_groups(model, optimizer, lr_scale, decays)
        self.layouts = build_layouts(model, units, index)
        self.n_units = len(self.layouts)
        self.policy = "deferred" if (max_gradient_norm or loss_scaler is not None) else "eager"
        flash_dir = Path(flash_dir) if flash_dir is not None else None
        self.bytes_per_param = state_bytes_per_param(optimizer.optimizer_type, optimizer.momentum,
                                                     getattr(optimizer, "beta1", None))
        self._spec = optimizer
        # state not shaped like the parameter (Adafactor's): each parameter is stepped whole, and masks are refused
        self._factored = getattr(OPTIMIZERS[optimizer.optimizer_type], "factored_state", False)
        # per unit: one optimizer leaf per owned parameter, or two flat ones (see the module's docstring)
        self.per_parameter = [self._factored] * self.n_units
        # tiers: the first units that fit the RAM budget stay in RAM, the rest go to flash
        if ram_budget_bytes is not None:
            return_freed_memory_to_os()
        used, self.stores = 0, []
        self._flash: FlashDir | None = None  # this run's own directory under flash_dir, made when a unit needs it
        for lay in self.layouts:
            need = lay.numel * self.bytes_per_param
            flash = ram_budget_bytes is not None and used + need > ram_budget_bytes
            if flash and flash_dir is None:
                raise ConfigError(f"MemoryX needs {self.total_state_bytes / 2**20:,.0f} MiB for weights, gradients "
                                  f"and optimizer state, more than its RAM budget of {ram_budget_bytes / 2**20:,.0f} "
                                  f"MiB; give a flash directory (--flash_dir) or raise --memoryx_ram_mb")
            if not flash:
                used += need
            if flash and self._flash is None:
                self._flash = FlashDir(flash_dir)
            self.stores.append(UnitStore(lay.index, lay.numel, self._flash.path if flash else None,
                                          pin_memory and not flash))
        self._masks: dict[str, Tensor] = {}
        self.sparsity: Group | None = None  # the algorithms choosing the masks (None: masks set by hand)
        self._mask_version = -1
        self.unit_masks = UnitMasks(self.layouts)  # the kept payload elements of units with masked matrices
        self._groups: list[list[tuple[Tensor, slice]]] = [[] for _ in self.layouts]  # (leaf, region of the slots)
        self._group_ids: list[list[int]] = [[] for _ in self.layouts]  # resident group of each optimizer group
        self.optimizers: list[torch.optim.Optimizer | None] = [None] * self.n_units
        self._adopted: list[set[int]] = [set() for _ in self.layouts]  # per unit: leaves whose state is in slots
        skeleton = dict(model.named_parameters())
        meta = next(iter(skeleton.values())).is_meta
        for lay, store in zip(self.layouts, self.stores):
            flat = store.create("param")
            store.create("grad")
            with torch.no_grad():
                for e in lay.owned:
                    v = flat[e.offset:e.offset + e.numel].view(e.shape)
                    if meta:  # the model's own rule (`CausalLM.init_parameter`), one parameter at a time
                        model.init_parameter(e.name, v)
                    else:
                        v.copy_(skeleton[e.name].detach())
            self._make_leaves(lay.index, flat)
            if store.on_flash:
                self._unbind(lay.index)
            del flat
        self._lane = Lane("memoryx-optimizer", share_cores=not pin_memory)  # (pinned: the device is CUDA)
        self._update_done: list[Future] = [done_future() for _ in self.layouts]
        self.begin_step(0.0)
        self._stats_lock = threading.Lock()
        self._stats = self._zero_stats()

    def _make_leaves(self, u: int, flat: Tensor) -> None:
        """Unit u's optimizer and its leaves over the parameter slot `flat`: per parameter (in owned order), or
        one flat tensor per run of consecutive parameters in the same resident group (the owned layout puts
        matrices first: split by dimension and without muP the runs are [matrices] and [vectors]), as
        one fused call each. The optimizer's groups are copies of the resident groups its leaves are in."""
        lay = self.layouts[u]
        runs: list[list[ParamEntry]] = []
        for e in lay.owned:
            if runs and not self.per_parameter[u] and self._group_of[runs[-1][0].name] == self._group_of[e.name]:
                runs[-1].append(e)
            else:
                runs.append([e])
        by_group: dict[int, list[Tensor]] = {}
        groups = []
        for run in runs:
            region = slice(run[0].offset, run[-1].offset + run[-1].numel)
            leaf = torch.empty(0)
            # a plain leaf (a view would pin a flash mapping)
            leaf.data = flat[region].view(run[0].shape if self.per_parameter[u] else (-1,))
            groups.append((leaf.requires_grad_(True), region))
            by_group.setdefault(self._group_of[run[0].name], []).append(leaf)
        self._groups[u] = groups
        self._group_ids[u] = sorted(by_group)
        self.optimizers[u] = build_optimizer([{**self._hyper[g], "params": by_group[g]} for g in sorted(by_group)],
                                             self._spec) if groups else None
        self._adopted[u] = set()

    def _to_per_parameter(self, u: int) -> None:
        """Give unit u one leaf per parameter, each taking its share of the flat leaves' state: exact, as every
        parameter of a flat unit has been stepped on the same steps (the unit splits before the first step one
        of them is absent from)."""
        old_opt, old_groups, old_adopted, store = self.optimizers[u], self._groups[u], self._adopted[u], self.stores[u]
        self.per_parameter[u] = True
        self._make_leaves(u, store.open("param"))
        opt = self.optimizers[u]
        for i, (p, region) in enumerate(old_groups):
            st = old_opt.state.get(p)
            if not st:
                continue
            for j, (q, r) in enumerate(self._groups[u]):
                if not region.start <= r.start < region.stop:
                    continue
                new: dict[str, Any] = {}
                for k, v in st.items():
                    if i in old_adopted and store.has(k):  # a slot: the parameter's part of it
                        new[k] = None if store.on_flash else store.open(k)[r].view(q.shape)
                    elif torch.is_tensor(v) and v.ndim > 0:  # (state made before the first update: Adagrad's)
                        new[k] = v.reshape(-1)[r.start - region.start:r.stop - region.start].view(q.shape).clone()
                    else:  # the step count and other scalars
                        new[k] = v.clone() if torch.is_tensor(v) else v
                opt.state[q] = new
                if i in old_adopted:
                    self._adopted[u].add(j)
        if store.on_flash:
            self._unbind(u)

    # ---- sizes ----
    @property
    def total_state_bytes(self) -> int:
        return sum(lay.numel for lay in self.layouts) * self.bytes_per_param

    def ram_bytes(self) -> int:
        return sum(s.ram_bytes() for s in self.stores)

    def flash_bytes(self) -> int:
        return sum(s.flash_bytes() for s in self.stores)

    def units_on_flash(self) -> int:
        return sum(s.on_flash for s in self.stores)

    # ---- binding flash-tier units for an update ----
    def _bind(self, u: int) -> dict[str, Tensor]:
        """Point unit u's optimizer tensors (parameter, gradient, state) at its slots (maps flash files)."""
        store = self.stores[u]
        slots = {s: store.open(s) for s in store.slots()}
        opt = self.optimizers[u]
        for i, (p, region) in enumerate(self._groups[u]):
            if store.on_flash:
                p.data = slots["param"][region].view(p.shape)
            p.grad = slots["grad"][region].view(p.shape)
            if i in self._adopted[u]:
                st = opt.state[p]
                for k in st:
                    if k in slots and k not in ("param", "grad"):
                        st[k] = slots[k][region].view(p.shape)
        return slots

    def _unbind(self, u: int) -> None:
        opt, store = self.optimizers[u], self.stores[u]
        for i, (p, _) in enumerate(self._groups[u]):
            p.grad = None
            if store.on_flash:  # (RAM units stay bound)
                p.data = torch.zeros(()).expand(p.shape)  # keeps the shape, holds one float
                if i in self._adopted[u]:
                    st = opt.state[p]
                    for k in st:
                        if store.has(k):  # (the rest lives in RAM only)
                            st[k] = None

    def _slot_keys(self, u: int, p: Tensor, st: dict[str, Any]) -> list[str]:
        """The state of leaf p of unit u that takes a slot: its parameter-shaped tensors; with factored state
        (Adafactor), those every parameter of the unit has (a vector's exp_avg_sq is a matrix's row average)."""
        if self._factored:
            opt = self.optimizers[u]
            shaped = [{k for k, shape in opt.state_shapes(q.shape, opt.defaults["beta1"]).items() if shape == q.shape}
                      for q, _ in self._groups[u]]
            return sorted(set.intersection(*shaped))
        return sorted(k for k, v in st.items() if torch.is_tensor(v) and v.ndim > 0 and v.shape == p.shape)

    def _adopt_state(self, u: int) -> None:
        """After an update, move the state the optimizer made for leaves that had none (lazily, at their first
        gradient) into flat slots."""
        opt, store = self.optimizers[u], self.stores[u]
        flats: dict[str, Tensor] = {}
        for i, (p, region) in enumerate(self._groups[u]):
            st = opt.state.get(p)
            if i in self._adopted[u] or not st:
                continue
            for k in self._slot_keys(u, p, st):
                if k not in flats:
                    flats[k] = store.open(k) if store.has(k) else store.create(k)
                view = flats[k][region].view(p.shape)
                if st.get(k) is not None:
                    view.copy_(st[k])
                st[k] = view
            self._adopted[u].add(i)

    # ---- streaming in ----
    def fetch(self, u: int, out_matrices: Tensor | None = None, out_vectors: Tensor | None = None
              ) -> tuple[Tensor, Tensor]:
        """Unit u's payload: (matrices, vectors): the matrices in the stream dtype, vectors in fp32, in payload
        order.
        Waits for pending updates of u and of the owners of weights it borrows."""
        lay = self.layouts[u]
        for o in {u, *(e.owner for e in lay.entries)}:
            self._update_done[o].result()
        matrices = out_matrices if out_matrices is not None else torch.empty(lay.n_matrices, dtype=self.stream_dtype)
        vectors = out_vectors if out_vectors is not None else torch.empty(lay.n_vectors, dtype=torch.float32)
        masters = {o: self.stores[o].open("param") for o in {e.owner for e in lay.entries}}
        owned_matrices = sum(e.numel for e in lay.owned if e.matrix)
        owned_vectors = lay.numel - owned_matrices
        with torch.no_grad():
            if owned_matrices:  # one contiguous copy (and cast) for the owned matrices, one for the vectors
                matrices[:owned_matrices].copy_(masters[u][:owned_matrices])
            if owned_vectors:
                vectors[:owned_vectors].copy_(masters[u][owned_matrices:owned_matrices + owned_vectors])
            for e in lay.entries:  # (masked weights are zero in the masters themselves)
                if e.owner != u:
                    dst = (matrices if e.matrix else vectors)[e.payload_offset:e.payload_offset + e.numel]
                    dst.copy_(masters[e.owner][e.offset:e.offset + e.numel])
        return matrices, vectors

    def fetch_view(self, u: int) -> tuple[Tensor, Tensor] | None:
        """Unit u's payload without a copy, where the payload is exactly its RAM-tier masters (fp32 streaming,
        no borrowed weights): for a device that shares host memory (the CPU). None where a copy is needed.
        The caller only reads the views; MemoryX writes the masters again only in the unit's next update,
        which comes after the unit's gradients, and the next fetch waits for it (as with `fetch`)."""
        lay, store = self.layouts[u], self.stores[u]
        if self.stream_dtype != torch.float32 or store.on_flash or any(e.owner != u for e in lay.entries):
            return None
        self._update_done[u].result()
        master = store.open("param")
        with self._stats_lock:
            self._stats["bytes_in_place"] += lay.numel * 4
        return master[:lay.n_matrices], master[lay.n_matrices:lay.numel]

    def fetch_packed(self, u: int) -> PackedUnit:
        """A unit with masked matrices as it travels: the kept matrix values (stream dtype), the bitmask, the
        vectors; and whether this step's gradients must come back dense (for the sparsity algorithm)."""
        lay, index = self.layouts[u], self.unit_masks.index[u]
        if any(e.owner != u for e in lay.entries):  # borrowed weights: through the dense payload
            matrices, vectors = self.fetch(u)
            values = matrices.index_select(0, index)
        else:  # straight from the masters (one gather and cast)
            self._update_done[u].result()
            master = self.stores[u].open("param")
            values = master[:lay.n_matrices].index_select(0, index).to(self.stream_dtype)
            vectors = master[lay.n_matrices:lay.numel].clone()
        return PackedUnit(values, self.unit_masks.bits[u], vectors, self.dense_grads())

    def dense_grads(self) -> bool:
        return self.sparsity is not None and self.sparsity.wants_dense_grads()

    # ---- a step ----
    def begin_step(self, lr: float | list[float]) -> None:
        """lr: the step's rate (times each group's `adjust_learning_rate`), or each group's own rate, in group
        order (a user's optimizer whose scheduler sets every group's rate)."""
        self.sync_masks()
        self._lr = [float(r) for r in lr] if isinstance(lr, (list, tuple)) else float(lr)
        self._written: set[int] = set()  # global indices of the gradients written this step
        self._got: set[int] = set()  # global indices of the parameters that got a gradient this step
        self._sqnorms: dict[int, Tensor] = {}  # param_order -> norm
        self._finite = True
        self._grad_futs: list[Future] = []

    def push_grads(self, u: int, matrices: Tensor, vectors: Tensor, absent: frozenset[int] = frozenset()) -> Future:
        """Hand over unit u's gradients (fp32, payload layout; host tensors MemoryX may keep until done).
        `absent`: indices of unit u's entries that got no gradient (zeros here): a parameter that gets none from
        any unit this step is not updated, as a resident optimizer skips a parameter whose grad is None.
        Asynchronous: accumulation (and, in the eager policy, the update) runs on MemoryX's lane."""
        fut = self._lane.submit(self._accumulate, u, matrices, vectors, self._lr, absent)
        self._grad_futs.append(fut)
        return fut

    def group_lr(self, g: int, lr: float | list[float]) -> float:
        """Resident group g's rate at a step whose `begin_step` rate was `lr`."""
        return lr[g] if isinstance(lr, list) else lr * self._hyper[g].get("adjust_learning_rate", 1.0)

    def _accumulate(self, u: int, matrices: Tensor, vectors: Tensor, lr: float | list[float],
                    absent: frozenset[int]) -> None:
        """Unit u's gradients into its (and its weights' owners') gradient slots. A unit with masked matrices
        sends the kept values only, or, when the algorithm needs them, dense gradients, which are kept for it
        and then masked."""
        t0 = time.perf_counter()
        lay = self.layouts[u]
        kept_values = u in self.unit_masks and matrices.numel() != lay.n_matrices
        if kept_values:  # zeros where masked already
            matrices = expand(matrices, self.unit_masks.keep[u], self.unit_masks.index[u])
        elif any(e.name in self._masks for e in lay.entries):
            self._keep_dense_grads(lay, matrices, vectors)
        grads = {o: self.stores[o].open("grad") for o in {e.owner for e in lay.entries}}
        with torch.no_grad():
            for i, e in enumerate(lay.entries):
                if i not in absent:
                    self._got.add(e.global_index)
                src = (matrices if e.matrix else vectors)[e.payload_offset:e.payload_offset + e.numel]
                dst = grads[e.owner][e.offset:e.offset + e.numel]
                mask = self._masks.get(e.name) if not (e.matrix and kept_values) else None
                if e.global_index in self._written:
                    dst.add_(src if mask is None else kept_only(src, mask))
                elif mask is None:
                    dst.copy_(src)
                else:  # masked as written (one pass; zero where masked, as the resident gradient hook does)
                    kept_only(src, mask, out=dst)
                self._written.add(e.global_index)
            own = grads.get(u)
            if own is not None and (self.max_gradient_norm or self.scaler is not None):
                for e in lay.owned:  # unit u is complete: its borrowers came earlier in backward
                    g = own[e.offset:e.offset + e.numel]
                    n = torch.linalg.vector_norm(g)
                    self._sqnorms[e.param_order] = n
                    if self.scaler is not None and not bool(torch.isfinite(n)):
                        self._finite = False
        del grads, own
        with self._stats_lock:
            self._stats["grad_writeback_s"] += time.perf_counter() - t0
        if self.policy == "eager":
            self._update(u, lr, 1.0, 1.0, self._got)

    def end_backward(self) -> tuple[float | None, bool]:
        """After the last push_grads of the step: (grad_norm or None, skipped). Schedules the deferred updates."""
        for f in self._grad_futs:
            f.result()
        self._grad_futs = []
        if self.policy == "eager":
            for u in range(self.n_units):
                self._update_done[u] = done_future()
            self._sparsity_step(finite=True)
            return None, False
        inv_scale = 1.0
        skipped = False
        if self.scaler is not None:
            inv_scale = float(torch.tensor(1.0 / self.scaler.scale, dtype=torch.float32))
            skipped = not self._finite
        norm = None
        coef = 1.0
        if self.max_gradient_norm:
            norms = [self._sqnorms[k] for k in sorted(self._sqnorms)]
            total = torch.linalg.vector_norm(torch.stack(norms)) * inv_scale  # norm of the unscaled gradients
            norm = float(total)
            coef = float(torch.clamp(self.max_gradient_norm / (total + 1e-6), max=1.0))
        if self.scaler is not None:
            self.scaler.update(skipped)
        if not skipped:
            lr = self._lr
            for u in range(self.n_units):  # forward order: the next step's fetches wait on these one by one
                # (this step's set of parameters with gradients: the next begin_step starts another)
                self._update_done[u] = self._lane.submit(self._update, u, lr, coef, inv_scale, self._got)
        self._sparsity_step(finite=not skipped)
        return norm, skipped

    def _sparsity_step(self, finite: bool) -> None:
        """After the step's updates: the algorithms advance (recomputing masks from the updated weights on their
        update steps; a skipped step changes no mask), and new masks prune the masters and optimizer state."""
        g = self.sparsity
        if g is None:
            return
        if g.updates_next():
            self.synchronize()
        g.update(g.dense_grads, finite)
        g.dense_grads.clear()
        self.sync_masks()

    def _keep_dense_grads(self, lay: UnitLayout, matrices: Tensor, vectors: Tensor) -> None:
        if self.sparsity is None or not self.sparsity.wants_dense_grads():
            return
        dense = self.sparsity.dense_grads
        for e in lay.entries:
            if e.name in self._masks:
                g = (matrices if e.matrix else vectors)[e.payload_offset:e.payload_offset + e.numel].view(e.shape)
                dense[e.name] = dense[e.name] + g if e.name in dense else g.clone()

    def _update(self, u: int, lr: float | list[float], coef: float, inv_scale: float, got: set[int]) -> None:
        if self.optimizers[u] is None:
            return
        t0 = time.perf_counter()
        owned = self.layouts[u].owned
        absent = [i for i, e in enumerate(owned) if e.global_index not in got]
        if len(absent) == len(owned):  # nothing to step (nor to split: they stay alike)
            return
        if absent and not self.per_parameter[u]:  # a flat step would decay (and count a step for) them too
            self._to_per_parameter(u)
        opt = self.optimizers[u]
        slots = self._bind(u)
        for i in absent:  # skipped as the resident optimizer skips a parameter whose grad is None
            self._groups[u][i][0].grad = None
        grads = [p.grad for p, _ in self._groups[u] if p.grad is not None]
        with torch.no_grad():
            if inv_scale != 1.0:
                torch._foreach_mul_(grads, inv_scale)
            if self.max_gradient_norm:
                torch._foreach_mul_(grads, coef)
            for g, group in zip(self._group_ids[u], opt.param_groups):
                group["lr"] = self.group_lr(g, lr)
            opt.step()
            for e in owned:
                if e.name in self._masks:
                    slots["param"][e.offset:e.offset + e.numel].mul_(self._masks[e.name].reshape(-1))
        self._adopt_state(u)
        del slots, grads
        self._unbind(u)
        with self._stats_lock:
            self._stats["optimizer_s"] += time.perf_counter() - t0

    def synchronize(self) -> None:
        """Wait for every pending update (before a checkpoint or an evaluation from the masters)."""
        for f in self._grad_futs:
            f.result()
        for f in self._update_done:
            f.result()

    def close(self) -> None:
        """Stop the optimizer lane and remove this run's flash files."""
        self._lane.close()
        if self._flash is not None:
            self._flash.close()

    # ---- observability ----
    @staticmethod
    def _zero_stats() -> dict[str, float]:
        return {"bytes_in_place": 0, "grad_writeback_s": 0.0, "optimizer_s": 0.0}

    def take_stats(self) -> dict[str, float]:
        with self._stats_lock:
            s, self._stats = self._stats, self._zero_stats()
        return s

    # ---- masks (per-parameter, for sparsity) ----
    def attach_sparsity(self, group: Group) -> None:
        """Let `group` (waferscale.sparse) choose the masks: of the weights it was applied to on a module, or else
        of the masters it selects here (drawn now). MemoryX applies them to the masters, the optimizer state and
        the streamed payloads, and runs the group's update after every step."""
        self._refuse_masks()
        if not group.params:
            owned = {e.name: e for lay in self.layouts for e in lay.owned}
            for name, _, algo in group.select([(n, torch.empty(e.shape, device="meta")) for n, e in owned.items()]):
                algo.add(name, lambda e=owned[name]: self.stores[e.owner].open("param")[e.offset:e.offset + e.numel]
                         .view(e.shape))
            group.initialize()
        group.streamed = True
        self.sparsity = group
        self.sync_masks()

    def sync_masks(self) -> None:
        """Take the group's masks when they changed (a mask update, a checkpoint's masks, a new group)."""
        g = self.sparsity
        if g is None or g.version == self._mask_version:
            return
        self.synchronize()
        for name, sp in g.params.items():
            self._apply_mask(name, sp.mask)
        self._mask_version = g.version
        self.unit_masks.refresh(self._masks)

    def set_mask(self, name: str, mask: Tensor | None) -> None:
        """Keep `name`'s weights where mask is True: applied to streamed weights and after every update."""
        self.synchronize()
        if self.sparsity is not None and name in self.sparsity.params and mask is not None:
            self.sparsity.set_mask(name, mask)
            self.sync_masks()
            return
        if mask is None:
            self._masks.pop(name, None)
        else:
            self._apply_mask(name, mask)
        self.unit_masks.refresh(self._masks)

    def _refuse_masks(self) -> None:
        if self._factored:
            raise ConfigError("weight sparsity with Adafactor is not supported: its second moment is factored into "
                              "row and column averages, which a mask cannot prune; use AdamW, Adam, SGD or Lion "
                              "with sparsity")

    def _apply_mask(self, name: str, mask: Tensor) -> None:
        """Record `name`'s mask and prune its master weights and optimizer state by it."""
        self._refuse_masks()
        e = next((e for lay in self.layouts for e in lay.owned if e.name == name), None)
        if e is None:
            raise KeyError(f"no parameter named {name!r}")
        if tuple(mask.shape) != e.shape:
            raise ConfigError(f"mask for {name} has shape {tuple(mask.shape)}, the weight {e.shape}")
        m = self._masks[name] = mask.detach().to("cpu", torch.bool).clone()
        store = self.stores[e.owner]
        with torch.no_grad():
            for slot in store.slots():
                if slot != "grad":
                    store.open(slot)[e.offset:e.offset + e.numel].mul_(m.reshape(-1))

    # ---- checkpoints (keyed like the resident model and optimizer: they interchange) ----
    def checkpoint_state(self, masks: bool = True) -> "OrderedDict[str, Tensor]":
        """Master weights (views) under the model's state-dict names (tied weights once); masks as `<name>_mask`."""
        self.synchronize()
        out: "OrderedDict[str, Tensor]" = OrderedDict()
        for lay, store in zip(self.layouts, self.stores):
            flat = store.open("param")
            for e in lay.owned:
                out[e.name] = flat[e.offset:e.offset + e.numel].view(e.shape)
        if masks:
            out.update((f"{name}_mask", m) for name, m in self._masks.items())
        return out

    def load_weights(self, weights: dict[str, Tensor], where: str) -> None:
        from waferscale.runtime.checkpoint import load_model_weights

        sparse = set(self.sparsity.params) if self.sparsity is not None else set(self._masks)
        for k, m in weights.items():  # all the masks first (a sync prunes by every mask), then the weights
            if k.endswith("_mask") and k[:-5] in sparse:  # (a dense run ignores a sparse run's masks)
                if self.sparsity is not None:
                    self.sparsity.set_mask(k[:-5], m)
                else:
                    self.set_mask(k[:-5], m)
        self.sync_masks()
        plain = {k: v for k, v in weights.items() if not k.endswith("_mask")}
        load_model_weights(self.checkpoint_state(masks=False), plain, where)
        self.weights_loaded()

    def weights_loaded(self) -> None:
        """The masters were written from outside (a load): they may hold values their masks drop (a dense run's
        weights). Pruned by the next `sync_masks`, by the masks then (masks may be drawn from the loaded weights
        first); masks set by hand, without a group, prune them now."""
        if self.sparsity is not None:
            self._mask_version = -1
            return
        self.synchronize()
        owned = {e.name: e for lay in self.layouts for e in lay.owned}
        with torch.no_grad():
            for name, m in self._masks.items():
                e = owned[name]
                self.stores[e.owner].open("param")[e.offset:e.offset + e.numel].mul_(m.reshape(-1))
