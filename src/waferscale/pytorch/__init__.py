"""The cstorch-style API: `import waferscale.pytorch as cstorch`, Cerebras' names and signatures.

A whole training loop is `examples/cstorch_train.py` (docs/cstorch.md walks through it); `wsc run`
drives its runs through this same API (see `waferscale.zoo`).
"""

from waferscale.pytorch import amp, distributed, optim, sparse, utils
from waferscale.pytorch.backend import backend, current_backend
from waferscale.pytorch.compiled import CompiledModel, compile
from waferscale.pytorch.context import reset, run_context
from waferscale.pytorch.serialization import load, save
from waferscale.pytorch.step import checkpoint_closure, step, step_closure, trace

__all__ = ["backend", "current_backend", "compile", "CompiledModel", "trace", "step", "step_closure",
           "checkpoint_closure", "save", "load", "optim", "amp", "utils", "distributed", "sparse", "reset",
           "run_context"]
