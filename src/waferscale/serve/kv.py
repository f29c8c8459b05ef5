"""The KV cache in fixed-size blocks: a pure-Python block allocator and the tensors that hold the blocks.

A sequence's KV positions live in the blocks of its block table: position p is slot
`table[p // block_size] * block_size + p % block_size` of a flat (2 n_kv_head, num_slots, head_dim) tensor per
layer (k heads, then v heads). The allocator knows nothing of tensors; `KVPool` knows nothing of sequences.

With sliding-window attention a sequence's oldest blocks fall out of every later query's window: they go back
to the pool (`release_before`) and their table entries become FREED, so that positions keep their indices.

Prefix caching (vLLM's automatic prefix caching): a full block whose KV has been computed is registered under
`block_hash` of its tokens chained over its parent's hash, so equal hashes mean the same tokens after the same
prefix, hence the same KV (the cache belongs to one engine: one model, one dtype; an adapter or anything else
that changed the KV would have to join the hash). A new sequence whose first blocks hash the same shares those
blocks (reference counts) instead of computing them. A block freed by its last sequence keeps its content and
hash and waits, least recently used first, until a block is needed and no never-cached one is free: only then is
it evicted. A block in use is never evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch


FREED = -1  # a table entry whose block went back to the pool (its positions are outside the window)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` positions."""
    return -(-num_tokens // block_size)


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """A full block's identity: SHA-256 over its parent block's hash (None: the first block) and its token ids.
    (A cryptographic hash, as vLLM's sha256 option: with Python's 64-bit hash one prompt could be crafted to
    collide with another's prefix and read its KV.)"""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockAllocator:
    """Hands out block ids in [first_block, first_block + num_blocks) to sequences; counts what is in use.

    Invariant: a block is either in use, held by as many tables as its reference count (more than one only when
    sequences share a cached prefix), or free; `num_used` returns to 0 when every sequence has been freed
    (finished, aborted or preempted). With `prefix_caching`, a free block may still hold a cached full block
    (`cache`), found again by `lookup` until a new block evicts it.
    """

    def __init__(self, num_blocks: int, block_size: int, first_block: int = 0, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size, self.first_block = num_blocks, block_size, first_block
        self.prefix_caching = prefix_caching
        # free blocks that hold nothing cached, handed out first; pop() -> lowest, so a lone sequence's blocks
        # are consecutive (model_runner.Prepared reads consecutive blocks as one view)
        self._free: list[int] = list(range(first_block + num_blocks - 1, first_block - 1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free blocks that hold a cached block, LRU first
        self._by_hash: dict[bytes, int] = {}  # cached full blocks: hash -> block
        self._hash_of: dict[int, bytes] = {}
        self._refs = [0] * num_blocks  # tables holding each block (index: block - first_block)
        self.tables: dict[str, list[int]] = {}
        self._released: dict[str, int] = {}  # per sequence: its table entries before this one are FREED

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached full block (in use or free)."""
        return len(self._by_hash)

    def extra_blocks(self, seq_id: str, num_tokens: int) -> int:
        """Blocks `seq_id` still needs so that it can hold `num_tokens` positions."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.tables.get(seq_id, ())))

    def can_allocate(self, seq_id: str, num_tokens: int, shared: Sequence[int] = ()) -> bool:
        """Whether `seq_id` can hold `num_tokens` positions, its table starting with the cached blocks `shared`
        (from `lookup`, not yet taken) when it has none yet: the free ones among them leave the pool too."""
        reused = sum(self._refs[b - self.first_block] == 0 for b in shared)
        return self.extra_blocks(seq_id, num_tokens) - len(shared) + reused <= self.num_free

    def _take(self) -> int:
        """A free block: a never-cached one if any, else the least recently used cached one, evicted."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(b)]
        self._refs[b - self.first_block] = 1
        return b

    def _release(self, b: int) -> None:
        i = b - self.first_block
        self._refs[i] -= 1
        if self._refs[i] == 0:
            if b in self._hash_of:
                self._evictable[b] = None  # the most recently used end
            else:
                self._free.append(b)

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow `seq_id`'s table to hold `num_tokens` positions; returns the table. RuntimeError if full."""
        need = self.extra_blocks(seq_id, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"KV cache full: {seq_id!r} needs {need} blocks, {self.num_free} free")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self._take() for _ in range(need))
        return table

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (a sequence's full blocks in order)."""
        blocks = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def share(self, seq_id: str, blocks: Sequence[int]) -> None:
        """Start `seq_id`'s (empty) table with the cached `blocks` (from `lookup`): one more reference each."""
        if self.tables.get(seq_id):
            raise ValueError(f"{seq_id!r} already holds blocks: a cached prefix can only start a table")
        for b in blocks:
            i = b - self.first_block
            if self._refs[i] == 0:
                del self._evictable[b]
            self._refs[i] += 1
        self.tables[seq_id] = list(blocks)

    def cache(self, block: int, h: bytes) -> None:
        """Register `block`, now holding the computed KV of a full block whose hash is `h`, for later lookups.
        A block already registered, or a hash another block already holds (two sequences computed the same
        block at once), leaves things as they are: this block then goes back to the pool uncached."""
        if h not in self._by_hash and block not in self._hash_of:
            self._by_hash[h] = block
            self._hash_of[block] = h

    def release_before(self, seq_id: str, position: int) -> int:
        """Return to the pool the blocks of `seq_id` that hold only positions before `position` (no query will
        read them again: they are outside its sliding window); returns how many."""
        table = self.tables.get(seq_id)
        if not table:
            return 0
        first, end = self._released.get(seq_id, 0), min(position // self.block_size, len(table))
        for i in range(first, end):
            self._release(table[i])
            table[i] = FREED
        if end > first:
            self._released[seq_id] = end
        return max(0, end - first)

    def free(self, seq_id: str) -> int:
        """Give back every block of `seq_id` (0 if it held none); returns how many. The last block goes first
        into the evictable order: a cached block is worth less than the blocks before it, which it needs."""
        table = [b for b in self.tables.pop(seq_id, []) if b != FREED]
        self._released.pop(seq_id, None)
        for b in reversed(table):
            self._release(b)
        return len(table)

    def held(self, seq_id: str) -> int:
        """Blocks `seq_id` holds now."""
        return sum(b != FREED for b in self.tables.get(seq_id, ()))


KV_CACHE_DTYPES = ("auto", "fp32", "fp16")  # --kv-cache-dtype's choices


def kv_cache_dtype(choice: str, weights: torch.dtype, narrow_weights: bool) -> torch.dtype:
    """The KV cache's element type for --kv-cache-dtype `choice`: fp32 / fp16 as named; auto is float16 when
    matrices run narrower than float32 (a GGUF's Q4_1, Q8_0, ... or BF16 blocks, or --dtype requantizing), as
    llama.cpp keeps its KV by default, and else the weights' dtype, as vLLM's auto (float32 weights, a GGUF's F32
    ones included, keep a float32 cache: the same bits as the model)."""
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {choice!r}")
    if choice == "auto":
        return torch.float16 if narrow_weights else weights
    return {"fp32": torch.float32, "fp16": torch.float16}[choice]


class KVPool:
    """K and V for a range of layers in one (n_layers, 2 * n_kv_head, num_slots, head_dim) tensor: per layer the
    k heads, then the v heads, head-major, so that one index_copy_ writes a step's k and v and one
    index_select gathers a sequence's keys and values already in attention's (nkv, S, hd) layout. Its dtype may
    be narrower than the activations' (a float16 cache for float32 compute): values are rounded on the way in
    and widened on the way out."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_head: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.kv = torch.zeros((n_layers, 2 * n_kv_head, num_blocks * block_size, head_dim), dtype=dtype,
                              device=device)

    @staticmethod
    def bytes_per_block(n_layers: int, block_size: int, n_kv_head: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * n_layers * block_size * n_kv_head * head_dim * torch.empty((), dtype=dtype).element_size()
