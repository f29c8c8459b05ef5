"""Optimizer math and learning-rate schedules: the one home of both. The cstorch API and the zoo wrap them; the
runtime takes plain arguments (`OptimizerSpec`, canonical scheduler dicts), reading a params file is the zoo's.

A schedule is a pure function of the step, `lr = schedule(step)`, with no state to save: resuming at step k
gives exactly the learning rate an uninterrupted run would have had. `step` counts optimizer updates already
made, so `schedule(0)` is the rate of the first update (as Cerebras' schedulers, whose `last_epoch` starts at 0).

The formulas are Cerebras' `cstorch.optim.lr_scheduler` ones (the classes below, named without the `LR`
suffix; `Linear` is `Polynomial` with power 1). A list of schedulers runs them one after another (Cerebras'
SequentialLR): each phase runs its `total_iters` steps counting from its own step 0, and the last phase
continues past its own total_iters (Linear / Polynomial / CosineDecay then hold their end value).
"""

from __future__ import annotations

import bisect
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from waferscale.errors import ConfigError
from waferscale.runtime import optimizers


# ---- schedules -----------------------------------------------------------------------------------------

class LRSchedule:
    """lr = schedule(step); step >= 0 counts the optimizer updates already made."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class Constant(LRSchedule):
    learning_rate: float

    def __call__(self, step: int) -> float:
        return self.learning_rate


@dataclass(frozen=True)
class Linear(LRSchedule):
    """`cycle` is accepted as Cerebras' schedulers accept it, and changes nothing, as there: their published
    formula divides by total_iters * ceil((step + 1) / total_iters), a factor 1 before total_iters, and holds the
    end value from total_iters on."""

    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int
    cycle: bool = False
    power = 1.0  # a class constant here, a field of Polynomial

    def __call__(self, step: int) -> float:
        remaining = 1.0 - min(step, self.total_iters) / self.total_iters
        return self.end_learning_rate + (self.initial_learning_rate - self.end_learning_rate) * remaining ** self.power


@dataclass(frozen=True)
class Polynomial(Linear):
    power: float = 1.0


@dataclass(frozen=True)
class CosineDecay(LRSchedule):
    initial_learning_rate: float
    end_learning_rate: float
    total_iters: int

    def __call__(self, step: int) -> float:
        progress = min(step, self.total_iters) / self.total_iters
        cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.end_learning_rate + (self.initial_learning_rate - self.end_learning_rate) * cos


@dataclass(frozen=True)
class CosineAnnealing(LRSchedule):
    initial_learning_rate: float
    T_max: int
    eta_min: float = 0.0

    def __call__(self, step: int) -> float:
        cos = 0.5 * (1.0 + math.cos(math.pi * step / self.T_max))
        return self.eta_min + (self.initial_learning_rate - self.eta_min) * cos


@dataclass(frozen=True)
class Exponential(LRSchedule):
    initial_learning_rate: float
    total_iters: int
    decay_rate: float
    staircase: bool = False

    def __call__(self, step: int) -> float:
        power = step / self.total_iters
        return self.initial_learning_rate * self.decay_rate ** (math.floor(power) if self.staircase else power)


@dataclass(frozen=True)
class InverseExponentialTimeDecay(LRSchedule):
    initial_learning_rate: float
    step_exponent: float
    total_iters: int
    decay_rate: float
    staircase: bool = False

    def __call__(self, step: int) -> float:
        alpha = float(step) ** self.step_exponent / self.total_iters
        if self.staircase:
            alpha = math.floor(alpha)
        return self.initial_learning_rate / (1.0 + self.decay_rate * alpha)


@dataclass(frozen=True)
class InverseSquareRootDecay(LRSchedule):
    initial_learning_rate: float = 1.0
    scale: float = 1.0
    warmup_steps: int = 1

    def __call__(self, step: int) -> float:
        return self.initial_learning_rate * self.scale / math.sqrt(max(step, self.warmup_steps))


@dataclass(frozen=True)
class Step(LRSchedule):
    initial_learning_rate: float
    step_size: int
    gamma: float

    def __call__(self, step: int) -> float:
        return self.initial_learning_rate * self.gamma ** (step // self.step_size)


@dataclass(frozen=True)
class MultiStep(LRSchedule):
    initial_learning_rate: float
    gamma: float
    milestones: tuple[int, ...]

    def __call__(self, step: int) -> float:
        return self.initial_learning_rate * self.gamma ** bisect.bisect_right(self.milestones, step)


@dataclass(frozen=True)
class PiecewiseConstant(LRSchedule):
    learning_rates: tuple[float, ...]
    milestones: tuple[int, ...]

    def __call__(self, step: int) -> float:
        return self.learning_rates[bisect.bisect_right(self.milestones, step)]


@dataclass(frozen=True)
class Sequential(LRSchedule):
    """Phases one after another; phase i starts at global step starts[i] and sees step - starts[i].

    `last_epoch` is Cerebras' SequentialLR argument: built with last_epoch = k - 1 the sequence is k steps further
    along its milestones (step + k is compared with them), while each phase counts its own steps from 0, from the
    step where it begins (step 0 for a phase whose milestone is already passed), as Cerebras' phases do."""

    phases: tuple[LRSchedule, ...]
    starts: tuple[int, ...]  # starts[0] == 0, increasing
    last_epoch: int = -1

    def __call__(self, step: int) -> float:
        ahead = self.last_epoch + 1
        i = bisect.bisect_right(self.starts, step + ahead) - 1
        return self.phases[i](step - max(0, self.starts[i] - ahead))


# canonical name (Model Zoo's, without the "LR" suffix) -> schedule; each class's fields are the scheduler's keys
SCHEDULES: dict[str, type[LRSchedule]] = {
    "Constant": Constant, "Linear": Linear, "Polynomial": Polynomial, "CosineDecay": CosineDecay,
    "CosineAnnealing": CosineAnnealing, "Exponential": Exponential,
    "InverseExponentialTimeDecay": InverseExponentialTimeDecay, "InverseSquareRootDecay": InverseSquareRootDecay,
    "Step": Step, "MultiStep": MultiStep, "PiecewiseConstant": PiecewiseConstant,
}
# Model Zoo's older names (lower case, without the "LR" suffix)
_OLD_NAMES = {"polynomialdecay": "Polynomial", "cosine": "CosineDecay",
              "inversetimedecay": "InverseExponentialTimeDecay", "exponentialdecay": "Exponential"}


def canonical_scheduler(name: Any) -> str | None:
    """'cosinedecaylr', 'CosineDecay', 'CosineDecayLR', 'cosine' -> 'CosineDecay'; None when unknown."""
    key = str(name).strip().lower()
    key = key[:-2] if key.endswith("lr") and key != "lr" else key
    return {n.lower(): n for n in SCHEDULES}.get(key) or _OLD_NAMES.get(key)


def _phase(spec: Mapping[str, Any]) -> LRSchedule:
    name = canonical_scheduler(spec.get("scheduler"))
    if name is None:
        raise ConfigError(f"optimizer.learning_rate: unknown scheduler {spec.get('scheduler')!r}; known: "
                          f"{', '.join(SCHEDULES)} (an 'LR' suffix is fine)")
    cls = SCHEDULES[name]
    accepted = inspect.signature(cls).parameters
    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in spec.items() if k in accepted}
    missing = [k for k, p in accepted.items() if p.default is p.empty and k not in kwargs]
    if missing:
        raise ConfigError(f"optimizer.learning_rate: {spec['scheduler']} needs {', '.join(missing)}")
    for key in ("total_iters", "T_max", "step_size"):
        if key in kwargs and kwargs[key] <= 0:
            raise ConfigError(f"optimizer.learning_rate: {spec['scheduler']} {key} must be positive, "
                              f"got {kwargs[key]}")
    return cls(**kwargs)


def build_schedule(learning_rate: float | Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> LRSchedule:
    """A schedule from a learning rate: a number, one scheduler dict, or a list of them run in sequence.

    Each dict names its schedule under `scheduler` (`canonical_scheduler` reads the spellings) and
    gives its arguments by name (keys a schedule does not take are ignored); every phase but the last needs
    `total_iters`. This is the canonical form `waferscale.params` normalizes a params file's
    `optimizer.learning_rate` to (legacy Model Zoo spellings such as `steps:` are mapped there)."""
    if isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool):
        return Constant(float(learning_rate))
    if isinstance(learning_rate, Mapping):
        learning_rate = [learning_rate]
    if isinstance(learning_rate, (str, bytes)) or not isinstance(learning_rate, Sequence) or not learning_rate \
            or not all(isinstance(spec, Mapping) for spec in learning_rate):
        raise ConfigError(f"optimizer.learning_rate: expected a number, a scheduler dict or a non-empty list of "
                          f"them, got {learning_rate!r}")
    phases = [_phase(spec) for spec in learning_rate]
    if len(phases) == 1:
        return phases[0]
    starts = [0]
    for i, spec in enumerate(learning_rate[:-1]):
        if not spec.get("total_iters"):
            raise ConfigError(f"optimizer.learning_rate[{i}].total_iters: is required for every phase but the last")
        starts.append(starts[-1] + spec["total_iters"])
    return Sequential(tuple(phases), tuple(starts))


# ---- optimizers ----------------------------------------------------------------------------------------

def param_groups(params: Iterable[Any], weight_decay: float,
                 decays: Callable[[str], bool] | None = None) -> list[dict[str, Any]]:
    """Split trainable parameters into {"name": "decay"} and {"name": "no_decay"}. By default by dimension (ndim >= 2:
    matmul and embedding weights; ndim < 2: biases and norm gains), the usual GPT recipe; `decays(name)`, when given,
    decides instead (a params file's run: Model Zoo's split, `models.modelzoo_optim.weight_decay_exempt`), and
    `params` must then be (name, tensor) pairs. Empty groups are left out.

    `params` may yield tensors or (name, tensor) pairs (as `model.named_parameters()`), or param-group dicts,
    which are taken as given (MemoryX's per-unit copies of the resident groups)."""
    params = list(params)
    if params and all(isinstance(p, dict) for p in params):
        return params
    if decays is not None and not all(isinstance(p, tuple) for p in params):
        raise TypeError("param_groups: a `decays` rule needs (name, tensor) pairs, as model.named_parameters()")
    named = [p if isinstance(p, tuple) else ("", p) for p in params]
    trainable = [(n, p) for n, p in named if p.requires_grad]
    decayed = [decays(n) if decays is not None else p.ndim >= 2 for n, p in trainable]
    groups = [{"name": "decay", "params": [p for (_, p), d in zip(trainable, decayed) if d],
               "weight_decay": weight_decay},
              {"name": "no_decay", "params": [p for (_, p), d in zip(trainable, decayed) if not d],
               "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ConfigError("the model has no trainable parameters to optimize")
    return groups


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern, 2018) as transformers' `Adafactor`, which Cerebras' `cstorch.optim.Adafactor`
    ports: a parameter with ndim >= 2 keeps its second moment factored, an average over its last dimension
    (`exp_avg_sq_row`, shape[:-1]) and one over its second-to-last (`exp_avg_sq_col`, shape[:-2] + shape[-1:]);
    others keep it whole (`exp_avg_sq`); `exp_avg` (the gradient's average) only with beta1. Per parameter,
    at its own step t (updates it took):

        v = beta2t * v + (1 - beta2t) * (g^2 + eps[0])          beta2t = 1 - t ** decay_rate
        u = g / sqrt(v)   (factored: v ~ row col^T / mean(row)), then u /= max(1, rms(u) / clip_threshold)
        lr_t = rel * (max(eps[1], rms(p)) if scale_parameter else 1)
        rel  = min(1e-6 t if warmup_init else 1e-2, 1 / sqrt(t)) if relative_step else lr
        p -= lr_t * wd * p + lr_t * u   (u averaged by beta1 first when given; rms(p) is taken before the update)

    Cerebras' port takes its rate from `lr` (a scheduler sets it every step; `relative_step` is False there,
    with `relative_step`, `warmup_init`, beta1 and clip_threshold != 1 refused); transformers' further options
    compute as transformers does. Every parameter is stepped whole, one at a time: the factors need its shape."""

    factored_state = True  # state not shaped like the parameter: a sparsity mask cannot prune it

    def __init__(self, params: Any, lr: float | None = None, eps: tuple[float, float] = (1e-30, 1e-3),
                 clip_threshold: float = 1.0, decay_rate: float = -0.8, beta1: float | None = None,
                 weight_decay: float = 0.0, scale_parameter: bool = True, relative_step: bool = True,
                 warmup_init: bool = False) -> None:
        if lr is not None and relative_step:
            raise ValueError("Adafactor: a learning rate and relative_step=True exclude each other (relative_step "
                             "computes the rate from the step)")
        if lr is None and not relative_step:
            raise ValueError("Adafactor: relative_step=False needs a learning rate")
        if warmup_init and not relative_step:
            raise ValueError("Adafactor: warmup_init=True needs relative_step=True")
        if len(eps) != 2 or min(eps) < 0 or clip_threshold <= 0 or (beta1 is not None and not 0.0 <= beta1 < 1.0):
            raise ValueError(f"Adafactor needs eps two numbers >= 0, clip_threshold > 0 and beta1 in [0, 1) or "
                             f"None, got eps={eps}, clip_threshold={clip_threshold}, beta1={beta1}")
        super().__init__(params, {"lr": lr, "eps": tuple(eps), "clip_threshold": clip_threshold,
                                  "decay_rate": decay_rate, "beta1": beta1, "weight_decay": weight_decay,
                                  "scale_parameter": scale_parameter, "relative_step": relative_step,
                                  "warmup_init": warmup_init})

    @staticmethod
    def state_shapes(shape: Sequence[int], beta1: float | None) -> dict[str, tuple[int, ...]]:
        """The state tensors of a parameter of this shape, by name (checkpoints are checked against them)."""
        shape = tuple(shape)
        out = {"exp_avg": shape} if beta1 is not None else {}
        if len(shape) >= 2:
            return {**out, "exp_avg_sq_row": shape[:-1], "exp_avg_sq_col": shape[:-2] + shape[-1:]}
        return {**out, "exp_avg_sq": shape}

    @staticmethod
    def _rms(t: torch.Tensor) -> torch.Tensor:
        return t.norm(2) / t.numel() ** 0.5

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                if "step" not in state:  # (a holder such as MemoryX may have placed zeroed tensors already)
                    state["step"] = 0
                    for name, shape in self.state_shapes(p.shape, g["beta1"]).items():
                        if state.get(name) is None:
                            state[name] = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
                state["step"] += 1
                t = state["step"]
                rate = g["lr"]
                if g["relative_step"]:
                    rate = min(1e-6 * t if g["warmup_init"] else 1e-2, 1.0 / math.sqrt(t))
                lr = rate * (torch.clamp(self._rms(p), min=g["eps"][1]) if g["scale_parameter"] else 1.0)
                beta2t = 1.0 - math.pow(t, g["decay_rate"])
                update = grad ** 2 + g["eps"][0]
                if p.ndim >= 2:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
                    col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
                    r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                    update = torch.mul(r_factor, col.unsqueeze(-2).rsqrt()).mul_(grad)
                else:
                    v = state["exp_avg_sq"]
                    v.mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                    update = v.rsqrt().mul_(grad)
                update.div_((self._rms(update) / g["clip_threshold"]).clamp_(min=1.0))
                update.mul_(lr)
                if g["beta1"] is not None:
                    update = state["exp_avg"].mul_(g["beta1"]).add_(update, alpha=1.0 - g["beta1"])
                if g["weight_decay"]:
                    p.sub_(p * (g["weight_decay"] * lr))
                p.sub_(update)
        return loss


# optimizer_type -> class: Cerebras' update rules (`runtime.optimizers`), Adafactor as cstorch's port of it
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "SGD": optimizers.SGD, "Adam": optimizers.Adam, "AdamW": optimizers.AdamW, "Adagrad": optimizers.Adagrad,
    "Adamax": optimizers.Adamax, "NAdam": optimizers.NAdam, "RAdam": optimizers.RAdam,
    "RMSprop": optimizers.RMSprop, "Lamb": optimizers.Lamb, "Lion": optimizers.Lion, "Adafactor": Adafactor,
    "ASGD": optimizers.ASGD, "Adadelta": optimizers.Adadelta, "Rprop": optimizers.Rprop,
}
# the OptimizerSpec fields each optimizer takes besides lr and weight_decay (the others: betas and eps)
_SPEC_FIELDS = {"SGD": ("momentum", "nesterov"), "Lion": ("betas",), "RMSprop": ("eps", "momentum"),
                "Adagrad": ("eps",), "Adam": ("betas", "eps"), "AdamW": ("betas", "eps", "correct_bias"),
                "ASGD": (), "Adadelta": ("eps",), "Rprop": (),
                "Adafactor": ("eps", "clip_threshold", "decay_rate", "beta1", "scale_parameter", "relative_step",
                              "warmup_init")}


def default_eps(optimizer_type: str) -> float | tuple[float, float] | None:
    """eps where none is given: the optimizer's own default, as cstorch's (1e-6 for the Adam family, Lamb and
    Adagrad; torch's Adam default is 1e-8; 1e-8 for RMSprop and NAdam; Adafactor's pair)."""
    eps = inspect.signature(OPTIMIZERS[optimizer_type]).parameters.get("eps")
    if eps is None:  # (SGD, Lion: no eps)
        return None
    return tuple(eps.default) if isinstance(eps.default, tuple) else eps.default


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer and its hyper-parameters, as `build_optimizer` and MemoryX read them.

    `learning_rate` is the rate of the first update (a schedule, if any, sets the later ones each step);
    `weight_decay` goes to the "decay" group only (`param_groups`); `momentum` / `nesterov` are SGD's
    (`momentum` is also RMSprop's); betas and eps are used by the optimizers that take them. `eps` left out is
    the optimizer's default (`default_eps`). `correct_bias` is AdamW's (false: no bias correction).
    The fields from clip_threshold on are Adafactor's, with cstorch's defaults (relative_step False: the
    scheduled rate is used, scaled by the parameter's RMS where scale_parameter)."""

    optimizer_type: str
    learning_rate: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float | tuple[float, float] | None = None
    weight_decay: float = 0.0
    momentum: float = 0.0
    nesterov: bool = False
    correct_bias: bool = True
    clip_threshold: float = 1.0
    decay_rate: float = -0.8
    beta1: float | None = None
    scale_parameter: bool = True
    relative_step: bool = False
    warmup_init: bool = False

    def __post_init__(self) -> None:
        if self.optimizer_type not in OPTIMIZERS:
            raise ConfigError(f"optimizer_type {self.optimizer_type!r} is not one of {', '.join(OPTIMIZERS)}")
        pair = self.optimizer_type == "Adafactor"
        if self.eps is None:
            object.__setattr__(self, "eps", default_eps(self.optimizer_type))
        elif pair != isinstance(self.eps, (tuple, list)):
            want = ("two numbers, [regularizer of the squared gradient, floor of the parameter scale]" if pair
                    else "one number")
            raise ConfigError(f"optimizer.eps: {self.optimizer_type} takes {want}, got {self.eps!r}")
        elif pair:
            object.__setattr__(self, "eps", tuple(float(e) for e in self.eps))


def build_optimizer(params: Iterable[Any], spec: OptimizerSpec,
                    decays: Callable[[str], bool] | None = None) -> torch.optim.Optimizer:
    """An optimizer (`OPTIMIZERS`) for `params` per `spec`, at the spec's (first-update) learning rate, weight decay
    on the "decay" group only (`param_groups`, split by `decays` where given). Any object with OptimizerSpec's
    attributes is read the same way."""
    kind = spec.optimizer_type
    cls = OPTIMIZERS.get(kind)
    if cls is None:
        raise ConfigError(f"optimizer_type {kind!r} is not one of {', '.join(OPTIMIZERS)}")
    lr = spec.learning_rate
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise ConfigError(f"the optimizer's learning_rate must be a number (the first update's rate), got {lr!r}; "
                          f"for a schedule pass build_schedule(learning_rate)(0)")
    if kind == "SGD" and spec.nesterov and spec.momentum <= 0:
        raise ConfigError("optimizer.nesterov: needs optimizer.momentum > 0")
    if not getattr(spec, "correct_bias", True) and kind != "AdamW":
        raise ConfigError(f"optimizer.correct_bias: false applies to AdamW only (Cerebras' {kind} has no such "
                          f"option); use AdamW or leave correct_bias out")
    groups = param_groups(params, spec.weight_decay, decays)
    kwargs: dict[str, Any] = {k: getattr(spec, k) for k in _SPEC_FIELDS.get(kind, ("betas", "eps"))}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if "eps" in kwargs and kwargs["eps"] is None:  # (a params section read as a spec)
        kwargs["eps"] = default_eps(kind)
    if kind == "Adafactor" and spec.relative_step:  # the rate comes from the step count, not from lr
        return cls(groups, lr=None, **kwargs)
    return cls(groups, lr=float(lr), **kwargs)


def split_by_lr_scale(optimizer: torch.optim.Optimizer, scale_of: Mapping[int, float]) -> None:
    """Split each param group of a new optimizer (no state yet) by its parameters' learning-rate scales
    (`scale_of`: id(parameter) -> scale, 1 where absent): the parameters of a scale other than 1 go to a copy of
    the group with `adjust_learning_rate` set, which `set_lr` multiplies into every step's rate. Groups in order:
    the given ones (scale 1), then for each given group its copies, scales in order of first appearance; empty
    groups are dropped. The resident run's groups (muP: `zoo.lm.adjust_learning_rates`) and MemoryX's copies of
    them come from here, so their order, and the state-dict indices, agree."""
    if all(s == 1.0 for s in scale_of.values()):
        return
    for group in list(optimizer.param_groups):
        by_scale: dict[float, list[Any]] = {}
        for p in group["params"]:
            by_scale.setdefault(scale_of.get(id(p), 1.0), []).append(p)
        group["params"] = by_scale.pop(1.0, [])
        for scale, params in by_scale.items():
            optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": params,
                                       "adjust_learning_rate": scale, "lr": group["lr"] * scale})
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]


def set_lr(optimizer: torch.optim.Optimizer, lr: float, applies: Any = None) -> None:
    """Set every param group's learning rate (weight decay per group is left as built): `lr` times the group's
    `adjust_learning_rate` where it has one (muP's per-group scale, as cstorch's ScalePerParamLR applies it).
    `applies(group)`, when given, picks the groups (a scheduler's `param_group_tags`)."""
    for group in optimizer.param_groups:
        if applies is None or applies(group):
            group["lr"] = lr * group.get("adjust_learning_rate", 1.0)


__all__ = ["LRSchedule", "SCHEDULES", "canonical_scheduler", "build_schedule", "OptimizerSpec", "OPTIMIZERS",
           "build_optimizer", "param_groups", "default_eps", "split_by_lr_scale", "set_lr", "Adafactor"]
