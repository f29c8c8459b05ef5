"""Learning-rate schedules (values worked out by hand) and optimizer construction."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from waferscale.params import OptimizerParams, load_params
from waferscale.errors import ConfigError
from waferscale.runtime import optimizers
from waferscale.runtime.optim import param_groups, set_lr
from waferscale.zoo.optim import build_optimizer, build_schedule

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def linear(initial: float, end: float, total: int, name: str = "Linear") -> dict:
    return {"scheduler": name, "initial_learning_rate": initial, "end_learning_rate": end, "total_iters": total}


def cosine(initial: float, end: float, total: int, name: str = "CosineDecay") -> dict:
    return {"scheduler": name, "initial_learning_rate": initial, "end_learning_rate": end, "total_iters": total}


# ---- schedules -----------------------------------------------------------------------------------------

def test_constant() -> None:
    assert build_schedule(3e-4)(0) == 3e-4 == build_schedule(3e-4)(10**6)
    s = build_schedule({"scheduler": "ConstantLR", "learning_rate": 0.5})
    assert s(0) == s(123) == 0.5


def test_linear() -> None:
    s = build_schedule(linear(0.0, 1e-3, 10))
    assert s(0) == 0.0
    assert s(5) == pytest.approx(5e-4)
    assert s(10) == pytest.approx(1e-3)
    assert s(20) == pytest.approx(1e-3)  # holds its end value
    down = build_schedule(linear(1.0, 0.5, 4))
    assert [down(i) for i in range(6)] == pytest.approx([1.0, 0.875, 0.75, 0.625, 0.5, 0.5])


def test_cosine_decay() -> None:
    s = build_schedule(cosine(1.0, 0.1, 100))
    assert s(0) == pytest.approx(1.0)
    assert s(50) == pytest.approx(0.55)  # halfway: the mean of the two ends
    assert s(25) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert s(100) == pytest.approx(0.1)
    assert s(150) == pytest.approx(0.1)


def test_exponential() -> None:
    s = build_schedule({"scheduler": "Exponential", "initial_learning_rate": 1.0, "total_iters": 10,
                        "decay_rate": 0.5})
    assert s(0) == 1.0 and s(10) == pytest.approx(0.5) and s(20) == pytest.approx(0.25)
    assert s(5) == pytest.approx(math.sqrt(0.5))
    stairs = build_schedule({"scheduler": "ExponentialLR", "initial_learning_rate": 1.0, "total_iters": 10,
                             "decay_rate": 0.5, "staircase": True})
    assert stairs(9) == 1.0 and stairs(15) == 0.5


def test_other_cerebras_schedulers() -> None:
    poly = build_schedule({"scheduler": "PolynomialDecay", "initial_learning_rate": 1.0, "end_learning_rate": 0.0,
                           "total_iters": 10, "power": 2.0})
    assert poly(5) == pytest.approx(0.25) and poly(10) == 0.0 and poly(11) == 0.0
    step = build_schedule({"scheduler": "StepLR", "initial_learning_rate": 1.0, "step_size": 3, "gamma": 0.1})
    assert [step(i) for i in (0, 2, 3, 6)] == pytest.approx([1.0, 1.0, 0.1, 0.01])
    multi = build_schedule({"scheduler": "MultiStep", "initial_learning_rate": 1.0, "gamma": 0.5,
                            "milestones": [2, 5]})
    assert [multi(i) for i in (0, 1, 2, 4, 5, 9)] == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.25])
    inv = build_schedule({"scheduler": "InverseExponentialTimeDecay", "initial_learning_rate": 1.0,
                          "step_exponent": 1, "total_iters": 10, "decay_rate": 1.0})
    assert inv(0) == 1.0 and inv(10) == pytest.approx(0.5) and inv(30) == pytest.approx(0.25)
    isqrt = build_schedule({"scheduler": "InverseSquareRootDecay", "initial_learning_rate": 2.0, "scale": 1.0,
                            "warmup_steps": 4})
    assert isqrt(0) == isqrt(4) == pytest.approx(1.0) and isqrt(16) == pytest.approx(0.5)
    ann = build_schedule({"scheduler": "CosineAnnealingLR", "initial_learning_rate": 1.0, "T_max": 10,
                          "eta_min": 0.0})
    assert ann(5) == pytest.approx(0.5) and ann(10) == pytest.approx(0.0) and ann(20) == pytest.approx(1.0)
    piece = build_schedule({"scheduler": "PiecewiseConstant", "learning_rates": [3.0, 2.0, 1.0],
                            "milestones": [10, 20]})
    assert [piece(i) for i in (0, 9, 10, 19, 20, 99)] == [3.0, 3.0, 2.0, 2.0, 1.0, 1.0]


def test_warmup_then_cosine() -> None:
    s = build_schedule([linear(0.0, 1e-3, 10), cosine(1e-3, 1e-4, 90, name="CosineDecayLR")])
    assert s(0) == 0.0
    assert s(5) == pytest.approx(5e-4)
    assert s(9) == pytest.approx(9e-4)
    assert s(10) == pytest.approx(1e-3)  # the cosine phase's own step 0
    assert s(55) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # cosine step 45 of 90
    assert s(100) == pytest.approx(1e-4)
    assert s(10_000) == pytest.approx(1e-4)  # the last phase holds its end value


def test_three_phases_ending_constant() -> None:
    s = build_schedule([linear(0.0, 1.0, 2, name="linearlr"),
                        {"scheduler": "Constant", "learning_rate": 1.0, "total_iters": 3},
                        {"scheduler": "Linear", "initial_learning_rate": 1.0, "end_learning_rate": 0.0,
                         "steps": 2}])  # legacy spelling of total_iters
    assert [s(i) for i in range(9)] == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0])


def test_demo_schedule() -> None:
    opt = load_params(CONFIGS / "gpt2_tiny_shakespeare.yaml").optimizer
    s = build_schedule(opt.learning_rate)
    assert s(0) == 0.0 and s(30) == pytest.approx(3e-3) and s(399) == pytest.approx(3e-4, rel=1e-3)


def test_schedule_errors() -> None:
    with pytest.raises(ConfigError, match="unknown scheduler 'Cosin'"):
        build_schedule({"scheduler": "Cosin", "initial_learning_rate": 1.0})
    with pytest.raises(ConfigError, match=r"learning_rate\[0\].total_iters: is required"):
        build_schedule([{"scheduler": "Constant", "learning_rate": 1.0}, linear(1.0, 0.0, 5)])
    with pytest.raises(ConfigError, match="total_iters must be positive"):
        build_schedule(linear(1.0, 0.0, 0))
    with pytest.raises(ConfigError, match="missing required key 'end_learning_rate'"):
        build_schedule({"scheduler": "CosineDecay", "initial_learning_rate": 1.0, "total_iters": 5})


# ---- optimizers ----------------------------------------------------------------------------------------

class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(self.emb(x))) + self.frozen(self.emb(x))


def opt_params(kind: str = "AdamW", **kw) -> OptimizerParams:
    return OptimizerParams(optimizer_type=kind, learning_rate=kw.pop("learning_rate", 1e-2),
                           weight_decay=kw.pop("weight_decay", 0.1), **kw)


def test_weight_decay_only_on_matrices() -> None:
    model = Tiny()
    optimizer = build_optimizer(model.parameters(), opt_params())
    assert isinstance(optimizer, optimizers.AdamW)  # Cerebras' formula (test_optim_cerebras), not torch's
    decay, no_decay = optimizer.param_groups
    assert decay["name"] == "decay" and decay["weight_decay"] == 0.1
    assert no_decay["name"] == "no_decay" and no_decay["weight_decay"] == 0.0
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(decay["params"]) == ids([model.emb.weight, model.fc.weight])
    assert ids(no_decay["params"]) == ids([model.fc.bias, model.norm.weight, model.norm.bias])  # no frozen ones
    assert optimizer.defaults["betas"] == (0.9, 0.999) and optimizer.defaults["eps"] == 1e-6
    # named parameters work too
    assert [len(g["params"]) for g in param_groups(model.named_parameters(), 0.1)] == [2, 3]


def test_starts_at_the_schedules_first_rate_and_set_lr() -> None:
    optimizer = build_optimizer(Tiny().parameters(), opt_params(learning_rate=[linear(0.0, 1.0, 10)]))
    assert all(g["lr"] == 0.0 for g in optimizer.param_groups)
    set_lr(optimizer, 0.25)
    assert all(g["lr"] == 0.25 for g in optimizer.param_groups)


def train_steps(kind: str, steps: int = 3, **kw) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Tiny()
    optimizer = build_optimizer(model.parameters(), opt_params(kind, **kw))
    x = torch.randint(0, 10, (4, 5))
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop"])
def test_every_optimizer_builds_and_steps(kind: str) -> None:
    torch.manual_seed(0)
    before = [p.detach().clone() for p in Tiny().parameters()]
    after = train_steps(kind, momentum=0.9 if kind == "SGD" else 0.0)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_adamw_matches_torch_without_eps() -> None:
    """Our AdamW is Cerebras' (eps before the bias correction; test_optim_cerebras checks it step for step); with
    a negligible eps (1e-12, not 0: rows of the embedding get no gradient, 0 / 0) the formulas agree, so it equals a
    plain torch AdamW with the same two param groups (up to the float32 bias-correction powers Cerebras keeps,
    hence the tolerance)."""
    ours = train_steps("AdamW", betas=(0.9, 0.95), eps=1e-12)
    torch.manual_seed(0)
    model = Tiny()
    groups = param_groups(model.parameters(), 0.1)
    ref = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-12, foreach=False)
    x = torch.randint(0, 10, (4, 5))
    for _ in range(3):
        ref.zero_grad()
        model(x).pow(2).mean().backward()
        ref.step()
    for a, b in zip(ours, model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def test_sgd_momentum() -> None:
    optimizer = build_optimizer(Tiny().parameters(), opt_params("sgd", momentum=0.9, nesterov=True))
    assert isinstance(optimizer, optimizers.SGD)
    assert optimizer.defaults["momentum"] == 0.9 and optimizer.defaults["nesterov"]


def test_refusals() -> None:
    with pytest.raises(ConfigError, match="correct_bias: false applies to AdamW only"):
        opt_params("Adam", correct_bias=False)
    with pytest.raises(ConfigError, match="nesterov"):
        build_optimizer(Tiny().parameters(), opt_params("SGD", nesterov=True))
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        build_optimizer(frozen.parameters(), opt_params())


# ---- the runtime's plain arguments (what the cstorch API and MemoryX use; no params layer) ------------------

def test_runtime_takes_a_spec_and_canonical_schedules() -> None:
    from waferscale.runtime import optim as rt

    spec = rt.OptimizerSpec(optimizer_type="AdamW", learning_rate=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    a, b = Tiny(), Tiny()
    b.load_state_dict(a.state_dict())
    ours, ref = rt.build_optimizer(a.parameters(), spec), build_optimizer(b.parameters(), opt_params())
    assert type(ours) is type(ref) and ours.defaults == ref.defaults
    s = rt.build_schedule([{"scheduler": "LinearLR", "initial_learning_rate": 0.0, "end_learning_rate": 1.0,
                            "total_iters": 4}, {"scheduler": "constant", "learning_rate": 0.5}])
    assert [s(i) for i in (0, 2, 4, 9)] == pytest.approx([0.0, 0.5, 0.5, 0.5])
    with pytest.raises(ConfigError, match="unknown scheduler 'Cosin'"):
        rt.build_schedule({"scheduler": "Cosin", "initial_learning_rate": 1.0})
    with pytest.raises(ConfigError, match="CosineDecay needs end_learning_rate"):
        rt.build_schedule({"scheduler": "CosineDecay", "initial_learning_rate": 1.0, "total_iters": 5})
    with pytest.raises(ConfigError, match="must be a number"):
        rt.build_optimizer(Tiny().parameters(), opt_params(learning_rate=[linear(0.0, 1.0, 10)]))
    with pytest.raises(ConfigError, match="not one of"):
        rt.OptimizerSpec(optimizer_type="Adafactr")
