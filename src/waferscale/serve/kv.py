"""The KV cache in fixed-size blocks: a pure-Python block allocator and the tensors that hold the blocks.

A sequence's KV positions live in the blocks of its block table: position p is slot
`table[p // block_size] * block_size + p % block_size` of a flat (2 n_kv_head, num_slots, head_dim) tensor per
layer (k heads, then v heads). The allocator knows nothing of tensors; `KVPool` knows nothing of sequences.

With sliding-window attention a sequence's oldest blocks fall out of every later query's window: they go back
to the pool (`release_before`) and their table entries become FREED, so that positions keep their indices.
"""

from __future__ import annotations

import torch


FREED = -1  # a table entry whose block went back to the pool (its positions are outside the window)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` positions."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Hands out block ids in [first_block, first_block + num_blocks) to sequences; counts what is in use.

    Invariant: every block is either free or in exactly one table; `num_used` returns to 0 when every
    sequence has been freed (finished, aborted or preempted).
    """

    def __init__(self, num_blocks: int, block_size: int, first_block: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size, self.first_block = num_blocks, block_size, first_block
        self._free: list[int] = list(range(first_block + num_blocks - 1, first_block - 1, -1))  # pop() -> lowest
        self.tables: dict[str, list[int]] = {}
        self._released: dict[str, int] = {}  # per sequence: its table entries before this one are FREED

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def extra_blocks(self, seq_id: str, num_tokens: int) -> int:
        """Blocks `seq_id` still needs so that it can hold `num_tokens` positions."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.tables.get(seq_id, ())))

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.extra_blocks(seq_id, num_tokens) <= self.num_free

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow `seq_id`'s table to hold `num_tokens` positions; returns the table. RuntimeError if full."""
        need = self.extra_blocks(seq_id, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"KV cache full: {seq_id!r} needs {need} blocks, {len(self._free)} free")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self._free.pop() for _ in range(need))
        return table

    def release_before(self, seq_id: str, position: int) -> int:
        """Return to the pool the blocks of `seq_id` that hold only positions before `position` (no query will
        read them again: they are outside its sliding window); returns how many."""
        table = self.tables.get(seq_id)
        if not table:
            return 0
        first, end = self._released.get(seq_id, 0), min(position // self.block_size, len(table))
        for i in range(first, end):
            self._free.append(table[i])
            table[i] = FREED
        if end > first:
            self._released[seq_id] = end
        return max(0, end - first)

    def free(self, seq_id: str) -> int:
        """Return every block of `seq_id` to the pool; returns how many (0 if it held none)."""
        table = [b for b in self.tables.pop(seq_id, []) if b != FREED]
        self._released.pop(seq_id, None)
        self._free.extend(reversed(table))
        return len(table)

    def held(self, seq_id: str) -> int:
        """Blocks `seq_id` holds now."""
        return sum(b != FREED for b in self.tables.get(seq_id, ()))


class KVPool:
    """K and V for a range of layers in one (n_layers, 2 * n_kv_head, num_slots, head_dim) tensor: per layer the
    k heads, then the v heads, head-major, so that one index_copy_ writes a step's k and v and one
    index_select gathers a sequence's keys and values already in attention's (nkv, S, hd) layout."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_head: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.kv = torch.zeros((n_layers, 2 * n_kv_head, num_blocks * block_size, head_dim), dtype=dtype,
                              device=device)

    @staticmethod
    def bytes_per_block(n_layers: int, block_size: int, n_kv_head: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * n_layers * block_size * n_kv_head * head_dim * torch.empty((), dtype=dtype).element_size()
