"""`wsc generate` on an encoder fills the prompt's mask tokens with the model's top predictions: the same sequence
transformers' fill-mask pipeline gives, for tiny random BERT and RoBERTa masked-LM models and tokenizers built here
(a WordPiece vocabulary, a byte-level BPE trained on the test text) and saved as Hugging Face directories."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import TEXT, wsc_main

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

PROMPTS = ["Before we [MASK] any further, hear me speak.",  # one mask
           "[MASK] citizen: you are all [MASK] rather to die than to famish?"]  # two, predicted in one pass


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Weights moved well off their initialisation, so that each mask's prediction depends on its context (freshly
    initialised, the tied embeddings mostly predict a neighbouring token)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _bert_dir(path: Path) -> Path:
    words = sorted(set(re.findall(r"[a-z]+|[^\sa-z]", TEXT.lower())))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    tok = transformers.BertTokenizerFast(vocab=dict(zip(vocab, range(len(vocab)))), do_lower_case=True)
    conf = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=64)
    _perturbed(transformers.BertForMaskedLM(conf)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _roberta_dir(path: Path) -> Path:
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT.split("\n\n"), vocab_size=300, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    merges = [tuple(m) for m in json.loads(bpe._tokenizer.to_str())["model"]["merges"]]
    tok = transformers.RobertaTokenizerFast(vocab=bpe.get_vocab(), merges=merges)
    conf = transformers.RobertaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=66, type_vocab_size=1,
                                      pad_token_id=1)
    _perturbed(transformers.RobertaForMaskedLM(conf)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _pipeline_top(model_dir: Path, prompt: str) -> str:
    """The pipeline's top sequence: its first candidate at each mask (with two masks it fills one per candidate,
    so the top sequence puts each mask's first candidate in place)."""
    fill = transformers.pipeline("fill-mask", model=str(model_dir), tokenizer=str(model_dir), device="cpu")
    out = fill(prompt)
    if isinstance(out[0], dict):  # one mask: the candidates
        return out[0]["sequence"]
    tok = fill.tokenizer
    ids = tok(prompt)["input_ids"]
    where = [i for i, t in enumerate(ids) if t == tok.mask_token_id]
    for i, candidates in zip(where, out):
        ids[i] = candidates[0]["token"]
    return tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_fill_mask_equals_the_pipeline(tmp_path: Path, family: str, capsys) -> None:
    model_dir = (_bert_dir if family == "bert" else _roberta_dir)(tmp_path / family)
    mask = "[MASK]" if family == "bert" else "<mask>"
    for prompt in PROMPTS:
        prompt = prompt.replace("[MASK]", mask)
        r = wsc_main(capsys, "generate", "--model", str(model_dir), "--prompt", prompt)
        assert r.returncode == 0, r.stderr
        expected = _pipeline_top(model_dir, prompt)
        assert r.stdout == expected + "\n"
        assert mask not in r.stdout


def test_fill_mask_needs_a_mask_token(tmp_path: Path, capsys) -> None:
    model_dir = _bert_dir(tmp_path / "bert")
    r = wsc_main(capsys, "generate", "--checkpoint", str(model_dir), "--prompt", "Before we proceed any further.")
    assert r.returncode == 2
    assert r.stderr.startswith("error: the prompt has no mask token '[MASK]'"), r.stderr
    r = wsc_main(capsys, "generate", "--checkpoint", str(model_dir), "--chat", "[MASK] citizen")
    assert r.returncode == 2 and "is an encoder: it fills the mask tokens of --prompt" in r.stderr
