"""GPT-J, GPT-NeoX, Falcon, MPT and Mistral: logits parity with transformers (prefill and KV-cache decode),
export to and import from Hugging Face directories, presets' parameter counts, Model Zoo configs, and a tiny
preset of each trained with weight streaming and on two systems equal to resident training."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import tiny_params, wsc
from hf_helpers import assert_config_round_trips, ids, max_diff, perturbed
from train_helpers import checkpoint_weights
from waferscale.cli.main import main
from waferscale.errors import CheckpointError
from waferscale.models import hf, registry
from waferscale.models.config import ModelConfig
from waferscale.models.layers import alibi_slopes
from waferscale.params import params_from_dict
from waferscale.zoo.runner import RunOptions, run

transformers = pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data" / "modelzoo"


def _cfg(family: str, **kw) -> ModelConfig:
    base = dict(name=f"t-{family}", family=family, vocab_size=97, n_layer=2, n_head=4, d_model=32, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


_GPTJ = dict(activation="gelu_tanh", position="rotary", rotary_dim=4, rotary_interleaved=True,
             block="parallel_shared_norm", tie_embeddings=False, attn_bias=False, lm_head_bias=True)
_NEOX = dict(activation="gelu", position="rotary", rotary_dim=2, d_ff=128, block="parallel", tie_embeddings=False)
_FALCON = dict(activation="gelu", position="rotary", d_ff=128, attn_bias=False, mlp_bias=False)
_MPT = dict(n_head=6, d_model=48, d_ff=192, activation="gelu", position="alibi", norm_bias=False, attn_bias=False,
            mlp_bias=False)
_MISTRAL = dict(n_kv_head=2, d_ff=48, norm="rmsnorm", activation="swiglu", position="rotary", sliding_window=8,
                tie_embeddings=False, attn_bias=False, mlp_bias=False)

CONFIGS = {
    "gptj": _cfg("gptj", **_GPTJ),
    "gptj-tied-full-rotary": _cfg("gptj", **{**_GPTJ, "rotary_dim": None, "tie_embeddings": True}),
    "gpt_neox-parallel": _cfg("gpt_neox", **_NEOX),
    "gpt_neox-sequential-nobias": _cfg("gpt_neox", **{**_NEOX, "block": "sequential", "attn_bias": False}),
    "falcon-7b-like": _cfg("falcon", **_FALCON, n_kv_head=1, block="parallel_shared_norm"),
    "falcon-40b-like": _cfg("falcon", **_FALCON, n_kv_head=2, block="parallel"),
    "falcon-gqa-one-norm": _cfg("falcon", **_FALCON, n_kv_head=2, block="parallel_shared_norm"),
    "falcon-mha-sequential-bias": _cfg("falcon", **{**_FALCON, "attn_bias": True, "mlp_bias": True}, n_kv_head=4,
                                       block="sequential", tie_embeddings=False),
    "mpt": _cfg("mpt", **_MPT),
    "mpt-untied": _cfg("mpt", **_MPT, tie_embeddings=False),
    "mistral": _cfg("mistral", **_MISTRAL),
}
EXPORTED = ["gptj", "gpt_neox-parallel", "falcon-7b-like", "falcon-40b-like", "mpt", "mistral"]


def _hf_model(cfg: ModelConfig, seed: int = 0):
    """A transformers model of `cfg`'s architecture, random weights of std 0.2 (norm weights around 1)."""
    torch.manual_seed(seed)
    conf = transformers.AutoConfig.for_model(**hf.config_to_hf(cfg))
    model = transformers.AutoModelForCausalLM.from_config(conf).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = p.ndim == 1 and any(s in name for s in ("ln", "norm")) and name.endswith("weight")
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if is_norm else 0.0))
    return model


def _loaded(cfg: ModelConfig):
    theirs = _hf_model(cfg)
    return theirs, hf.model_from_state_dict(cfg, hf.state_dict_from_hf(theirs.state_dict(), cfg))


# ---- configs and parity -------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_config_round_trip(key: str) -> None:
    assert_config_round_trips(CONFIGS[key])


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_logits_match_transformers(key: str) -> None:
    cfg = CONFIGS[key]
    theirs, ours = _loaded(cfg)
    x = ids(cfg)
    with torch.no_grad():
        diff = max_diff(ours(x), theirs(x).logits)
    assert diff <= 1e-4, f"{key}: max |logit difference| {diff}"


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_kv_cache_decode_matches_transformers(key: str) -> None:
    """A 12-token prefill then 6 single-token steps through each side's KV cache (past Mistral's window of 8)."""
    cfg = CONFIGS[key]
    theirs, ours = _loaded(cfg)
    x = ids(cfg, 18)
    caches = ours.make_kv_caches(2, cfg.max_seq_len)
    with torch.no_grad():
        out = theirs(x[:, :12], use_cache=True)
        diffs = [max_diff(ours(x[:, :12], 0, caches), out.logits)]
        for t in range(12, 18):
            out = theirs(x[:, t:t + 1], cache=out.cache, use_cache=True)
            diffs.append(max_diff(ours(x[:, t:t + 1], t, caches), out.logits))
    assert max(diffs) <= 1e-4, f"{key}: max |logit difference| per step {diffs}"


@pytest.mark.parametrize("key, change", [
    ("gptj", dict(rotary_interleaved=False)), ("gpt_neox-parallel", dict(rotary_dim=None)),
    ("gpt_neox-parallel", dict(block="sequential")), ("mistral", dict(sliding_window=None)),
    ("falcon-40b-like", dict(block="parallel_shared_norm"))])
def test_parity_is_sensitive_to_each_knob(key: str, change: dict) -> None:
    """Guard against vacuous passes: loading the same weights with one knob changed moves the logits."""
    cfg, other = CONFIGS[key], CONFIGS[key].replace(**change)
    theirs = _hf_model(cfg)
    sd = hf.state_dict_from_hf(theirs.state_dict(), cfg)
    if other.block == "parallel_shared_norm":
        sd = {k: v for k, v in sd.items() if ".mlp_norm." not in k}
    x = ids(cfg)
    with torch.no_grad():
        assert max_diff(hf.model_from_state_dict(other, sd)(x), theirs(x).logits) > 1e-2


@pytest.mark.parametrize("interleave, same", [(True, True), (False, False)])
def test_falcon_query_groups_share_their_kv_head(interleave: bool, same: bool) -> None:
    """Falcon-40B's fused layout puts query heads 2j, 2j+1 with kv head j: repeating each kv head in place gives
    the same model as multi-head attention; tiling the kv heads instead (the wrong grouping) does not."""
    cfg = CONFIGS["falcon-40b-like"]
    theirs = _hf_model(cfg)
    sd = hf.state_dict_from_hf(theirs.state_dict(), cfg)
    for i in range(cfg.n_layer):
        for n in "kv":
            w = sd[f"blocks.{i}.attn.{n}_proj.weight"].view(cfg.kv_heads, -1, cfg.d_model)  # (nkv, hd, C)
            w = w.repeat_interleave(2, dim=0) if interleave else w.repeat(2, 1, 1)  # (nh, hd, C)
            sd[f"blocks.{i}.attn.{n}_proj.weight"] = w.reshape(-1, cfg.d_model)
    ours = hf.model_from_state_dict(cfg.replace(n_kv_head=cfg.n_head), sd)
    x = ids(cfg)
    with torch.no_grad():
        assert (max_diff(ours(x), theirs(x).logits) <= 1e-4) == same


def test_sliding_window_mask_and_alibi_slopes() -> None:
    """Mistral's window hides keys older than `sliding_window` positions; ALiBi slopes are the paper's (6 heads:
    the 4-head slopes 2^-2i, then the 8-head slopes between them)."""
    one_layer = perturbed(CONFIGS["mistral"].replace(n_layer=1))  # window 8
    x = ids(one_layer.config, 20)
    y = x.clone()
    y[:, 11] = (y[:, 11] + 1) % one_layer.config.vocab_size
    with torch.no_grad():  # position 19 sees positions 12..19 only, position 12 sees 5..12
        assert torch.allclose(one_layer(y)[:, 19], one_layer(x)[:, 19], atol=1e-6)
        assert not torch.allclose(one_layer(y)[:, 12], one_layer(x)[:, 12], atol=1e-3)
    assert torch.allclose(alibi_slopes(8), 2.0 ** -torch.arange(1.0, 9.0))
    assert torch.allclose(alibi_slopes(6), torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]))


def test_state_dict_round_trip_is_exact() -> None:
    for cfg in CONFIGS.values():
        ours = perturbed(cfg)
        back = hf.state_dict_from_hf(hf.state_dict_to_hf(ours.state_dict(), cfg), cfg)
        sd = ours.state_dict()
        assert back.keys() == sd.keys()
        for k in sd:
            assert torch.equal(back[k], sd[k]), (cfg.name, k)


@pytest.mark.parametrize("key", EXPORTED)
def test_export_loads_in_transformers(key: str, tmp_path: Path) -> None:
    cfg = CONFIGS[key]
    ours = perturbed(cfg)
    hf.save_hf_dir(ours, tmp_path / "export")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").float().eval()
    x = ids(cfg)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x).logits) <= 1e-4
    again = hf.load_hf_dir(tmp_path / "export")
    assert again.config == cfg
    with torch.no_grad():
        assert max_diff(ours(x), again(x)) == 0.0


def test_gpt_neox_head_under_either_name() -> None:
    """Published GPT-NeoX files name the head `embed_out`; transformers 5 state dicts name it `lm_head`."""
    cfg = CONFIGS["gpt_neox-parallel"]
    theirs = _hf_model(cfg)
    sd = theirs.state_dict()
    assert "lm_head.weight" in sd and "embed_out.weight" in hf.state_dict_to_hf(perturbed(cfg).state_dict(), cfg)
    ours = hf.model_from_state_dict(cfg, hf.state_dict_from_hf(sd, cfg))
    x = ids(cfg)
    with torch.no_grad():
        assert max_diff(ours(x), theirs(x).logits) <= 1e-4


def test_unsupported_inputs_are_named() -> None:
    with pytest.raises(CheckpointError, match=r"unsupported model_type 'bloom'.*gptj, gpt_neox, falcon, mpt, mistral"):
        hf.config_from_hf({"model_type": "bloom"})
    falcon = hf.config_to_hf(CONFIGS["falcon-7b-like"])
    with pytest.raises(CheckpointError, match="alibi"):
        hf.config_from_hf({**falcon, "alibi": True})
    mpt = hf.config_to_hf(CONFIGS["mpt"])
    with pytest.raises(CheckpointError, match="qk_ln"):
        hf.config_from_hf({**mpt, "attn_config": {**mpt["attn_config"], "qk_ln": True}})
    with pytest.raises(CheckpointError, match="grouped-query attention"):
        hf.config_to_hf(CONFIGS["falcon-40b-like"].replace(block="sequential"))
    with pytest.raises(CheckpointError, match="rotary_interleaved=True"):
        hf.config_to_hf(CONFIGS["gptj"].replace(rotary_interleaved=False))


# ---- presets ----------------------------------------------------------------------------------------------------

# Published sizes: the parameter count transformers builds from each release's config.json (checked below).
PUBLISHED = {"gptj-6b": 6_050_882_784, "gpt-neox-20b": 20_554_567_680, "pythia-70m": 70_426_624,
             "pythia-160m": 162_322_944, "pythia-410m": 405_334_016, "pythia-1b": 1_011_781_632,
             "pythia-1.4b": 1_414_647_808, "pythia-2.8b": 2_775_208_960, "pythia-6.9b": 6_857_302_016,
             "pythia-12b": 11_846_072_320, "falcon-7b": 6_921_720_704, "falcon-40b": 41_303_293_952,
             "mpt-7b": 6_649_286_656, "mpt-30b": 29_957_200_896, "mistral-7b": 7_241_732_096}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts(name: str) -> None:
    cfg = registry.PRESETS[name]
    assert cfg.num_params == PUBLISHED[name]
    assert registry.build(cfg, device="meta").num_params() == PUBLISHED[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gptj-6b", "gpt-neox-20b", "falcon-7b", "falcon-40b", "mpt-30b", "mistral-7b"])
def test_preset_counts_equal_transformers(name: str) -> None:
    conf = transformers.AutoConfig.for_model(**hf.config_to_hf(registry.PRESETS[name]))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(conf)
    assert model.num_parameters() == PUBLISHED[name]


# ---- Model Zoo configs --------------------------------------------------------------------------------------------

ZOO = {"params_gptj_6B.yaml": ("gptj", 6_049_711_185), "params_gpt_neox_20B.yaml": ("gpt_neox", 20_552_663_040),
       "params_falcon_7b.yaml": ("falcon", 6_921_720_704), "params_mpt_7B.yaml": ("mpt", 6_649_286_656),
       "params_mistral_7B.yaml": ("mistral", 7_241_732_096)}


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.slow
def test_published_modelzoo_config_validates(name: str) -> None:
    """Each published config validates as its family with the parameter count of its own shape (GPT-J's and
    GPT-NeoX-20B's Model Zoo vocabularies are 50257 and 50277, not the released checkpoints' padded ones)."""
    family, count = ZOO[name]
    r = wsc("validate", str(DATA / name))
    assert r.returncode == 0, r.stderr
    r = wsc("estimate", "--params", str(DATA / name), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["params"] == count
    with open(DATA / name) as f:
        d = yaml.safe_load(f)
    model = d["trainer"]["init"]["model"] if "trainer" in d else d["model"]
    from waferscale.params.model import ModelParams
    cfg = ModelParams(**{k: v for k, v in model.items() if k not in ModelParams.IGNORED_KEYS}).to_model_config()
    assert cfg.family == family


def test_modelzoo_keys_map_to_the_knobs() -> None:
    from waferscale.params.model import ModelParams
    base = dict(vocab_size=97, hidden_size=32, num_heads=4, num_hidden_layers=2, max_position_embeddings=64)
    neox = ModelParams(name="gptj", **base, position_embedding_type="rotary", rotary_dim=2,
                       use_untied_layer_norm=True).to_model_config()
    assert (neox.family, neox.block, neox.rotary_dim, neox.rotary_interleaved) == ("gpt_neox", "parallel", 2, False)
    gptj = ModelParams(name="gptj", **base, position_embedding_type="rotary", rotary_dim=8,
                       use_bias_in_output=True).to_model_config()
    assert (gptj.family, gptj.block, gptj.rotary_dim, gptj.rotary_interleaved, gptj.lm_head_bias) == \
        ("gptj", "parallel_shared_norm", None, True, True)
    falcon = ModelParams(**base, position_embedding_type="rotary", use_untied_layer_norm=True,
                         extra_attention_params={"num_kv_groups": 2}).to_model_config()
    assert (falcon.family, falcon.kv_heads) == ("falcon", 2)
    mpt = ModelParams(**base, position_embedding_type="alibi", norm_type="biasless-layernorm").to_model_config()
    assert (mpt.family, mpt.position, mpt.norm_bias) == ("mpt", "alibi", False)
    with pytest.raises(ValueError, match="rotary_dim"):
        ModelParams(**base, position_embedding_type="rotary", rotary_dim=12)


# ---- training: streaming and two systems equal resident ----------------------------------------------------------

TINY = ["gptj-tiny", "gpt-neox-tiny", "falcon-tiny", "mpt-tiny", "mistral-tiny"]


def _train(corpus: Path, model_dir: Path, model: str, **opts: object) -> dict:
    d = tiny_params(corpus, model_dir)
    d["runconfig"]["max_steps"] = 4
    d["model"]["name"] = model
    return run(params_from_dict(d, source="test"), RunOptions(model_dir=model_dir, progress=False, **opts),
               out=io.StringIO())


def _same_training(a: Path, b: Path) -> None:
    ra = [json.loads(ln) for ln in (a / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(ln) for ln in (b / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
    step = ra[-1]["step"]
    wa, wb = (checkpoint_weights(d / f"checkpoint_{step}.safetensors") for d in (a, b))
    assert wa.keys() == wb.keys()
    for k in wa:
        if not k.endswith("k_proj.bias"):  # zero-gradient parameter: rounding noise only (see test_streaming)
            assert float((wa[k] - wb[k]).norm() / wa[k].norm().clamp_min(1e-2)) <= 1e-5, k


@pytest.mark.parametrize("model", TINY)
def test_streaming_equals_resident(corpus: Path, tmp_path: Path, model: str) -> None:
    r = _train(corpus, tmp_path / "r", model, execution="resident")
    s = _train(corpus, tmp_path / "s", model, execution="streaming")
    assert (r["executor"], s["executor"]) == ("resident", "streaming")
    _same_training(tmp_path / "r", tmp_path / "s")


@pytest.mark.slow
@pytest.mark.parametrize("model", TINY)
def test_two_systems_equal_one(corpus: Path, tmp_path: Path, model: str) -> None:
    _train(corpus, tmp_path / "one", model, execution="resident")
    d = tiny_params(corpus, tmp_path / "unused")
    d["runconfig"]["max_steps"] = 4
    d["model"]["name"] = model
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(d))
    # `wsc run` by its main in this process (rank 0 here, its two system ranks processes of their own)
    assert main(["run", "-p", str(p), "-o", str(tmp_path / "two"), "--no_progress", "--num_csx", "2"]) == 0
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["executor"] == "swarmx"
    _same_training(tmp_path / "one", tmp_path / "two")
