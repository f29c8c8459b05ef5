"""The optimizers' update rules, as Cerebras' `cerebras.pytorch.optim` (cerebras_pytorch 2.10.0) computes them:
the one home of each formula. `cstorch.optim` makes them streamable, the zoo builds them from a params file and
MemoryX steps its units with them (`runtime.optim.build_optimizer`), so every path computes the same update.

Where Cerebras' formula differs from torch's, Cerebras' is the one here:

    Adam / AdamW   update = m / (sqrt(v) + eps) * sqrt(1 - beta2^t) / (1 - beta1^t): epsilon before the bias
                   correction, with beta1^t and beta2^t kept as float32 state (`beta1_power`, `beta2_power`,
                   multiplied by the betas each step, not recomputed); eps defaults to 1e-6; `correct_bias`
    Lamb           the weight norm is capped at 10 before the trust ratio; `adam=True` fixes the ratio at 1
    SGD            `lr` is required; the momentum buffer starts at zero (torch's starts at the first gradient, which
                   differs when dampening != 0); `maximize`
    Adamax, NAdam, RAdam, Adagrad, ASGD  step counts and bias-correction powers are float32 tensors

The closure runs under no_grad (Cerebras traces it as part of the step) except in Lion, ASGD, NAdam and RAdam,
which enable grad around it as their published step does.

State is made at a parameter's first step (zeros, as Cerebras pre-initializes it), so a parameter that never gets
a gradient holds none; ASGD and Rprop make theirs at construction, as their initial values come from the
constructor's lr. Param groups may carry any further keys (a muP `adjust_learning_rate`; `tags`, a name or a
list of names, which the schedulers' `param_group_tags` select: kept as given, where Cerebras makes it a set, so
the state dict stays savable).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from waferscale.errors import ConfigError


def _check(name: str, lr: float, eps: float = 0.0, betas: tuple[float, float] = (0.0, 0.0),
           weight_decay: float = 0.0) -> None:
    if lr < 0.0 or eps < 0.0 or weight_decay < 0.0 or not all(0.0 <= b < 1.0 for b in betas):
        raise ConfigError(f"{name} needs lr >= 0, eps >= 0, weight_decay >= 0 and betas in [0, 1), got lr={lr}, "
                         f"eps={eps}, weight_decay={weight_decay}, betas={tuple(betas)}")


def _f32(value: float, like: Tensor) -> Tensor:
    return torch.tensor(value, dtype=torch.float32, device=like.device)


# elements per multi-tensor call: bounds its temporaries (two float32 copies of a chunk, 1 GiB), where torch's
# multi-tensor optimizers copy a whole group (an assumption: large enough that launches are few on a GPU)
_CHUNK_NUMEL = 1 << 27


def _chunks(items: list[tuple[Tensor, Tensor, dict]]) -> Any:
    """(parameter, gradient, state) triples in runs of at most _CHUNK_NUMEL elements (a larger tensor alone)."""
    chunk: list[tuple[Tensor, Tensor, dict]] = []
    numel = 0
    for item in items:
        if chunk and numel + item[0].numel() > _CHUNK_NUMEL:
            yield chunk
            chunk, numel = [], 0
        chunk.append(item)
        numel += item[0].numel()
    if chunk:
        yield chunk


class CerebrasOptimizer(torch.optim.Optimizer):
    """Base: the closure's grad mode, the float32 global step of Cerebras' base optimizer."""

    closure_grad = False  # whether step() enables grad around the closure

    def _run_closure(self, closure: Any) -> Any:
        if closure is None:
            return None
        with torch.set_grad_enabled(self.closure_grad):
            return closure()

    def _stepped(self, group: dict[str, Any]) -> Any:
        """(parameter, gradient, state) of the group's parameters that have a gradient."""
        for p in group["params"]:
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                yield p, p.grad, self.state[p]

    @staticmethod
    def _zeros(state: dict[str, Any], p: Tensor, *names: str) -> list[Tensor]:
        return [state[n] if state.get(n) is not None else state.setdefault(n, torch.zeros_like(p)) for n in names]

    @staticmethod
    def _increment_global_step(state: dict[str, Any], p: Tensor) -> Tensor:
        step = state.get("step")
        state["step"] = (_f32(0.0, p) if step is None else torch.as_tensor(step, dtype=torch.float32)) + 1.0
        return state["step"]


class AdamBase(CerebrasOptimizer):
    """Adam (`l2_regularization_rate`: the decay added to the gradient) and AdamW (`weight_decay`: decoupled)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, l2_regularization_rate: float = 0.0, correct_bias: bool = True,
                 amsgrad: bool = False) -> None:
        _check(type(self).__name__, lr, eps, betas, weight_decay)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "l2_regularization_rate": l2_regularization_rate, "correct_bias": correct_bias,
                                  "amsgrad": amsgrad})

    @staticmethod
    def _beta_powers(state: dict[str, Any], group: dict[str, Any], p: Tensor) -> tuple[Tensor, Tensor]:
        """beta1^t and beta2^t of the coming step t; from torch's `step` (steps done) when the state came from a
        torch-format checkpoint (Cerebras' own conversion uses beta^step, one step behind: see docs/cli.md)."""
        if state.get("beta1_power") is None:
            done = float(state.pop("step", 0))
            beta1, beta2 = group["betas"]
            state["beta1_power"] = _f32(beta1 ** (done + 1), p)
            state["beta2_power"] = _f32(beta2 ** (done + 1), p)
        return state["beta1_power"], state["beta2_power"]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Cerebras' update, through torch's fused AdamW kernel where it applies (`_fused_step`), else Cerebras'
        per-parameter operations, each applied to a chunk of the group's parameters at once (torch's multi-tensor
        kernels: one launch per operation, not per parameter)."""
        loss = self._run_closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            stepped = list(self._stepped(group))
            if _FUSED and all(p.dtype == torch.float32 and p.device.type in ("cpu", "cuda") and g.dtype == p.dtype
                              for p, g, _ in stepped):
                self._fused_step(group, stepped)
                continue
            for chunk in _chunks(stepped):
                ps, grads = [p for p, _, _ in chunk], [g for _, g, _ in chunk]
                if group["l2_regularization_rate"] > 0.0:
                    grads = torch._foreach_add(grads, ps, alpha=group["l2_regularization_rate"])
                exp_avg, exp_avg_sq = map(list, zip(*(self._zeros(s, p, "exp_avg", "exp_avg_sq") for p, _, s in chunk)))
                torch._foreach_mul_(exp_avg, beta1)
                torch._foreach_add_(exp_avg, grads, alpha=1.0 - beta1)
                torch._foreach_mul_(exp_avg_sq, beta2)
                torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1.0 - beta2)
                if group["amsgrad"]:
                    max_sq = [self._zeros(s, p, "max_exp_avg_sq")[0] for p, _, s in chunk]
                    torch._foreach_maximum_(max_sq, exp_avg_sq)
                    exp_avg_sq = max_sq
                denom = torch._foreach_sqrt(exp_avg_sq)
                torch._foreach_add_(denom, group["eps"])
                update = torch._foreach_div(exp_avg, denom)
                del denom
                if group["correct_bias"]:
                    beta1_power, beta2_power = map(list, zip(*(self._beta_powers(s, group, p) for p, _, s in chunk)))
                    step_size = torch._foreach_sqrt(torch._foreach_add(torch._foreach_neg(beta2_power), 1.0))
                    torch._foreach_div_(step_size, torch._foreach_add(torch._foreach_neg(beta1_power), 1.0))
                    torch._foreach_mul_(update, step_size)
                    torch._foreach_mul_(beta1_power, beta1)
                    torch._foreach_mul_(beta2_power, beta2)
                if group["weight_decay"]:
                    torch._foreach_add_(update, torch._foreach_mul(ps, group["weight_decay"]))
                torch._foreach_mul_(update, group["lr"])
                torch._foreach_sub_(ps, update)
        return loss


    def _fused_step(self, group: dict[str, Any], stepped: list[tuple[Tensor, Tensor, dict]]) -> None:
        """The same update in one pass per tensor. torch's fused AdamW at step 1 computes
            p <- p (1 - lr' wd') - lr' / (1 - b1) * m / (sqrt(v) / sqrt(1 - b2) + eps')
        with m, v updated as Cerebras updates them (m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2, or their
        running maximum with amsgrad), which is Cerebras' p - lr wd p - lr c m / (sqrt(v) + eps) for
            eps' = eps / sqrt(1 - b2),   lr' = lr c (1 - b1) / sqrt(1 - b2),   wd' = lr wd / lr'
        where c = sqrt(1 - beta2^t) / (1 - beta1^t), computed in float32 from the state's powers as Cerebras
        computes it (1 without correct_bias). Only the rounding of the scalars' products differs (~1e-7)."""
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        runs: dict[tuple[float, float, torch.device], list[tuple[Tensor, Tensor, dict]]] = {}
        for p, g, st in stepped:  # parameters whose powers agree share one call (all of them, in a normal run)
            powers = self._beta_powers(st, group, p) if group["correct_bias"] else (p.new_zeros(()),) * 2
            runs.setdefault((float(powers[0]), float(powers[1]), p.device), []).append((p, g, st))
        t1 = math.sqrt(1.0 - beta2)
        for (b1p, b2p, device), run in runs.items():
            c = 1.0
            if group["correct_bias"]:  # float32, as Cerebras' tensors compute it
                one = torch.ones((), dtype=torch.float32)
                c = float(torch.sqrt(one - b2p) / (one - b1p))
            lr1 = lr * c * (1.0 - beta1) / t1
            for chunk in _chunks(run):
                ps = [p for p, _, _ in chunk]
                grads = [g for _, g, _ in chunk]
                if group["l2_regularization_rate"] > 0.0:
                    grads = torch._foreach_add(grads, ps, alpha=group["l2_regularization_rate"])
                names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")
                state = [self._zeros(st, p, *names) for p, _, st in chunk]
                m, v = [s[0] for s in state], [s[1] for s in state]
                vmax = [s[2] for s in state] if group["amsgrad"] else []
                step = [torch.ones((), dtype=torch.float32, device=device)] * len(ps)
                torch._fused_adamw_(ps, grads, m, v, vmax, step, lr=lr1, beta1=beta1, beta2=beta2,
                                    weight_decay=(lr * wd / lr1) if lr1 else 0.0,  # lr 0: weights stay, moments move
                                    eps=eps / t1, amsgrad=group["amsgrad"], maximize=False)
            if group["correct_bias"]:
                for p, _, st in run:
                    st["beta1_power"].mul_(beta1)
                    st["beta2_power"].mul_(beta2)


# torch's fused AdamW kernel (CPU and CUDA float32) where this torch has it
_FUSED = hasattr(torch, "_fused_adamw_")


class AdamW(AdamBase):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, correct_bias: bool = True, amsgrad: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, 0.0, correct_bias, amsgrad)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for group in state_dict["param_groups"]:  # (torch's and Hugging Face's AdamW state has no such key)
            group["l2_regularization_rate"] = 0.0
            group.setdefault("correct_bias", True)
        super().load_state_dict(state_dict)


class Adam(AdamBase):
    """torch's `weight_decay` (added to the gradient) is Cerebras' `l2_regularization_rate`."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, amsgrad: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, 0.0, True, amsgrad)
        self._l2_from_weight_decay(self.param_groups)

    @staticmethod
    def _l2_from_weight_decay(groups: list[dict[str, Any]]) -> None:
        """A group's `weight_decay` (its own or the constructor's) becomes its L2 rate; torch-format state
        (`weight_decay` only) loads the same way. (Cerebras' Adam gives every group the constructor's rate.)"""
        for group in groups:
            decay = group.pop("weight_decay", 0.0)
            group["l2_regularization_rate"] = group.get("l2_regularization_rate") or decay
            group["weight_decay"], group["correct_bias"] = 0.0, True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._l2_from_weight_decay(state_dict["param_groups"])
        super().load_state_dict(state_dict)


class SGD(CerebrasOptimizer):
    def __init__(self, params: Any, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False) -> None:
        _check("SGD", lr, weight_decay=weight_decay)
        if momentum < 0.0:
            raise ConfigError(f"SGD needs momentum >= 0, got {momentum}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigError(f"SGD: Nesterov momentum needs momentum > 0 and dampening 0, got momentum={momentum}, "
                             f"dampening={dampening}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._run_closure(closure)
        for group in self.param_groups:
            momentum = group["momentum"]
            for p, grad, state in self._stepped(group):
                grad = -grad if group["maximize"] else grad
                grad = grad + p * group["weight_decay"]
                if momentum != 0:
                    (buf,) = self._zeros(state, p, "momentum_buffer")
                    buf.mul_(momentum).add_(grad, alpha=1.0 - group["dampening"])
                    if group["nesterov"]:
                        grad.add_(buf, alpha=momentum)
                    else:
                        grad = buf
                p.add_(-group["lr"] * grad)
        return loss


class Lamb(CerebrasOptimizer):
    """LAMB (You et al., 2019) without bias correction; the trust ratio is min(||p||, 10) / ||u||, 1 where either
    norm is zero or with `adam=True`."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, adam: bool = False) -> None:
        _check("Lamb", lr, eps, betas)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "adam": adam})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._run_closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p, grad, state in self._stepped(group):
                exp_avg, exp_avg_sq = self._zeros(state, p, "exp_avg", "exp_avg_sq")
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                weight_norm = p.pow(2).sum().sqrt().clamp(0, 10).to(torch.float)
                adam_step = exp_avg / exp_avg_sq.sqrt().add(group["eps"])
                adam_step = adam_step + p * group["weight_decay"]
                if group["adam"]:
                    trust_ratio: Tensor | float = 1.0
                else:
                    adam_norm = adam_step.pow(2).sum().sqrt().to(torch.float)
                    one = _f32(1.0, p)
                    trust_ratio = torch.where(weight_norm > 0, torch.where(adam_norm > 0, weight_norm / adam_norm, one),
                                              one)
                p.sub_(adam_step.mul(trust_ratio) * group["lr"])
        return loss


class Lion(CerebrasOptimizer):
    """Lion (Chen et al., 2023): p -= lr * (sign(b1 * m + (1 - b1) * g) + wd * p); m = b2 * m + (1 - b2) * g."""

    closure_grad = True

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        _check("Lion", lr, betas=betas, weight_decay=weight_decay)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._run_closure(closure)
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for p, grad, state in self._stepped(group):
                (exp_avg,) = self._zeros(state, p, "exp_avg")
                p.mul_(1 - lr * group["weight_decay"])
                update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
                p.add_(-lr * update)
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
        return loss


class Adagrad(CerebrasOptimizer):
    def __init__(self, params: Any, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-6, maximize: bool = False) -> None:
        _check("Adagrad", lr, eps, weight_decay=weight_decay)
        if lr_decay < 0.0 or initial_accumulator_value < 0.0:
            raise ConfigError(f"Adagrad needs lr_decay >= 0 and initial_accumulator_value >= 0, got {lr_decay}, "
                             f"{initial_accumulator_value}")
        super().__init__(params, {"lr": lr, "lr_decay": lr_decay, "eps": eps, "weight_decay": weight_decay,
                                  "initial_accumulator_value": initial_accumulator_value, "maximize": maximize})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._run_closure(closure)
        for group in self.param_groups:
            for p, grad, state in self._stepped(group):
                if state.get("sum") is None:
                    state["sum"] = torch.full_like(p, group["initial_accumulator_value"])
                global_step = self._increment_global_step(state, p)
                grad = -grad if group["maximize"] else grad
                grad = grad + p * group["weight_decay"]
                state["sum"].addcmul_(grad, grad, value=1.0)
                std = state["sum"].sqrt().add_(group["eps"])
                grad.div_(1.0 + (global_step - 1.0) * group["lr_decay"])
                p.addcdiv_(-group["lr"] * grad, std)
        return loss


class Adamax(CerebrasOptimizer):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, maximize: bool = False) -> None:
        _check("Adamax", lr, eps, betas)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "maximize": maximize})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._run_closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p, grad, state in self._stepped(group):
                grad = -grad if group["maximize"] else grad
                grad = grad + p * group["weight_decay"]
                exp_avg, exp_inf = self._zeros(state, p, "exp_avg", "exp_inf")
                if state.get("beta1_power") is None:
                    state["beta1_power"] = _f32(beta1, p)
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                torch.maximum(exp_inf.mul(beta2), grad.abs().add_(group["eps"]), out=exp_inf)
                update = exp_avg / exp_inf
                update.div_(1.0 - state["beta1_power"])
                state["beta1_power"] *= beta1
                update *= group["lr"]
                p.sub_(update)
        return loss


class RMSprop(CerebrasOptimizer):
    def __init__(self, params: Any, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False) -> None:
        _check("RMSprop", lr, eps, weight_decay=weight_decay)
        if momentum < 0.0 or alpha < 0.0:
            raise ConfigError(f"RMSprop needs momentum >= 0 and alpha >= 0, got {momentum}, {alpha}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "alpha": alpha, "eps": eps, "centered": centered,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._run_closure(closure)
        for group in self.param_groups:
            lr, alpha, eps = group["lr"], group["alpha"], group["eps"]
            for p, grad, state in self._stepped(group):
                (square_avg,) = self._zeros(state, p, "square_avg")
                grad = grad + p * group["weight_decay"]
                square_avg.mul_(alpha).addcmul_(grad, grad, value=1.0 - alpha)
                if group["centered"]:
                    (grad_avg,) = self._zeros(state, p, "grad_avg")
                    grad_avg.mul_(alpha).add_(grad, alpha=1 - alpha)
                    avg = square_avg.addcmul(grad_avg, grad_avg, value=-1.0).sqrt_().add_(eps)
                else:
                    avg = square_avg.sqrt().add_(eps)
                if group["momentum"] > 0.0:
                    (buf,) = self._zeros(state, p, "momentum_buffer")
                    buf.mul_(group["momentum"]).addcdiv_(grad, avg)
                    p.add_(-lr * buf)
                else:
                    p.addcdiv_(-lr * grad, avg)
        return loss


class NAdam(CerebrasOptimizer):
    closure_grad = True

    def __init__(self, params: Any, lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum_decay: float = 4e-3) -> None:
        _check("NAdam", lr, eps, betas, weight_decay)
        if momentum_decay < 0.0:
            raise ConfigError(f"NAdam needs momentum_decay >= 0, got {momentum_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "momentum_decay": momentum_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._run_closure(closure)
        for group in self.param_groups:
            beta1, decay = group["betas"][0], group["momentum_decay"]
            for p, grad, state in self._stepped(group):
                beta2 = _f32(group["betas"][1], p)  # (a float32 tensor in Cerebras' step: so are 1 - beta2, ...)
                exp_avg, exp_avg_sq = self._zeros(state, p, "exp_avg", "exp_avg_sq")
                if state.get("mu_product") is None:
                    state["mu_product"] = _f32(1.0, p)
                mu_product = state["mu_product"]
                t = self._increment_global_step(state, p)
                bias_correction2 = 1 - torch.pow(beta2, t)
                grad = grad + p * group["weight_decay"]
                point_nine_six = _f32(0.96, p)
                mu = beta1 * (1.0 - 0.5 * torch.pow(point_nine_six, t * decay))
                mu_next = beta1 * (1.0 - 0.5 * torch.pow(point_nine_six, (t + 1) * decay))
                mu_product *= mu
                mu_product_next = mu_product * mu * mu_next
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = exp_avg_sq.div(bias_correction2).sqrt().add_(group["eps"])
                update = (mu_next * exp_avg) / (1.0 - mu_product_next) + (grad * (1.0 - mu)) / (1.0 - mu_product)
                update *= -group["lr"]
                p.addcdiv_(update, denom)
        return loss


class RAdam(CerebrasOptimizer):
    closure_grad = True

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0) -> None:
        _check("RAdam", lr, eps, betas, weight_decay)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._run_closure(closure)
        for group in self.param_groups:
            for p, grad, state in self._stepped(group):
                beta1, beta2 = (_f32(b, p) for b in group["betas"])  # (float32 tensors in Cerebras' step)
                rho_inf = 2 / (1 - beta2) - 1
                exp_avg, exp_avg_sq = self._zeros(state, p, "exp_avg", "exp_avg_sq")
                t = self._increment_global_step(state, p)
                grad = grad + p * group["weight_decay"]
                beta2t = torch.pow(beta2, t)
                bias_correction1, bias_correction2 = 1 - torch.pow(beta1, t), 1 - beta2t
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                update = exp_avg / bias_correction1
                rho_t = rho_inf - 2 * t * beta2t / bias_correction2
                one, rectify = _f32(1.0, p), rho_t > 5.0
                rect = torch.where(rectify, torch.sqrt((rho_t - 4.0) * (rho_t - 2.0) * rho_inf
                                                       / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)), one)
                adaptive_lr = torch.where(rectify, torch.sqrt(bias_correction2)
                                          / exp_avg_sq.sqrt().add_(group["eps"]), one)
                update *= rect
                update *= adaptive_lr
                update *= group["lr"]
                p.sub_(update)
        return loss


class ASGD(CerebrasOptimizer):
    closure_grad = True

    def __init__(self, params: Any, lr: float = 1e-2, lambd: float = 1e-4, alpha: float = 0.75, t0: float = 1e6,
                 weight_decay: float = 0.0, maximize: bool = False) -> None:
        _check("ASGD", lr, weight_decay=weight_decay)
        super().__init__(params, {"lr": lr, "lambd": lambd, "alpha": alpha, "t0": t0, "weight_decay": weight_decay,
                                  "maximize": maximize})
        for group in self.param_groups:  # eta starts at the constructor's lr: made now, as Cerebras does
            for p in group["params"]:
                self.state[p].update(eta=_f32(group["lr"], p), mu=_f32(1.0, p), ax=torch.zeros_like(p),
                                     step=_f32(0.0, p))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._run_closure(closure)
        for group in self.param_groups:
            lambd, lr, t0 = group["lambd"], group["lr"], group["t0"]
            for p, grad, state in self._stepped(group):
                alpha = _f32(group["alpha"], p)
                grad = -grad if group["maximize"] else grad
                mu, ax, eta = state["mu"], state["ax"], state["eta"]
                t = self._increment_global_step(state, p)
                grad = grad + p * group["weight_decay"]
                p.mul_(1 - lambd * eta)
                p.add_(grad * eta.neg())
                ax.copy_(torch.where(mu == 1, p, ax.add(p.sub(ax).mul(mu))))
                eta.copy_(lr / torch.pow(1 + lambd * lr * t, alpha))
                mu.copy_(1 / torch.maximum(torch.ones(size=[], dtype=mu.dtype, device=p.device), t - t0))
        return loss


class Adadelta(CerebrasOptimizer):
    def __init__(self, params: Any, lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0.0,
                 maximize: bool = False) -> None:
        _check("Adadelta", lr, eps, weight_decay=weight_decay)
        if not 0.0 <= rho <= 1.0:
            raise ConfigError(f"Adadelta needs rho in [0, 1], got {rho}")
        super().__init__(params, {"lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay,
                                  "maximize": maximize})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._run_closure(closure)
        for group in self.param_groups:
            rho, eps = group["rho"], group["eps"]
            for p, grad, state in self._stepped(group):
                square_avg, acc_delta = self._zeros(state, p, "square_avg", "acc_delta")
                grad = -grad if group["maximize"] else grad
                grad = grad + p * group["weight_decay"]
                square_avg.mul_(rho).addcmul_(grad, grad, value=1 - rho)
                std = square_avg.add(eps).sqrt_()
                delta = acc_delta.add(eps).sqrt_().div_(std).mul_(grad)
                acc_delta.mul_(rho).addcmul_(delta, delta, value=1 - rho)
                p.add_(-group["lr"] * delta)
        return loss


class Rprop(CerebrasOptimizer):
    def __init__(self, params: Any, lr: float = 1e-3, etas: tuple[float, float] = (0.5, 1.2),
                 step_sizes: tuple[float, float] = (1e-6, 50.0)) -> None:
        _check("Rprop", lr)
        super().__init__(params, {"lr": lr, "etas": tuple(etas), "step_sizes": tuple(step_sizes)})
        for group in self.param_groups:  # the step sizes start at the constructor's lr: made now, as Cerebras does
            for p in group["params"]:
                self.state[p].update(prev=torch.zeros_like(p), step_size=torch.full_like(p, group["lr"]))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._run_closure(closure)
        for group in self.param_groups:
            (size_min, size_max), (etaminus, etaplus) = group["step_sizes"], group["etas"]
            for p, grad, state in self._stepped(group):
                zero, one = _f32(0.0, p), _f32(1.0, p)
                minus, plus = _f32(etaminus, p), _f32(etaplus, p)
                multiplier = grad.mul(state["prev"])
                multiplier = torch.where(multiplier > zero, plus, multiplier)
                multiplier = torch.where(multiplier < zero, minus, multiplier)
                multiplier = torch.where(multiplier == zero, one, multiplier)
                step_size = torch.clamp(state["step_size"].mul_(multiplier), min=size_min, max=size_max)
                grad = grad * torch.where(multiplier == minus, zero, one)  # (Cerebras masks p.grad in place)
                p.sub_(torch.sign(grad) * step_size)
                state["prev"].copy_(grad)
                state["step_size"].copy_(step_size)
        return loss


__all__ = ["CerebrasOptimizer", "AdamBase", "Adam", "AdamW", "SGD", "Lamb", "Lion", "Adagrad", "Adamax", "RMSprop",
           "NAdam", "RAdam", "ASGD", "Adadelta", "Rprop"]
