"""Kernels on the mesh, each a functional tile-level execution in numpy (see `tiles.py`).

Cycle models live in `waferscale.fabric.cost` (with `cost_matmul` and `cost_collectives`), the wavelet-level event
simulation in `waferscale.fabric.sim`.
"""

from waferscale.fabric.kernels.attention import attention_decode, attention_reference
from waferscale.fabric.kernels.collectives import ALGOS, allreduce, broadcast, reduce
from waferscale.fabric.kernels.gemv import gemm, gemv, gemv_allreduce, random_sparse, spmv
from waferscale.fabric.kernels.pointwise import ELEMENTWISE_OPS, elementwise, layernorm, rmsnorm, softmax
from waferscale.fabric.kernels.tiles import TileRun, Tiles

__all__ = ["ALGOS", "ELEMENTWISE_OPS", "TileRun", "Tiles", "allreduce", "attention_decode", "attention_reference",
           "broadcast", "elementwise", "gemm", "gemv", "gemv_allreduce", "layernorm", "random_sparse", "reduce",
           "rmsnorm", "softmax", "spmv"]
