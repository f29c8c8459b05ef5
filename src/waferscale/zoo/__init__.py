"""The Model Zoo runner behind `wsc run`: a program on the cstorch API (`waferscale.pytorch`), as Cerebras'
Model Zoo `run.py` is one on `cerebras.pytorch`. It reads the params file (`waferscale.params`) and turns it into
a model, data, an optimizer and schedules, a compiled training step and the closures around it.

    optim.py     the params file's optimizer section -> the runtime's optimizer and schedule
"""
