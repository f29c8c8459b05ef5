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

from dataclasses import dataclass, field

import torch.fx as fx
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


def split_into_units(model: nn.Module) -> StreamUnits:
    """Split a user's module into a chain of units by tracing its forward (see the module docstring)."""
    cands = _candidates(model)
    weighted = {q for q, m in cands.items() if any(True for _ in m.parameters())}
    if len(weighted) < 2:
        return _whole(model, "fewer than two of its top-level modules hold weights")
    try:
        graph = _UnitTracer(set(cands)).trace(model)
    except Exception as e:  # noqa: BLE001 - any tracing failure means: stream it whole, and say why
        return _whole(model, f"its forward could not be traced ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        return _whole(model, f"its forward takes {len(placeholders)} inputs (a streamed model takes one tensor)")

    # which nodes start units, and which values depend on the model's input alone (recomputed where needed)
    starts = [n for n in graph.nodes if n.op == "call_module" and n.target in weighted]
    part: dict[fx.Node, int] = {}  # node -> unit that computes it; absent: input-only (recomputed per unit)
    k = -1
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            break
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
    out_node = next(n for n in graph.nodes if n.op == "output")

    # the one value each unit hands to the next: everything a later unit reads from unit u must be one node
    handoff: dict[int, fx.Node] = {}
    for node in graph.nodes:
        for a in node.all_input_nodes:
            if a not in part:
                continue
            reader = part.get(node, k if node is out_node else None)
            if reader is None:  # an input-only node reading a unit's output cannot happen (it would be in part)
                continue
            if reader == part[a]:
                continue
            if reader != part[a] + 1 or handoff.setdefault(part[a], a) is not a:
                return _whole(model, f"the value {a.name} of unit {part[a]} is read by unit {reader}: units "
                                     f"must form a chain, each reading only the one before it")
    if len(out_node.all_input_nodes) != 1 or part.get(out_node.all_input_nodes[0]) != k:
        return _whole(model, "its output is not one value computed by the last unit")
    handoff[k] = out_node.all_input_nodes[0]

    units = [_unit_module(model, graph, part, u, handoff, placeholders[0]) for u in range(k + 1)]
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
    gm = fx.GraphModule(model, g, class_name=f"Unit{u}")
    gm.graph.eliminate_dead_code()
    gm.recompile()
    gm.train(model.training)
    return gm
