"""T5 / FLAN-T5: parity with transformers' T5ForConditionalGeneration (v1.0: relu, tied and rescaled head; v1.1:
gated-GELU, untied head), the packed unit chain equal to encode/decode, KV-cache decoding and greedy generation
equal to transformers', published parameter counts, span-corruption training resident = streaming = two
systems, and the errors that name what is unsupported."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import TEXT, tiny_params, wsc
from hf_helpers import assert_config_round_trips, ids, max_diff, perturbed
from train_helpers import assert_same_training, checkpoint_weights
from waferscale.cli.main import main
from waferscale.data.tokenizer import CharTokenizer
from waferscale.errors import CheckpointError, ConfigError
from waferscale.models import hf
from waferscale.models.config import ModelConfig
from waferscale.models.registry import PRESETS, build
from waferscale.models.t5 import relative_position_bucket
from waferscale.params import params_from_dict
from waferscale.serve.model_runner import check_servable
from waferscale.serve.sampling import SamplingParams
from waferscale.serve.seq2seq import generate_seq2seq
from waferscale.zoo.runner import RunOptions, run

transformers = pytest.importorskip("transformers")

# v1.0 and v1.1 shapes with a decoder deeper than the encoder and a head size apart from d_model / n_head
VARIANTS = {"t5": PRESETS["t5-tiny"].replace(n_decoder_layer=3, d_kv=12),
            "flan-t5": PRESETS["flan-t5-tiny"].replace(n_decoder_layer=3, d_kv=12)}


def _theirs(cfg: ModelConfig, tmp_path: Path, seed: int = 0):
    """(our perturbed model, transformers' model loaded from its export)."""
    ours = perturbed(cfg, seed)
    hf.save_hf_dir(ours, tmp_path / "hf")
    return ours, transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()


@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_config_round_trip(key: str) -> None:
    assert_config_round_trips(VARIANTS[key])


@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_logits_match_transformers_both_ways(key: str, tmp_path: Path) -> None:
    cfg = VARIANTS[key]
    ours, theirs = _theirs(cfg, tmp_path)
    x, y = ids(cfg, 40), ids(cfg, 13)
    with torch.no_grad():
        ref = theirs(input_ids=x, decoder_input_ids=y).logits
        assert max_diff(ours(x, y), ref) < 1e-4
        loaded = hf.load_hf_dir(tmp_path / "hf")  # their directory back into ours
        assert max_diff(loaded(x, y), ref) < 1e-4
    assert (theirs.lm_head.weight is theirs.shared.weight) == cfg.tie_embeddings


def test_transformers_checkpoint_loads(tmp_path: Path) -> None:
    """A checkpoint transformers wrote itself (v1.1: untied head saved beside the shared embedding)."""
    torch.manual_seed(0)
    tcfg = transformers.T5Config(vocab_size=96, d_model=24, d_kv=8, d_ff=40, num_layers=2, num_decoder_layers=1,
                                 num_heads=3, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                 relative_attention_num_buckets=16, relative_attention_max_distance=20)
    theirs = transformers.T5ForConditionalGeneration(tcfg).eval()
    theirs.save_pretrained(tmp_path / "t")
    ours = hf.load_hf_dir(tmp_path / "t")
    assert (ours.config.activation, ours.config.tie_embeddings, ours.config.decoder_layers) == ("geglu", False, 1)
    x, y = ids(ours.config, 50), ids(ours.config, 30)  # distances past max_distance: the log buckets matter
    with torch.no_grad():
        assert max_diff(ours(x, y), theirs(input_ids=x, decoder_input_ids=y).logits) < 1e-4


def test_relative_buckets_equal_transformers() -> None:
    rel = torch.arange(-300, 300)[None, :]
    for bidirectional in (True, False):
        for nb, dist in ((32, 128), (16, 20)):
            bucket = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
            theirs = bucket(rel, bidirectional, nb, dist)
            assert torch.equal(relative_position_bucket(rel, bidirectional, nb, dist), theirs)


@pytest.mark.parametrize("change", [{"tie_embeddings": True}, {"activation": "relu"},
                                    {"relative_attention_max_distance": 40}])
def test_parity_is_sensitive_to_each_knob(change: dict, tmp_path: Path) -> None:
    """Each knob changes the logits: a parity test that ignored it would not pass by accident."""
    cfg = VARIANTS["flan-t5"]
    _, theirs = _theirs(cfg, tmp_path)
    other = perturbed(cfg.replace(**change))
    other.load_state_dict(perturbed(cfg).state_dict(), strict=False)
    x, y = ids(cfg, 40), ids(cfg, 13)
    with torch.no_grad():
        assert max_diff(other(x, y), theirs(input_ids=x, decoder_input_ids=y).logits) > 1e-3


@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_packed_units_equal_encode_decode(key: str) -> None:
    """The unit chain streaming runs (one packed sequence: max_seq_len inputs, then the decoder's) computes what
    encode + decode compute."""
    cfg = VARIANTS[key].replace(max_seq_len=40)
    model = perturbed(cfg)
    x, y = ids(cfg, 40), ids(cfg, 13)
    with torch.no_grad():
        assert max_diff(model(torch.cat((x, y), dim=1)), model(x, y)) < 1e-5
    assert len(model.units()) == 1 + cfg.n_layer + 1 + cfg.decoder_layers + 1
    with pytest.raises(ConfigError, match="packed T5 sequence"):
        model(x)


def test_kv_cache_decode_equals_full_decode() -> None:
    cfg = VARIANTS["flan-t5"]
    model = perturbed(cfg)
    x, y = ids(cfg, 30), ids(cfg, 9)
    with torch.no_grad():
        enc = model.encode(x)
        full = model.decode(y, enc)
        caches, cross = model.make_kv_caches(2, 9), model.cross_kv(enc)
        steps = [model.decode(y[:, :4], None, 0, caches, cross)] + \
                [model.decode(y[:, t:t + 1], None, t, caches, cross) for t in range(4, 9)]
    assert max_diff(torch.cat(steps, dim=1), full) < 1e-4  # (logits of magnitude ~20: float32 rounding)


@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_greedy_generation_equals_transformers(key: str, tmp_path: Path) -> None:
    cfg = VARIANTS[key].replace(n_decoder_layer=None)  # (transformers' generate sizes its cache by num_layers)
    ours, theirs = _theirs(cfg, tmp_path)
    x = ids(cfg, 17)[:1]
    with torch.no_grad():
        ref = theirs.generate(input_ids=x, max_new_tokens=12, do_sample=False, eos_token_id=None,
                              decoder_start_token_id=0)[0, 1:].tolist()
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)  # (eos_token_id=None there)
        assert generate_seq2seq(ours, x[0].tolist(), greedy) == ref


def test_wsc_generate_runs_seq2seq_on_a_transformers_directory(tmp_path: Path, capsys) -> None:
    """`wsc generate --model <HF T5 dir> --prompt ...` prints what transformers' greedy generate writes."""
    tok = CharTokenizer.from_text(TEXT).with_sentinels(100)
    cfg = VARIANTS["flan-t5"].replace(vocab_size=tok.vocab_size, n_decoder_layer=None)
    ours = perturbed(cfg)
    hf.save_hf_dir(ours, tmp_path / "hf", tokenizer=tok)
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    prompt = "First Citizen: <extra_id_0> speak."
    x = torch.tensor([tok.encode(prompt) + [tok.eos_id]])  # (the char format's post-processor: "$A <eos>")
    with torch.no_grad():
        out = theirs.generate(input_ids=x, max_new_tokens=10, do_sample=False, decoder_start_token_id=0,
                              eos_token_id=tok.eos_id)[0, 1:].tolist()
    expected = tok.decode([t for t in out if t != tok.eos_id])
    capsys.readouterr()
    code = main(["generate", "--model", str(tmp_path / "hf"), "--prompt", prompt, "--max_new_tokens", "10",
                 "--temperature", "0", "--device", "cpu"])  # `wsc generate`, in this process
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert out.out.rstrip("\n") == expected


@pytest.mark.parametrize("name,published", [("t5-small", 60.5e6), ("t5-base", 223e6), ("t5-large", 738e6),
                                            ("flan-t5-small", 77e6), ("flan-t5-base", 248e6),
                                            ("flan-t5-large", 783e6), ("flan-t5-xl", 2.85e9)])
def test_preset_parameter_counts(name: str, published: float) -> None:
    """The count from our shapes, from transformers' T5 built with the release's config (an untied head counted
    apart from the shared embedding), and the published figure (Raffel et al.; the model cards)."""
    cfg = PRESETS[name]
    # the shapes on the meta device: materialising (and initialising) base and large takes seconds and GBs
    assert build(cfg, device="meta").num_params() == cfg.num_params
    with torch.device("meta"):
        theirs = transformers.T5ForConditionalGeneration(transformers.T5Config(**hf.config_to_hf(cfg)))
    shapes = {k: v.numel() for k, v in theirs.state_dict().items() if "embed_tokens" not in k}
    if cfg.tie_embeddings:
        shapes.pop("lm_head.weight")
    assert sum(shapes.values()) == cfg.num_params
    assert cfg.num_params == pytest.approx(published, rel=0.005)
    if name in ("t5-small", "flan-t5-xl"):  # build's own choice, one preset each side of its threshold
        assert (cfg.num_params > 1e9) == (next(build(cfg).parameters()).device.type == "meta")


def test_unsupported_inputs_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="feed_forward_proj 'gated-relu' is not supported; supported: relu"):
        hf.config_from_hf({**hf.config_to_hf(VARIANTS["t5"]), "feed_forward_proj": "gated-relu"})
    with pytest.raises(CheckpointError, match="decoder_start_token_id 5"):
        hf.config_from_hf({**hf.config_to_hf(VARIANTS["t5"]), "decoder_start_token_id": 5})
    with pytest.raises(ConfigError, match="position 'relative'"):
        PRESETS["gpt-tiny"].replace(position="relative")
    with pytest.raises(ConfigError, match="n_decoder_layer"):
        PRESETS["gpt-tiny"].replace(n_decoder_layer=2)
    with pytest.raises(ConfigError, match="no biases"):
        PRESETS["t5-tiny"].replace(attn_bias=True)
    with pytest.raises(CheckpointError, match="cannot be saved as Hugging Face t5: it needs norm 'rmsnorm'"):
        hf.config_to_hf(PRESETS["t5-tiny"].replace(norm="layernorm"))
    with pytest.raises(ConfigError, match="serving engine has no encoder-decoder"):  # wsc serve: never as a decoder
        check_servable(PRESETS["t5-tiny"])


# ---- wsc run: span corruption, resident = streaming = two systems ------------------------------------------------

def _params(corpus: Path, model_dir: Path, steps: int = 4) -> dict:
    d = tiny_params(corpus, model_dir)
    d["runconfig"]["max_steps"] = steps
    d["model"] = {"name": "flan-t5-tiny", "vocab_size": 256, "max_position_embeddings": 32,
                  "mixed_precision": False}
    d["train_input"].pop("max_sequence_length")  # the encoder's input length is the model's
    return d


def _train(corpus: Path, model_dir: Path, **opts: object) -> dict:
    return run(params_from_dict(_params(corpus, model_dir), source="test"),
               RunOptions(model_dir=model_dir, progress=False, **opts), out=io.StringIO())


def _same_training(a: Path, b: Path) -> None:
    assert_same_training(a, b)


def test_t5_trains_span_corruption_resident_and_streaming_alike(corpus: Path, tmp_path: Path) -> None:
    r = _train(corpus, tmp_path / "r", execution="resident", mode="train_and_eval")
    s = _train(corpus, tmp_path / "s", execution="streaming", mode="train_and_eval")
    assert (r["executor"], s["executor"]) == ("resident", "streaming")
    _same_training(tmp_path / "r", tmp_path / "s")
    assert s["eval_loss"] == pytest.approx(r["eval_loss"], rel=1e-5)
    w = checkpoint_weights(tmp_path / "r" / "checkpoint_4.safetensors")
    w0 = build(PRESETS["flan-t5-tiny"].replace(name="flan-t5-tiny", max_seq_len=32)).state_dict()
    # every layer's table gradient reached its owner, and the encoder learned through the decoder's cross-attention
    assert not torch.equal(w["encoder.0.rel.weight"], w0["encoder.0.rel.weight"])
    assert not torch.equal(w["encoder.1.mlp.down_proj.weight"], w0["encoder.1.mlp.down_proj.weight"])
    assert r["seq_len"] == 34  # windows of 34 tokens corrupt to 32 encoder inputs (and 8 targets)


def test_t5_resumes_exactly(corpus: Path, tmp_path: Path) -> None:
    d = _params(corpus, tmp_path / "once")
    d["runconfig"]["checkpoint_steps"] = 2
    run(params_from_dict(d, source="test"), RunOptions(model_dir=tmp_path / "once", progress=False), out=io.StringIO())
    d["runconfig"]["model_dir"] = str(tmp_path / "twice")
    for _ in range(2):
        run(params_from_dict(d, source="test"), RunOptions(model_dir=tmp_path / "twice", num_steps=2, progress=False),
            out=io.StringIO())
    _same_training(tmp_path / "once", tmp_path / "twice")


@pytest.mark.slow
def test_t5_on_two_systems_equals_one(corpus: Path, tmp_path: Path) -> None:
    _train(corpus, tmp_path / "one", execution="resident")
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(_params(corpus, tmp_path / "unused")))
    r = wsc("run", "-p", str(p), "-o", str(tmp_path / "two"), "--no_progress", "--num_csx", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["executor"] == "swarmx"
    _same_training(tmp_path / "one", tmp_path / "two")


# ---- Model Zoo's published T5 configs ------------------------------------------------------------------------------

MODELZOO = Path(__file__).parent / "data" / "modelzoo"


def _hf_count_with_layernorm_biases(cfg: ModelConfig) -> int:
    """transformers' T5 with these shapes, plus the bias of each LayerNorm (Model Zoo's T5 configs use LayerNorm,
    transformers' T5 has only its RMS norm): 2 per encoder layer, 3 per decoder layer, 2 final norms."""
    with torch.device("meta"):
        theirs = transformers.T5ForConditionalGeneration(transformers.T5Config(**hf.config_to_hf(
            cfg.replace(norm="rmsnorm"))))
    count = sum(v.numel() for k, v in theirs.state_dict().items() if "embed_tokens" not in k and k != "lm_head.weight")
    return count + (2 * cfg.n_layer + 3 * cfg.decoder_layers + 2) * cfg.d_model


def test_modelzoo_t5_small_validates_with_its_parameter_count(capsys) -> None:
    """Model Zoo's t5_small (legacy layout): T5 v1.1-small's shape (8 + 8 layers, 6 heads of 64, d_ff 1024) with
    ReLU, LayerNorm and a tied head over 32001 + 100 sentinel ids. Model Zoo publishes its shape, not a count: the
    count is transformers' T5 of that shape plus the LayerNorm biases."""
    code, out = main(["validate", str(MODELZOO / "params_t5_small.yaml")]), capsys.readouterr()
    assert code == 0, out.err
    cfg = params_from_dict(yaml.safe_load((MODELZOO / "params_t5_small.yaml").read_text()), "t").model.to_model_config()
    assert (cfg.family, cfg.vocab_size, cfg.n_layer, cfg.decoder_layers, cfg.n_head, cfg.head_dim, cfg.ffn_dim) == (
        "t5", 32101, 8, 8, 6, 64, 1024)
    assert (cfg.norm, cfg.activation, cfg.tie_embeddings, cfg.mlm_loss_weight) == ("layernorm", "relu", True, 0.015)
    assert cfg.num_params == _hf_count_with_layernorm_biases(cfg) == 52_130_688
    assert f"valid ({cfg.num_params / 1e6:,.1f}M-parameter model)" in out.out


def test_modelzoo_t5_base_model_section_and_its_optimizer() -> None:
    """Model Zoo's t5_base (current layout): its model section maps (norm_type, mlm_loss_scaling); its optimizer
    is Adafactor (Model Zoo's spelling 'AdaFactor', cstorch's defaults) under its InverseSquareRootDecay schedule
    (training it: tests/test_adafactor.py)."""
    d = yaml.safe_load((MODELZOO / "params_t5_base.yaml").read_text())
    p = params_from_dict(d, "t")
    assert (p.optimizer.optimizer_type, p.optimizer.relative_step, p.optimizer.scale_parameter) == (
        "Adafactor", False, True)
    cfg = p.model.to_model_config()
    assert (cfg.d_model, cfg.n_layer, cfg.n_head, cfg.ffn_dim, cfg.norm, cfg.norm_eps) == (
        768, 12, 12, 3072, "layernorm", 1e-5)
    assert cfg.mlm_loss_weight is None  # precomputed_num_masked: the mean over the target tokens
    assert cfg.num_params == _hf_count_with_layernorm_biases(cfg)


def _tiny_t5_small(corpus: Path, model_dir: Path) -> dict:
    d = yaml.safe_load((MODELZOO / "params_t5_small.yaml").read_text())
    d.pop("eval_input")
    d["train_input"].update(src_data_dir=str(corpus), src_max_sequence_length=32, tgt_max_sequence_length=8,
                            batch_size=4, num_workers=0)
    d["train_input"].pop("src_vocab_file")  # (a SentencePiece vocab.txt: the run reads 'char' instead)
    d["model"].update(src_vocab_size=156, encoder_num_hidden_layers=2, decoder_num_hidden_layers=2, num_heads=4,
                      d_kv=8, d_ff=64, d_model=32, src_max_position_embeddings=32, mixed_precision=False)
    d["optimizer"]["learning_rate"] = 1e-3
    d["runconfig"].update(max_steps=2, checkpoint_steps=2, eval_steps=1, model_dir=str(model_dir))
    return d


def test_modelzoo_t5_small_tiny_override_trains(corpus: Path, tmp_path: Path) -> None:
    s = run(params_from_dict(_tiny_t5_small(corpus, tmp_path / "m"), "t"),
            RunOptions(model_dir=tmp_path / "m", progress=False, mode="train_and_eval"), out=io.StringIO())
    assert s["steps"] == 2 and s["seq_len"] == 34 and s["eval_loss"] > 0


def test_modelzoo_t5_keys_we_cannot_honour_are_named(corpus: Path, tmp_path: Path, capsys) -> None:
    base = _tiny_t5_small(corpus, tmp_path)
    for section, change, message in [
            ("model", {"decoder_nonlinearity": "gelu"}, "decoder_nonlinearity: 'gelu' differs from "
                                                        "encoder_nonlinearity 'relu'"),
            ("model", {"share_encoder_decoder_embedding": False}, "share_encoder_decoder_embedding: false is not "
                                                                  "supported"),
            ("model", {"position_embedding_type": "learned"}, "'learned' is not supported for T5; supported: "
                                                              "relative"),
            ("model", {"encoder_nonlinearity": "gelu_new"}, "'gelu_new' is not supported for T5; supported: relu, "
                                                            "gelu, geglu, gated-gelu"),
            ("model", {"rotary_dim": 4}, "rotary_dim: is not a key of Model Zoo's T5 model"),
            ("train_input", {"tgt_max_sequence_length": 9}, "9 differs from the 8 targets span corruption"),
            ("train_input", {"src_max_sequence_length": 16}, "16 differs from the T5 model's encoder input length 32")]:
        d = yaml.safe_load(yaml.safe_dump(base))
        d[section].update(change)
        p = tmp_path / "bad.yaml"
        p.write_text(yaml.safe_dump(d))
        code, err = main(["validate", str(p)]), capsys.readouterr().err  # `wsc validate`, in this process
        assert code == 2 and err.count("error:") == 1, (change, err)
        assert message in err, (change, err)
    gpt = tiny_params(corpus, tmp_path)
    gpt["train_input"]["noise_density"] = 0.2
    with pytest.raises(ConfigError, match="noise_density: is a T5 span-corruption setting, but the model"):
        params_from_dict(gpt, "t")


def test_streamed_t5_built_on_meta_gets_t5s_initialisation() -> None:
    """MemoryX initialises a model built on the meta device (as flan-t5-xl is) by the model's own rule: T5's
    standard deviations, not GPT's."""
    from waferscale.runtime.memoryx import MemoryX
    from waferscale.runtime.optim import OptimizerSpec

    cfg = PRESETS["flan-t5-tiny"].replace(d_model=64, d_ff=256, d_kv=16)
    mx = MemoryX(build(cfg, device="meta"), OptimizerSpec("AdamW", 1e-3))
    w = mx.checkpoint_state()
    expected = {"embed.tok.weight": 1.0, "head.lm_head.weight": 1.0, "encoder.0.attn.q_proj.weight": (64 * 16) ** -0.5,
                "encoder.0.attn.k_proj.weight": 64 ** -0.5, "encoder.0.attn.o_proj.weight": 64 ** -0.5,
                "decoder.1.mlp.down_proj.weight": 256 ** -0.5, "decoder.0.rel.weight": 64 ** -0.5}
    for name, std in expected.items():
        assert float(w[name].std()) == pytest.approx(std, rel=0.15), name
    assert float(w["decoder.1.cross_norm.weight"].min()) == 1.0


def test_the_tokenizers_post_processor_decides_the_inputs_special_tokens(tmp_path: Path) -> None:
    """T5's tokenizer.json appends `</s>` to an input by its post-processor; a tokenizer without that template
    appends nothing. The seq2seq prompt is what the tokenizer's own encode gives (the `tokenizers` library's
    default, add_special_tokens=True), never an EOS added by hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from waferscale.data import load_tokenizer

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    for template in (True, False):
        tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        if template:
            tk.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        d = tmp_path / str(template)
        d.mkdir()
        tk.save(str(d / "tokenizer.json"))
        ours = load_tokenizer(str(d))
        assert ours.encode("hello world", add_special_tokens=True) == tk.encode("hello world").ids
        assert ours.encode("hello world", add_special_tokens=True) == ([3, 4, 1] if template else [3, 4])
        assert ours.encode("hello world") == [3, 4]
