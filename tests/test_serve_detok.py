"""The serving detokenizer with SentencePiece-style tokenizers (Llama 2, Mistral, Mixtral, T5: pieces like "▁the"),
whose decoder drops the space of the first piece it decodes: a completion streams as decode(prompt + generated)
minus decode(prompt), its first word keeping its space, a multi-byte character split over byte-fallback tokens
arrives whole, and stop strings still match; in process and through the real server with the openai client.

The tokenizers are built here without downloads: llama.cpp's SentencePiece vocabulary in a GGUF file (read by
`tokenizer_from_gguf`), the same saved as a Hugging Face Llama-style tokenizer.json or with the Metaspace
pre-tokenizer, and a T5-style Unigram with the Metaspace pre-tokenizer and decoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from serve_helpers import run_server

gguf = pytest.importorskip("gguf")

from gguf_helpers import write_byte_bpe_vocab_gguf, write_sentencepiece_vocab_gguf  # noqa: E402

from waferscale.data.tokenizer.from_gguf import tokenizer_from_gguf  # noqa: E402
from waferscale.data.tokenizer.hf import HFTokenizer  # noqa: E402
from waferscale.serve.sampling import Detokenizer  # noqa: E402

CORPUS = " ".join(["Good morrow, the king is here. The king is good and the queen is here too."] * 20)
PROMPT = "Good morrow,"
# (continuation, the pieces it must hold): leading-space words, a lone "▁" before byte-fallback bytes, a
# two-byte and a four-byte character
CASES = [(" the king is here", ["▁the"]),
         (" é the king", ["▁", "<0xC3>", "<0xA9>"]),
         (" the king é is here 😀 now", ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"])]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> HFTokenizer:
    return tokenizer_from_gguf(write_sentencepiece_vocab_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", CORPUS))


@pytest.fixture(scope="module")
def spm_json(spm_gguf, tmp_path_factory) -> HFTokenizer:
    """The GGUF's tokenizer saved as tokenizer.json and read back, as a Llama 2 / Mistral model directory has it:
    a byte-fallback BPE, normalizer Prepend("▁") + Replace(" ", "▁"), decoder Replace / ByteFallback / Fuse /
    Strip."""
    d = tmp_path_factory.mktemp("spm-json")
    spm_gguf.save(d)
    return HFTokenizer.from_file(d)


@pytest.fixture(scope="module")
def spm_metaspace(spm_gguf) -> HFTokenizer:
    """The same vocabulary as transformers writes a non-legacy Llama tokenizer.json: no normalizer, the Metaspace
    pre-tokenizer ("▁" in front of the first word only), the same decoder."""
    from tokenizers import Tokenizer, pre_tokenizers

    tk = Tokenizer.from_str(spm_gguf.tk.to_str())
    tk.normalizer = None
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    return HFTokenizer(tk, eos_id=spm_gguf.eos_id)


def _t5_style() -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["▁Good", "▁morrow", ",", "▁the", "▁king", "▁is", "▁here", "▁now", "▁é", "▁", "é", "▁😀"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *((p, -1.0 - i / 10) for i, p in enumerate(pieces)),
             *((c, -10.0) for c in "abcdefghijklmnopqrstuvwxyzGT.")]
    tk = Tokenizer(models.Unigram(vocab, unk_id=2))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return HFTokenizer(tk, eos_id=1)


def _stream(tok, prompt_ids: list[int], gen: list[int], stop: list[str] = ()) -> tuple[list[str], bool]:
    """Deltas of `gen` after `prompt_ids` as the engine emits them (flushed at the end unless a stop hit)."""
    d = Detokenizer(tok, list(stop), prompt_ids)
    deltas = []
    for t in gen:
        delta, hit = d.add(t)
        deltas.append(delta)
        if hit:
            return deltas, True
    return [*deltas, d.flush()], False


@pytest.mark.parametrize("which", ["spm_gguf", "spm_json", "spm_metaspace", "t5"])
def test_deltas_keep_leading_space_and_whole_characters(which, request):
    tok = _t5_style() if which == "t5" else request.getfixturevalue(which)
    p = tok.encode(PROMPT)
    for cont, pieces in CASES:
        ids = tok.encode(PROMPT + cont)
        assert ids[:len(p)] == p
        gen = ids[len(p):]
        if which != "t5":  # the case exercises what it names
            assert all(tok.token_to_id(x) in gen for x in pieces), [tok.id_to_token(i) for i in gen]
        deltas, hit = _stream(tok, p, gen)
        assert not hit
        assert "".join(deltas) == tok.decode(ids)[len(tok.decode(p)):] == cont
        assert not any("\ufffd" in x for x in deltas), deltas
        assert deltas[0].startswith(" ")  # the first token's own delta has its space


def test_leading_space_is_lost_without_the_prompt(spm_gguf):
    """Why the prompt's tail is there: the same ids decoded alone drop the first word's space."""
    p = spm_gguf.encode(PROMPT)
    gen = spm_gguf.encode(PROMPT + " the king")[len(p):]
    assert "".join(_stream(spm_gguf, [], gen)[0]) == "the king"
    assert "".join(_stream(spm_gguf, p, gen)[0]) == " the king"


def test_stop_strings_see_the_leading_space(spm_gguf):
    tok = spm_gguf
    p = tok.encode(PROMPT)
    gen = tok.encode(PROMPT + " the king é is here 😀 now")[len(p):]
    assert _stream(tok, p, gen, [" the"]) == ([""], True)  # matches at once, nothing emitted
    deltas, hit = _stream(tok, p, gen, [" is"])
    assert hit and "".join(deltas) == " the king é"
    deltas, hit = _stream(tok, p, gen, ["😀"])
    assert hit and "".join(deltas) == " the king é is here "
    deltas, hit = _stream(tok, p, gen, ["é is"])  # withheld while it could still be the stop string
    assert hit and "".join(deltas) == " the king "


def test_byte_level_bpe_deltas_unchanged_by_the_prompt(tmp_path):
    """GPT-2 byte-level BPE decodes token by token, so the prompt's tail changes none of its deltas."""
    tok = tokenizer_from_gguf(write_byte_bpe_vocab_gguf(tmp_path / "bpe.gguf", CORPUS, "gpt2"))
    p = tok.encode(PROMPT)
    ids = tok.encode(PROMPT + " the king é is here 😀 now")
    gen = ids[len(p):]
    with_prompt, alone = _stream(tok, p, gen)[0], _stream(tok, [], gen)[0]
    assert with_prompt == alone
    assert "".join(with_prompt) == " the king é is here 😀 now"


# ---- through the server ---------------------------------------------------------------------------------------
CONTINUATION = " the king é is here😀"  # each token once, so a bigram model can write it


def _bigram_model_dir(tok: HFTokenizer, prompt: str, continuation: str, out: Path) -> Path:
    """A 1-layer Llama whose blocks add nothing (zero weights), so each next token depends on the current one
    only: the current token's embedding is a basis vector the head maps to the next token of prompt +
    continuation, and the continuation's last token to EOS. Greedy decoding then writes exactly `continuation`."""
    from waferscale.models import ModelConfig, build
    from waferscale.models.hf import save_hf_dir

    p = tok.encode(prompt)
    chain = [p[-1], *tok.encode(prompt + continuation)[len(p):], tok.eos_id]
    assert len(set(chain)) == len(chain), [tok.id_to_token(i) for i in chain]
    d = 64
    assert len(chain) <= d
    cfg = ModelConfig(name="tiny-spm", family="llama", vocab_size=tok.vocab_size, n_layer=1, n_head=4, n_kv_head=2,
                      d_model=d, d_ff=128, max_seq_len=128, norm="rmsnorm", activation="swiglu", position="rotary",
                      attn_bias=False, mlp_bias=False, tie_embeddings=False)
    model = build(cfg, device="cpu")
    with torch.no_grad():
        for p_ in model.blocks.parameters():
            p_.zero_()
        model.embed.tok.weight.zero_()
        model.head.lm_head.weight.zero_()
        for k, (cur, nxt) in enumerate(zip(chain, chain[1:])):
            model.embed.tok.weight[cur, k] = 1.0
            model.head.lm_head.weight[nxt, k] = 1.0
    save_hf_dir(model, out, tokenizer=tok)
    return out


@pytest.mark.slow
def test_server_streams_and_returns_the_leading_space_and_whole_characters(spm_gguf, tmp_path):
    openai = pytest.importorskip("openai")
    model_dir = _bigram_model_dir(spm_gguf, PROMPT, CONTINUATION, tmp_path / "tiny-spm")
    decoder = json.loads((model_dir / "tokenizer.json").read_text())["decoder"]  # what the server decodes with
    assert [d["type"] for d in decoder["decoders"]] == ["Replace", "ByteFallback", "Fuse", "Strip"]
    with run_server(model_dir, tmp_path) as srv:
        c = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=120)
        r = c.completions.create(model="tiny-spm", prompt=PROMPT, max_tokens=32, temperature=0)
        assert r.choices[0].text == CONTINUATION and r.choices[0].finish_reason == "stop"
        deltas = [ch.choices[0].text for ch in c.completions.create(model="tiny-spm", prompt=PROMPT, max_tokens=32,
                                                                     temperature=0, stream=True) if ch.choices]
        assert "".join(deltas) == CONTINUATION and deltas[0] == " the"
        assert not any("\ufffd" in x for x in deltas), deltas
        r = c.completions.create(model="tiny-spm", prompt=PROMPT, max_tokens=32, temperature=0, stop=["😀"])
        assert r.choices[0].text == " the king é is here" and r.choices[0].finish_reason == "stop"
        deltas = [ch.choices[0].text for ch in c.completions.create(model="tiny-spm", prompt=PROMPT, max_tokens=32,
                                                                     temperature=0, stop=[" is"], stream=True)
                  if ch.choices]
        assert "".join(deltas) == " the king é"
