"""The continuous-batching scheduler and the KV block allocator, with hand-written sequences and no model."""

from __future__ import annotations

import pytest

from waferscale.serve.kv import BlockAllocator, blocks_for
from waferscale.serve.scheduler import Scheduler, Sequence, Status


def make(num_blocks: int = 64, block_size: int = 4, seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks, block_size), max_num_seqs=seqs, max_num_batched_tokens=budget)


def step(s: Scheduler) -> list[tuple[str, int, int]]:
    """One engine step with a fake model: every sampling chunk produces token 7; max_tokens ends a sequence."""
    out = s.schedule()
    s.update(out)
    for c in out.chunks:
        if c.sample:
            c.seq.output_ids.append(7)
            if len(c.seq.output_ids) >= c.seq.max_tokens:
                s.finish(c.seq)
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_allocator_counts_blocks_and_returns_them() -> None:
    a = BlockAllocator(8, 4)
    assert a.allocate("x", 9) == [0, 1, 2]  # 9 positions -> 3 blocks
    assert a.allocate("x", 12) == [0, 1, 2]  # still fits
    assert a.allocate("x", 13) == [0, 1, 2, 3]
    assert a.allocate("y", 1) == [4]
    assert (a.num_used, a.num_free) == (5, 3)
    assert not a.can_allocate("y", 17) and a.can_allocate("y", 16)
    with pytest.raises(RuntimeError, match="KV cache full"):
        a.allocate("z", 40)
    assert a.free("x") == 4 and a.free("y") == 1 and a.free("nobody") == 0
    assert a.num_used == 0
    assert blocks_for(0, 4) == 0 and blocks_for(1, 4) == 1 and blocks_for(8, 4) == 2


def test_chunked_prefill_within_the_token_budget() -> None:
    s = make(budget=16)
    for rid, n in (("a", 10), ("b", 20), ("c", 3)):
        s.add(Sequence(rid, list(range(n)), max_tokens=3))
    assert step(s) == [("a", 0, 10), ("b", 0, 6)]  # a whole, b's first chunk: 16 tokens
    assert step(s) == [("a", 10, 1), ("b", 6, 14), ("c", 0, 1)]  # a decodes, b's rest, c's first token
    assert step(s) == [("a", 11, 1), ("b", 20, 1), ("c", 1, 2)]  # everyone running gets its turn
    assert [q.request_id for q in s.running] == ["b", "c"]  # a reached max_tokens=3 and left
    while s.num_unfinished:
        step(s)
    assert s.allocator.num_used == 0


def test_every_running_sequence_decodes_each_step_and_new_ones_join() -> None:
    s = make(budget=64)
    s.add(Sequence("a", [1, 2, 3], max_tokens=10))
    step(s)
    s.add(Sequence("b", [4, 5], max_tokens=10))
    assert step(s) == [("a", 3, 1), ("b", 0, 2)]  # continuous batching: b joins a's decode step
    assert step(s) == [("a", 4, 1), ("b", 2, 1)]


def test_max_num_seqs_limits_admission() -> None:
    s = make(seqs=2, budget=64)
    for rid in "abc":
        s.add(Sequence(rid, [1, 2], max_tokens=2))
    assert {r for r, _, _ in step(s)} == {"a", "b"}
    assert [q.request_id for q in s.waiting] == ["c"]
    step(s)  # a and b finish (2 tokens each)
    assert step(s) == [("c", 0, 2)]


def test_admission_waits_for_free_blocks_and_counts_return_to_zero() -> None:
    s = make(num_blocks=3, block_size=4, budget=64)  # 12 positions in all
    s.add(Sequence("a", list(range(8)), max_tokens=4))  # 2 blocks now, 3 by the end
    s.add(Sequence("b", list(range(8)), max_tokens=4))  # does not fit beside a: waits
    assert [r for r, _, _ in step(s)] == ["a"]
    assert [q.request_id for q in s.waiting] == ["b"] and s.allocator.num_used == 2
    order = []
    while s.num_unfinished:
        order.append([r for r, _, _ in step(s)])
        assert s.allocator.num_used <= 3
    assert order[:3] == [["a"], ["a"], ["a"]] and order[3] == ["b"]  # b admitted once a freed its blocks
    assert s.allocator.num_used == 0


def test_preemption_when_running_sequences_outgrow_memory() -> None:
    s = make(num_blocks=4, block_size=2, budget=64)  # 8 positions
    s.add(Sequence("a", [1, 2, 3], max_tokens=4))  # grows to 7 positions (4 blocks)
    s.add(Sequence("b", [4, 5, 6], max_tokens=4))
    assert [r for r, _, _ in step(s)] == ["a", "b"]  # both fit at first (2 + 2 blocks)
    preempted = []
    for _ in range(30):
        out = s.schedule()
        preempted += out.preempted
        s.update(out)
        for c in out.chunks:
            if c.sample:
                c.seq.output_ids.append(7)
                if len(c.seq.output_ids) >= c.seq.max_tokens:
                    s.finish(c.seq)
        if not s.num_unfinished:
            break
    assert preempted and preempted[0] == "b"  # the newest goes back to the queue, to be recomputed
    assert not s.num_unfinished and s.allocator.num_used == 0


def test_preempted_sequence_recomputes_prompt_and_generated_tokens() -> None:
    s = make(num_blocks=3, block_size=2, budget=64)
    a, b = Sequence("a", [1, 2], max_tokens=4), Sequence("b", [3, 4], max_tokens=4)
    s.add(a)
    s.add(b)
    step(s)
    step(s)  # a: 3 positions (2 blocks) -> pool of 3 blocks is short; b is preempted
    assert b.status is Status.WAITING and b.num_preemptions == 1 and b.num_computed == 0
    while a.status is not Status.FINISHED:
        step(s)
    out = s.schedule()
    (c,) = out.chunks
    assert (c.seq, c.start, c.num_tokens) == (b, 0, len(b.prompt_ids) + len(b.output_ids) - 0)
    assert c.sample and b.token_ids(0, c.num_tokens) == [3, 4, *b.output_ids]


def test_fits_ever() -> None:
    s = make(num_blocks=4, block_size=4)
    assert s.fits_ever(16) and not s.fits_ever(17)
