"""Paged KV cache: a pool of fixed-size blocks, a block table per slot, per-slot lengths on the device.

A slot is a row of the block table (one request's sequence); position p of slot s lives in row p % block_size
of block `block_tables[s, p // block_size]`. Blocks are handed to a slot as it grows (`reserve`) and back to
the pool when it is done (`release`); the attention and K/V-write kernels read the table, so a CUDA graph
captured once serves any assignment of blocks (the table is a fixed device tensor updated in place).

Rolling back rejected tokens is still `lengths[slot] -= n`: the stale K/V rows stay in the slot's blocks
(which it keeps) and are overwritten by the next append, across block boundaries too, so no copies happen
on rejection.

Block 0 is never handed out (`NULL_BLOCK`): unmapped table entries point at it, so padding rows of a graph
(on the scratch slot, whose table is all null) and padding tokens past a row's reservation write there and
never into a block someone owns. Nothing real reads it: a request reads only positions it has reserved.

`static=True` reserves every slot's full `max_len + HEADROOM` up front: the memory and layout of the former
contiguous cache, for callers that do not manage blocks (and as the comparison in benchmarks).
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch

MAX_K = 8  # longest draft the cache reserves headroom for (verify writes k+1 rows past the length)
HEADROOM = MAX_K + 2
DEFAULT_BLOCK_SIZE = 16
NULL_BLOCK = 0


class SlotsExhaustedError(RuntimeError):
    pass


class BlocksExhaustedError(RuntimeError):
    pass


class CacheSizeError(ValueError):
    pass


class BlockPool:
    """Host bookkeeping of the physical blocks: a free list and a reference count per block.

    A block is free at count 0. Counts above 1 are blocks shared by several slots (prefix caching).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise CacheSizeError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, dtype=np.int64)
        self.refcount[NULL_BLOCK] = 1  # held forever
        self._free = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise BlocksExhaustedError(f"{n} KV blocks wanted, {len(self._free)} free of {self.num_blocks - 1}")
        blocks = [self._free.popleft() for _ in range(n)]
        self.refcount[blocks] = 1
        return blocks

    def incref(self, block: int) -> None:
        self.refcount[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; True when the block is now unreferenced (the caller frees or caches it)."""
        if block == NULL_BLOCK or self.refcount[block] <= 0:
            raise ValueError(f"block {block} is not held")
        self.refcount[block] -= 1
        return self.refcount[block] == 0

    def put_back(self, block: int) -> None:
        assert self.refcount[block] == 0, f"block {block} still referenced"
        self._free.append(block)


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class KVCache:
    """K/V for `num_slots` sequences of up to `max_len` tokens each, in `num_blocks` blocks of `block_size`.

    k[l], v[l]: [num_blocks, block_size, Hkv, D]; block_tables: [S, W] int64 with W = blocks per slot at
    max_len + HEADROOM; lengths: [S] int64 (tokens valid per slot).
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, block_size: int = DEFAULT_BLOCK_SIZE,
                 num_blocks: int | None = None, static: bool = False):
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.num_slots, self.max_len, self.block_size = num_slots, max_len, block_size
        self.device = torch.device(device)
        self.blocks_per_slot = math.ceil((max_len + HEADROOM) / block_size)
        if num_blocks is None or static:
            num_blocks = num_slots * self.blocks_per_slot + 1
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.block_tables = torch.full((num_slots, self.blocks_per_slot), NULL_BLOCK, dtype=torch.int64,
                                       device=device)
        self.pool = BlockPool(num_blocks)
        self.held: list[list[int]] = [[] for _ in range(num_slots)]  # blocks of each slot, in table order
        self.static = static
        if static:
            for slot in range(num_slots):
                self.reserve(slot, self.blocks_per_slot * block_size)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return min(math.ceil(num_tokens / self.block_size), self.blocks_per_slot)

    def blocks_missing(self, slot: int, num_tokens: int) -> int:
        """Blocks `reserve(slot, num_tokens)` would take from the pool."""
        return max(0, self.blocks_for(num_tokens) - len(self.held[slot]))

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Map positions [0, num_tokens) of `slot` (capped at the slot's table), taking blocks from the pool
        as needed; all or nothing: BlocksExhaustedError leaves the slot as it was."""
        self.reserve_many([slot], [num_tokens])

    def reserve_many(self, slots: list[int], num_tokens: list[int]) -> None:
        """`reserve` for several slots, all or nothing, with one table copy to the device."""
        missing = [self.blocks_missing(s, n) for s, n in zip(slots, num_tokens)]
        if sum(missing) > self.pool.num_free:
            raise BlocksExhaustedError(f"{sum(missing)} KV blocks wanted, {self.pool.num_free} free")
        rows, cols, ids = [], [], []
        for slot, n in zip(slots, missing):
            if n:
                start = len(self.held[slot])
                new = self.pool.alloc(n)
                self.held[slot].extend(new)
                rows += [slot] * n
                cols += range(start, start + n)
                ids += new
        if ids:
            self._write_table(rows, cols, ids)

    def release(self, slot: int) -> list[int]:
        """Give every block of `slot` back (its length goes to 0); returns the blocks that became unreferenced
        (already back in the pool)."""
        if self.static:
            self.lengths[slot] = 0
            return []
        freed = [b for b in self.held[slot] if self.pool.decref(b)]
        for b in freed:
            self.pool.put_back(b)
        count = len(self.held[slot])
        self.held[slot] = []
        if count:
            self._write_table([slot] * count, list(range(count)), [NULL_BLOCK] * count)
        return freed

    def _write_table(self, rows: list[int], cols: list[int], ids: list[int]) -> None:
        # advanced-index put: one small host-to-device copy of the changed entries
        index = torch.tensor([rows, cols], dtype=torch.int64).to(self.device, non_blocking=True)
        values = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        self.block_tables.index_put_((index[0], index[1]), values)

    def slot_kv(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, length) of `slot` in `layer`, gathered contiguous: ([length, Hkv, D], same)."""
        n = math.ceil(length / self.block_size)
        blocks = self.block_tables[slot, :n]
        flat = (lambda t: t[blocks].flatten(0, 1)[:length])
        return flat(self.k[layer]), flat(self.v[layer])

    def check_blocks(self) -> None:
        """Consistency of the host bookkeeping (tests): every held block has a positive count equal to its
        holders, free blocks have count 0 and are held by nobody, no block is lost."""
        counts = np.zeros(self.pool.num_blocks, dtype=np.int64)
        counts[NULL_BLOCK] = 1
        for blocks in self.held:
            for b in blocks:
                counts[b] += 1
        free = set(self.pool._free)
        assert len(free) == len(self.pool._free), "a block is on the free list twice"
        extra = self.extra_refs()
        assert all(self.pool.refcount[b] == 0 for b in free), "a free block is referenced"
        assert (self.pool.refcount >= 0).all(), "negative reference count"
        assert np.array_equal(self.pool.refcount, counts + extra), "reference counts differ from holders"
        unaccounted = set(range(self.pool.num_blocks)) - free - {b for b in range(self.pool.num_blocks) if counts[b]
                                                                 or extra[b]} - self.idle_blocks()
        assert not unaccounted, f"blocks leaked: {sorted(unaccounted)[:10]}"

    def extra_refs(self) -> np.ndarray:
        """References held by something other than a slot (none here; the prefix cache adds its own)."""
        return np.zeros(self.pool.num_blocks, dtype=np.int64)

    def idle_blocks(self) -> set[int]:
        """Unreferenced blocks kept out of the free list (none here; the prefix cache keeps its own)."""
        return set()

    @staticmethod
    def bytes_per_slot(num_layers: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return (max_len + HEADROOM) * bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)


class SlotAllocator:
    """Hands out slot indices; freeing a slot makes it reusable (its length is reset by the next prefill)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    def alloc(self) -> int:
        if not self._free:
            raise SlotsExhaustedError(f"all {self.num_slots} KV slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)
