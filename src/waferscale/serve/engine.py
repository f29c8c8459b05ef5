"""The inference engine: continuous batching over a paged KV cache, per-request sampling, pipelined stages.

`Engine.step()` is schedule -> execute -> update (vLLM's `EngineCore.step`): the pure-Python `Scheduler` picks
this step's tokens (a decode token per running sequence, prompt chunks for admitted ones, up to
`max_num_batched_tokens`) and allocates their KV blocks; the `ModelRunner` runs them as one flat batch; each
sequence samples its next token with its own generator, is detokenized and checked against its stop rules,
and the step reports `EngineOutput` deltas (finished sequences free their blocks).

With `stages=K` the running sequences are split into K groups ("virtual engines", as in vLLM's pipeline
parallelism), each with its own scheduler and share of the KV blocks. A step submits the next group's batch
while the others are still in the pipe (serve/stages.py) and completes the oldest, so every stage is busy and
only activations cross between stages. `AsyncEngine` runs `step()` in one background thread and streams
outputs to asyncio consumers.

Prefix caching (on by default, as in vLLM; kv.py and scheduler.py): a request whose prompt starts with full
KV blocks computed for an earlier request shares them and prefills only the rest. Block tables are the
driver's, so every pipeline stage's slice of a block holds the same positions of the same tokens; each group
has its own blocks and so its own cache, and a request joins, among the least busy groups, the one that holds
most of its prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from waferscale.errors import ConfigError
from waferscale.models.layers import CausalLM
from waferscale.models.modelzoo import fold_mup_model
from waferscale.serve.file_weights import served_weights
from waferscale.serve.model_runner import BatchSpec, ModelRunner
from waferscale.serve.kv import BlockAllocator, KVPool, kv_cache_dtype as resolve_kv_dtype
from waferscale.serve.sampling import (Detokenizer, RequestSampler, SamplingParams, TokenBytes, logprob_entry,
                                       sample_rows)
from waferscale.serve.scheduler import ScheduledChunk, Scheduler, SchedulerOutput, Sequence
from waferscale.serve.speculative import NgramProposer, NgramSpeculation, verify

__all__ = ["AsyncEngine", "Engine", "EngineDead", "EngineOutput", "RequestTooLong", "SamplingParams",
           "check_request"]

FinishReason = Literal["stop", "length", "abort"]


class RequestTooLong(ValueError):
    """The prompt plus max_tokens can never fit this engine's context or KV cache."""


class EngineDead(RuntimeError):
    """The engine (its process) has stopped: open streams fail with this, and so does every new request."""


def load_named(name: Any, *, dtype: str | None = None, device: Any = "cpu", tokenizer: Any = None
               ) -> tuple[CausalLM, Any]:
    """(model, tokenizer) of what `name` names (runtime/source.py), for the engine: a GGUF's matrices stay in the
    file's precision unless dtype is "fp32"; `tokenizer` (a name, a path or a tokenizer) overrides the source's
    own; ConfigError when there is none (a zoo name)."""
    from waferscale.runtime.source import resolve

    src = resolve(name)
    tok = tokenizer if tokenizer is not None and not isinstance(tokenizer, str) else src.tokenizer(tokenizer)
    if tok is None:
        raise ConfigError(f"{src.spec} carries no tokenizer of its own (a zoo name, or a checkpoint with no "
                          "tokenizer/ beside it): give one (--tokenizer NAME-OR-PATH), or serve a .gguf or a Hugging "
                          "Face directory")
    return src.load(device=device, keep_quantized=dtype != "fp32"), tok


def check_request(prompt_token_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                  block_size: int, group_blocks: int, window: int = 0, max_chunk: int = 0) -> None:
    """Raise (RequestTooLong / ValueError) if the request could never run on an engine with these limits
    (`Engine.describe()["limits"]`); changes nothing. With a sliding window a sequence holds at most the
    blocks of a window plus a chunk of `max_chunk` tokens (the scheduler frees the rest as it goes)."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if params.n != 1:
        raise ValueError(f"SamplingParams.n is {params.n}: the engine runs one sequence per request; fan out n "
                         "requests (seed + i), as LLM.generate and the server do")
    bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})")
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise RequestTooLong(
            f"this model's context is {max_model_len} tokens; the prompt has {len(prompt_token_ids)} "
            f"and max_tokens asks for {params.max_tokens} more ({total}); shorten the prompt or lower "
            "max_tokens")
    need = -(-total // block_size)
    if window:
        need = min(need, -(-(window + max_chunk - 1) // block_size) + 1)
    if need > group_blocks:
        raise RequestTooLong(
            f"the KV cache holds {group_blocks * block_size} positions per sequence group; this request needs "
            f"{total} ({len(prompt_token_ids)} prompt + {params.max_tokens} max_tokens); raise kv_cache_mb or "
            "lower max_tokens")


@dataclass
class EngineOutput:
    """What one step produced for one request: the new tokens and the text delta since the last output.

    Stop strings are withheld from `new_text` until resolved and never emitted. `logprobs` has one entry per
    new token when asked for. The three times (seconds) are set on the final output: queue (arrival -> first
    scheduled), prompt (first scheduled -> first token), completion (first token -> finish).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict] | None = None
    cached_tokens: int = 0  # (final output) prompt tokens whose KV came from the prefix cache
    queue_time_s: float = 0.0
    prompt_time_s: float = 0.0
    completion_time_s: float = 0.0
    draft_tokens: int | None = None  # speculation, so far (None: the request does not speculate): tokens drafted
    accepted_tokens: int | None = None  # and of them accepted


@dataclass(eq=False)
class _Request:
    seq: Sequence
    params: SamplingParams
    sampler: RequestSampler
    detok: Detokenizer
    ve: int
    stop_ids: frozenset[int]
    first_token_s: float | None = None
    proposer: NgramProposer | None = None  # None: no speculation (off, or structured output)
    drafted: int = 0
    accepted: int = 0


class _InProcessExecutor:
    """One stage: the runner over every layer, in this process."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._results: deque[torch.Tensor] = deque()

    def submit(self, spec: BatchSpec) -> None:
        self._results.append(self.runner.run(spec))

    def collect(self) -> torch.Tensor:
        return self._results.popleft()

    def close(self) -> None:
        pass


class Engine:
    """Continuous-batching engine over one model. Not thread-safe: drive it from one thread (AsyncEngine does).

    num_blocks: KV blocks of `block_size` positions (None: as many as fit in `kv_cache_mb`). stages: pipeline
    stages (K > 1 runs K worker processes, each with its slice of the layers). fast_linear: on CPU float32,
    run the projections, norms, SwiGLU and decode attention in the C kernels of serve/kernels.py (without a
    C compiler: MKL, its packed one-row GEMM for one row) (None: automatic). threads: intra-op threads the
    torch path lends to big GEMMs and long prefill attention (None: 1 with one stage, see model_runner.py; with
    K stages each worker process gets torch.get_num_threads() // K). decode_threads: threads of the C kernels'
    pool (None: torch.get_num_threads(), per stage process torch.get_num_threads() // K; one-row products
    fall back to one thread when sharing does not pay, e.g. when other processes keep the other cores busy).
    enable_prefix_caching: share the KV of full blocks between requests with the same prefix (not with a
    sliding window, whose blocks leave the cache as the window moves: off there). speculative: prompt-lookup
    speculative decoding (serve/speculative.py; None: off); requests with structured output do not speculate.
    dtype: the precision the matrices run in (serve/file_weights.py): "auto" is a GGUF's own (loaded with
    keep_quantized) or else float32; fp32, bf16, q8_0, q4_0, q4_1 requantize at load. Not float32: CPU only.
    kv_cache_dtype: the KV cache's element type, auto / fp32 / fp16 (serve/kv.py's kv_cache_dtype: auto is
    float16 when matrices run narrower than float32, as llama.cpp, else the weights' dtype).
    """

    def __init__(self, model: CausalLM, tokenizer: Any, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_mb: float = 512, stages: int = 1, device: str | torch.device = "cpu",
                 fast_linear: bool | None = None, threads: int | None = None,
                 decode_threads: int | None = None, enable_prefix_caching: bool = True,
                 speculative: NgramSpeculation | None = None, dtype: str = "auto",
                 kv_cache_dtype: str = "auto") -> None:
        model = fold_mup_model(model)  # muP's multipliers folded into the weights: the same logits, standard kernels
        cfg = model.config
        if not isinstance(stages, int) or not 1 <= stages <= cfg.n_layer:
            raise ValueError(f"stages must be in [1, {cfg.n_layer}] (the model's layers), got {stages!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        model.eval()
        device = torch.device(device)
        qweights = served_weights(model, dtype)
        if qweights and device.type != "cpu":
            what = "the file's own precision" if dtype == "auto" else dtype
            raise ConfigError(f"weights in {what} run on CPU only, not {device.type}: pass --dtype fp32 to run "
                              "in float32 there")
        if model.head.norm.weight.device != device:  # (matrices held as QWeights stay on the meta device)
            model.to(device)
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.max_model_len: int = cfg.max_seq_len
        kv_dtype = resolve_kv_dtype(kv_cache_dtype, model.head.lm_head.weight.dtype,
                                    any(w.qtype != "fp32" for w in qweights.values()))
        self.kv_dtype = kv_dtype
        bpb = KVPool.bytes_per_block(cfg.n_layer, block_size, cfg.kv_heads, cfg.head_dim, kv_dtype)
        if num_blocks is None:
            num_blocks = int(kv_cache_mb * 2**20) // bpb
        per_stage = num_blocks // stages
        if per_stage < 1:
            raise ValueError(f"KV cache of {num_blocks} blocks cannot be shared by {stages} stages; "
                             f"raise kv_cache_mb (a block is {bpb / 2**20:.2f} MiB) or num_blocks")
        self.block_size, self.num_blocks, self.stages = block_size, per_stage * stages, stages
        self.kv_block_bytes = bpb
        self.prefix_caching = bool(enable_prefix_caching) and not cfg.sliding_window
        self._schedulers = [
            Scheduler(BlockAllocator(per_stage, block_size, first_block=v * per_stage,
                                     prefix_caching=self.prefix_caching),
                      max_num_seqs=max(1, -(-max_num_seqs // stages)),
                      max_num_batched_tokens=max_num_batched_tokens, window=cfg.sliding_window)
            for v in range(stages)]
        self.max_num_batched_tokens = max_num_batched_tokens
        if stages == 1:
            runner = ModelRunner(model, 0, cfg.n_layer, num_blocks=self.num_blocks, block_size=block_size,
                                 has_embed=True, has_head=True, device=device, fast_linear=fast_linear,
                                 threads=threads, decode_threads=decode_threads, qweights=qweights,
                                 kv_dtype=kv_dtype)
            self.fast_linear = runner.fast_linear
            self.c_kernels: bool | None = runner.c_kernels  # None: decided in each stage process
            self.decode_threads: int | None = runner.decode_threads
            self.weight_bytes: tuple[int, int] | None = runner.weight_bytes  # (all dense, as packed) per token
            self._runner: ModelRunner | None = runner
            self._executor: Any = _InProcessExecutor(runner)
        else:
            from waferscale.serve.stages import PipelineExecutor

            self._executor = PipelineExecutor(model, stages, num_blocks=self.num_blocks, block_size=block_size,
                                              device=device, fast_linear=fast_linear, threads_per_stage=threads,
                                              decode_threads=decode_threads, qweights=qweights,
                                              kv_dtype=kv_dtype)
            self.fast_linear = self._executor.fast_linear
            self.c_kernels = self.decode_threads = self.weight_bytes = self._runner = None
        # the C kernels' vector path ("avx2", "avx512-vnni", "neon-dotprod", ...) or "off (why: torch)"; with
        # stages, each stage decides on this machine, whose build is this process's
        from waferscale.serve import kernels

        self.kernel_path: str = self._runner.kernel_path if self._runner is not None else kernels.path()
        eos = getattr(tokenizer, "eos_id", None)
        self.eos_ids: list[int] = [] if eos is None else [int(eos)]
        tv = getattr(tokenizer, "vocab_size", None)
        self.vocab_limit: int | None = tv if tv is not None and tv < cfg.vocab_size else None
        self._token_bytes = TokenBytes(tokenizer)
        self._requests: dict[str, _Request] = {}
        self._pending: list[EngineOutput] = []
        self._inflight: deque[tuple[int, SchedulerOutput]] = deque()
        self._next_ve = 0
        self._counters = {"steps": 0, "requests_added": 0, "requests_finished": 0, "requests_aborted": 0,
                          "prompt_tokens": 0, "generation_tokens": 0, "batched_tokens": 0}
        self.speculative = speculative
        if speculative is not None:  # verification rounds with drafts, tokens drafted, tokens accepted
            self._counters.update(spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0)

    @classmethod
    def from_pretrained(cls, name: Any = "smollm2-135m-instruct", *, tokenizer: Any = None, **kw: Any) -> Engine:
        """Load what `name` names (runtime/source.py: a packaged model, a .gguf, a Hugging Face directory, a
        checkpoint or model_dir, a zoo name) and its tokenizer (`tokenizer`, a name or path, overrides it); a
        GGUF's matrices stay in the file's precision unless kw's dtype is "fp32"."""
        model, tok = load_named(name, dtype=kw.get("dtype"), device=kw.get("device", "cpu"), tokenizer=tokenizer)
        return cls(model, tok, **kw)

    # ---- requests --------------------------------------------------------------------------------------
    def limits(self) -> dict[str, int]:
        """What `check_request` checks against."""
        return {"vocab_size": self.model.config.vocab_size, "max_model_len": self.max_model_len,
                "block_size": self.block_size, "group_blocks": self._schedulers[0].allocator.num_blocks,
                "window": self.model.config.sliding_window or 0, "max_chunk": self.max_num_batched_tokens}

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise (RequestTooLong / ValueError) if the request could never run; thread-safe, changes nothing."""
        check_request(prompt_token_ids, params, **self.limits())

    def describe(self) -> dict[str, Any]:
        """Picklable facts for a client in another process (serve/core.py)."""
        return {"max_model_len": self.max_model_len, "limits": self.limits(), "stats": self.stats(),
                "c_kernels": self.c_kernels, "decode_threads": self.decode_threads, "fast_linear": self.fast_linear,
                "stages": self.stages}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        self.check_request(prompt_token_ids, params)
        if params.grammar is not None and params.logits_processor is None:  # structured output: this engine's
            params = dataclasses.replace(  # tokenizer builds the grammar's state
                params, logits_processor=params.grammar.constraint(self.tokenizer).logits_processor)
        seq = Sequence(request_id, [int(t) for t in prompt_token_ids], params.max_tokens)
        scheds = self._schedulers
        ve = min(range(self.stages), key=lambda v: (scheds[v].num_unfinished, -len(scheds[v].cached_prefix(seq)), v))
        eos = [] if params.ignore_eos else self.eos_ids
        req = _Request(seq, params, RequestSampler(params, eos, self.vocab_limit),
                       Detokenizer(self.tokenizer, params.stop, seq.prompt_ids), ve,
                       frozenset(eos) | frozenset(params.stop_token_ids))
        if self.speculative is not None and params.logits_processor is None:  # (a grammar's state follows
            req.proposer = NgramProposer(self.speculative, seq.prompt_ids)  # the generated ids: no speculation)
        self._requests[request_id] = req
        self._schedulers[ve].add(seq)
        self._counters["requests_added"] += 1

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; its final output (finish_reason "abort") comes from the
        next step. Unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self._schedulers[req.ve].finish(req.seq)
        self._counters["requests_aborted"] += 1
        self._pending.append(self._final(req, [], "", "abort", None))

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._pending or self._inflight)

    def abort_all(self) -> list[str]:
        """After a failed step: abort every request (freeing its blocks), drop what was in flight, and return
        the ids, whose consumers the caller tells (no final outputs are produced for them)."""
        ids = list(self._requests)
        for rid in ids:
            self.abort_request(rid)
        self._pending.clear()
        self._inflight.clear()
        return ids

    # ---- one step --------------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """schedule -> execute -> update. Returns the outputs of the micro-batch that completed (all running
        sequences when stages=1), plus the final outputs of requests aborted since the last step.

        The step runs with one torch intra-op thread: the runner lends its threads only to work that pays for
        them, and the C kernels have their own pool. (An OpenMP parallel region anywhere in the step, e.g. in
        sampling, leaves its worker spinning on the other core for a while afterwards, where it slows the
        pool; bench/serve_http.py shows the difference.)"""
        prev = torch.get_num_threads()
        if prev != 1:
            torch.set_num_threads(1)
        try:
            return self._step()
        finally:
            if prev != 1:
                torch.set_num_threads(prev)

    def _step(self) -> list[EngineOutput]:
        outputs, self._pending = self._pending, []
        K = self.stages
        for _ in range(K):  # schedule: keep up to K micro-batches (one per group) in the pipe
            if len(self._inflight) >= K:
                break
            ve, self._next_ve = self._next_ve, (self._next_ve + 1) % K
            if any(v == ve for v, _ in self._inflight):
                continue
            if self.speculative is not None:
                self._propose(ve)
            so = self._schedulers[ve].schedule()
            if so:
                spec = BatchSpec([t for c in so.chunks for t in c.token_ids()],
                                 [(c.start, c.num_tokens, c.block_table, c.num_logits) for c in so.chunks])
                self._executor.submit(spec)  # execute (asynchronously when pipelined)
                self._inflight.append((ve, so))
                self._counters["batched_tokens"] += so.num_tokens
        if not self._inflight:
            return outputs
        ve, so = self._inflight.popleft()
        logits = self._executor.collect()  # (the chunks' num_logits rows, V)
        self._schedulers[ve].cache_computed(so)  # (prefix caching: before finished sequences free their blocks)
        self._counters["steps"] += 1
        outputs.extend(self._update(so, logits))  # (accepts drafts: before the scheduler's update counts them)
        self._schedulers[ve].update(so)
        return outputs

    def _propose(self, ve: int) -> None:
        """Draft tokens for group ve's decoding sequences that speculate (at most what max_tokens leaves after
        the token the verification adds)."""
        for seq in self._schedulers[ve].running:
            req = self._requests.get(seq.request_id)
            if req is not None and req.proposer is not None and seq.remaining == 1:
                seq.draft_ids = req.proposer.propose(min(self.speculative.k, req.params.max_tokens -
                                                         len(seq.output_ids) - 1))

    def _update(self, so: SchedulerOutput, logits: torch.Tensor) -> list[EngineOutput]:
        items: list[tuple[_Request, ScheduledChunk, int]] = []  # (request, chunk, its first row of logits)
        j = 0
        for c in so.chunks:
            if not c.num_logits:
                continue
            req = self._requests.get(c.seq.request_id)
            if req is not None and req.seq is c.seq:  # not aborted while in flight
                items.append((req, c, j))
            j += c.num_logits
        if not items:
            return []
        if logits.device.type != "cpu":  # sampling runs on the CPU, each request with its own CPU generator
            logits = logits.cpu()
        plain = [(r, j) for r, c, j in items if not c.drafts]  # one token each, sampled together
        sampled = iter(sample_rows(logits if len(plain) == logits.shape[0] else logits[[j for _, j in plain]],
                                   [(r.sampler, r.seq.output_ids) for r, _ in plain], self.vocab_limit))
        now = time.perf_counter()
        outs = []
        for req, c, j in items:
            if req.first_token_s is None:
                req.first_token_s = now
            if not c.drafts:
                tok, lp = next(sampled)
                outs.append(self._emit(req, [tok], [lp]))
                continue
            toks, c.accepted = verify(req.sampler, logits[j:j + c.num_logits], c.drafts, req.seq.output_ids,
                                      self.vocab_limit)
            req.drafted += len(c.drafts)
            req.accepted += c.accepted
            self._counters["spec_drafts"] += 1
            self._counters["spec_draft_tokens"] += len(c.drafts)
            self._counters["spec_accepted_tokens"] += c.accepted
            lps = [torch.log_softmax(logits[j + i, :self.vocab_limit].float(), -1) if req.params.logprobs else None
                   for i in range(len(toks))]
            outs.append(self._emit(req, toks, lps))
        return outs

    def _emit(self, req: _Request, toks: list[int], lps: list[torch.Tensor | None]) -> EngineOutput:
        """One request's new tokens of this step, in order, until one ends it (eos or a stop token, which is
        not emitted; a stop string; max_tokens or the context)."""
        seq, p = req.seq, req.params
        new: list[int] = []
        entries: list[dict] | None = [] if p.logprobs else None
        text = ""
        for tok, lp in zip(toks, lps):
            if tok in req.stop_ids:
                return self._finish(req, new, text + req.detok.flush(), "stop", entries)
            seq.output_ids.append(tok)
            new.append(tok)
            self._counters["generation_tokens"] += 1
            if entries is not None:
                entries.append(logprob_entry(self._token_bytes, tok, lp, p.top_logprobs))
            delta, hit_stop = req.detok.add(tok, check_stop=len(seq.output_ids) >= p.min_tokens)
            text += delta
            if hit_stop:
                return self._finish(req, new, text, "stop", entries)
            if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                return self._finish(req, new, text + req.detok.flush(), "length", entries)
        if req.proposer is not None:
            req.proposer.extend(new)
        return EngineOutput(seq.request_id, new, text, False, None, len(seq.prompt_ids), len(seq.output_ids),
                            entries, **self._spec_counts(req))

    def _spec_counts(self, req: _Request) -> dict[str, int | None]:
        on = req.proposer is not None
        return {"draft_tokens": req.drafted if on else None, "accepted_tokens": req.accepted if on else None}

    def _finish(self, req: _Request, toks: list[int], text: str, reason: FinishReason,
                entries: list[dict] | None) -> EngineOutput:
        self._requests.pop(req.seq.request_id, None)
        self._schedulers[req.ve].finish(req.seq)
        self._counters["requests_finished"] += 1
        return self._final(req, toks, text, reason, entries)

    def _final(self, req: _Request, toks: list[int], text: str, reason: FinishReason,
               entries: list[dict] | None) -> EngineOutput:
        seq, now = req.seq, time.perf_counter()
        sched = seq.first_scheduled_s if seq.first_scheduled_s is not None else now
        first = req.first_token_s if req.first_token_s is not None else now
        self._counters["prompt_tokens"] += len(seq.prompt_ids)
        return EngineOutput(seq.request_id, toks, text, True, reason, len(seq.prompt_ids), len(seq.output_ids),
                            entries, cached_tokens=seq.num_cached_tokens, queue_time_s=max(0.0, sched - seq.arrival_s),
                            prompt_time_s=max(0.0, first - sched), completion_time_s=max(0.0, now - first),
                            **self._spec_counts(req))

    # ---- observability ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Gauges and counters: running, waiting, kv_blocks_used (returns to 0 when idle), kv_blocks_total, ...
        and, with one stage, the weight bytes decode reads: per decode token so far (a batch of B tokens reads
        its weights once: B shares; a mixture of experts reads only the experts its tokens chose), against
        those of the parameters one token computes with (active: a mixture's routed experts only) and of all."""
        scheds = self._schedulers
        r = self._runner
        weights = {} if r is None else {
            "decode_tokens": r.decode_tokens, "decode_weight_bytes": r.decode_bytes,
            "decode_weight_bytes_per_token": r.decode_bytes / r.decode_tokens if r.decode_tokens else 0.0,
            "active_weight_bytes": r.active_bytes, "total_weight_bytes": r.total_bytes}
        return {
            "running": sum(len(s.running) for s in scheds),
            "waiting": sum(len(s.waiting) for s in scheds),
            "kv_blocks_used": sum(s.allocator.num_used for s in scheds),
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_cached": sum(s.allocator.num_cached for s in scheds),
            "kv_block_size": self.block_size,
            "prefix_caching": self.prefix_caching,
            "prefix_cache_queries": sum(s.prefix_cache_queries for s in scheds),
            "prefix_cache_hits": sum(s.prefix_cache_hits for s in scheds),
            "kv_cache_bytes": self.num_blocks * self.kv_block_bytes,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "num_preemptions": sum(s.num_preemptions for s in scheds),
            "stages": self.stages,
            "max_model_len": self.max_model_len,
            "kernel_path": self.kernel_path,
            **weights,
            **self._counters,
        }

    def close(self) -> None:
        """Stop pipeline worker processes (no-op with one stage)."""
        self._executor.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Convenience: run prompts to completion, return each one's generated ids (in order)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"_gen-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, pr, sp in zip(ids, prompts, plist):
            self.add_request(rid, pr, sp)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
        return [out[r] for r in ids]


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


class StreamHub:
    """The open streams of an engine front end (AsyncEngine here, CoreClient for an engine process): one
    asyncio queue per request on its consumer's loop. The producer thread hands items over with `deliver`;
    `stream` yields them to the consumer."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    def open_ids(self) -> list[str]:
        return list(self._streams)

    def deliver(self, items: list[tuple[str, Any, bool]]) -> None:
        """Hand (request id, output or exception, last) to their consumers: one wake-up per event loop, not one
        per item (a step of 16 streams would otherwise write 16 times to the loop's self-pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for request_id, item, last in items:
            ent = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
            if ent is not None:
                by_loop.setdefault(ent[0], []).append((ent[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the consumer's loop is closed
                pass

    async def stream(self, request_id: str, submit: Callable[[], None],
                     cancel: Callable[[], None]) -> AsyncIterator[EngineOutput]:
        """Open request_id's stream, `submit()` the request, and yield its items until the last (an exception
        item is raised). Leaving early (client disconnect) calls `cancel()`."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already streaming")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        submit()
        done = False
        try:
            while not done:
                item = await q.get()
                done = isinstance(item, BaseException) or item.finished
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not done:
                self._streams.pop(request_id, None)
                cancel()


class AsyncEngine:
    """Runs `Engine.step` in one background thread; `generate` streams a request's outputs to asyncio.

    All engine calls happen on that thread: requests and aborts reach it through a command queue. Leaving a
    `generate` iterator early (client disconnect: GeneratorExit / CancelledError) aborts the request, which
    frees its KV blocks.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._hub = StreamHub()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = engine.stats()

    async def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="wsc-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def stats(self) -> dict:
        return dict(self._stats)

    def unhealthy(self) -> str | None:
        """Why the engine cannot serve, or None (its thread, once started, runs until stop)."""
        if self._thread is not None and not self._thread.is_alive() and not self._stopping:
            return "the engine thread stopped"
        return None

    def _loop(self) -> None:
        eng = self.engine
        while not self._stopping:
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "add":
                    _, rid, prompt, params = cmd
                    try:
                        eng.add_request(rid, prompt, params)
                    except ValueError as e:
                        self._hub.deliver([(rid, e, True)])
                else:
                    eng.abort_request(cmd[1])
            if not eng.has_unfinished():
                self._stats = eng.stats()
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                outs = eng.step()
            except Exception as e:  # a broken step fails every live request; the loop keeps serving
                err = RuntimeError(f"engine step failed: {e!r}")
                self._hub.deliver([(rid, err, True) for rid in eng.abort_all()])
                self._stats = eng.stats()
                continue
            self._hub.deliver([(o.request_id, o, o.finished) for o in outs])
            self._stats = eng.stats()
        stopped = RuntimeError("the engine stopped")
        self._hub.deliver([(rid, stopped, True) for rid in self._hub.open_ids()])

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[EngineOutput]:
        """Yield this request's outputs as steps produce them; the last has finished=True."""
        self.engine.check_request(prompt_token_ids, params)  # RequestTooLong / ValueError, before streaming
        if self._thread is None:
            await self.start()

        def send(cmd: tuple) -> None:
            self._cmds.put(cmd)
            self._wake.set()

        async with contextlib.aclosing(self._hub.stream(
                request_id, lambda: send(("add", request_id, list(prompt_token_ids), params)),
                lambda: send(("abort", request_id)))) as items:
            async for item in items:
                yield item
