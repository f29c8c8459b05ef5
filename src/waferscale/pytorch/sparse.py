"""`cstorch.sparse`: weight sparsity as cerebras.pytorch spells it.

    sparsity = cstorch.sparse.configure({"algorithm": "rigl", "sparsity": 0.9, "update": {"freq": 100}})
    model.apply(sparsity)          # masks as `<param>_mask` buffers; weights pruned before each forward
    optimizer.apply(sparsity)      # optimizer state pruned; masks updated after each step

The algorithms are `waferscale.sparse`'s. On "CPU"/"GPU" hooks apply the masks to the resident model; on "CSX"
MemoryX applies them to the master weights and streams only the kept values (runtime/sparse_stream.py).
`model.apply(sparsity)` is torch's own `Module.apply`, unchanged: an algorithm is the function it calls on every
submodule, and puts the masks on at the last call, the model's (`SparsityAlgorithm.__call__`).
"""

from __future__ import annotations

from waferscale.sparse import (GMP, SET, DynamicSparsityAlgorithm, Group, RigL, SparsityAlgorithm, Static,
                               configure)

__all__ = ["configure", "SparsityAlgorithm", "DynamicSparsityAlgorithm", "Static", "GMP", "SET", "RigL", "Group"]
