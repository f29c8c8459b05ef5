"""Model Zoo's initializers (models/init.py) checked against their formulas; the params file's `initializer`,
`output_layer_initializer` and `embedding_initializer` applied where Model Zoo applies them, also to a model
built on the meta device; the Cerebras-GPT muP configs' scalings in the model and the optimizer's per-group
learning rates; and the muP property itself: one AdamW step moves the hidden features by the same amount at
widths 64, 128 and 256 with muP, by an amount growing with width without it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from waferscale.errors import CheckpointError, ConfigError
from waferscale.models import build, config_from_name
from waferscale.models.init import Initializer
from waferscale.models.mup import lr_adjustment
from waferscale.params import load_params, params_from_dict
from waferscale.runtime.optim import OptimizerSpec, build_optimizer, set_lr
from waferscale.zoo.lm import adjust_learning_rates

ZOO = Path(__file__).resolve().parent / "data" / "modelzoo"
MUP_111M = ZOO / "params_cerebras_gpt_111m_mup.yaml"
FAN_OUT, FAN_IN = 256, 1024  # a Linear weight (out, in): torch's fan_in is its second dimension


def _filled(spec) -> torch.Tensor:
    torch.manual_seed(0)
    return Initializer.parse(spec)(torch.empty(FAN_OUT, FAN_IN))


def _phi(x: float) -> float:
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return (1 + math.erf(x / math.sqrt(2))) / 2


def _truncated_moments(mean: float, std: float, a: float, b: float) -> tuple[float, float]:
    """Mean and std of N(mean, std^2) restricted to [a, b] (the textbook formulas)."""
    al, be = (a - mean) / std, (b - mean) / std
    z = _cdf(be) - _cdf(al)
    m = mean + std * (_phi(al) - _phi(be)) / z
    var = std ** 2 * (1 + (al * _phi(al) - be * _phi(be)) / z - ((_phi(al) - _phi(be)) / z) ** 2)
    return m, math.sqrt(var)


def _check(t: torch.Tensor, mean: float, std: float, lo: float = -math.inf, hi: float = math.inf) -> None:
    assert lo <= t.min().item() and t.max().item() <= hi
    assert t.mean().item() == pytest.approx(mean, abs=0.02 * std)
    assert t.std().item() == pytest.approx(std, rel=0.02)


def test_each_initializer_follows_its_formula():
    relu_gain = math.sqrt(2.0)
    _check(_filled({"name": "normal", "mean": 0.5, "std": 0.2}), 0.5, 0.2)
    _check(_filled("normal"), 0.0, 0.05)  # Model Zoo's defaults
    m, s = _truncated_moments(0.1, 0.1, -0.15, 0.25)
    _check(_filled({"name": "truncated_normal", "mean": 0.1, "std": 0.1, "a": -0.15, "b": 0.25}), m, s, -0.15, 0.25)
    m, s = _truncated_moments(0.0, 0.03, -0.06, 0.06)  # a, b left out: 2 stds either side
    _check(_filled({"name": "truncated_normal", "std": 0.03}), m, s, -0.06, 0.06)
    _check(_filled({"name": "uniform", "a": -0.3, "b": 0.1}), -0.1, 0.4 / math.sqrt(12), -0.3, 0.1)
    _check(_filled("uniform"), 0.0, 0.1 / math.sqrt(12), -0.05, 0.05)
    bound = 2.0 * math.sqrt(6 / (FAN_IN + FAN_OUT))
    _check(_filled({"name": "xavier_uniform", "gain": 2.0}), 0.0, bound / math.sqrt(3), -bound, bound)
    _check(_filled({"name": "glorot_normal", "gain": "relu"}), 0.0, relu_gain * math.sqrt(2 / (FAN_IN + FAN_OUT)))
    bound = relu_gain * math.sqrt(3 / FAN_IN)  # leaky_relu with slope 0: relu's gain, over fan_in
    _check(_filled("kaiming_uniform"), 0.0, bound / math.sqrt(3), -bound, bound)
    _check(_filled({"name": "kaiming_normal", "mode": "fan_out", "nonlinearity": "relu"}), 0.0,
           relu_gain / math.sqrt(FAN_OUT))
    bound = math.sqrt(3 * 2.0 / ((FAN_IN + FAN_OUT) / 2))
    _check(_filled({"name": "variance_scaling", "scale": 2.0, "mode": "fan_avg", "distribution": "uniform"}), 0.0,
           bound / math.sqrt(3), -bound, bound)
    # TensorFlow's truncation correction over torch's default bounds (+-2, far outside these values)
    _check(_filled("lecun_normal"), 0.0, math.sqrt(1 / FAN_IN) / 0.87962566103423978)
    assert torch.equal(_filled({"name": "constant", "val": 0.7}), torch.full((FAN_OUT, FAN_IN), 0.7))
    assert torch.equal(_filled("ones"), torch.ones(FAN_OUT, FAN_IN))
    assert torch.equal(_filled("zeros"), torch.zeros(FAN_OUT, FAN_IN))


@pytest.mark.parametrize("spec, words", [
    ("xavier", ["'xavier'", "xavier_uniform"]),
    ({"name": "xavier_uniform", "std": 0.1}, ["std", "gain"]),
    ({"name": "uniform", "a": 0.2, "b": 0.1}, ["a (0.2)", "below b"]),
    ({"name": "kaiming_normal", "mode": "fan_avg"}, ["fan_in or fan_out"]),
    ({"name": "normal", "stdev": 0.1}, ["stdev"]),
    ({"std": 0.1}, ["name"]),
])
def test_a_bad_initializer_says_what_is_wrong(spec, words):
    with pytest.raises(ConfigError) as e:
        Initializer.parse(spec)
    assert all(w in str(e.value) for w in words), str(e.value)


def _small_mup_config():
    """The published 111M muP model section on a small shape (its initializers and scalings kept)."""
    cfg = load_params(MUP_111M).model.to_model_config()
    return cfg.replace(n_layer=2, d_model=256, n_head=4, d_ff=1024, vocab_size=512, max_seq_len=64)


def test_published_mup_config_is_honoured_by_the_model_and_its_optimizer():
    p = load_params(MUP_111M)
    cfg = p.model.to_model_config()
    assert (cfg.embeddings_scale, cfg.output_logits_scale, cfg.scale_qk_dot_by_d) == (10.0, 1 / 3, True)
    assert cfg.initializer == Initializer("truncated_normal", mean=0.0, std=0.046188021535170064,
                                          a=-0.09237604307034013, b=0.09237604307034013)
    assert p.optimizer.adjust_learning_rate == {"decoder_kernel": 1 / 3}
    assert not any(k.endswith("initializer") for k in p.ignored)

    small = _small_mup_config()
    torch.manual_seed(0)
    model = build(small)
    for name, t in model.named_parameters():
        if t.ndim == 1:
            assert torch.equal(t, torch.ones_like(t) if name.endswith("norm.weight") else torch.zeros_like(t)), name
            continue
        spec = (small.embedding_initializer if name.startswith("embed.") else small.output_layer_initializer
                if name.endswith(("o_proj.weight", "down_proj.weight")) else small.initializer)
        m, s = _truncated_moments(spec.mean, spec.std, spec.a, spec.b)
        assert spec.a <= t.min().item() and t.max().item() <= spec.b, name
        assert t.mean().item() == pytest.approx(m, abs=0.05 * s), name
        assert t.std().item() == pytest.approx(s, rel=0.05), name


def _spread(t: torch.Tensor, spec: Initializer) -> None:
    """t is spec's truncated normal (its bounds, its std)."""
    assert spec.arg("a") <= t.min().item() and t.max().item() <= spec.arg("b")
    mean, std = _truncated_moments(spec.arg("mean"), spec.arg("std"), spec.arg("a"), spec.arg("b"))
    assert t.mean().item() == pytest.approx(mean, abs=0.05 * std)
    assert t.std().item() == pytest.approx(std, rel=0.05)


def test_each_family_applies_the_initializers_where_model_zoo_does():
    shape = dict(n_layer=2, d_model=256, n_head=4, d_ff=1024, vocab_size=512, max_seq_len=64)
    # Model Zoo's GPT-J model (the published GPT-J 6B config): the MLP takes output_layer_initializer
    gptj = load_params(ZOO / "params_gptj_6B.yaml").model.to_model_config().replace(**shape, rotary_dim=None)
    torch.manual_seed(0)
    w = dict(build(gptj).named_parameters())
    for name in ("attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
        _spread(w[f"blocks.1.{name}.weight"], gptj.output_layer_initializer)
    _spread(w["blocks.1.attn.q_proj.weight"], gptj.initializer)
    _spread(w["embed.tok.weight"], gptj.embedding_initializer)
    assert w["head.lm_head.weight"].std().item() == pytest.approx(gptj.init_std, rel=0.05)  # untied: normal
    assert w["head.lm_head.weight"].abs().max().item() > 3 * gptj.init_std
    # Model Zoo's GPT-2 model given only `initializer`: the outputs take it too, the embeddings Model Zoo's
    # default truncated_normal(0, initializer_range)
    gpt = config_from_name("gpt-tiny").replace(**shape, initializer={"name": "uniform", "a": -0.1, "b": 0.1})
    w = dict(build(gpt).named_parameters())
    for name in ("attn.q_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
        _check(w[f"blocks.0.{name}.weight"], 0.0, 0.2 / math.sqrt(12), -0.1, 0.1)
    _spread(w["embed.tok.weight"], Initializer("truncated_normal", std=gpt.init_std))


def test_initializers_reach_a_model_built_on_the_meta_device():
    cfg = config_from_name("gpt3-1.3b").replace(output_layer_initializer={"name": "uniform", "a": -0.01, "b": 0.01},
                                                embedding_initializer="zeros")
    model = build(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())  # nothing materialized
    t = torch.empty(512, 1024)
    model.init_parameter("blocks.3.mlp.down_proj.weight", t)  # as MemoryX fills a streamed model's weights
    _check(t, 0.0, 0.02 / math.sqrt(12), -0.01, 0.01)
    e = torch.ones(10, 64)
    model.init_parameter("embed.tok.weight", e)
    assert not e.any()
    q = torch.empty(512, 1024)
    model.init_parameter("blocks.0.attn.q_proj.weight", q)  # left out beside others: Model Zoo's default
    _spread(q, Initializer("truncated_normal", std=cfg.init_std))


def test_mup_scalings_in_the_forward_pass():
    small = _small_mup_config().replace(d_model=64, d_ff=256)
    torch.manual_seed(0)
    mup = build(small)
    plain = build(small.replace(embeddings_scale=1.0, output_logits_scale=1.0, scale_qk_dot_by_d=False))
    plain.load_state_dict(mup.state_dict())
    idx = torch.randint(0, small.vocab_size, (2, 8))
    assert torch.allclose(mup.embed(idx), 10 * plain.embed(idx))
    x = torch.randn(2, 8, small.d_model)
    assert torch.allclose(mup.head(x), plain.head(x) / 3, atol=1e-6)
    attn = mup.blocks[0].attn
    q, k, v = (proj(x).view(2, 8, 4, 16).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    logits = q @ k.transpose(-1, -2) / 16  # q.k / d, not / sqrt(d)
    logits = logits.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    want = attn.o_proj((F.softmax(logits, -1) @ v).transpose(1, 2).reshape(2, 8, small.d_model))
    assert torch.allclose(attn(x), want, atol=1e-5)


def test_adjusted_groups_take_the_scaled_rate():
    small = _small_mup_config()
    model = build(small)
    opt = build_optimizer(model.parameters(), OptimizerSpec("AdamW", learning_rate=0.006, weight_decay=0.1))
    adjust_learning_rates(opt, model.named_parameters(), {"decoder_kernel": 1 / 3})
    set_lr(opt, 0.003)
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    wd_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        kernel = name.startswith("blocks.") and name.endswith("_proj.weight")
        assert lr_of[id(p)] == pytest.approx(0.001 if kernel else 0.003), name
        assert wd_of[id(p)] == (0.1 if p.ndim >= 2 else 0.0), name
    with pytest.raises(ConfigError, match="decoder_attention, decoder_kernel|decoder_kernel, decoder_attention"):
        adjust_learning_rates(build_optimizer(model.parameters(), OptimizerSpec("AdamW")), model.named_parameters(),
                              {"decoder_kernel": 0.5, "decoder_attention": 0.25})


def _feature_change(width: int, mup: bool) -> float:
    """RMS change of the last block's output on a fixed batch after one AdamW step at a fixed rate. muP (base
    width 64, as Model Zoo's configs derive it): hidden initializers' std times sqrt(64 / width), output logits and
    the hidden matrices' learning rate times 64 / width, q.k / d; without it, the same base values at every width."""
    mult = width / 64
    base = dict(n_layer=2, d_model=width, n_head=4, d_ff=2 * width, vocab_size=128, max_seq_len=16,
                embedding_initializer={"name": "truncated_normal", "std": 0.08}, embeddings_scale=10.0)
    hidden = {"name": "truncated_normal", "std": 0.08 / math.sqrt(mult if mup else 1.0)}
    cfg = config_from_name("gpt-tiny").replace(
        **base, initializer=hidden, output_logits_scale=1 / mult if mup else 1.0, scale_qk_dot_by_d=mup,
        output_layer_initializer=Initializer.parse(hidden).scaled(1 / math.sqrt(2 * 2)))
    torch.manual_seed(1)
    model = build(cfg)
    opt = build_optimizer(model.parameters(), OptimizerSpec("AdamW", learning_rate=0.01, eps=1e-8))
    adjust_learning_rates(opt, model.named_parameters(), {"decoder_kernel": 1 / mult} if mup else {})
    set_lr(opt, 0.01)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 128, (4, 16), generator=gen)
    target = torch.randint(0, 128, (4, 16), generator=gen)

    def features() -> torch.Tensor:
        x = model.embed(idx)
        for block in model.blocks:
            x = block(x)
        return x

    with torch.no_grad():
        before = features()
    F.cross_entropy(model(idx).flatten(0, 1), target.flatten()).backward()
    opt.step()
    with torch.no_grad():
        return (features() - before).pow(2).mean().sqrt().item()


def test_mup_keeps_the_update_size_width_independent():
    mup = [_feature_change(w, mup=True) for w in (64, 128, 256)]
    standard = [_feature_change(w, mup=False) for w in (64, 128, 256)]
    assert max(mup) / min(mup) < 1.5, mup
    assert standard[2] / standard[0] > 2.5, standard  # Adam's update moves features ~ width without muP


def test_base_widths_derive_the_published_scalings():
    """Model Zoo 2.3's muP by base widths, from the 111M config's base (hidden 256, filter 1024, sigma 0.08),
    gives the scalings the published 111M config spells out, and the same learning rate for every parameter."""
    published = load_params(MUP_111M)
    d = published.to_dict()
    for key in ("initializer", "output_layer_initializer", "output_logits_scale"):
        del d["model"][key]
    del d["optimizer"]["adjust_learning_rate"]
    sigma = {"name": "truncated_normal", "mean": 0.0, "std": 0.08}
    d["model"].update(mup_base_hidden_size=256, mup_base_filter_size=1024, initializer=sigma,
                      output_layer_initializer=sigma, ffn_output_layer_initializer=sigma)
    derived = params_from_dict(d)
    want, got = published.model.to_model_config(), derived.model.to_model_config()
    assert got.output_logits_scale == pytest.approx(want.output_logits_scale)
    for key in ("initializer", "ffn_initializer", "output_layer_initializer", "ffn_output_layer_initializer"):
        spec = getattr(got, key)
        expect = want.output_layer_initializer if "output" in key else want.initializer
        assert (spec.name, spec.mean) == (expect.name, expect.mean)
        assert (spec.std, spec.a, spec.b) == pytest.approx((expect.std, expect.a, expect.b), rel=1e-12), key
    model = build(_small_mup_config())
    for name, _ in model.named_parameters():
        assert lr_adjustment(name, derived.optimizer.adjust_learning_rate) == pytest.approx(
            lr_adjustment(name, published.optimizer.adjust_learning_rate)), name


def test_model_zoo_mup_keys_in_the_params_file():
    d = load_params(MUP_111M).to_dict()
    d["model"]["mup_base_hidden_size"] = 256
    with pytest.raises(ConfigError, match="mup_base_hidden_size.*needs both"):
        params_from_dict(d)
    d["model"]["mup_base_filter_size"] = 1024
    with pytest.raises(ConfigError, match="output_logits_scale.*drop it"):
        params_from_dict(d)
    del d["model"]["output_logits_scale"]
    assert params_from_dict(d).optimizer.adjust_learning_rate["decoder_kernel"] == pytest.approx(1 / 3)
    d["optimizer"]["adjust_learning_rate"] = {"decoder_kernel": 0.5}  # the base widths give the attention 1/3
    with pytest.raises(ConfigError, match="decoder_kernel, decoder_attention with different scales"):
        params_from_dict(d)
    d = load_params(MUP_111M).to_dict()
    d["optimizer"]["adjust_learning_rate"] = {"decoder_kernels": 0.5}
    with pytest.raises(ConfigError, match="adjust_learning_rate.*'decoder_kernels'.*decoder_kernel"):
        params_from_dict(d)
    d = load_params(MUP_111M).to_dict()
    d["model"]["initializer"] = {"name": "truncated_normal", "sdt": 0.02}
    with pytest.raises(ConfigError, match="model.initializer.*sdt"):
        params_from_dict(d)


def test_a_mup_model_is_served_as_its_folded_standard_copy():
    """The serving kernels have no muP multipliers: the engine serves fold_mup_model's copy, whose greedy tokens
    are the muP model's own (its full forward pass, argmax after argmax)."""
    from waferscale.serve.llm import LLM, SamplingParams

    torch.manual_seed(0)
    model = build(_small_mup_config(), device="cpu").eval()
    prompt = [5, 17, 3, 99, 42]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))

    class Tok:  # token ids only (the engine's detokenizer needs decode)
        eos_id, vocab_size = None, 512

        def decode(self, ids):
            return " ".join(map(str, ids))

    with LLM(model, Tok(), max_model_len=32) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == ids[len(prompt):]


def test_hugging_face_config_refuses_an_unfolded_mup_model_by_name():
    from waferscale.models.hf_config import hf_model_type
    from waferscale.serve.model_runner import check_servable

    with pytest.raises(ConfigError, match="muP scaling"):
        check_servable(_small_mup_config())
    with pytest.raises(CheckpointError, match="muP scaling.*embeddings_scale 10.0"):
        hf_model_type(_small_mup_config())
    check_servable(config_from_name("gpt-tiny"))
    assert hf_model_type(config_from_name("gpt-tiny")) == "gpt2"
