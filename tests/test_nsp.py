"""BERT's pretraining objective (masked LM + next sentence): the sentence-pair examples (layout, token types, the
50/50 draw, masking that never picks [CLS]/[SEP], determinism), the loss against transformers' BertForPreTraining,
and `wsc run` training it resident and streamed alike, resuming exactly, with RoBERTa left as it was."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_params
from train_helpers import assert_same_training, checkpoint_weights
from waferscale.data.masking import IGNORE_INDEX, Masker
from waferscale.data.sentence_pairs import PairBatches, SentencePairs, tokenizer_with_pair_tokens
from waferscale.data.loader import BatchLoader
from waferscale.data.tokenizer import CharTokenizer, load_tokenizer
from waferscale.errors import DataError
from waferscale.models import hf
from waferscale.models.config import ModelConfig
from waferscale.models.registry import build
from waferscale.params import params_from_dict
from waferscale.zoo.runner import RunOptions, run

CLS, SEP, MASK, V = 1, 2, 3, 97


def _pairs(T: int = 40, seed: int = 3) -> SentencePairs:
    return SentencePairs(CLS, SEP, V, Masker(MASK, V, seed=seed, special_ids=(CLS, SEP)), T)


def _stream(n: int = 5000) -> np.ndarray:
    return np.random.default_rng(0).integers(4, V, n)


def _windows(stream: np.ndarray, B: int, n: int) -> torch.Tensor:
    return torch.from_numpy(stream[:B * n].reshape(B, n))


def test_pair_layout_types_labels_and_masking() -> None:
    stream, T = _stream(), 40
    w = _windows(stream, 64, T - 3)
    sp = _pairs(T)
    x, y = sp.make(w, stream, 0)
    ids, types = x % V, x // V
    original = torch.cat((ids[:, :1], torch.where(y[:, 1:] != IGNORE_INDEX, y[:, 1:], ids[:, 1:])), dim=1)
    assert (original[:, 0] == CLS).all() and (original[:, -1] == SEP).all()
    for b in range(len(x)):
        seps = (original[b] == SEP).nonzero().flatten().tolist()
        assert len(seps) == 2 and seps[1] == T - 1  # [CLS] A [SEP] B [SEP]
        a = seps[0] - 1
        assert (types[b, :a + 2] == 0).all() and (types[b, a + 2:] == 1).all()
        masked = (y[b, 1:] != IGNORE_INDEX).nonzero().flatten() + 1
        assert len(masked) == round(0.15 * T) and not set(masked.tolist()) & {0, a + 1, T - 1}
        assert torch.equal(original[b, 1:a + 1], w[b, :a])  # A: the window's start
        second = original[b, a + 2:T - 1]
        if y[b, 0] == 0:  # B continues A in the window
            assert torch.equal(second, w[b, a:])
        else:  # a random segment of the stream
            spans = np.lib.stride_tricks.sliding_window_view(stream, len(second))
            assert (spans == second.numpy()).all(1).any()
    assert 0.3 < y[:, 0].float().mean() < 0.7  # half of the time a random segment
    assert set(y[:, 0].tolist()) == {0, 1}
    # deterministic per (seed, batch index); a fresh draw per batch
    assert all(torch.equal(a, b) for a, b in zip(sp.make(w, stream, 0), (x, y)))
    assert not torch.equal(sp.make(w, stream, 1)[0], x)
    assert not torch.equal(_pairs(T, seed=4).make(w, stream, 0)[0], x)


def test_masker_never_chooses_specials_and_is_unchanged_without_them() -> None:
    x = torch.randint(4, V, (8, 32), generator=torch.Generator().manual_seed(0))
    x[:, ::2] = SEP  # half the positions special: the draw must still avoid every one of them
    _, labels = Masker(MASK, V, seed=1, probability=0.4, special_ids=(CLS, SEP)).mask(x, 0)
    assert (labels[:, ::2] == IGNORE_INDEX).all() and ((labels != IGNORE_INDEX).sum(1) == 13).all()
    plain = torch.randint(4, V, (8, 32), generator=torch.Generator().manual_seed(0))
    a, b = Masker(MASK, V, seed=1).mask(plain, 0), Masker(MASK, V, seed=1, special_ids=(CLS, SEP)).mask(plain, 0)
    assert all(torch.equal(s, t) for s, t in zip(a, b))  # no specials in the text: the masked LM's draw


def test_pair_batches_resume_and_refuse_other_settings() -> None:
    stream = _stream()
    fresh = PairBatches(BatchLoader(stream, 4, 37, seed=1), _pairs())
    next(fresh), next(fresh)
    state = json.loads(json.dumps(fresh.state_dict()))  # as a checkpoint's manifest keeps it
    third = next(fresh)
    resumed = PairBatches(BatchLoader(stream, 4, 37, seed=1), _pairs())
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(next(resumed), third))
    other = PairBatches(BatchLoader(stream, 4, 37, seed=1), _pairs(seed=9))
    with pytest.raises(DataError, match="masking settings"):
        other.load_state_dict(state)


def test_char_tokenizer_gains_cls_and_sep(tmp_path: Path) -> None:
    tok = tokenizer_with_pair_tokens(CharTokenizer.from_text("ab c").with_mask_token())
    assert [tok.token_to_id(t) for t in ("[MASK]", "[CLS]", "[SEP]")] == [4, 5, 6] and tok.vocab_size == 7
    assert tok.encode("[CLS]ab[SEP]c[MASK]") == [5, 1, 2, 6, 3, 4]
    tok.save(tmp_path / "tok")
    back = load_tokenizer(tmp_path / "tok")
    assert back.encode("[CLS]a[SEP]") == [5, 1, 6] and back.mask_id == 4


# ---- the loss: transformers' BertForPreTraining ---------------------------------------------------------------------

def _tiny_bert(**kw) -> ModelConfig:
    return ModelConfig(name="t-bert", family="bert", vocab_size=V, n_layer=2, n_head=4, d_model=32, d_ff=48,
                       max_seq_len=40, norm_eps=1e-12, activation="gelu", block="post_norm", lm_head_bias=True,
                       type_vocab_size=2, pad_token_id=0, nsp_head=True, **kw)


@pytest.mark.parametrize("weight", [None, 0.058])
def test_loss_matches_bert_for_pretraining(weight: float | None) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = _tiny_bert(mlm_loss_weight=weight)
    torch.manual_seed(0)
    conf = transformers.AutoConfig.for_model(**hf.config_to_hf(cfg))
    theirs = transformers.BertForPreTraining(conf).float().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():  # std 0.2 so that every path matters
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "layernorm.weight" in name.lower() else 0.0))
    ours = hf.model_from_state_dict(cfg, hf.state_dict_from_hf(theirs.state_dict(), cfg)).eval()
    stream = _stream()
    x, y = _pairs().make(_windows(stream, 8, 37), stream, 0)
    mlm_labels = y.clone()
    mlm_labels[:, 0] = IGNORE_INDEX
    with torch.no_grad():
        loss = ours.loss(ours.forward_aux(x)[0], y)
        out = theirs(input_ids=x % V, token_type_ids=x // V, labels=mlm_labels, next_sentence_label=y[:, 0])
    if weight is None:  # transformers: mean masked-LM cross-entropy + mean next-sentence cross-entropy
        expected = out.loss
    else:  # Model Zoo's BertPretrainModelLoss: weight x the masked positions' sum / sequences + next sentence
        mlm = F.cross_entropy(out.prediction_logits.reshape(-1, V), mlm_labels.reshape(-1), reduction="sum")
        expected = weight * mlm / len(x) + F.cross_entropy(out.seq_relationship_logits, y[:, 0])
    assert abs(float(loss) - float(expected)) <= 1e-5
    # the next-sentence term is in: other labels, another loss
    flipped = y.clone()
    flipped[:, 0] = 1 - flipped[:, 0]
    with torch.no_grad():
        assert abs(float(ours.loss(ours.forward_aux(x)[0], flipped)) - float(loss)) > 1e-3
    # inference reads the masked-LM logits alone, BertForPreTraining's prediction_logits
    with torch.no_grad():
        assert (ours(x % V, x // V) - out.prediction_logits).abs().max() <= 1e-4


def test_the_next_sentence_term_trains() -> None:
    """Gradients reach the next-sentence head through the head unit's packed output: a fixed batch is learnt."""
    torch.manual_seed(0)
    model = build(_tiny_bert(), device="cpu")
    stream = _stream()
    x, y = _pairs().make(_windows(stream, 8, 37), stream, 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def nsp_loss() -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model.pretraining_logits(x % V, x // V)[1], y[:, 0]))

    before = nsp_loss()
    for _ in range(30):
        opt.zero_grad()
        model.loss(model.forward_aux(x)[0], y).backward()
        opt.step()
    assert before > 0.5 and nsp_loss() < 0.05


# ---- wsc run ----------------------------------------------------------------------------------------------------

def _params(corpus: Path, model_dir: Path, name: str = "bert-tiny", steps: int = 4) -> dict:
    d = tiny_params(corpus, model_dir)
    d["runconfig"]["max_steps"] = steps
    d["model"]["name"] = name
    if name == "bert-tiny":
        d["model"]["disable_nsp"] = False  # the preset is BertForMaskedLM's shape: give it the next-sentence head
    return d


def _train(corpus: Path, model_dir: Path, name: str = "bert-tiny", **opts: object) -> tuple[dict, str]:
    out = io.StringIO()
    d = _params(corpus, model_dir, name)
    d["runconfig"]["save_initial_checkpoint"] = True
    s = run(params_from_dict(d, source="test"),
            RunOptions(model_dir=model_dir, progress=False, **opts), out=out)
    return s, out.getvalue()


def _same_training(a: Path, b: Path) -> None:
    # (a key's bias gets a zero gradient but for rounding, softmax ignoring it: its noise is not compared)
    assert_same_training(a, b, grad_norm=False, skip=("k_proj.bias",))


def test_wsc_run_trains_the_next_sentence_head_resident_and_streamed_alike(corpus: Path, tmp_path: Path) -> None:
    r, said = _train(corpus, tmp_path / "r", execution="resident", mode="train_and_eval")
    s, _ = _train(corpus, tmp_path / "s", execution="streaming", mode="train_and_eval")
    assert (r["executor"], s["executor"]) == ("resident", "streaming") and "not trained" not in said
    _same_training(tmp_path / "r", tmp_path / "s")
    assert s["eval_loss"] == pytest.approx(r["eval_loss"], rel=1e-5)
    start, end = (checkpoint_weights(tmp_path / "r" / f"checkpoint_{k}.safetensors") for k in (0, 4))
    for k in ("head.nsp.weight", "head.pooler.weight"):  # the next-sentence head trains
        assert not torch.equal(start[k], end[k]), k
    tok = load_tokenizer(tmp_path / "r" / "tokenizer")
    assert tok.token_to_id("[CLS]") is not None and tok.token_to_id("[SEP]") is not None


def test_wsc_run_resumes_the_pretraining_objective_exactly(corpus: Path, tmp_path: Path) -> None:
    d = _params(corpus, tmp_path / "once")
    d["runconfig"]["checkpoint_steps"] = 2
    run(params_from_dict(d, source="test"), RunOptions(model_dir=tmp_path / "once", progress=False), out=io.StringIO())
    for _ in range(2):
        run(params_from_dict(d, source="test"), RunOptions(model_dir=tmp_path / "twice", num_steps=2, progress=False),
            out=io.StringIO())
    _same_training(tmp_path / "once", tmp_path / "twice")


def test_roberta_trains_the_masked_lm_alone(corpus: Path, tmp_path: Path) -> None:
    _train(corpus, tmp_path / "r", name="roberta-tiny", execution="resident")
    tok = load_tokenizer(tmp_path / "r" / "tokenizer")
    assert tok.token_to_id("[CLS]") is None  # no sentence pairs: the character tokenizer gains [MASK] alone
