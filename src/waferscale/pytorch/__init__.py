"""The cstorch-style API: `import waferscale.pytorch as cstorch`.

    backend = cstorch.backend("CSX", artifact_dir="./artifacts")   # weight streaming from MemoryX
    compiled_model = cstorch.compile(model, backend)
    optimizer = cstorch.optim.AdamW(model.parameters(), lr=1e-3)

    @cstorch.trace
    def training_step(inputs, targets):
        loss = loss_fn(compiled_model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(input_fn), num_steps=100,
                                               checkpoint_steps=50)
    for inputs, targets in executor:
        loss = training_step(inputs, targets)

`wsc run` drives its runs through this same API (see `waferscale.zoo`).
"""

from waferscale.pytorch import amp, distributed, optim, utils
from waferscale.pytorch.backend import backend, current_backend
from waferscale.pytorch.compiled import CompiledModel, compile
from waferscale.pytorch.serialization import load, save
from waferscale.pytorch.step import checkpoint_closure, step, step_closure, trace

__all__ = ["backend", "current_backend", "compile", "CompiledModel", "trace", "step", "step_closure",
           "checkpoint_closure", "save", "load", "optim", "amp", "utils", "distributed"]
