"""Sparsity core: schedules, masks, the algorithms' choices, configure's errors, and the resident hooks against a
hand-masked dense reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from waferscale import sparse
from waferscale.errors import ConfigError
from waferscale.sparse.masks import (Shaper, drop_minimum, grow_maximum, mask_for_sparsity, pack_bits, topk_mask,
                                     unpack_bits)
from waferscale.sparse.schedules import make_schedule, make_update_schedule


def test_schedules_follow_their_formulas() -> None:
    assert make_schedule(0.5)(7) == 0.5
    assert make_schedule({"type": "linear", "init": 0.1, "slope": 0.01})(10) == pytest.approx(0.2)
    assert make_schedule({"type": "exp", "init": 0.0, "gamma": -0.1, "final": 0.9})(10) == \
        pytest.approx(0.9 - 0.9 * math.exp(-1.0))
    assert make_schedule({"type": "power", "init": 0.8, "beta": 0.5})(2) == pytest.approx(0.2)
    cos = make_schedule({"type": "cosine", "init": 0.3, "half_period": 10})
    assert (cos(0), cos(10), cos(20)) == pytest.approx((0.3, 0.0, 0.3))
    cyc = make_schedule([0.1, 0.2])
    seen = []
    for update in (False, True, True):
        seen.append(cyc(0))
        cyc.update(update)
    assert seen == [0.1, 0.1, 0.2] and cyc.state_dict() == {"index": 0}


def test_update_schedules() -> None:
    freq = make_update_schedule({"freq": 3, "start": 2, "stop": 9})
    assert [s for s in range(12) if freq(s)] == [2, 5, 8]
    assert [s for s in range(12) if make_update_schedule({"steps": [1, 4]})(s)] == [1, 4]
    assert all(make_update_schedule(None)(s) for s in range(3))


def test_topk_is_stable_and_balanced() -> None:
    score = torch.tensor([[1.0, 1.0, 0.0, 3.0], [2.0, 0.0, 0.0, 0.0]])
    assert topk_mask(score, 3).tolist() == [[True, False, False, True], [True, False, False, False]]  # tie: lower index
    rows = mask_for_sparsity(score, 0.5, Shaper(2, "out"))  # each row keeps 2
    assert rows.sum(1).tolist() == [2, 2]
    cols = mask_for_sparsity(score, 0.5, Shaper(2, "in"))  # each half of the columns keeps 2
    assert cols[:, :2].sum().item() == 2 and cols[:, 2:].sum().item() == 2


def test_drop_and_regrow_keep_the_count() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 8, generator=g)
    mask = mask_for_sparsity(w.abs(), 0.75)
    dropped, k = drop_minimum(w.abs(), mask, 0.5)
    assert k == 8 and dropped.sum() == 8 and not (dropped & ~mask).any()
    grown = grow_maximum(torch.rand(8, 8, generator=g), dropped, 0.75, k)
    assert grown.sum() == 16 and (grown & dropped).sum() == 8


@pytest.mark.parametrize("n", [1, 7, 8, 13, 64])
def test_bitmask_round_trip(n: int) -> None:
    keep = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.4
    bits = pack_bits(keep)
    assert bits.dtype == torch.uint8 and bits.numel() == (n + 7) // 8
    assert torch.equal(unpack_bits(bits, n), keep)


@pytest.mark.parametrize("cfg, message", [
    (1.0, "in [0, 1)"),
    ({"sparsity": -0.1}, "in [0, 1)"),
    ({"algorithm": "magic", "sparsity": 0.5}, "choose one of static, gmp, set, rigl"),
    ({"sparsity": 0.5, "colour": 1}, "unknown key colour"),
    ({"algorithm": "set", "sparsity": 0.5}, "needs update"),
    ({"algorithm": "gmp", "sparsity": 0.5, "update": {"freq": 10}}, "never changes its masks"),
    ({"algorithm": "static", "sparsity": 0.5, "update": {"freq": 10}}, "dynamic algorithms"),
    ({"algorithm": "rigl", "sparsity": 0.5, "update": {"start": 3}}, "needs freq"),
    ({"sparsity": {"type": "zigzag"}}, "choose one of constant"),
    ({"algorithm": "set", "sparsity": 0.5, "update": {"freq": 2}, "drop_fraction": 1.5}, "drop_fraction"),
])
def test_configure_refuses_bad_input(cfg: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        sparse.configure(cfg)


def test_type_is_the_older_name_of_algorithm() -> None:
    with pytest.warns(DeprecationWarning):
        group = sparse.configure({"type": "rigl", "sparsity": 0.5, "update": {"freq": 5}})
    assert isinstance(group.algorithms[0], sparse.RigL)


def test_a_filter_that_matches_nothing_is_an_error() -> None:
    with pytest.raises(ConfigError, match="matches no parameter"):
        sparse.sparsify_module(sparse.configure({"sparsity": 0.5, "param_filter": "*.nothing"}), nn.Linear(4, 4))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, 8)
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(torch.relu(self.fc1(self.embedding(x)))))


ALGORITHMS = {
    "static": {"sparsity": 0.75, "init_method": "topk"},
    "gmp": {"algorithm": "gmp", "sparsity": {"type": "linear", "init": 0.2, "slope": 0.1}, "update": {"freq": 2}},
    "set": {"algorithm": "set", "sparsity": 0.75, "update": {"freq": 2, "stop": 5}, "drop_fraction": 0.3},
    "rigl": {"algorithm": "rigl", "sparsity": 0.75, "update": {"freq": 2},
             "drop_fraction": {"type": "cosine", "init": 0.5, "half_period": 4}, "balance_out_groups": 4},
}


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 16, (4, 5), generator=g) for _ in range(n)]


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_hooks_equal_a_hand_masked_dense_run(name: str) -> None:
    """The hooked model trains exactly as a plain one whose weights, gradients and optimizer state are masked by
    hand with the masks the algorithm chose at each step."""
    torch.manual_seed(0)
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    group = sparse.configure(ALGORITHMS[name])
    sparse.sparsify_module(group, model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sparse.sparsify_optimizer(group, opt)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    names = list(group.params)
    assert names == ["fc1.weight", "fc2.weight"]  # the default filter: no embedding, norm or bias
    changes = 0
    for x in _batches(6):
        masks = {n: group.params[n].mask.clone() for n in names}
        ref_params = dict(ref.named_parameters())
        with torch.no_grad():
            for n in names:
                ref_params[n].mul_(masks[n])
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        for n in names:
            ref_params[n].grad.mul_(masks[n])
            for v in ref_opt.state.get(ref_params[n], {}).values():
                if v.shape == masks[n].shape:
                    v.mul_(masks[n])
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        changes += any(not torch.equal(masks[n], group.params[n].mask) for n in names)
        with torch.no_grad():  # the reference adopts the new masks as the hooked run did
            for n in names:
                ref_params[n].mul_(group.params[n].mask)
                for v in ref_opt.state.get(ref_params[n], {}).values():
                    if v.shape == masks[n].shape:
                        v.mul_(group.params[n].mask)
        for (k, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=k)
    assert (changes > 0) == (name != "static")
    mask = model.state_dict()["fc1.weight_mask"]
    assert mask.dtype == torch.bool and 1 - mask.float().mean().item() == pytest.approx(group.figures()["sparsity"],
                                                                                       abs=0.05)
    assert (model.fc1.weight[~mask] == 0).all()


PARAMS = """\
train_input: {data_dir: shakespeare, batch_size: 4}
model: {vocab_size: 65, hidden_size: 32, num_hidden_layers: 2, num_heads: 2, max_position_embeddings: 64}
optimizer: {optimizer_type: AdamW, learning_rate: 1.0e-3}
runconfig: {max_steps: 10}
sparsity:
"""


@pytest.mark.parametrize("section, line, message", [
    ("  algorithm: rigl\n  sparsity: 0.9\n  update:\n    freq: 0\n", 8, "update.freq must be an integer >= 1"),
    ("  algorithm: gmp\n  sparsity: {type: linear, init: 0.1, slope: 0.1}\n  update: {freq: 2, start: 10}\n", 5,
     "comes after the run ends"),
    ("  algorithm: rigll\n  sparsity: 0.9\n", 6, "choose one of static, gmp, set, rigl"),
    ("  sparsity: 0.9\n  colour: red\n", 7, "unknown key colour"),
    ("  sparsity: 1.5\n", 6, "in [0, 1)"),
    ("  algorithm: set\n  sparsity: 0.5\n", 5, "set needs update"),
])
def test_a_params_files_sparsity_section_is_checked_with_its_line(tmp_path, section, line, message) -> None:
    from waferscale.params import load_params

    path = tmp_path / "p.yaml"
    path.write_text(PARAMS + section)
    with pytest.raises(ConfigError) as e:
        load_params(path)
    assert f"{path}:{line}:" in str(e.value) and message in str(e.value), str(e.value)


def test_both_layouts_and_the_older_type_key_are_accepted(tmp_path) -> None:
    from waferscale.params import load_params

    path = tmp_path / "p.yaml"
    path.write_text(PARAMS + "  type: set\n  sparsity: 0.75\n  update: {freq: 3}\n  drop_fraction: 0.2\n")
    assert load_params(path).sparsity["type"] == "set"
    trainer = """\
trainer:
  init:
    model: {name: gpt2, vocab_size: 65, hidden_size: 32, num_hidden_layers: 2, num_heads: 2,
            max_position_embeddings: 64}
    optimizer: {AdamW: {weight_decay: 0.1}}
    schedulers: [{ConstantLR: {learning_rate: 1.0e-3}}]
    sparsity: {algorithm: gmp, sparsity: {type: exp, init: 0.0, gamma: -0.1, final: 0.9}, update: {freq: 2}}
    loop: {max_steps: 10}
  fit:
    train_dataloader: {data_dir: shakespeare, batch_size: 4}
"""
    path.write_text(trainer)
    assert load_params(path).sparsity["algorithm"] == "gmp"
