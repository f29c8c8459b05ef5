"""Optimizers torch does not ship: Lion and Lamb, with multi-tensor (foreach) kernels."""

from __future__ import annotations

from typing import Any

import torch


def _with_grads(opt: torch.optim.Optimizer, group: dict, *state: str) -> tuple[list, ...]:
    """The group's parameters that have gradients, their gradients, and per name in `state` their state
    tensors (zeros on first use)."""
    ps = [p for p in group["params"] if p.grad is not None]
    return (ps, [p.grad for p in ps],
            *([opt.state[p].setdefault(n, torch.zeros_like(p)) for p in ps] for n in state))


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023): p -= lr * (sign(b1 * m + (1 - b1) * g) + wd * p); m = b2 * m + (1 - b2) * g."""

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if lr < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion needs lr >= 0 and betas in [0, 1), got lr={lr}, betas={betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for g in self.param_groups:
            ps, grads, ms = _with_grads(self, g, "exp_avg")
            if not ps:
                continue
            b1, b2 = g["betas"]
            if g["weight_decay"]:
                torch._foreach_mul_(ps, 1.0 - g["lr"] * g["weight_decay"])
            update = torch._foreach_mul(ms, b1)
            torch._foreach_add_(update, grads, alpha=1.0 - b1)
            torch._foreach_sign_(update)
            torch._foreach_add_(ps, update, alpha=-g["lr"])
            torch._foreach_mul_(ms, b2)
            torch._foreach_add_(ms, grads, alpha=1.0 - b2)
        return loss


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019) without bias correction: u = m / (sqrt(v) + eps) + wd * p, then
    p -= lr * trust * u with trust = ||p|| / ||u|| per parameter (1 where either norm is zero)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        if lr < 0 or eps < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb needs lr >= 0, eps >= 0, betas in [0, 1), got {lr}, {eps}, {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for g in self.param_groups:
            ps, grads, ms, vs = _with_grads(self, g, "exp_avg", "exp_avg_sq")
            if not ps:
                continue
            b1, b2 = g["betas"]
            torch._foreach_lerp_(ms, grads, 1.0 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1.0 - b2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_add_(denom, g["eps"])
            update = torch._foreach_div(ms, denom)
            if g["weight_decay"]:
                torch._foreach_add_(update, ps, alpha=g["weight_decay"])
            w_norm = torch._foreach_norm(ps)
            u_norm = torch._foreach_norm(update)
            for p, u, wn, un in zip(ps, update, w_norm, u_norm):
                trust = torch.where((wn > 0) & (un > 0), wn / un, torch.ones_like(wn))
                p.add_(u * trust, alpha=-g["lr"])
        return loss
