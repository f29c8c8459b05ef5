"""`cstorch.optim` computes what Cerebras' optimizers compute, step for step.

Each reference below is transcribed from the published cerebras_pytorch 2.10.0 wheel
(cerebras/pytorch/optim/<Name>.py, the `preinitialize` and `step` bodies; AdamBase.py for Adam and AdamW), with
the state made up front as there. A small MLP trains 20 steps under each: every parameter must agree within 1e-6
relative, and the state must hold Cerebras' keys (so a Cerebras checkpoint's optimizer state loads).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

import waferscale.pytorch as cstorch
from waferscale.errors import ConfigError
from waferscale.runtime import optimizers

# ---- references (cerebras_pytorch 2.10.0, cerebras/pytorch/optim/*.py) ------------------------------------------
# Each: (state initializer per parameter, step per parameter). `t` (the float32 global step, Cerebras'
# `increment_global_step`) is passed to those with `enable_global_step=True`.
Init = Callable[[torch.Tensor, dict], dict]
Step = Callable[[torch.Tensor, torch.Tensor, dict, dict, torch.Tensor], None]


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def adam_init(p, g):  # AdamBase.preinitialize
    s = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    if g["amsgrad"]:
        s["max_exp_avg_sq"] = torch.zeros_like(p)
    if g["correct_bias"]:
        s["beta1_power"], s["beta2_power"] = torch.tensor(g["betas"][0]), torch.tensor(g["betas"][1])
    return s


def adam_step(p, grad, s, g, t):  # AdamBase.step
    if g["l2_regularization_rate"] > 0.0:
        grad = grad.add(p, alpha=g["l2_regularization_rate"])
    beta1, beta2 = g["betas"]
    s["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
    s["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    if g["amsgrad"]:
        torch.maximum(s["max_exp_avg_sq"], s["exp_avg_sq"], out=s["max_exp_avg_sq"])
        denom = s["max_exp_avg_sq"].sqrt().add_(g["eps"])
    else:
        denom = s["exp_avg_sq"].sqrt().add_(g["eps"])
    update = s["exp_avg"] / denom
    if g["correct_bias"]:
        one = torch.tensor(1.0, dtype=torch.float32)
        update *= torch.sqrt(one - s["beta2_power"]) / (one - s["beta1_power"])
        s["beta1_power"] *= beta1
        s["beta2_power"] *= beta2
    update.add_(p * g["weight_decay"])
    update *= g["lr"]
    p.sub_(update)


def sgd_init(p, g):
    return {"momentum_buffer": torch.zeros_like(p)} if g["momentum"] != 0 else {}


def sgd_step(p, grad, s, g, t):  # SGD.step
    grad = grad if not g["maximize"] else -grad
    grad = grad + p * g["weight_decay"]
    if g["momentum"] != 0:
        buf = s["momentum_buffer"]
        buf.mul_(g["momentum"]).add_(grad, alpha=1.0 - g["dampening"])
        if g["nesterov"]:
            grad.add_(buf, alpha=g["momentum"])
        else:
            grad = buf
    p.add_(-g["lr"] * grad)


def lamb_step(p, grad, s, g, t):  # Lamb.step
    beta1, beta2 = g["betas"]
    s["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
    s["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    weight_norm = p.pow(2).sum().sqrt().clamp(0, 10).to(torch.float)
    adam_step = s["exp_avg"] / s["exp_avg_sq"].sqrt().add(g["eps"])
    adam_step = adam_step + p * g["weight_decay"]
    adam_norm = adam_step.pow(2).sum().sqrt().to(torch.float)
    zero = torch.tensor(0.0, dtype=torch.float32)
    trust_ratio = torch.where(torch.gt(weight_norm, zero), torch.where(torch.gt(adam_norm, zero),
                              weight_norm / adam_norm, f32(1.0)), f32(1.0))
    if g["adam"]:
        trust_ratio = 1
    p.sub_(adam_step.mul(trust_ratio) * g["lr"])


def lion_step(p, grad, s, g, t):  # Lion.step
    lr, (beta1, beta2) = g["lr"], g["betas"]
    p.mul_(1 - lr * g["weight_decay"])
    update = s["exp_avg"].clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
    p.add_(-lr * update)
    s["exp_avg"].mul_(beta2).add_(grad, alpha=1 - beta2)


def adagrad_step(p, grad, s, g, t):  # Adagrad.step
    grad = grad if not g["maximize"] else -grad
    grad = grad + p * g["weight_decay"]
    s["sum"].addcmul_(grad, grad, value=1.0)
    std = s["sum"].sqrt().add_(g["eps"])
    grad.div_(1.0 + (t - 1.0) * g["lr_decay"])
    p.addcdiv_(-g["lr"] * grad, std)


def adamax_step(p, grad, s, g, t):  # Adamax.step
    grad = grad if not g["maximize"] else -grad
    grad = grad + p * g["weight_decay"]
    beta1, beta2 = g["betas"]
    s["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
    torch.maximum(s["exp_inf"].mul(beta2), grad.abs().add_(g["eps"]), out=s["exp_inf"])
    update = s["exp_avg"] / s["exp_inf"]
    update.div_(1.0 - s["beta1_power"])
    s["beta1_power"] *= beta1
    update *= g["lr"]
    p.sub_(update)


def rmsprop_step(p, grad, s, g, t):  # RMSprop.step
    grad = grad + p * g["weight_decay"]
    alpha = g["alpha"]
    s["square_avg"].mul_(alpha).addcmul_(grad, grad, value=1.0 - alpha)
    if g["centered"]:
        s["grad_avg"].mul_(alpha).add_(grad, alpha=1 - alpha)
        avg = s["square_avg"].addcmul(s["grad_avg"], s["grad_avg"], value=-1.0).sqrt_().add_(g["eps"])
    else:
        avg = s["square_avg"].sqrt().add_(g["eps"])
    if g["momentum"] > 0.0:
        s["momentum_buffer"].mul_(g["momentum"]).addcdiv_(grad, avg)
        p.add_(-g["lr"] * s["momentum_buffer"])
    else:
        p.addcdiv_(-g["lr"] * grad, avg)


def nadam_step(p, grad, s, g, t):  # NAdam.step
    beta1, beta2 = g["betas"][0], torch.tensor(g["betas"][1])
    beta2t = torch.pow(beta2, t)
    bias_correction2 = 1 - beta2t
    grad = grad + p * g["weight_decay"]
    mu = beta1 * (1.0 - 0.5 * torch.pow(f32(0.96), t * g["momentum_decay"]))
    mu_next = beta1 * (1.0 - 0.5 * torch.pow(f32(0.96), (t + 1) * g["momentum_decay"]))
    s["mu_product"] *= mu
    mu_product_next = s["mu_product"] * mu * mu_next
    s["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
    s["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = s["exp_avg_sq"].div(bias_correction2).sqrt().add_(g["eps"])
    update = (mu_next * s["exp_avg"]) / (1.0 - mu_product_next) + (grad * (1.0 - mu)) / (1.0 - s["mu_product"])
    update *= -g["lr"]
    p.addcdiv_(update, denom)


def radam_step(p, grad, s, g, t):  # RAdam.step
    beta1, beta2 = torch.tensor(g["betas"][0]), torch.tensor(g["betas"][1])
    grad = grad + p * g["weight_decay"]
    beta1t, beta2t = torch.pow(beta1, t), torch.pow(beta2, t)
    bias_correction1, bias_correction2 = 1 - beta1t, 1 - beta2t
    s["exp_avg"].mul_(beta1).add_(grad, alpha=1.0 - beta1)
    s["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    update = s["exp_avg"] / bias_correction1
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * t * beta2t / bias_correction2
    one, five = torch.tensor(1.0), torch.tensor(5.0)
    rect = torch.where(torch.gt(rho_t, five), torch.sqrt((rho_t - 4.0) * (rho_t - 2.0) * rho_inf
                                                         / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)), one)
    adaptive_lr = torch.where(torch.gt(rho_t, five), torch.sqrt(bias_correction2)
                              / s["exp_avg_sq"].sqrt().add_(g["eps"]), one)
    update *= rect
    update *= adaptive_lr
    update *= g["lr"]
    p.sub_(update)


def asgd_step(p, grad, s, g, t):  # ASGD.step
    alpha = torch.tensor(g["alpha"])
    grad = grad if not g["maximize"] else -grad
    mu, ax, eta = s["mu"], s["ax"], s["eta"]
    grad = grad + p * g["weight_decay"]
    p.mul_(1 - g["lambd"] * eta)
    p.add_(grad * eta.neg())
    ax.copy_(torch.where(mu == 1, p, ax.add(p.sub(ax).mul(mu))))
    eta.copy_(g["lr"] / torch.pow(1 + g["lambd"] * g["lr"] * t, alpha))
    mu.copy_(1 / torch.maximum(torch.ones(size=[], dtype=mu.dtype), t - g["t0"]))


def adadelta_step(p, grad, s, g, t):  # Adadelta.step
    grad = grad if not g["maximize"] else -grad
    grad = grad + p * g["weight_decay"]
    rho, eps = g["rho"], g["eps"]
    s["square_avg"].mul_(rho).addcmul_(grad, grad, value=1 - rho)
    std = s["square_avg"].add(eps).sqrt_()
    delta = s["acc_delta"].add(eps).sqrt_().div_(std).mul_(grad)
    s["acc_delta"].mul_(rho).addcmul_(delta, delta, value=1 - rho)
    p.add_(-g["lr"] * delta)


def rprop_step(p, grad, s, g, t):  # Rprop.step (it masks p.grad in place; a copy here, the update is the same)
    grad = grad.clone()
    (size_min, size_max), (etaminus, etaplus) = (torch.tensor(v) for v in g["step_sizes"]), map(torch.tensor, g["etas"])
    zero, one, neg_one = torch.tensor(0.0), torch.tensor(1.0), torch.tensor(-1.0)
    m = grad.mul(s["prev"])
    m = torch.where(torch.gt(m, zero), etaplus, m)
    m = torch.where(torch.lt(m, zero), etaminus, m)
    m = torch.where(torch.eq(m, zero), one, m)
    step_size = torch.clamp(s["step_size"].mul_(m), min=size_min, max=size_max)
    grad.mul_(torch.where(torch.eq(m, etaminus), zero, one))
    sign = torch.where(torch.gt(grad, zero), one, torch.zeros_like(grad))
    sign = torch.where(torch.lt(grad, zero), neg_one, sign)
    p.sub_(torch.mul(sign, step_size))
    s["prev"].copy_(grad)
    s["step_size"].copy_(step_size)


def adafactor_init(p, g):  # Adafactor.preinitialize (beta1 None: Cerebras refuses it)
    if p.ndim >= 2:
        return {"exp_avg_sq_row": torch.zeros(p.shape[:-1]), "exp_avg_sq_col": torch.zeros(p.shape[:-2] + p.shape[-1:])}
    return {"exp_avg_sq": torch.zeros_like(p)}


def adafactor_step(p, grad, s, g, t):  # Adafactor.step with _get_lr, _rms, _approx_sq_grad
    def rms(x):
        return x.square().mean().sqrt()

    lr = (torch.maximum(rms(p), torch.tensor(g["eps"][1])) if g["scale_parameter"] else 1.0) * g["lr"]
    beta2t = 1.0 - torch.pow(t, torch.tensor(g["decay_rate"]))
    update = (grad**2) + g["eps"][0]
    if p.ndim >= 2:
        row, col = s["exp_avg_sq_row"], s["exp_avg_sq_col"]
        row.mul_(beta2t).add_(update.mean(dim=-1).mul(1.0 - beta2t))
        col.mul_(beta2t).add_(update.mean(dim=-2).mul(1.0 - beta2t))
        r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
        update = torch.mul(r_factor, col.rsqrt().unsqueeze(-2))
        update.mul_(grad)
    else:
        s["exp_avg_sq"].mul_(beta2t).add_(update.mul(1.0 - beta2t))
        update = s["exp_avg_sq"].rsqrt().mul_(grad)
    update.div_(torch.maximum(rms(update) / g["clip_threshold"], torch.tensor(1.0, dtype=torch.float32)))
    update.mul_(lr)
    p.sub_(p.mul(g["weight_decay"] * lr))
    p.sub_(update)


def zeros(*names: str) -> Init:
    return lambda p, g: {n: torch.zeros_like(p) for n in names}


REFERENCES: dict[str, tuple[Init, Step, bool]] = {  # name -> (preinitialize, step, enable_global_step)
    "Adam": (adam_init, adam_step, False), "AdamW": (adam_init, adam_step, False), "SGD": (sgd_init, sgd_step, False),
    "Lamb": (zeros("exp_avg", "exp_avg_sq"), lamb_step, False), "Lion": (zeros("exp_avg"), lion_step, False),
    "Adagrad": (lambda p, g: {"sum": torch.full_like(p, g["initial_accumulator_value"])}, adagrad_step, True),
    "Adamax": (lambda p, g: {**zeros("exp_avg", "exp_inf")(p, g), "beta1_power": torch.tensor(g["betas"][0])},
               adamax_step, False),
    "RMSprop": (lambda p, g: {**zeros("square_avg")(p, g), **(zeros("momentum_buffer")(p, g) if g["momentum"] > 0
                                                               else {}),
                              **(zeros("grad_avg")(p, g) if g["centered"] else {})}, rmsprop_step, False),
    "NAdam": (lambda p, g: {"mu_product": torch.tensor(1.0), **zeros("exp_avg", "exp_avg_sq")(p, g)}, nadam_step, True),
    "RAdam": (zeros("exp_avg", "exp_avg_sq"), radam_step, True),
    "ASGD": (lambda p, g: {"eta": torch.tensor(g["lr"]), "mu": torch.tensor(1.0), "ax": torch.zeros_like(p)},
             asgd_step, True),
    "Adadelta": (zeros("square_avg", "acc_delta"), adadelta_step, False),
    "Rprop": (lambda p, g: {"prev": torch.zeros_like(p), "step_size": torch.full_like(p, g["lr"])}, rprop_step, False),
    "Adafactor": (adafactor_init, adafactor_step, True),
}


def mlp(scale: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    with torch.no_grad():
        model[0].weight.mul_(scale)
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(20)]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean() * 1e-2  # small gradients: eps matters, as in a real run's late steps


def train_reference(name: str, model: nn.Module, group: dict[str, Any]) -> dict:
    init, step, global_step = REFERENCES[name]
    state = {p: {**init(p, group), **({"step": f32(0.0)} if global_step else {})} for p in model.parameters()}
    for x, y in batches():
        model.zero_grad()
        loss_of(model, x, y).backward()
        with torch.no_grad():
            for p in model.parameters():
                t = None
                if global_step:
                    state[p]["step"] += 1.0
                    t = state[p]["step"]
                step(p, p.grad, state[p], group, t)
    return state


def train_ours(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    for x, y in batches():
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()


CASES = [  # (class name, constructor arguments, reference param-group values beyond them, first-layer scale)
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}, {"l2_regularization_rate": 0.0}, 1.0),
    ("AdamW", {"lr": 1e-2, "amsgrad": True, "correct_bias": False}, {"l2_regularization_rate": 0.0}, 1.0),
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1}, {"l2_regularization_rate": 0.1, "weight_decay": 0.0}, 1.0),
    ("SGD", {"lr": 0.5, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01}, {}, 1.0),
    ("SGD", {"lr": 0.5, "momentum": 0.9, "nesterov": True, "maximize": True}, {}, 1.0),
    ("Lamb", {"lr": 1e-2, "weight_decay": 0.01}, {}, 8.0),  # the first layer's norm (~13) is capped at 10
    ("Lamb", {"lr": 1e-2, "adam": True}, {}, 1.0),
    ("Lion", {"lr": 1e-3, "weight_decay": 0.1}, {}, 1.0),
    ("Adagrad", {"lr": 1e-2, "lr_decay": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1}, {}, 1.0),
    ("Adamax", {"lr": 1e-2, "weight_decay": 0.01}, {}, 1.0),
    ("RMSprop", {"lr": 1e-3, "momentum": 0.5, "centered": True, "weight_decay": 0.01}, {}, 1.0),
    ("NAdam", {"lr": 1e-2, "weight_decay": 0.01}, {}, 1.0),
    ("RAdam", {"lr": 1e-2, "weight_decay": 0.01}, {}, 1.0),  # rho_t passes 5 at step 6: both branches run
    ("ASGD", {"lr": 0.5, "t0": 5.0, "lambd": 1e-2}, {}, 1.0),
    ("Adadelta", {"lr": 1.0, "weight_decay": 0.01}, {}, 1.0),
    ("Rprop", {"lr": 1e-2}, {}, 1.0),
    ("Adafactor", {"lr": 1e-2, "weight_decay": 0.01}, {}, 1.0),
]


@pytest.mark.parametrize("name,kwargs,extra,scale", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_matches_cerebras_step_for_step(name: str, kwargs: dict, extra: dict, scale: float) -> None:
    check_against_reference(name, kwargs, extra, scale)


@pytest.mark.parametrize("fused", [True, False])
def test_adam_in_several_multi_tensor_chunks(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adam/AdamW step a group in chunks of bounded size (their temporaries): 40 elements here, a chunk per layer
    tensor or two, the same result; through torch's fused kernel (float32 on CPU/CUDA) and through the per-operation
    path (any other dtype or device)."""
    monkeypatch.setattr(optimizers, "_CHUNK_NUMEL", 40)
    monkeypatch.setattr(optimizers, "_FUSED", fused)
    for case in CASES[:3]:
        check_against_reference(*case)


def check_against_reference(name: str, kwargs: dict, extra: dict, scale: float) -> None:
    ours_model, ref_model = mlp(scale), mlp(scale)
    opt = getattr(cstorch.optim, name)(ours_model.parameters(), **kwargs)
    group = {**{k: v for k, v in opt.param_groups[0].items() if k != "params"}, **extra}
    if name == "Lamb" and scale > 1:
        assert ref_model[0].weight.norm() > 10  # (the cap is exercised)
    train_ours(opt, ours_model)
    ref_state = train_reference(name, ref_model, group)
    for (n, ours), ref in zip(ours_model.named_parameters(), ref_model.parameters()):
        rel = ((ours - ref).norm() / ref.norm()).item()
        assert rel <= 1e-6, f"{name} {n}: relative difference {rel:.2e}"
        assert set(opt.state[ours]) == set(ref_state[ref]), f"{name} state keys"  # Cerebras' names
        for k, v in ref_state[ref].items():  # (Adafactor counts its steps in an int: the value is compared)
            torch.testing.assert_close(torch.as_tensor(opt.state[ours][k], dtype=v.dtype), v, rtol=1e-5, atol=1e-9)


def test_torch_adamw_drifts_where_cerebras_does_not() -> None:
    """The difference the reference test catches: torch's AdamW (eps after the bias correction) on the same run."""
    torch_model, ref_model = mlp(), mlp()
    train_ours(torch.optim.AdamW(torch_model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1), torch_model)
    train_reference("AdamW", ref_model, {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.1,
                                         "l2_regularization_rate": 0.0, "correct_bias": True, "amsgrad": False})
    worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(torch_model.parameters(), ref_model.parameters()))
    assert worst > 1e-5


# the published step(): closure under no_grad (the step is decorated), except where it enables grad around it
CLOSURE_GRAD = {"Adam": False, "AdamW": False, "SGD": False, "Lamb": False, "Adagrad": False, "Adamax": False,
                "RMSprop": False, "Adadelta": False, "Rprop": False, "Adafactor": False,
                "Lion": True, "ASGD": True, "NAdam": True, "RAdam": True}


@pytest.mark.parametrize("name", sorted(CLOSURE_GRAD))
def test_closure_grad_mode(name: str) -> None:
    model = mlp()
    opt = getattr(cstorch.optim, name)(model.parameters(), lr=1e-3)
    seen = []
    x, y = batches()[0]

    def closure() -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        return loss_of(model, x, y)

    loss = opt.step(closure)
    assert seen == [CLOSURE_GRAD[name]] and loss.requires_grad == CLOSURE_GRAD[name]


def test_sgd_needs_a_learning_rate() -> None:
    with pytest.raises(TypeError, match="lr"):
        cstorch.optim.SGD(mlp().parameters())
    with pytest.raises(ConfigError, match="SGD needs lr"):
        cstorch.optim.configure_optimizer("SGD", mlp().parameters(), momentum=0.9)


def test_torch_format_adam_state_resumes() -> None:
    """A torch AdamW state (`step`, steps done) becomes beta powers of the coming step: resuming after 10 steps gives
    the run that never stopped."""
    whole, resumed = mlp(), mlp()
    opt = cstorch.optim.AdamW(whole.parameters(), lr=1e-2)
    train_ours(opt, whole)
    first = cstorch.optim.AdamW(resumed.parameters(), lr=1e-2)
    data = batches()
    for x, y in data[:10]:
        first.zero_grad()
        loss_of(resumed, x, y).backward()
        first.step()
    sd = first.state_dict()
    for st in sd["state"].values():  # as torch writes it
        st["step"] = torch.tensor(10.0)
        del st["beta1_power"], st["beta2_power"]
    for g in sd["param_groups"]:
        del g["l2_regularization_rate"], g["correct_bias"]
    second = cstorch.optim.AdamW(resumed.parameters(), lr=1e-2)
    second.load_state_dict(sd)
    for x, y in data[10:]:
        second.zero_grad()
        loss_of(resumed, x, y).backward()
        second.step()
    for a, b in zip(whole.parameters(), resumed.parameters()):  # (beta^11 from a float64 power, not the float32
        assert ((a - b).norm() / b.norm()).item() <= 1e-5       # running product: a few ulps apart)


# ---- schedulers (cerebras/pytorch/optim/scheduler.py, cerebras_pytorch 2.10.0) -----------------------------------

def polynomial_closed_form(t: int, initial: float, end: float, total_iters: int, power: float, cycle: bool) -> float:
    """PolynomialScheduler._get_closed_form."""
    last_epoch = torch.tensor(t)
    alpha = torch.tensor(1.0, dtype=torch.float32)
    if cycle:
        alpha = torch.add(last_epoch, 1).div(total_iters).ceil()
    return float(torch.where(last_epoch >= total_iters, torch.tensor(end, dtype=torch.float32),
                             torch.sub(1, torch.div(last_epoch, torch.mul(total_iters, alpha)))
                             .pow(power).mul(initial - end).add(end).float()))


def tagged_optimizer() -> torch.optim.Optimizer:
    model = mlp()
    return cstorch.optim.AdamW([{"params": [model[0].weight], "tags": "embedding"},
                                {"params": [model[0].bias], "tags": ["norm", "bias"]},
                                {"params": list(model[2].parameters())}], lr=0.5)


@pytest.mark.parametrize("cycle", [False, True])
def test_linear_and_polynomial_lr_follow_the_published_formula(cycle: bool) -> None:
    opt = tagged_optimizer()
    linear = cstorch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, 7, cycle=cycle)
    poly = cstorch.optim.lr_scheduler.PolynomialLR(tagged_optimizer(), 1.0, 0.1, 7, 2.0)  # (power, positionally)
    for t in range(20):
        assert linear.get_last_lr()[0] == pytest.approx(polynomial_closed_form(t, 1.0, 0.1, 7, 1.0, cycle), rel=1e-6)
        assert poly.get_last_lr()[0] == pytest.approx(polynomial_closed_form(t, 1.0, 0.1, 7, 2.0, False), rel=1e-6)
        linear.step()
        poly.step()


def should_apply(tags: set | None, group: dict) -> bool:
    """Scheduler._should_apply_to_param_group, after optimizer.py's Optimizer.__init__ made the group's tags a set."""
    if group.get("tags", None):
        if isinstance(group["tags"], (list, tuple)):
            group = {**group, "tags": set(group["tags"])}
        elif not isinstance(group["tags"], set):
            group = {**group, "tags": {group["tags"]}}
    if tags is None:
        return True
    if p_tags := group.get("tags", {None}):
        return bool(tags.intersection(p_tags))
    return False


@pytest.mark.parametrize("tags", [None, "embedding", ["bias"], [None], ["embedding", None]])
def test_param_group_tags_pick_the_groups(tags: Any) -> None:
    opt = tagged_optimizer()
    sched = cstorch.optim.lr_scheduler.ConstantLR(opt, 0.25, param_group_tags=tags)
    wanted = None if tags is None else set(tags) if isinstance(tags, list) else {tags}
    applies = [should_apply(wanted, g) for g in opt.param_groups]
    assert [g["lr"] for g in opt.param_groups] == [0.25 if a else 0.5 for a in applies]
    assert sched.get_last_lr() == [0.25 if a else None for a in applies]


def test_param_group_tags_refusals() -> None:
    with pytest.raises(ConfigError, match=r"match no param group .*bias, embedding, norm"):
        cstorch.optim.lr_scheduler.ConstantLR(tagged_optimizer(), 0.1, param_group_tags="decoder")
    with pytest.raises(ConfigError, match="holds a tag twice"):
        cstorch.optim.lr_scheduler.ConstantLR(tagged_optimizer(), 0.1, param_group_tags=["bias", "bias"])
    opt = tagged_optimizer()
    a = cstorch.optim.lr_scheduler.ConstantLR(opt, 0.1, param_group_tags="bias")
    b = cstorch.optim.lr_scheduler.ConstantLR(opt, 0.2, param_group_tags="bias")
    with pytest.raises(ConfigError, match="must be the same"):
        cstorch.optim.lr_scheduler.SequentialLR(opt, [a, b], [3])


@pytest.mark.parametrize("last_epoch", [-1, 0, 3, 8])
def test_sequential_lr_last_epoch(last_epoch: int) -> None:
    """SequentialScheduler: its last_epoch starts at last_epoch + 1 (the constructor's step), its schedulers at 0;
    each step advances the first and, past milestone i, scheduler i + 1 (`increment_last_epoch`); the value is
    scheduler i's where last_epoch has passed milestone i (`_get_closed_form`)."""
    forms = [lambda t: polynomial_closed_form(t, 0.0, 1.0, 4, 1.0, False),
             lambda t: polynomial_closed_form(t, 1.0, 0.2, 6, 1.0, False), lambda t: 0.2]
    milestones = [4, 10]
    opt = tagged_optimizer()
    lrs = cstorch.optim.lr_scheduler
    ours = lrs.SequentialLR(opt, [lrs.LinearLR(opt, 0.0, 1.0, 4), lrs.LinearLR(opt, 1.0, 0.2, 6),
                                  lrs.ConstantLR(opt, 0.2)], milestones, last_epoch=last_epoch)
    seq, subs = last_epoch + 1, [0, 0, 0]
    for _ in range(20):
        value = forms[0](subs[0])
        for i, m in enumerate(milestones):
            value = value if seq < m else forms[i + 1](subs[i + 1])
        assert ours.get_last_lr()[0] == pytest.approx(value, rel=1e-6)
        ours.step()
        seq += 1
        subs[0] += 1
        for i, m in enumerate(milestones):
            subs[i + 1] += 0 if seq <= m else 1


def test_scheduled_rate_takes_each_groups_mup_adjustment() -> None:
    """A group's `adjust_learning_rate` (muP, as ScalePerParamScheduler applies it) scales what a scheduler sets."""
    model = mlp()
    opt = cstorch.optim.AdamW([{"params": [model[0].weight], "adjust_learning_rate": 0.25, "tags": "hidden"},
                               {"params": list(model[2].parameters())}], lr=1.0)
    sched = cstorch.optim.lr_scheduler.LinearLR(opt, 0.8, 0.0, 4, param_group_tags=["hidden", None])
    sched.step()
    assert sched.get_last_lr() == pytest.approx([0.6 * 0.25, 0.6])


@pytest.mark.parametrize("kind", ["AdamW", "Lamb"])
def test_params_file_path_computes_cerebras_update(kind: str) -> None:
    """`wsc run`'s optimizer section builds the same optimizers (Cerebras' formulas are the default there too)."""
    from waferscale.params import OptimizerParams
    from waferscale.zoo.optim import build_optimizer

    ours_model, ref_model = mlp(8.0), mlp(8.0)
    opt = build_optimizer(ours_model.parameters(), OptimizerParams(optimizer_type=kind, learning_rate=1e-2))
    train_ours(opt, ours_model)
    train_reference(kind, ref_model, {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0,
                                      "l2_regularization_rate": 0.0, "correct_bias": True, "amsgrad": False,
                                      "adam": False})
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        assert ((a - b).norm() / b.norm()).item() <= 1e-6
