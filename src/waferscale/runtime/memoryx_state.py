"""MemoryX's optimizer state in and out of checkpoints, in torch's per-parameter state-dict format with the
resident optimizer's param groups and parameter indices, whichever way MemoryX holds it (a unit's flat leaves,
one per run of parameters in one group, or a leaf per parameter; state in the unit's slots or, for Adafactor's
factored averages, with the optimizer). A mixin of `runtime.memoryx.MemoryX`, whose attributes it reads."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from waferscale.errors import CheckpointError

__all__ = ["OptimizerStateIO"]


class OptimizerStateIO:
    def optimizer_state_dict(self) -> dict[str, Any]:
        """torch's optimizer state-dict format with the resident optimizer's parameter indices."""
        self.synchronize()
        state: dict[int, dict[str, Any]] = {}
        hyper: dict[int, dict[str, Any]] = {}  # by resident group
        members: dict[int, list[int]] = {}
        for u, (lay, store, opt) in enumerate(zip(self.layouts, self.stores, self.optimizers)):
            if opt is None:
                continue
            slots = {s: store.open(s) for s in store.slots() if s not in ("param", "grad")}
            for g, group in zip(self._group_ids[u], opt.param_groups):
                hyper.setdefault(g, {k: v for k, v in group.items() if k != "params"})
            for e in lay.owned:
                members.setdefault(self._group_of[e.name], []).append(e.global_index)
            for i, (p, region) in enumerate(self._groups[u]):
                own = opt.state.get(p)
                if not own:
                    continue
                for e in (e for e in lay.owned if region.start <= e.offset < region.stop):
                    at = slice(e.offset - region.start, e.offset - region.start + e.numel)
                    st: dict[str, Any] = {}
                    for k, v in own.items():
                        if i in self._adopted[u] and k in slots:
                            st[k] = slots[k][e.offset:e.offset + e.numel].view(e.shape)
                        elif torch.is_tensor(v) and v.ndim > 0:  # factored, or made before the first update
                            st[k] = v.clone() if self.per_parameter[u] else v.reshape(-1)[at].view(e.shape).clone()
                        elif v is not None:  # scalars (AdamW's "step"): a flat leaf's are each of its parameters'
                            st[k] = v.clone() if torch.is_tensor(v) else v
                    state[e.global_index] = st
        param_groups = [{**hyper[g], "lr": self.group_lr(g, self._lr),
                         "params": sorted(members[g])} for g in sorted(members)]
        out: dict[str, Any] = {"state": state, "param_groups": param_groups}
        if self.scaler is not None:
            out["grad_scaler"] = self.scaler.state_dict()
        return out

    def set_group_settings(self, settings: list[dict[str, Any]]) -> None:
        """Give each resident group these settings (its keys but "params", in group order: a user's optimizer
        after its load_state_dict took a checkpoint's), in every unit optimizer's copy of it too."""
        self.synchronize()
        for g, given in enumerate(settings):
            self._hyper[g].update(copy.deepcopy(given))
        for u, opt in enumerate(self.optimizers):
            for g, group in zip(self._group_ids[u], opt.param_groups if opt is not None else []):
                group.update(copy.deepcopy(settings[g]))

    def load_optimizer_state_dict(self, sd: dict[str, Any]) -> None:
        self.synchronize()
        sd = dict(sd)
        scaler = sd.pop("grad_scaler", None)
        if scaler is not None and self.scaler is not None:
            self.scaler.load_state_dict(scaler)
        state = {int(k): v for k, v in sd["state"].items()}
        n_expected = sum(len(lay.owned) for lay in self.layouts)
        n_given = sum(len(g["params"]) for g in sd["param_groups"])
        if n_given != n_expected:
            raise CheckpointError(f"the optimizer state holds {n_given} parameters, this model has {n_expected}")
        given_sizes = [len(g["params"]) for g in sd["param_groups"]]
        sizes = [list(self._group_of.values()).count(g) for g in range(len(self._hyper))]
        if given_sizes != sizes:  # the indices would name other parameters (as torch, refused)
            raise CheckpointError(f"the optimizer state's param groups hold {given_sizes} parameters, this run's "
                                  f"{sizes}: the checkpoint's groups were made another way (other muP "
                                  f"adjust_learning_rate groups, or an earlier version's weight-decay split); "
                                  f"resume its weights alone with --load_checkpoint_states model")
        for u, (lay, store, opt) in enumerate(zip(self.layouts, self.stores, self.optimizers)):
            if opt is None:
                continue
            given = [state.get(e.global_index, {}) for e in lay.owned]
            if not self.per_parameter[u] and len({_scalars(st) if st else None for st in given}) > 1:
                self._to_per_parameter(u)  # parameters stepped on different steps (or not yet): each its own leaf
            if self.per_parameter[u]:
                self._load_per_parameter(u, given)
                continue
            keys = sorted({k for st in given for k, v in st.items() if torch.is_tensor(v) and v.ndim > 0})
            slots = {k: (store.open(k) if store.has(k) else store.create(k)) for k in keys}
            for i, (p, region) in enumerate(self._groups[u]):
                new: dict[str, Any] = {}
                for e, st in zip(lay.owned, given):
                    if not region.start <= e.offset < region.stop:
                        continue
                    for k, v in st.items():
                        if k in slots:
                            if tuple(v.shape) != e.shape:
                                raise CheckpointError(f"optimizer state {k} of {e.name} has shape "
                                                      f"{tuple(v.shape)}, expected {e.shape}")
                            with torch.no_grad():
                                slots[k][e.offset:e.offset + e.numel].copy_(v.reshape(-1))
                            new[k] = None if store.on_flash else slots[k][region].view(p.shape)
                        elif k not in new:  # scalars such as "step": equal across the unit (else per parameter)
                            new[k] = v.to(torch.float32).clone() if torch.is_tensor(v) else v
                if new:
                    opt.state[p] = new
                    self._adopted[u].add(i)
                else:
                    opt.state.pop(p, None)
                    self._adopted[u].discard(i)
            del slots

    def _load_per_parameter(self, u: int, given: list[dict[str, Any]]) -> None:
        """Unit u's per-parameter state from a checkpoint's (`given`, in owned order): parameter-shaped tensors go
        to their slots, the rest (Adafactor's factored averages, the step count) to the optimizer; a parameter
        with no state gets none, so it starts afresh at its next gradient, as the resident optimizer's would.
        With factored state each parameter's tensors must be the ones Adafactor keeps for its shape (a
        checkpoint of another optimizer, or of Adafactor with(out) beta1, is refused)."""
        lay, store, opt = self.layouts[u], self.stores[u], self.optimizers[u]
        slots: dict[str, Tensor] = {}
        self._adopted[u] = set()
        for i, ((p, region), e, st) in enumerate(zip(self._groups[u], lay.owned, given)):
            opt.state.pop(p, None)
            if not st:
                continue
            tensors = {k: v for k, v in st.items() if torch.is_tensor(v) and v.ndim > 0}
            if self._factored:
                expected = opt.state_shapes(e.shape, opt.defaults["beta1"])
                if {k: tuple(v.shape) for k, v in tensors.items()} != expected:
                    raise CheckpointError(f"optimizer state of {e.name}: {sorted(tensors)} with shapes "
                                          f"{[tuple(v.shape) for v in tensors.values()]}; Adafactor keeps "
                                          f"{', '.join(f'{k} {s}' for k, s in expected.items())}")
            else:
                for k, v in tensors.items():
                    if tuple(v.shape) != e.shape:
                        raise CheckpointError(f"optimizer state {k} of {e.name} has shape {tuple(v.shape)}, "
                                              f"expected {e.shape}")
            keys = self._slot_keys(u, p, st)
            new: dict[str, Any] = {}
            with torch.no_grad():
                for k, v in st.items():
                    if k in keys:
                        if k not in slots:
                            slots[k] = store.open(k) if store.has(k) else store.create(k)
                        view = slots[k][region]
                        view.copy_(v.reshape(-1))
                        new[k] = None if store.on_flash else view.view(e.shape)
                    elif k in tensors:
                        new[k] = v.to(torch.float32).clone()
                    elif self._factored:  # (Adafactor's step count is an int)
                        new[k] = int(v)
                    else:
                        new[k] = v.to(torch.float32).clone() if torch.is_tensor(v) else v
            opt.state[p] = new
            self._adopted[u].add(i)
        del slots


def _scalars(st: dict[str, Any]) -> tuple:
    """A parameter's optimizer state less its tensors (its step count, ...), comparable."""
    return tuple(sorted((k, float(v) if torch.is_tensor(v) else v) for k, v in st.items()
                        if not (torch.is_tensor(v) and v.ndim > 0)))
