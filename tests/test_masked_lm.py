"""The masked-LM objective of the encoders: dynamic masking (15% of each sequence; 80% mask token, 10% random,
10% kept; labels -100 elsewhere), the tokenizers' mask tokens, and `wsc run` training a tiny BERT resident,
streamed and on two systems with equal losses, resuming exactly."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from conftest import tiny_params
from train_helpers import assert_same_training, checkpoint_weights
from waferscale.cli.main import main
from waferscale.data import BatchLoader, CharTokenizer, HFTokenizer, MaskedBatches, Masker, tokenizer_with_mask
from waferscale.data.masking import IGNORE_INDEX
from waferscale.data.tokenizer import load_tokenizer
from waferscale.errors import DataError
from waferscale.models.layers import lm_loss
from waferscale.models.registry import PRESETS, build
from waferscale.params import params_from_dict
from waferscale.zoo.runner import RunOptions, run


def test_masking_statistics() -> None:
    V, mask_id = 50, 49
    x = torch.randint(0, V - 1, (400, 100), generator=torch.Generator().manual_seed(0))
    inputs, labels = Masker(mask_id, V, seed=7).mask(x, 0)
    chosen = labels != IGNORE_INDEX
    assert (chosen.sum(1) == 15).all()  # round(0.15 * 100) on every sequence
    assert torch.equal(labels[chosen], x[chosen]) and torch.equal(inputs[~chosen], x[~chosen])
    n = chosen.sum().item()
    masked = (inputs[chosen] == mask_id).sum().item() / n
    kept = (inputs[chosen] == x[chosen]).sum().item() / n
    replaced = 1 - masked - kept  # a random token that is not the original
    # 6000 draws: three standard deviations of a 10% fraction are 1.2%
    assert abs(masked - 0.8) < 0.02
    assert abs(kept - (0.1 + 0.1 / V)) < 0.015 and abs(replaced - 0.1 * (1 - 1 / V)) < 0.015
    assert set(inputs.unique().tolist()) <= set(range(V))
    # positions are uniform: every column is chosen about 15% of the time
    assert chosen.float().mean(0).sub(0.15).abs().max() < 0.07


def test_draws_are_fresh_per_batch_and_reproducible() -> None:
    x = torch.randint(0, 40, (8, 64), generator=torch.Generator().manual_seed(0))
    m = Masker(40, 41, seed=3)
    a, b = m.mask(x, 5), m.mask(x, 6)
    assert not torch.equal(a[1], b[1])  # batch 6 is masked anew, even with the same windows
    assert all(torch.equal(p, q) for p, q in zip(a, m.mask(x, 5)))
    assert not torch.equal(a[1], Masker(40, 41, seed=4).mask(x, 5)[1])  # the run's seed decides the draws
    assert not torch.equal(m.eval_batches([(x, x)])[0][1], m.mask(x, 0)[1])  # evaluation draws are their own


def test_loss_counts_only_masked_positions() -> None:
    torch.manual_seed(0)
    model = build(PRESETS["bert-tiny"], device="cpu").eval()
    x = torch.randint(0, 200, (2, 32))
    inputs, labels = Masker(255, 256, seed=1).mask(x, 0)
    with torch.no_grad():
        logits = model(inputs)
        chosen = labels != IGNORE_INDEX
        expected = F.cross_entropy(logits[chosen], x[chosen])
        assert torch.allclose(lm_loss(logits, labels), expected)
        other = logits.clone()
        other[~chosen] = torch.randn_like(other[~chosen])  # the unmasked positions' predictions do not count
        assert torch.equal(lm_loss(other, labels), lm_loss(logits, labels))


def test_masked_batches_resume_exactly(tmp_path: Path) -> None:
    tokens = np.arange(5000) % 40
    make = lambda seed: MaskedBatches(BatchLoader(tokens, 4, 16, seed=1), Masker(40, 41, seed=seed))  # noqa: E731
    a = make(2)
    for _ in range(3):
        next(a)
    state = json.loads(json.dumps(a.state_dict()))  # as the checkpoint manifest holds it
    b = make(2)
    b.load_state_dict(state)
    assert all(torch.equal(p, q) for p, q in zip(next(a), next(b)))
    with pytest.raises(DataError, match="masked with"):
        make(9).load_state_dict(state)


def test_char_tokenizer_mask_token(tmp_path: Path) -> None:
    plain = CharTokenizer.from_text("abc d")
    tok = tokenizer_with_mask(plain)
    assert (tok.mask_id, tok.mask_token, tok.vocab_size) == (5, "[MASK]", 6)
    ids = tok.encode("ab[MASK] d[MASK]")
    assert ids == [1, 2, 5, 0, 4, 5] and tok.decode(ids) == "ab[MASK] d[MASK]"
    assert tokenizer_with_mask(tok) is tok
    tok.save(tmp_path / "t")
    back = load_tokenizer(tmp_path / "t")
    assert (back.mask_id, back.encode("[MASK]a")) == (5, [5, 1])
    plain.save(tmp_path / "p")  # a tokenizer without a mask token is written as before (same fingerprint)
    assert "mask_token" not in (tmp_path / "p" / "tokenizer.json").read_text()
    with pytest.raises(DataError, match="vocabulary"):
        plain.encode("[MASK]")


def test_hf_tokenizers_bring_their_mask_tokens(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    for mask in ("[MASK]", "<mask>"):
        tk = Tokenizer(models.WordLevel({"[PAD]": 0, "hello": 1, mask: 2, "[UNK]": 3}, unk_token="[UNK]"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        assert tokenizer_with_mask(HFTokenizer(tk)).mask_id == 2
    tk = Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1, "<special_mask>": 2}, unk_token="[UNK]"))
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"mask_token": "<special_mask>"}))
    assert load_tokenizer(tmp_path).mask_id == 2
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(DataError, match="no mask token"):
        tokenizer_with_mask(load_tokenizer(tmp_path))


# ---- wsc run: a tiny BERT ------------------------------------------------------------------------------------------

def _params(corpus: Path, model_dir: Path, steps: int = 4) -> dict:
    d = tiny_params(corpus, model_dir)
    d["runconfig"]["max_steps"] = steps
    d["model"]["name"] = "bert-tiny"
    return d


def _train(corpus: Path, model_dir: Path, **opts: object) -> dict:
    return run(params_from_dict(_params(corpus, model_dir), source="test"),
               RunOptions(model_dir=model_dir, progress=False, **opts), out=io.StringIO())


def _same_training(a: Path, b: Path) -> None:
    # (a key's bias gets a zero gradient but for rounding, softmax ignoring it: its noise is not compared)
    assert_same_training(a, b, skip=("k_proj.bias",))


def test_bert_trains_masked_lm_resident_and_streaming_alike(corpus: Path, tmp_path: Path) -> None:
    r = _train(corpus, tmp_path / "r", execution="resident", mode="train_and_eval")
    s = _train(corpus, tmp_path / "s", execution="streaming", mode="train_and_eval")
    assert (r["executor"], s["executor"]) == ("resident", "streaming")
    _same_training(tmp_path / "r", tmp_path / "s")
    assert s["eval_loss"] == pytest.approx(r["eval_loss"], rel=1e-5)
    # the saved tokenizer carries the mask token (what `wsc generate` and a resumed run read)
    assert load_tokenizer(tmp_path / "r" / "tokenizer").mask_token == "[MASK]"


def test_bert_resumes_exactly(corpus: Path, tmp_path: Path) -> None:
    d = _params(corpus, tmp_path / "once")
    d["runconfig"]["checkpoint_steps"] = 2
    run(params_from_dict(d, source="test"), RunOptions(model_dir=tmp_path / "once", progress=False), out=io.StringIO())
    d["runconfig"]["model_dir"] = str(tmp_path / "twice")
    for _ in range(2):
        run(params_from_dict(d, source="test"), RunOptions(model_dir=tmp_path / "twice", num_steps=2, progress=False),
            out=io.StringIO())
    _same_training(tmp_path / "once", tmp_path / "twice")


@pytest.mark.slow
def test_bert_on_two_systems_equals_one(corpus: Path, tmp_path: Path) -> None:
    _train(corpus, tmp_path / "one", execution="resident")
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(_params(corpus, tmp_path / "unused")))
    # `wsc run` by its main in this process (rank 0 here, its two system ranks processes of their own)
    assert main(["run", "-p", str(p), "-o", str(tmp_path / "two"), "--no_progress", "--num_csx", "2"]) == 0
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["executor"] == "swarmx"
    _same_training(tmp_path / "one", tmp_path / "two")


# ---- a pretrained BertForPreTraining: its next-sentence head trains, streamed as resident ----------------------

def _bert_with_nsp_head(tmp_path: Path) -> Path:
    """A tiny BertForPreTraining directory: `wsc run` trains it on sentence pairs, the next-sentence head too."""
    from waferscale.models import hf

    torch.manual_seed(0)
    model = build(PRESETS["bert-tiny"].replace(vocab_size=64, max_seq_len=32, nsp_head=True, dropout=0.0))
    hf.save_hf_dir(model, tmp_path / "bert-nsp")
    return tmp_path / "bert-nsp"


@pytest.mark.parametrize("systems", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_pretrained_next_sentence_head_trains_streamed_as_resident(corpus: Path, tmp_path: Path, systems: int) -> None:
    """The pretrained model's pooler and next-sentence classifier get the objective's gradients and step alike
    resident, streamed (MemoryX steps a unit's parameters as one flat tensor) and on two systems."""
    pretrained = _bert_with_nsp_head(tmp_path)
    d = _params(corpus, tmp_path / "unused")
    d["model"]["pretrained"] = str(pretrained)
    run(params_from_dict(d, source="test"), RunOptions(model_dir=tmp_path / "r", execution="resident",
                                                       progress=False), out=io.StringIO())
    if systems == 1:
        run(params_from_dict(d, source="test"), RunOptions(model_dir=tmp_path / "s", execution="streaming",
                                                           progress=False), out=io.StringIO())
    else:
        p = tmp_path / "p.yaml"
        p.write_text(yaml.safe_dump(d))
        assert main(["run", "-p", str(p), "-o", str(tmp_path / "s"), "--no_progress", "--num_csx", "2"]) == 0
    start = load_file(str(pretrained / "model.safetensors"))
    nsp = {k: v for k, v in checkpoint_weights(tmp_path / "r" / "checkpoint_4.safetensors").items()
           if k.startswith(("head.nsp", "head.pooler"))}
    assert len(nsp) == 4
    hf_names = {"head.nsp.weight": "cls.seq_relationship.weight", "head.nsp.bias": "cls.seq_relationship.bias",
                "head.pooler.weight": "bert.pooler.dense.weight", "head.pooler.bias": "bert.pooler.dense.bias"}
    assert not any(torch.equal(v, start[hf_names[k]]) for k, v in nsp.items())  # every one of them trained
    _same_training(tmp_path / "r", tmp_path / "s")  # streamed: the same, the head included
