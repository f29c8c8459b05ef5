"""`LLM`: generation in this process on the serving engine, as vLLM's `LLM` class is; what `wsc generate` runs.

The same `Engine` (scheduler, paged model runner with the C kernels on CPU float32, per-request sampler,
detokenizer) that `wsc serve` runs, so a prompt with the same `SamplingParams` decodes and samples the same
tokens from the command line and from the server. Any `CausalLM` runs: the Llama family (rotary positions,
RMSNorm, SwiGLU) and the GPT family (learned positions, LayerNorm, GELU), with any tokenizer (a char-level
tokenizer of a `wsc run` checkpoint included).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from waferscale.errors import ConfigError
from waferscale.models.layers import CausalLM
from waferscale.runtime.source import ModelSource
from waferscale.serve.engine import Engine, EngineOutput, load_named
from waferscale.serve.kv import blocks_for
from waferscale.serve.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "SamplingParams"]


@dataclass
class CompletionOutput:
    """One continuation of a prompt, as vLLM's `CompletionOutput` (eos and stop strings not included)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos, a stop token or string) or "length" (max_tokens or the context)


@dataclass
class RequestOutput:
    """One prompt's result, as vLLM's `RequestOutput`: its `SamplingParams.n` continuations in `outputs` (a
    seeded request's continuation i samples with seed + i, as the server's choices do). `text`, `token_ids` and
    `finish_reason` are the first continuation's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason


class LLM:
    """An in-process engine over `model` and `tokenizer` (encode / decode / eos_id / vocab_size), or over what a
    name or path names (`LLM("smollm2-135m-instruct")`, `LLM("runs/demo")`, a .gguf, a Hugging Face
    directory, a checkpoint: runtime/source.py, as every command resolves a model; `tokenizer` then overrides its
    own; a `.mdl`: `LLM(resolve("x.mdl", config=ModelConfig))`).

    max_num_seqs: sequences decoded together. max_model_len: prompt + generated tokens a sequence may reach
    (None: the model's context); with `max_num_seqs` it sizes the KV cache (blocks for that many sequences of
    that length) unless `num_blocks` or `kv_cache_mb` is given. Other keywords go to `Engine`.
    """

    def __init__(self, model: CausalLM | str | os.PathLike | ModelSource, tokenizer: Any = None, *,
                 max_num_seqs: int = 1, max_model_len: int | None = None, **engine_kw: Any) -> None:
        if isinstance(model, (str, os.PathLike, ModelSource)):
            model, tokenizer = load_named(model, dtype=engine_kw.get("dtype"), tokenizer=tokenizer)
        elif tokenizer is None:
            raise ConfigError("LLM(model, tokenizer): a model object needs its tokenizer")
        ctx = model.config.max_seq_len if max_model_len is None else min(max_model_len, model.config.max_seq_len)
        if "num_blocks" not in engine_kw and "kv_cache_mb" not in engine_kw:
            engine_kw["num_blocks"] = max_num_seqs * blocks_for(ctx, engine_kw.get("block_size", 16))
        engine_kw.setdefault("device", model.head.norm.weight.device)  # (a GGUF's matrices may be meta)
        self.engine = Engine(model, tokenizer, max_num_seqs=max_num_seqs, **engine_kw)
        self.tokenizer = tokenizer
        self.max_model_len = ctx
        self._ids = itertools.count()

    def _prompt_ids(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """Token ids, and params whose max_tokens is cut to what the context leaves after the prompt."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ConfigError("the prompt is empty: give at least one token")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ConfigError(f"the prompt has {len(ids)} tokens; the context is {self.max_model_len} tokens "
                              "(the model's, or max_model_len): shorten the prompt")
        return ids, (params if params.max_tokens <= room else replace(params, max_tokens=room))

    def _add(self, prompts: list[str | list[int]], params: SamplingParams
             ) -> tuple[dict[str, tuple[int, int]], list[list[int]]]:
        """Queue every prompt's `params.n` sequences (ConfigError for a prompt that cannot run, before any is
        queued); (request id -> (prompt index, continuation index), each prompt's token ids)."""
        checked = [self._prompt_ids(p, params) for p in prompts]
        rids = {}
        for i, (ids, sp) in enumerate(checked):
            for k in range(params.n):
                rid = f"llm-{next(self._ids)}"
                one = replace(sp, n=1, seed=None if sp.seed is None else sp.seed + k)
                self.engine.add_request(rid, ids, one)
                rids[rid] = (i, k)
        return rids, [ids for ids, _ in checked]

    def _outputs(self, rids: dict[str, tuple[int, int]]) -> Iterator[tuple[tuple[int, int], EngineOutput]]:
        """((prompt index, continuation index), output) as the engine steps, every queued sequence in flight
        together."""
        try:
            while self.engine.has_unfinished():
                for o in self.engine.step():
                    if o.request_id in rids:
                        yield rids[o.request_id], o
        finally:  # a consumer that stops early (or an error) leaves no request holding KV blocks
            if self.engine.has_unfinished():
                self.engine.abort_all()

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
        """Text deltas of one prompt's continuation as they are sampled (stop strings are never emitted).
        The prompt is checked now (ConfigError), before the first delta is asked for."""
        if params.n != 1:
            raise ConfigError(f"stream() runs one continuation; SamplingParams.n is {params.n}: use generate()")
        outputs = self._outputs(self._add([prompt], params)[0])
        return (o.new_text for _, o in outputs if o.new_text)

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run every prompt (a string, token ids, or a list of either) to completion, batched; one RequestOutput
        per prompt, in order. sampling_params: vLLM's default (SamplingParams()) when None."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        rids, ids = self._add(list(prompts), params)
        first = {i: rid for rid, (i, k) in rids.items() if k == 0}
        done = [RequestOutput(first[i], p if isinstance(p, str) else None, ids[i],
                              [CompletionOutput(k, "", [], "length") for k in range(params.n)])
                for i, p in enumerate(prompts)]
        for (i, k), o in self._outputs(rids):
            c = done[i].outputs[k]
            c.text += o.new_text
            c.token_ids += o.new_token_ids
            if o.finished:
                c.finish_reason = o.finish_reason or "stop"
        return done

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, *, add_generation_prompt: bool = True,
             **template_kw: Any) -> list[RequestOutput]:
        """Continue one conversation ([{"role": ..., "content": ...}, ...]) or several, rendered with the
        tokenizer's own chat template (as `wsc serve`'s /v1/chat/completions does); one RequestOutput each.
        template_kw (e.g. `tools`) go to the template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if not hasattr(self.tokenizer, "apply_chat_template"):
            raise ConfigError("this tokenizer has no chat template: use generate() with plain prompts")
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt, **template_kw)
                   for c in convs]
        return self.generate(prompts, sampling_params)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
