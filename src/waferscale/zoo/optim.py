"""The params file's `optimizer` section -> the runtime's optimizer math (`waferscale.runtime.optim`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from waferscale.params import OptimizerParams, normalize_learning_rate
from waferscale.params.schema import ADAFACTOR_KEYS
from waferscale.runtime import optim as rt


def optimizer_spec(opt: OptimizerParams) -> rt.OptimizerSpec:
    """What the runtime needs from the section; the learning rate is the schedule's step-0 value."""
    return rt.OptimizerSpec(optimizer_type=opt.optimizer_type, learning_rate=build_schedule(opt.learning_rate)(0),
                            betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay,
                            momentum=opt.momentum, nesterov=opt.nesterov, correct_bias=opt.correct_bias,
                            **{k: getattr(opt, k) for k in ADAFACTOR_KEYS})


def build_optimizer(params: Iterable[Any], opt: OptimizerParams) -> torch.optim.Optimizer:
    """A torch optimizer for `params` per the section, starting at the schedule's step-0 learning rate (weight
    decay split by dimension, `runtime.optim.param_groups`; a `wsc run` splits as Model Zoo does instead:
    `zoo.lm.zoo_group_rules`)."""
    return rt.build_optimizer(params, optimizer_spec(opt))


def build_schedule(learning_rate: Any) -> rt.LRSchedule:
    """A schedule from `optimizer.learning_rate` as a params file may spell it: a number, one scheduler dict or
    a list run in sequence, with Model Zoo's legacy names and keys ('PolynomialDecay', `steps:`). Validated
    by the params layer (errors name the key path), then built by the runtime's schedule math."""
    return rt.build_schedule(normalize_learning_rate(learning_rate))


__all__ = ["optimizer_spec", "build_optimizer", "build_schedule"]
