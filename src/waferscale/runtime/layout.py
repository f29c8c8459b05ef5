"""Unit layouts: how each unit's parameters sit in MemoryX's flat buffers and in the payload streamed to a device.

A unit owns the parameters it is the first to use (a tied embedding belongs to the embedding unit; the head
borrows it). Its payload is two flat buffers: the matrices (ndim >= 2, streamed in the half dtype under mixed
precision) and the vectors (biases, norms: always fp32), each in payload order: owned first, then borrowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

__all__ = ["ParamEntry", "UnitLayout", "build_layouts"]


@dataclass(frozen=True)
class ParamEntry:
    """One parameter as a unit streams it. `local` is its name inside the unit module (for functional_call)."""

    local: str
    name: str  # the model's state-dict name of the owner (the first name of a tied weight)
    shape: tuple[int, ...]
    numel: int
    matrix: bool  # ndim >= 2: streams in the half dtype under mixed precision; vectors stream in fp32
    owner: int  # unit that stores it
    offset: int  # in the owner's flat buffers
    payload_offset: int  # in this unit's payload (the matrices' buffer if matrix, else the vectors')
    global_index: int  # index in the resident optimizer's state dict (its param groups in order)
    param_order: int  # position in model.parameters() (clip_grad_norm_'s summation order)


@dataclass
class UnitLayout:
    index: int
    name: str  # "embed", "blocks.3", "head"
    entries: list[ParamEntry] = field(default_factory=list)  # payload order: matrices, then vectors, each owned first

    @property
    def owned(self) -> list[ParamEntry]:
        return [e for e in self.entries if e.owner == self.index]

    @property
    def numel(self) -> int:  # stored here
        return sum(e.numel for e in self.owned)

    @property
    def n_matrices(self) -> int:  # payload elements streamed in the half dtype
        return sum(e.numel for e in self.entries if e.matrix)

    @property
    def n_vectors(self) -> int:
        return sum(e.numel for e in self.entries if not e.matrix)

    def payload_bytes(self, half_itemsize: int) -> int:
        return self.n_matrices * half_itemsize + self.n_vectors * 4


def build_layouts(model: nn.Module, units: list[nn.Module] | None = None,
                  index: Mapping[str, int] | None = None) -> list[UnitLayout]:
    """Layouts of `units` (default `model.units()`), modules that together hold all of `model`'s parameters, in
    execution order (submodules of `model`, or units split from its traced forward that share its parameter
    objects); works on meta-device models (shapes only). A parameter is stored by the first unit that uses it
    and named by its name in `model`. `index`: each parameter's index in the resident optimizer's state dict,
    by name, where its groups are not `runtime.optim.param_groups`' (matrices, then vectors)."""
    units = model.units() if units is None else units
    mod_name = {id(m): n for n, m in model.named_modules()}
    all_params = list(model.parameters())  # unique, in order
    pname = {id(p): n for n, p in model.named_parameters()}
    order = {id(p): i for i, p in enumerate(all_params)}
    by_group = [p for p in all_params if p.ndim >= 2] + [p for p in all_params if p.ndim < 2]  # as param_groups
    gidx = {id(p): i if index is None else index[pname[id(p)]] for i, p in enumerate(by_group)}
    owner: dict[int, tuple[int, str, int]] = {}  # id(param) -> (unit, name, offset)
    layouts = []
    for u, mod in enumerate(units):
        lay = UnitLayout(u, mod_name.get(id(mod)) or f"unit{u}")
        named = list(mod.named_parameters())
        offset = 0  # the parameters first used here are stored here, matrices first
        for n, p in sorted([(n, p) for n, p in named if id(p) not in owner], key=lambda x: x[1].ndim < 2):
            if id(p) not in pname:
                raise ValueError(f"unit {u}'s parameter {n} is not a parameter of the model")
            owner[id(p)] = (u, pname[id(p)], offset)
            offset += p.numel()
        for matrix in (True, False):
            group = [(n, p) for n, p in named if (p.ndim >= 2) == matrix]
            pay = 0
            for n, p in sorted(group, key=lambda x: owner[id(x[1])][0] < u):  # owned first, then borrowed
                ou, oname, ooff = owner[id(p)]  # ou <= u: every parameter of unit u is owned by now
                lay.entries.append(ParamEntry(n, oname, tuple(p.shape), p.numel(), matrix, ou, ooff, pay,
                                              gidx[id(p)], order[id(p)]))
                pay += p.numel()
        layouts.append(lay)
    return layouts
