"""`cstorch.sparse`: weight sparsity as cerebras.pytorch spells it.

    sparsity = cstorch.sparse.configure({"algorithm": "rigl", "sparsity": 0.9, "update": {"freq": 100}})
    model.apply(sparsity)          # masks as `<param>_mask` buffers; weights pruned before each forward
    optimizer.apply(sparsity)      # optimizer state pruned; masks updated after each step

The algorithms are `waferscale.sparse`'s. On "CPU"/"GPU" hooks apply the masks to the resident model; on "CSX"
MemoryX applies them to the master weights and streams only the kept values (runtime/sparse_stream.py).
`model.apply(sparsity)` is torch's `Module.apply`, which this module extends to take a sparsity algorithm
(any other function is passed on unchanged).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from waferscale.sparse import (GMP, SET, DynamicSparsityAlgorithm, Group, RigL, SparsityAlgorithm, Static,
                               configure, sparsify_module)

__all__ = ["configure", "SparsityAlgorithm", "DynamicSparsityAlgorithm", "Static", "GMP", "SET", "RigL", "Group"]

_module_apply = nn.Module.apply


def _apply(self: nn.Module, fn: Callable[[nn.Module], Any]) -> nn.Module:
    if isinstance(fn, SparsityAlgorithm):
        sparsify_module(fn, self)
        return self
    return _module_apply(self, fn)


nn.Module.apply = _apply  # type: ignore[method-assign]
