"""The continuous-batching scheduler: pure Python, no torch, testable with hand-written sequences.

Each step (vLLM's `Scheduler.schedule`, V1 flavour): every running sequence gets its next tokens first (one
token when decoding, the next chunk when its prompt is still being prefilled), then waiting sequences are
admitted in arrival order while the token budget (`max_num_batched_tokens`), the sequence limit
(`max_num_seqs`) and free KV blocks allow: chunked prefill. A prompt longer than the remaining budget is split
over steps. KV blocks are allocated lazily as positions are scheduled. When a running sequence cannot get a
block, the newest running sequence is preempted: its blocks are freed and it goes back to the front of the
queue, to be recomputed later (prompt + tokens generated so far), so memory pressure never crashes a step.
With sliding-window attention (`window`), a sequence's blocks that every later query's window has left go back
to the pool before its next chunk is placed, so a long generation holds a bounded number of blocks.

A sequence's tokens are `prompt + output`; `num_computed` of them have their KV in the cache. A chunk that
reaches the end of the tokens produces logits, from which the engine samples the next token.

With prefix caching (kv.py), a sequence being admitted (new, or preempted and back) first looks up its full
blocks, all but the last token's (that token is always computed, so that there are logits to sample from):
the cached ones join its table and count as computed, and only the rest is prefilled. After each step, the
full blocks a chunk completed are registered, prompt and generated tokens alike, so a later request that
shares a conversation's history finds them, while its first holder still runs or after it finished.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from waferscale.serve.kv import BlockAllocator, block_hash, blocks_for


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's token state as the scheduler sees it."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    status: Status = Status.WAITING
    arrival_s: float = field(default_factory=time.perf_counter)
    first_scheduled_s: float | None = None
    num_preemptions: int = 0
    draft_ids: list[int] = field(default_factory=list)  # speculation: tokens to verify next step (engine's)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    block_hashes: list[bytes] = field(default_factory=list)  # of its first full blocks (kv.block_hash), as needed

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens to feed before the next sample (1 when decoding)."""
        return self.num_tokens - self.num_computed

    def token_ids(self, start: int, n: int) -> list[int]:
        p = len(self.prompt_ids)
        if start + n <= p:
            return self.prompt_ids[start:start + n]
        return (self.prompt_ids + self.output_ids)[start:start + n]


@dataclass
class ScheduledChunk:
    """Feed tokens [start, start + num_tokens) of `seq`; `sample` when the chunk reaches its last token. With
    speculation the chunk's last `len(drafts)` positions hold drafted tokens, past the sequence's end, of which
    the engine accepts the first `accepted` (their KV stays; the rest is overwritten later)."""

    seq: Sequence
    start: int
    num_tokens: int
    block_table: list[int]
    drafts: list[int] = field(default_factory=list)
    accepted: int = 0

    @property
    def sample(self) -> bool:
        return self.start + self.num_tokens - len(self.drafts) == self.seq.num_tokens

    @property
    def num_logits(self) -> int:
        """Positions whose logits the engine needs: the last token's and one per draft (0: none)."""
        return 1 + len(self.drafts) if self.sample else 0

    def token_ids(self) -> list[int]:
        return self.seq.token_ids(self.start, self.num_tokens - len(self.drafts)) + self.drafts


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    """Decides, each step, which tokens of which sequences run. Owns the waiting queue, the running list and
    (through `allocator`) their KV blocks."""

    def __init__(self, allocator: BlockAllocator, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 window: int | None = None) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.allocator = allocator
        self.window = window
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens of the sequences admitted with prefix caching on,
        self.prefix_cache_hits = 0  # and those of them found in the cache (vLLM's counters)

    # ---- requests --------------------------------------------------------------------------------------
    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` positions fits the whole pool (else it would wait forever)."""
        return blocks_for(num_tokens, self.allocator.block_size) <= self.allocator.num_blocks

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished or aborted) wherever it is; frees its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.allocator.free(seq.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- prefix cache ----------------------------------------------------------------------------------
    def _hashes(self, seq: Sequence, n_blocks: int) -> list[bytes]:
        """The hashes of `seq`'s first `n_blocks` full blocks (computed once per block, kept on the sequence)."""
        hs, bs = seq.block_hashes, self.allocator.block_size
        while len(hs) < n_blocks:
            hs.append(block_hash(hs[-1] if hs else None, seq.token_ids(len(hs) * bs, bs)))
        return hs[:n_blocks]

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` would start with if admitted now: its full blocks before its last token."""
        if not self.allocator.prefix_caching:
            return []
        return self.allocator.lookup(self._hashes(seq, (seq.num_tokens - 1) // self.allocator.block_size))

    # ---- one step --------------------------------------------------------------------------------------
    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.request_id)
        seq.num_computed = 0
        seq.draft_ids = []
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq.request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([])
        budget = self.max_num_batched_tokens
        alloc = self.allocator
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # a decoding sequence's drafts ride along while the budget leaves a token for every later sequence
            room = max(0, budget - seq.remaining - (len(self.running) - i - 1))
            drafts, seq.draft_ids = seq.draft_ids[:room], []
            if drafts and not alloc.can_allocate(seq.request_id, seq.num_tokens + len(drafts)):
                drafts = []  # drafts never preempt anyone
            n = min(seq.remaining + len(drafts), budget)
            if self.window:  # the chunk's first query, at num_computed, sees positions from num_computed - window + 1
                alloc.release_before(seq.request_id, seq.num_computed - self.window + 1)
            while not alloc.can_allocate(seq.request_id, seq.num_computed + n):
                victim = self.running[-1]  # the newest running sequence
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # seq preempted itself: it was the newest and nothing else could be freed
            table = alloc.allocate(seq.request_id, seq.num_computed + n)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, n, list(table), drafts))
            budget -= n
            i += 1
        if out.preempted:  # memory is short: admit nobody this step
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]  # (num_computed is 0: a new or a preempted sequence)
            hits = self.cached_prefix(seq)
            computed = len(hits) * alloc.block_size
            n = min(seq.num_tokens - computed, budget)
            if not alloc.can_allocate(seq.request_id, computed + n, hits):
                break  # first come, first served: later requests wait behind it
            self.waiting.popleft()
            if alloc.prefix_caching:
                alloc.share(seq.request_id, hits)
                seq.num_computed = computed
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += computed
            table = alloc.allocate(seq.request_id, seq.num_computed + n)
            seq.status = Status.RUNNING
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = time.perf_counter()
                seq.num_cached_tokens = computed
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, n, list(table)))
            budget -= n
        return out

    def update(self, out: SchedulerOutput) -> None:
        """After execution (and the engine's acceptance of drafts): the scheduled positions, less the rejected
        drafts, now have their KV in the cache."""
        for c in out.chunks:
            seq = c.seq
            if seq.status is Status.RUNNING:
                fed = c.start + c.num_tokens - len(c.drafts)
                seq.num_computed = fed + c.accepted
                if c.accepted and self.allocator.prefix_caching:
                    self._cache_blocks(seq, fed, seq.num_computed)

    def cache_computed(self, out: SchedulerOutput) -> None:
        """After execution, before the engine samples (and finishes sequences, which frees their blocks):
        register for sharing the full blocks that the chunks' tokens completed (drafts wait for `update`)."""
        if self.allocator.prefix_caching:
            for c in out.chunks:
                if c.seq.status is Status.RUNNING:
                    self._cache_blocks(c.seq, c.start, c.start + c.num_tokens - len(c.drafts))

    def _cache_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Register `seq`'s full blocks completed by positions [start, end), whose KV is now computed."""
        alloc = self.allocator
        first, last = start // alloc.block_size, end // alloc.block_size
        table = alloc.tables[seq.request_id]
        for i, h in enumerate(self._hashes(seq, last)[first:], first):
            alloc.cache(table[i], h)
