"""Mixture of experts (Mixtral): the config's derived figures, Hugging Face parity (logits, KV-cache decode, the
router's load-balancing loss, export), Model Zoo's `moe` section, and training with the load-balancing loss
resident, streaming and on two systems, equal to 1e-5."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from conftest import tiny_params, wsc
from train_helpers import checkpoint_weights
from waferscale.errors import CheckpointError, ConfigError
from waferscale.models import hf
from waferscale.models.config import ModelConfig
from waferscale.models.layers import MoE, lm_loss
from waferscale.models.registry import build, config_from_name
from waferscale.params import params_from_dict
from waferscale.zoo.runner import RunOptions, run

transformers = pytest.importorskip("transformers")

_TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
             rope_theta=10000.0, router_aux_loss_coef=0.02, tie_word_embeddings=False)


# ---- the config ---------------------------------------------------------------------------------------------

def test_presets_have_the_published_total_and_active_parameters() -> None:
    big = config_from_name("mixtral-8x7b")
    assert round(big.num_params / 1e9, 1) == 46.7 and round(big.num_active_params / 1e9, 1) == 12.9
    huge = config_from_name("mixtral-8x22b")
    assert round(huge.num_params / 1e9) == 141 and round(huge.num_active_params / 1e9) == 39
    tiny = build(config_from_name("mixtral-tiny"))
    assert tiny.num_params() == tiny.config.num_params
    # a token computes with its 2 routed experts of 8 (a dense MLP twice as wide) and the router
    dense = big.replace(n_experts=0, d_ff=2 * big.ffn_dim)
    router = big.n_layer * big.d_model * big.n_experts
    assert big.num_active_params == dense.num_params + router
    assert big.flops_per_token(4096) == dense.flops_per_token(4096) + 6 * router


@pytest.mark.parametrize("over, words", [
    (dict(n_experts=-1), "n_experts must be 0"),
    (dict(n_experts=4, experts_per_token=5), "experts_per_token must be in 1..n_experts (4)"),
    (dict(n_experts=4, experts_per_token=0), "experts_per_token must be in 1..n_experts (4)"),
    (dict(router_aux_loss_coef=-0.1), "router_aux_loss_coef must be >= 0"),
])
def test_bad_expert_settings_are_refused(over: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        ModelConfig(name="m", **over)


def test_experts_compute_only_their_tokens() -> None:
    """Each expert sees exactly the rows routed to it (no dense all-experts compute), and the output is the
    weighted sum of the chosen experts, as a per-token loop computes it."""
    torch.manual_seed(0)
    cfg = config_from_name("mixtral-tiny")
    moe = MoE(cfg)
    x = torch.randn(3, 5, cfg.d_model)
    seen = []
    hooks = [e.register_forward_pre_hook(lambda _m, a: seen.append(a[0].shape[0])) for e in moe.experts]
    with torch.no_grad():
        y, stats = moe(x)
    for h in hooks:
        h.remove()
    assert sum(seen) == 15 * cfg.experts_per_token
    h = x.reshape(-1, cfg.d_model)
    with torch.no_grad():
        probs = torch.softmax(moe.router(h), -1)
        for t in range(15):
            w, e = probs[t].topk(2)
            ref = sum(wi / w.sum() * moe.experts[int(ei)](h[t]) for wi, ei in zip(w, e))
            assert torch.allclose(y.reshape(-1, cfg.d_model)[t], ref, atol=1e-6)
    assert torch.allclose(stats[0], probs.mean(0)) and float(stats[1].sum()) == pytest.approx(2.0)


# ---- Hugging Face ---------------------------------------------------------------------------------------------

def _hf_mixtral(seed: int = 0, **over):
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**_TINY, **over})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def _ids(vocab: int, T: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("mixtral") / "hf"
    _hf_mixtral().save_pretrained(d)
    return d


def test_load_matches_transformers_logits_decode_and_aux_loss(hf_dir: Path) -> None:
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    ours = hf.load_hf_dir(hf_dir, dtype=torch.float32)
    cfg = ours.config
    assert (cfg.family, cfg.n_experts, cfg.experts_per_token, cfg.router_aux_loss_coef) == ("mixtral", 4, 2, 0.02)
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        ref = theirs(ids, labels=ids, output_router_logits=True)
        logits, aux = ours.forward_aux(ids)
        assert (logits - ref.logits).abs().max() < 1e-4
        assert float(aux / cfg.router_aux_loss_coef) == pytest.approx(float(ref.aux_loss), rel=1e-5)
        # the training loss: next-token cross-entropy plus the weighted load-balancing loss, as transformers'
        assert float(lm_loss(logits[:, :-1].contiguous(), ids[:, 1:]) + aux) == pytest.approx(float(ref.loss), rel=1e-5)
        # KV-cache decode: a prefix, then one token at a time
        caches = ours.make_kv_caches(2, ids.shape[1])
        steps = [ours(ids[:, :8], 0, caches)] + [ours(ids[:, t:t + 1], t, caches) for t in range(8, ids.shape[1])]
    assert (torch.cat(steps, 1) - ref.logits).abs().max() < 1e-4


def test_export_loads_in_transformers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ours = build(config_from_name("mixtral-tiny")).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf.save_hf_dir(ours, tmp_path / "m")
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.3.w2.weight",
            "lm_head.weight"} <= keys
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (conf["model_type"], conf["num_local_experts"], conf["num_experts_per_tok"]) == ("mixtral", 4, 2)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").float().eval()
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max() < 1e-4
    back = hf.load_hf_dir(tmp_path / "m")
    assert back.config == ours.config
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values()))


def test_unsupported_router_noise_and_dense_shapes_are_refused(hf_dir: Path) -> None:
    conf = json.loads((hf_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="router_jitter_noise 0.1 is not supported"):
        hf.config_from_hf({**conf, "router_jitter_noise": 0.1})
    with pytest.raises(CheckpointError, match="lacks the key 'num_local_experts'"):
        hf.config_from_hf({k: v for k, v in conf.items() if k != "num_local_experts"})
    gelu = config_from_name("mixtral-tiny").replace(activation="gelu")
    with pytest.raises(CheckpointError, match="cannot be saved as Hugging Face mixtral"):
        hf.config_to_hf(gelu)


# ---- Model Zoo ---------------------------------------------------------------------------------------------

# the model section of Model Zoo's params_mixtral_8x7b.yaml (models/nlp/mixtral/configs)
_ZOO_8X7B = {
    "vocab_size": 32000, "hidden_size": 4096, "position_embedding_type": "rotary", "rotary_dim": 128,
    "rope_theta": 1000000.0, "share_embedding_weights": False, "max_position_embeddings": 32768,
    "embedding_dropout_rate": 0.0, "num_hidden_layers": 32, "dropout_rate": 0.0, "layer_norm_epsilon": 1.0e-5,
    "norm_type": "rmsnorm", "num_heads": 32, "attention_type": "scaled_dot_product",
    "attention_module": "multiquery_attention", "extra_attention_params": {"num_kv_groups": 8},
    "attention_dropout_rate": 0.0, "use_projection_bias_in_attention": False, "use_ffn_bias_in_attention": False,
    "filter_size": 14336, "nonlinearity": "swiglu", "use_ffn_bias": False,
    "moe": {"num_experts": 8, "top_k": 2, "load_balancing_loss_coef": 0.02, "router_fp32": True},
    "use_bias_in_output": False, "fp16_type": "cbfloat16", "mixed_precision": True,
}


def _zoo(model: dict, trainer: bool = False):
    """A params file around the model section, in the legacy or the trainer layout."""
    if trainer:
        model = {k: v for k, v in model.items() if k not in ("mixed_precision", "fp16_type")}  # (under precision)
        return params_from_dict({"trainer": {
            "init": {"model": model, "optimizer": {"AdamW": {"betas": [0.9, 0.95]}}, "loop": {"max_steps": 1},
                     "schedulers": [{"ConstantLR": {"learning_rate": 3e-4}}],
                     "precision": {"enabled": True, "fp16_type": "cbfloat16"}},
            "fit": {"train_dataloader": {"data_dir": "./data", "batch_size": 12}}}}, source="zoo.yaml")
    return params_from_dict({"train_input": {"data_dir": "./data", "batch_size": 12}, "model": model,
                             "optimizer": {"optimizer_type": "AdamW", "learning_rate": 3e-4},
                             "runconfig": {"max_steps": 1}}, source="zoo.yaml")


@pytest.mark.parametrize("trainer", [False, True])
def test_zoo_mixtral_config_is_the_preset(trainer: bool) -> None:
    model = {**_ZOO_8X7B, "name": "mixtral"} if trainer else _ZOO_8X7B
    cfg = _zoo(model, trainer).model.to_model_config()
    assert cfg.name == ("mixtral" if trainer else "mixtral-8x7b")  # (an explicit shape takes the preset's name)
    assert cfg.replace(name="x", embedding_initializer=None) == config_from_name("mixtral-8x7b").replace(name="x")
    assert round(cfg.num_params / 1e9, 1) == 46.7


@pytest.mark.parametrize("moe, words", [
    ({"num_experts": 8, "top_k": 9}, "moe.top_k must be in 1..moe.num_experts (8)"),
    ({"num_experts": 8, "routing_algorithm": "hash"}, "routing_algorithm"),
    ({"num_experts": 8, "num_shared_experts": 1}, "num_shared_experts"),
    ({"num_experts": 8, "expert_weighting_normalization": False}, "expert_weighting_normalization"),
    ({"num_experts": 8, "top_k": 2, "capacity": 1.0}, "capacity"),
])
def test_zoo_moe_keys_are_checked(moe: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        _zoo({**_ZOO_8X7B, "moe": moe}).model.to_model_config()


def test_zoo_moe_with_no_experts_is_dense() -> None:
    cfg = _zoo({**_ZOO_8X7B, "moe": {"num_experts": 0}}).model.to_model_config()
    assert cfg.n_experts == 0 and cfg.family == "llama"


# ---- training: resident, streaming and two systems give the same losses ---------------------------------------

def _params(corpus: Path, model_dir: Path) -> dict:
    d = tiny_params(corpus, model_dir)
    d["model"].update(name="mixtral-tiny", moe={"num_experts": 4, "top_k": 2, "load_balancing_loss_coef": 1.0})
    # the load-balancing loss is a forward's: per micro-batch, so every run's micro-batches hold the same rows
    # (two systems: each its half of the batch of 4)
    d["train_input"]["micro_batch_size"] = 2
    d["runconfig"]["max_steps"] = 4
    return d


def _metrics(model_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (model_dir / "metrics.jsonl").read_text().splitlines()]


def _library_run(corpus: Path, model_dir: Path, execution: str, **opts: object) -> None:
    run(params_from_dict(_params(corpus, model_dir), source="test"),
        RunOptions(model_dir=model_dir, progress=False, execution=execution, **opts), out=io.StringIO())


def _same(a: Path, b: Path) -> None:
    ra, rb = _metrics(a), _metrics(b)
    assert len(ra) == len(rb) == 4
    for x, y in zip(ra, rb):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("recompute", ["always", "never"])
def test_streaming_equals_resident_with_the_load_balancing_loss(corpus: Path, tmp_path: Path, recompute: str) -> None:
    _library_run(corpus, tmp_path / "r", "resident")
    _library_run(corpus, tmp_path / "s", "streaming", recompute=recompute)
    _same(tmp_path / "r", tmp_path / "s")
    # the load-balancing loss is in the loss: about coef * top_k = 2 above the cross-entropy of ~ln(64)
    assert _metrics(tmp_path / "r")[0]["loss"] > 5.5


def _sparse_experts(corpus: Path, model_dir: Path) -> dict:
    """64 experts, one per token, 64 tokens per micro-batch: several experts get no token in a step."""
    d = _params(corpus, model_dir)
    d["model"]["moe"] = {"num_experts": 64, "top_k": 1, "load_balancing_loss_coef": 1.0}
    d["runconfig"].update(save_initial_checkpoint=True, checkpoint_steps=1)
    return d


def _same_weights(a: Path, b: Path, step: int = 4) -> None:
    wa, wb = (checkpoint_weights(d / f"checkpoint_{step}.safetensors") for d in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert float((wa[k] - wb[k]).norm() / wa[k].norm().clamp_min(1e-2)) <= 1e-5, k


@pytest.mark.slow
def test_experts_without_tokens_are_left_alone_when_streamed(corpus: Path, tmp_path: Path) -> None:
    """An expert the router gives no token this step gets no gradient: resident AdamW skips it (no weight decay,
    no moment decay, no step counted: its bias correction uses its own count when it gets tokens again), and
    streaming must too, in RAM and on flash, resumed from its own checkpoint or from a resident one (whose
    experts differ in step count)."""
    d = _sparse_experts(corpus, tmp_path / "unused")

    def go(name: str, execution: str, **opts: object) -> None:
        run(params_from_dict(d, source="test"), RunOptions(model_dir=tmp_path / name, progress=False,
                                                           execution=execution, **opts), out=io.StringIO())

    go("r", "resident")
    for _ in range(2):  # 2 steps, then 2 more from the checkpoint
        go("s", "streaming", num_steps=2)
    go("m", "resident", num_steps=2)
    go("m", "streaming", num_steps=2)
    # on flash (from a resident checkpoint: a flash tier's units are initialised otherwise), then from its own
    go("f", "resident", num_steps=1)
    for n in (2, 1):
        go("f", "streaming", num_steps=n, memoryx_ram_mb=0.001, flash_dir=str(tmp_path / "flash"))
        summary = json.loads((tmp_path / "f" / "summary.json").read_text())
        assert summary["memoryx_units_on_flash"] >= 1 and summary["memoryx_flash_bytes"] > 0
    assert not any((tmp_path / "flash").iterdir())  # each run's flash files went with it
    # step 2 (the first at a rate above 0) changed some experts and left others, which had no token, alone
    ckpt = {k: checkpoint_weights(tmp_path / "r" / f"checkpoint_{k}.safetensors") for k in (1, 2)}
    unchanged = [torch.equal(ckpt[1][k], ckpt[2][k]) for k in ckpt[1] if ".experts." in k]
    assert any(unchanged) and not all(unchanged)
    for name in "sfm":
        _same(tmp_path / "r", tmp_path / name)
        _same_weights(tmp_path / "r", tmp_path / name)


@pytest.mark.parametrize("optimizer", ["SGD", "Lion", "RMSprop"])
def test_experts_without_tokens_with_other_optimizers(corpus: Path, tmp_path: Path, optimizer: str) -> None:
    """Each optimizer leaves an expert without tokens alone, resident and streamed alike; SGD with momentum
    runs although some experts have a momentum buffer and others not yet (torch's fused SGD refuses that)."""
    d = _sparse_experts(corpus, tmp_path / "unused")
    d["optimizer"].update(optimizer_type=optimizer, **({"momentum": 0.9} if optimizer != "Lion" else {}))
    if optimizer == "RMSprop":  # (its default eps, 1e-8 as Cerebras', lets the rounding of tiny gradients, streamed
        d["optimizer"]["eps"] = 1e-6  # and resident, through to the weights above the 1e-5 compared here)
    for name, execution in (("r", "resident"), ("s", "streaming")):
        run(params_from_dict(d, source="test"), RunOptions(model_dir=tmp_path / name, progress=False,
                                                           execution=execution), out=io.StringIO())
    _same(tmp_path / "r", tmp_path / "s")
    _same_weights(tmp_path / "r", tmp_path / "s")


@pytest.mark.slow
def test_experts_without_tokens_on_two_systems(corpus: Path, tmp_path: Path) -> None:
    """As above with --num_csx 2: an expert neither system gave a token to is left alone (SwarmX reduces, per
    parameter, the number of systems that computed a gradient)."""
    d = _sparse_experts(corpus, tmp_path / "unused")
    run(params_from_dict(d, source="test"), RunOptions(model_dir=tmp_path / "r", progress=False,
                                                       execution="resident"), out=io.StringIO())
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(d))
    r = wsc("run", "-p", str(p), "-o", str(tmp_path / "two"), "--no_progress", "--num_csx", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _metrics(tmp_path / "two")[0]["num_csx"] == 2
    _same(tmp_path / "r", tmp_path / "two")
    _same_weights(tmp_path / "r", tmp_path / "two")


@pytest.mark.slow
def test_two_systems_equal_one(corpus: Path, tmp_path: Path) -> None:
    _library_run(corpus, tmp_path / "r", "resident")
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(_params(corpus, tmp_path / "unused")))
    r = wsc("run", "-p", str(p), "-o", str(tmp_path / "two"), "--no_progress", "--num_csx", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _metrics(tmp_path / "two")[0]["num_csx"] == 2
    _same(tmp_path / "r", tmp_path / "two")
