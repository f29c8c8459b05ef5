"""The Model Zoo runner behind `wsc run`: a program on the cstorch API (`waferscale.pytorch`), as Cerebras'
Model Zoo `run.py` is one on `cerebras.pytorch`. It reads the params file (`waferscale.params`) and turns it into
a model, data, an optimizer and schedules, a compiled training step and the closures around it.

    runner.py    the run: set-up, the step loop (schedule -> execute -> update), evaluation, the summary
    lm.py        `compile_lm_step`: a zoo language model's whole training step compiled for a backend
    optim.py     the params file's optimizer section -> the runtime's optimizer and schedule
    wafer.py     a params file -> the wafer compiler's graph (`wsc compile --params`, `wsc run --compile_only`)
"""
