"""Weight sparsity, written once for every backend: schedules (`schedules.py`), masks and their streamed
bitmask (`masks.py`), the algorithms Static, GMP, SET, RigL and Group and `configure` (`algorithms.py`), and
their hooks on a resident model (`hooks.py`). MemoryX applies the same masks to streamed weights."""

from waferscale.sparse.algorithms import (GMP, SET, DynamicSparsityAlgorithm, Group, RigL, SparsityAlgorithm,
                                          Static, configure)
from waferscale.sparse.hooks import applied, sparsify_module, sparsify_optimizer

__all__ = ["SparsityAlgorithm", "DynamicSparsityAlgorithm", "Static", "GMP", "SET", "RigL", "Group", "configure",
           "sparsify_module", "sparsify_optimizer", "applied"]
