"""`LLM` (serve/llm.py, what `wsc generate` runs): the engine's tokens in process, for the GPT family (learned
positions, a char tokenizer) as for Llama; streaming equals batch; the context cuts max_tokens; an abandoned
stream frees its KV blocks; a prompt that cannot run is one ConfigError; the decoder families serve, an encoder
is refused."""

from __future__ import annotations

import re
import string

import pytest
import torch

from generate_reference import generate
from waferscale.data.tokenizer import CharTokenizer
from waferscale.errors import ConfigError
from waferscale.models import ModelConfig, build, from_name
from waferscale.serve.llm import LLM, SamplingParams

TOK = CharTokenizer(list(string.ascii_letters + string.digits + " .,"))


# d_model 256: the runner takes the C kernels for the GPT block too (LayerNorm, GELU, learned positions)
GPT_C = ModelConfig(name="gpt-c", family="gpt", vocab_size=256, n_layer=2, n_head=4, d_model=256, max_seq_len=64,
                    norm="layernorm", activation="gelu_tanh", position="learned", tie_embeddings=True)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "gpt-c"])
def test_generate_and_stream_match_the_plain_forward(name: str) -> None:
    torch.manual_seed(0)
    model = (build(GPT_C, device="cpu") if name == "gpt-c" else from_name(name)).eval()
    prompts = ["Hello", "ab", "The cat sat"]
    ref = [list(generate(model, TOK.encode(p), 20, temperature=0, vocab_limit=TOK.vocab_size)) for p in prompts]
    with LLM(model, TOK, max_num_seqs=3) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
        assert [o.token_ids for o in outs] == ref
        assert all(o.finish_reason == "length" and o.text == TOK.decode(o.token_ids) for o in outs)
        assert "".join(llm.stream(prompts[2], SamplingParams(temperature=0, max_tokens=20))) == outs[2].text
        sp = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=3, max_tokens=20)
        seeded = list(generate(model, TOK.encode(prompts[0]), 20, temperature=0.8, top_k=10, top_p=0.9, seed=3,
                               vocab_limit=TOK.vocab_size))
        assert llm.generate([prompts[0]], sp)[0].token_ids == seeded


def test_context_cuts_max_tokens_and_abandoned_streams_free_blocks() -> None:
    torch.manual_seed(0)
    model = from_name("gpt-tiny").eval()  # context 64
    ctx = model.config.max_seq_len
    llm = LLM(model, TOK)
    out = llm.generate(["abcd"], SamplingParams(temperature=0, max_tokens=1000))[0]
    assert len(out.token_ids) == ctx - 4 and out.finish_reason == "length"
    it = llm.stream("abcd", SamplingParams(temperature=0, max_tokens=30))
    next(it)
    it.close()
    assert llm.engine.stats()["kv_blocks_used"] == 0 and not llm.engine.has_unfinished()
    with pytest.raises(ConfigError, match="context"):
        llm.stream("a" * ctx, SamplingParams(max_tokens=5))
    with pytest.raises(ConfigError, match="empty"):
        llm.stream("", SamplingParams(max_tokens=5))


@pytest.mark.parametrize("name", ["gptj-tiny", "gpt-neox-tiny", "falcon-tiny", "mpt-tiny", "mistral-tiny",
                                  "mixtral-tiny"])
def test_the_decoder_families_match_the_plain_forward(name: str) -> None:
    """Partial and interleaved rotary, parallel blocks, ALiBi, sliding windows and experts all serve (parity with
    transformers: tests/test_serve_families.py)."""
    torch.manual_seed(0)
    model = from_name(name).eval()
    prompts = ["Hello", "The cat sat on the mat"]
    ref = [list(generate(model, TOK.encode(p), 20, temperature=0, vocab_limit=TOK.vocab_size)) for p in prompts]
    with LLM(model, TOK, max_num_seqs=2) as llm:
        assert [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))] == ref


def test_an_encoder_is_refused_by_name() -> None:
    """Never served wrong: an encoder (no next-token decoding) is named."""
    with pytest.raises(ConfigError, match=f"cannot serve 'bert-tiny'.*{re.escape('no encoder')}"):
        LLM(from_name("bert-tiny").eval(), TOK)


def test_results_are_shaped_as_vllms_and_n_continuations_use_seed_plus_i() -> None:
    """`generate` takes one prompt or a list and returns RequestOutputs (`outputs[i]`: continuation i, a seeded
    request's sampling with seed + i, as the server's choices); `chat` renders the tokenizer's own template."""
    torch.manual_seed(0)
    model = from_name("llama-tiny").eval()
    sp = lambda **kw: SamplingParams(temperature=0.9, top_k=20, max_tokens=12, **kw)  # noqa: E731
    with LLM(model, TOK, max_num_seqs=4) as llm:
        one = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=6))
        assert len(one) == 1 and one[0].prompt == "Hello" and one[0].prompt_token_ids == TOK.encode("Hello")
        assert one[0].finished and one[0].outputs[0].index == 0 and one[0].text == one[0].outputs[0].text
        two = llm.generate(["Hello", "The cat"], sp(n=3, seed=7))
        assert [len(r.outputs) for r in two] == [3, 3] and [o.index for o in two[0].outputs] == [0, 1, 2]
        for k in range(3):  # continuation k is the request with seed 7 + k
            assert two[1].outputs[k].token_ids == llm.generate("The cat", sp(seed=7 + k))[0].token_ids
        assert len({tuple(o.token_ids) for o in two[0].outputs}) > 1
        with pytest.raises(ConfigError, match="one continuation"):
            llm.stream("Hello", sp(n=2))

    class ChatTok(CharTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
            return "".join(f"{m['role'][0]}: {m['content']}. " for m in messages) + ("a: " if add_generation_prompt
                                                                                     else "")

    tok = ChatTok(list(string.ascii_letters + string.digits + " .,:"))
    with LLM(model, tok) as llm:
        conv = [{"role": "user", "content": "Hi there"}]
        got = llm.chat(conv, SamplingParams(temperature=0, max_tokens=5))
        assert got[0].prompt == "u: Hi there. a: "
        assert got[0].token_ids == llm.generate("u: Hi there. a: ", SamplingParams(temperature=0,
                                                                                   max_tokens=5))[0].token_ids
        assert len(llm.chat([conv, conv + [{"role": "assistant", "content": "Yo"}]])) == 2
