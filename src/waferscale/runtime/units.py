"""Units: the pieces of a model that weight streaming runs one after another, each with its own weights.

    a model with `units()`   (every zoo model: embedding, each block, head) -- taken as they are; unit u
                             is called as `unit(h)` with the previous unit's output
    an nn.Sequential         its children, in order
    any other nn.Module      split automatically (`split_into_units`), as the wafer compiler takes any model:
                             its forward is traced (torch.fx) with each top-level child, and each element of a
                             top-level nn.ModuleList / nn.Sequential / nn.ModuleDict, kept whole; every call of
                             one of those modules that holds weights starts a unit. The glue between calls (an
                             added positional embedding, a reshape) runs in the unit that produces its input;
                             values computed from the model's input alone (positions, a causal mask) are
                             recomputed in every unit that needs them, so each unit is called as
                             `unit(h, x)` with the previous unit's output h and the model's input x.

A forward whose data flow is not a chain of such calls (a unit reading an output two units back, a Python
branch on a tensor value) cannot stream block by block: it streams as one unit, and `SplitReport.reason` says
why (define `units()` on the model to choose the pieces yourself).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

__all__ = ["StreamUnits", "SplitReport", "model_units", "split_into_units"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass
class SplitReport:
    """How a model was split: `how` is "units()", "sequential", "traced" or "whole"; `reason` says why a
    model streams whole."""

    how: str
    reason: str = ""


@dataclass
class StreamUnits:
    """The units of a model and how to call them: `takes_input` means unit u is called as `unit(h, x)`."""

    modules: list[nn.Module]
    takes_input: bool = False
    report: SplitReport = field(default_factory=lambda: SplitReport("units()"))

    def __len__(self) -> int:
        return len(self.modules)


def model_units(model: nn.Module) -> StreamUnits:
    """The streamable units of `model` (see the module docstring)."""
    if hasattr(model, "units") and callable(model.units):
        return StreamUnits(list(model.units()))
    if isinstance(model, nn.Sequential) and len(model) > 0:
        return StreamUnits(list(model), report=SplitReport("sequential"))
    return split_into_units(model)


def _candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> module of every module that may start a unit: top-level children, and the elements
    of top-level containers (recursively through nested containers)."""
    out: dict[str, nn.Module] = {}

    def visit(prefix: str, mod: nn.Module) -> None:
        if isinstance(mod, _CONTAINERS):
            for name, child in mod.named_children():
                visit(f"{prefix}.{name}", child)
        else:
            out[prefix] = mod

    for name, child in model.named_children():
        visit(name, child)
    return out


class _UnitTracer(fx.Tracer):
    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves
        self.proxy_buffer_attributes = True  # a buffer sliced by a traced length (a causal mask) stays symbolic

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)


def _whole(model: nn.Module, reason: str) -> StreamUnits:
    return StreamUnits([model], report=SplitReport("whole", reason))


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.setitem}
_RANDOM_FUNCTIONS = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
                     torch.randperm, torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, torch.dropout,
                     F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "normal_", "uniform_", "random_", "exponential_", "geometric_",
                   "cauchy_", "log_normal_"}


def _mutates(node: fx.Node, model: nn.Module) -> bool:
    """An in-place op (`x.add_(y)`, `x += y`, `x[i] = y`, `inplace=True`): a split would drop or repeat it."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.op == "call_function":
        return node.target in _INPLACE_OPERATORS or getattr(node.target, "__name__", "").endswith("_")
    if node.op == "call_module":
        return getattr(model.get_submodule(str(node.target)), "inplace", False) is True
    return False


def _random(node: fx.Node, model: nn.Module) -> bool:
    if node.op == "call_function":
        return node.target in _RANDOM_FUNCTIONS
    if node.op == "call_method":
        return node.target in _RANDOM_METHODS
    if node.op == "call_module":
        return isinstance(model.get_submodule(str(node.target)), nn.modules.dropout._DropoutNd)
    return False


def _trace(model: nn.Module, leaves: set[str], training: bool) -> fx.Graph:
    was = model.training
    model.train(training)
    try:
        return _UnitTracer(leaves).trace(model)
    finally:
        model.train(was)


def split_into_units(model: nn.Module) -> StreamUnits:
    """Split a user's module into a chain of units by tracing its forward (see the module docstring). The
    split is exact or not made: anything it cannot reproduce makes the model stream whole, with the reason."""
    cands = _candidates(model)
    weighted = {q for q, m in cands.items() if any(True for _ in m.parameters())}
    if len(weighted) < 2:
        return _whole(model, "fewer than two of its top-level modules hold weights")
    try:
        graph = _trace(model, set(cands), model.training)
        if str(_trace(model, set(cands), not model.training)) != str(graph):
            return _whole(model, "its forward reads `self.training` outside its submodules (a traced split would "
                                 "keep one mode's branch)")
    except Exception as e:  # noqa: BLE001 - any tracing failure means: stream it whole, and say why
        return _whole(model, f"its forward could not be traced ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        return _whole(model, f"its forward takes {len(placeholders)} inputs (a streamed model takes one tensor)")
    body = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    mutating = [n.name for n in body if _mutates(n, model)]
    if mutating:
        return _whole(model, f"its forward changes tensors in place ({', '.join(mutating[:3])})")

    # which unit computes each node; absent: depends on the model's input alone (recomputed where needed)
    part: dict[fx.Node, int] = {}
    k = -1
    for node in body:
        deps = [part[a] for a in node.all_input_nodes if a in part]
        if node.op == "call_module" and node.target in weighted:
            k += 1
            if deps and max(deps) != k - 1:
                return _whole(model, f"unit {k} ({node.target}) reads the output of unit {max(deps)}, not of the "
                                     f"unit before it")
            part[node] = k
        elif deps:
            part[node] = max(deps)
    if k < 1:
        return _whole(model, "its forward calls fewer than two weighted modules")
    random_input_only = [n.name for n in body if n not in part and _random(n, model)]
    if random_input_only:
        return _whole(model, f"a random value every unit would redraw ({', '.join(random_input_only[:3])})")
    result = next(n for n in graph.nodes if n.op == "output").args[0]
    if not isinstance(result, fx.Node) or part.get(result) != k:
        return _whole(model, "its output is not one tensor computed by the last unit")

    # the one value each unit hands to the next: everything a later unit reads from unit u must be that node
    handoff: dict[int, fx.Node] = {k: result}
    for node in body:
        for a in node.all_input_nodes:
            if a in part and part[node] != part[a]:
                if part[node] != part[a] + 1 or handoff.setdefault(part[a], a) is not a:
                    return _whole(model, f"the value {a.name} of unit {part[a]} is read by unit {part[node]}: "
                                         f"units must form a chain, each reading only the one before it")
    if len(handoff) != k + 1:
        unread = sorted(set(range(k + 1)) - set(handoff))
        return _whole(model, f"the output of unit {unread[0]} is never read by the unit after it")
    units = [_unit_module(model, graph, part, u, handoff, placeholders[0]) for u in range(k + 1)]
    covered = {id(p) for u in units for p in u.parameters()}
    unused = [n for n, p in model.named_parameters() if id(p) not in covered]
    if unused:
        return _whole(model, f"its forward does not use every parameter ({', '.join(unused[:3])})")
    return StreamUnits(units, takes_input=True, report=SplitReport("traced"))


def _unit_module(model: nn.Module, graph: fx.Graph, part: dict[fx.Node, int], u: int,
                 handoff: dict[int, fx.Node], x_node: fx.Node) -> fx.GraphModule:
    """Unit u as a GraphModule called `(h, x)`: its nodes, the input-only nodes they read, recomputed."""
    g = fx.Graph()
    h = g.placeholder("h")
    x = g.placeholder("x")
    env: dict[fx.Node, fx.Node] = {x_node: x}
    if u > 0:
        env[handoff[u - 1]] = h

    def copy(node: fx.Node) -> fx.Node:
        if node not in env:
            for a in node.all_input_nodes:
                copy(a)
            env[node] = g.node_copy(node, lambda a: env[a])
        return env[node]

    for node in graph.nodes:
        if part.get(node) == u:
            copy(node)
    g.output(env[handoff[u]])
    return fx.GraphModule(model, g, class_name=f"Unit{u}")
