"""Weight sparsity, written once for every backend: schedules (`schedules.py`), masks and their streamed
bitmask (`masks.py`), the algorithms Static, GMP, SET, RigL and Group, `configure` and their hooks on a
resident model (`algorithms.py`). MemoryX applies the same masks to streamed weights."""

from waferscale.sparse.algorithms import (GMP, SET, DynamicSparsityAlgorithm, Group, RigL, SparsityAlgorithm,
                                          Static, applied, configure, sparsify_module, sparsify_optimizer)

__all__ = ["SparsityAlgorithm", "DynamicSparsityAlgorithm", "Static", "GMP", "SET", "RigL", "Group", "configure",
           "sparsify_module", "sparsify_optimizer", "applied"]
