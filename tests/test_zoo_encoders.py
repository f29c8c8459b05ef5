"""Model Zoo's published BERT, RoBERTa and Mixtral configs (tests/data/modelzoo, both YAML layouts): they validate
as their families with the parameter counts of their shapes, their BERT keys map onto the encoder's knobs (or are
refused by name), their data keys drive the masked-LM objective and the WordPiece tokenizer, and a tiny version of
each BERT config trains streamed and on two systems as it does resident (BERT's with the next-sentence head: the
pretraining objective on sentence pairs)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import TEXT, wsc, wsc_main
from train_helpers import assert_same_training
from waferscale.data.masking import IGNORE_INDEX, Masker
from waferscale.data.tokenizer import load_tokenizer
from waferscale.errors import ConfigError
from waferscale.models import registry
from waferscale.params import load_params, params_from_dict
from waferscale.params.model import ModelParams

DATA = Path(__file__).parent / "data" / "modelzoo"

# (family, parameter count of the config's shapes, next-sentence head, token types, mlm_loss_weight). BERT-base
# and BERT-large are BertForPreTraining's counts (the papers' 110M and 340M); Model Zoo's RoBERTa-base config is
# BERT-base with the cased BERT vocabulary (28996), no next-sentence head, no segments and a padding position:
# 108.3M (roberta-base's own release, with its 50265-token vocabulary, is 124.7M: the `roberta-base` preset)
ENCODERS = {"params_bert_base_MSL128.yaml": ("bert", 110_106_428, True, 2, 0.058),
            "params_bert_large_MSL512.yaml": ("bert", 336_226_108, True, 2, 0.019),
            "params_roberta_base.yaml": ("roberta", 108_340_036, False, 0, 0.019)}


def _model_section(d: dict) -> dict:
    return d["trainer"]["init"]["model"] if "trainer" in d else d["model"]


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_published_encoder_config_validates(name: str, capsys) -> None:
    family, count, nsp, segments, weight = ENCODERS[name]
    r = wsc_main(capsys, "validate", str(DATA / name))
    assert r.returncode == 0, r.stderr
    assert f"({count / 1e6:,.1f}M-parameter model)" in r.stdout
    r = wsc_main(capsys, "estimate", "--params", str(DATA / name), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["params"] == count
    cfg = load_params(DATA / name).model.to_model_config()
    assert (cfg.family, cfg.nsp_head, cfg.type_vocab_size, cfg.norm_eps, cfg.dropout, cfg.mlm_loss_weight) == \
        (family, nsp, segments, 1e-5, 0.1, weight)
    assert registry.build(cfg, device="meta").num_params() == count


def test_published_mixtral_config_validates(capsys) -> None:
    r = wsc_main(capsys, "validate", str(DATA / "params_mixtral_8x7b.yaml"))
    assert r.returncode == 0, r.stderr
    assert "(46,702.8M-parameter model, 12,879.9M active per token)" in r.stdout
    cfg = load_params(DATA / "params_mixtral_8x7b.yaml").model.to_model_config()
    assert (cfg.family, cfg.n_experts, cfg.experts_per_token, cfg.router_aux_loss_coef) == ("mixtral", 8, 2, 0.02)
    assert (cfg.num_params, cfg.num_active_params) == (46_702_792_704, 12_879_925_248)
    assert cfg.num_params == registry.PRESETS["mixtral-8x7b"].num_params


def test_published_data_keys_drive_the_masking() -> None:
    p = load_params(DATA / "params_bert_large_MSL512.yaml")
    inp = p.train_input
    assert (inp.masked_lm_prob, inp.max_predictions_per_seq, inp.mask_whole_word, inp.do_lower) == (0.15, 80, False,
                                                                                                    True)
    assert inp.tokenizer_spec == "../../vocab/google_research_uncased_L-12_H-768_A-12.txt"
    assert Masker(4, 10, seed=0, max_predictions=80).per_sequence(1024) == 80  # capped (154 without the cap)
    assert Masker(4, 10, seed=0, max_predictions=80).per_sequence(512) == 77


_BASE = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=4, max_position_embeddings=64)


def test_bert_keys_map_onto_the_encoder() -> None:
    bert = ModelParams(**_BASE, encoder_nonlinearity="gelu_new", pooler_nonlinearity="tanh", num_segments=3,
                       layer_norm_epsilon=1e-12, dropout_rate=0.0).to_model_config()
    assert (bert.family, bert.activation, bert.type_vocab_size, bert.nsp_head, bert.pad_token_id, bert.norm_eps,
            bert.block, bert.lm_head_bias) == ("bert", "gelu_tanh", 3, True, 0, 1e-12, "post_norm", True)
    roberta = ModelParams(**_BASE, encoder_nonlinearity="gelu", disable_nsp=True, mask_padding_in_positional_embed=True,
                          pad_token_id=1, share_embedding_weights=False).to_model_config()
    assert (roberta.family, roberta.nsp_head, roberta.type_vocab_size, roberta.pad_token_id,
            roberta.tie_embeddings) == ("roberta", False, 0, 1, False)
    # a preset keeps its own fields where the keys say nothing; Model Zoo's `name: bert` takes Model Zoo's defaults
    base = ModelParams(name="bert-base", disable_nsp=True).to_model_config()
    assert (base.family, base.nsp_head, base.type_vocab_size, base.norm_eps) == ("bert", False, 2, 1e-12)
    label = ModelParams(name="bert", **_BASE, disable_nsp=True).to_model_config()
    assert (label.family, label.type_vocab_size, label.norm_eps, label.dropout, label.n_layer) == ("bert", 0, 1e-5,
                                                                                                  0.1, 2)


def test_bert_configs_are_never_decoders() -> None:
    """A BERT key makes an unnamed config an encoder; with a decoder's name it is an error, as is a decoder key on
    an encoder, and the rest of what the encoder does not have is refused by name."""
    assert ModelParams(**_BASE, pooler_nonlinearity="tanh").to_model_config().family == "bert"
    bad = [(dict(name="gpt2", disable_nsp=True), "disable_nsp: is a key of Model Zoo's BERT model"),
           (dict(name="gpt2", mlm_loss_weight=0.058), "mlm_loss_weight: is a key of Model Zoo's BERT model"),
           (dict(name="bert", disable_nsp=True, mlm_loss_weight=0.0), "mlm_loss_weight must be > 0"),
           (dict(name="bert", nonlinearity="gelu"), "nonlinearity: is a decoder key.*encoder_nonlinearity"),
           (dict(encoder_nonlinearity="gelu", position_embedding_type="rotary", rotary_dim=8), "rotary_dim"),
           (dict(encoder_nonlinearity="relu"), "pooler_nonlinearity: 'relu' \\(left out, it is encoder_nonl"),
           (dict(name="bert", pooler_nonlinearity="gelu"), "pooler_nonlinearity: 'gelu' is not supported"),
           (dict(encoder_nonlinearity="gelu", mlm_nonlinearity="relu"), "mlm_nonlinearity: 'relu' differs"),
           (dict(name="bert", use_output_bias_in_mlm=False), "use_output_bias_in_mlm: false is not supported"),
           (dict(name="bert", num_classes=3), "num_classes: 3"),
           (dict(name="bert", label_smoothing=0.1), "label_smoothing"),
           (dict(name="bert", embedding_layer_norm=False), "embedding_layer_norm: false"),
           (dict(name="gpt2", embedding_layer_norm=True), "embedding_layer_norm: true"),
           (dict(name="bert", attention_dropout_rate=0.2), "attention_dropout_rate: 0.2 differs from dropout_rate")]
    for keys, message in bad:
        with pytest.raises(ConfigError, match=message):
            ModelParams(**{**_BASE, **keys})
    # encoder keys without a name, but decoder ones too: refused, never trained as GPT
    with pytest.raises(ConfigError, match="nonlinearity: is a decoder key"):
        ModelParams(**_BASE, disable_nsp=True, nonlinearity="gelu")


def test_mlm_loss_weight_is_model_zoos_loss() -> None:
    """Model Zoo's BERT loss: mlm_loss_weight x the cross-entropy summed over the masked positions / the number of
    sequences; without the weight, the mean over the masked positions."""
    logits = torch.randn(3, 8, 97, generator=torch.Generator().manual_seed(0))
    targets = torch.full((3, 8), IGNORE_INDEX)
    targets[:, [1, 5]] = torch.randint(0, 97, (3, 2), generator=torch.Generator().manual_seed(1))
    ce = torch.nn.functional.cross_entropy(logits[:, [1, 5]].reshape(6, 97), targets[:, [1, 5]].reshape(6),
                                           reduction="none")
    for weight, expected in ((None, ce.mean()), (0.058, 0.058 * ce.sum() / 3)):
        cfg = ModelParams(name="bert", **_BASE, disable_nsp=True, mlm_loss_weight=weight).to_model_config()
        model = registry.build(cfg, device="meta")
        assert float(model.loss(logits, targets)) == pytest.approx(float(expected), rel=1e-6)


def _tiny(d: dict[str, Any], corpus: Path, model_dir: Path, vocab_size: int, **data: Any) -> dict[str, Any]:
    """The published config `d` (either layout) shrunk to a tiny model on the test corpus: a few fp32 steps at a
    constant learning rate, no dropout, a log line every step."""
    model = dict(hidden_size=32, num_hidden_layers=2, num_heads=4, filter_size=64, max_position_embeddings=64,
                 dropout_rate=0.0, attention_dropout_rate=0.0, mixed_precision=False)
    loader = dict(data_dir=[str(corpus)], batch_size=4, max_sequence_length=32, val_fraction=0.1, num_workers=0,
                  **data)
    if "trainer" in d:
        init, fit = d["trainer"]["init"], d["trainer"]["fit"]
        init["model"].update(model, vocab_size=vocab_size)
        init["model"].pop("fp16_type", None)
        init["precision"] = {"enabled": False, "max_gradient_norm": 1.0}
        init["schedulers"] = [{"ConstantLR": {"learning_rate": 1e-3}}]
        init["loop"] = {"max_steps": 4}
        init["checkpoint"] = {"steps": 4}
        init["logging"] = {"log_steps": 1}
        init["model_dir"] = str(model_dir)
        fit["train_dataloader"].update(loader)
        del fit["val_dataloader"], d["trainer"]["validate"], d["trainer"]["validate_all"]
    else:
        d["model"].update(model, vocab_size=vocab_size, use_bfloat16=False)
        d["optimizer"]["learning_rate"] = 1e-3
        d["runconfig"].update(max_steps=4, checkpoint_steps=4, log_steps=1, model_dir=str(model_dir))
        d["train_input"].update(loader)
        del d["eval_input"]
    return d


def _vocab(tmp_path: Path) -> Path:
    """A WordPiece vocabulary covering the corpus, lowercase (the configs' do_lower: true), with BERT's specials."""
    words = sorted(set(re.findall(r"[a-z]+|[^\sa-z]", TEXT.lower() + " speak we are accounted poor citizens")))
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return path


def _same_training(a: Path, b: Path, learns: bool) -> None:
    ra, _ = assert_same_training(a, b, grad_norm=False)
    if learns:  # (4 fresh batches of 4 sentence pairs: the next-sentence term's noise outweighs 4 steps' progress)
        assert ra[-1]["loss"] < ra[0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_tiny_published_encoder_trains_streamed_and_on_two_systems_as_resident(corpus: Path, tmp_path: Path,
                                                                              name: str, capsys) -> None:
    family, _, nsp, _, _ = ENCODERS[name]
    d = yaml.safe_load((DATA / name).read_text())
    vocab = _vocab(tmp_path)  # in place of the config's vocab_file; its do_lower stays
    runs = {}
    for run, flags in {"resident": ["--execution", "resident"], "streaming": ["--execution", "streaming"],
                       "swarmx": ["--num_csx", "2"]}.items():
        p = tmp_path / f"{run}.yaml"
        p.write_text(yaml.safe_dump(_tiny(json.loads(json.dumps(d)), corpus, tmp_path / run,
                                          len(vocab.read_text().split()), vocab_file=str(vocab))))
        if run == "swarmx":  # the real command line, its ranks processes of their own
            r = wsc("run", "-p", str(p), "--no_progress", *flags)
        else:  # one process: `wsc run` by its main here
            r = wsc_main(capsys, "run", "-p", str(p), "--no_progress", *flags)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "not trained" not in r.stdout  # the next-sentence head, where there is one, trains
        runs[run] = json.loads((tmp_path / run / "summary.json").read_text())["executor"]
    assert runs == {"resident": "resident", "streaming": "streaming", "swarmx": "swarmx"}
    _same_training(tmp_path / "resident", tmp_path / "streaming", learns=not nsp)
    _same_training(tmp_path / "resident", tmp_path / "swarmx", learns=not nsp)
    params = load_params(tmp_path / "resident.yaml")
    cfg = params.model.to_model_config()
    assert (cfg.family, cfg.nsp_head, cfg.n_layer, cfg.d_model) == (family, nsp, 2, 32)
    tok = load_tokenizer(tmp_path / "resident" / "tokenizer")  # the WordPiece vocabulary is the run's tokenizer
    assert tok.vocab_size == cfg.vocab_size and tok.mask_token == "[MASK]"
    if params.train_input.do_lower:  # BERT's uncased configs
        assert tok.decode(tok.encode("First Citizen: SPEAK")) == "first citizen : speak"
    else:  # RoBERTa's is cased: capitals are not in this lowercase vocabulary
        assert tok.encode("Speak speak") == [tok.token_to_id("[UNK]"), tok.token_to_id("speak")]


def test_wordpiece_vocab_file_tokenizes_as_bert(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    vocab = _vocab(tmp_path)
    ours = load_tokenizer(vocab, lowercase=True)
    words = vocab.read_text().split()
    theirs = transformers.BertTokenizerFast(vocab=dict(zip(words, range(len(words)))), do_lower_case=True)
    text = "Before we proceed, hear me SPEAK. [MASK] resolved?"
    assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.mask_id == theirs.mask_token_id
    cased = load_tokenizer(vocab, lowercase=False)
    assert cased.encode("Speak") == [cased.token_to_id("[UNK]")]  # no "Speak" in the lowercase vocabulary


def test_masked_lm_data_keys(corpus: Path, tmp_path: Path) -> None:
    d = {"train_input": {"data_dir": [str(corpus)], "batch_size": 4, "max_sequence_length": 32,
                         "masked_lm_prob": 0.3, "max_predictions_per_seq": 5},
         "model": {"name": "bert-tiny"}, "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-3},
         "runconfig": {"max_steps": 1}}
    p = params_from_dict(d, source="test")
    from waferscale.zoo.runner import prepare_data

    data = prepare_data(p, p.model.to_model_config(), progress=False)
    assert (data.masker.probability, data.masker.max_predictions) == (0.3, 5)
    x = torch.from_numpy(data.train[:4 * 32].astype("int64")).view(4, 32)
    assert ((data.masker.mask(x, 0)[1] != IGNORE_INDEX).sum(1) == 5).all()  # round(0.3 * 32) = 10, capped at 5
    for section, key, message in [("train_input", "mask_whole_word", "mask_whole_word: true .* not supported"),
                                  ("train_input", "whole_word_masking", "mask_whole_word: true .* not supported"),
                                  ("model", "name", "masked_lm_prob: is a masked-LM setting")]:
        bad = json.loads(json.dumps(d))
        bad[section][key] = "gpt-tiny" if key == "name" else True
        with pytest.raises(ConfigError, match=message):
            params_from_dict(bad, source="test")
    # dynamic_mlm_scale: Model Zoo's loss is then the mean over the batch's masked positions, without the weight
    scaled = json.loads(json.dumps(d))
    scaled["model"] = {"name": "bert", "disable_nsp": True, "mlm_loss_weight": 0.058}
    assert params_from_dict(scaled, source="test").model.to_model_config().mlm_loss_weight == 0.058
    scaled["train_input"]["dynamic_mlm_scale"] = True
    assert params_from_dict(scaled, source="test").model.to_model_config().mlm_loss_weight is None
    bad = json.loads(json.dumps(d))
    bad["train_input"]["do_lower"] = True
    with pytest.raises(ConfigError, match="do_lower: applies to a vocab_file"):
        params_from_dict(bad, source="test")
