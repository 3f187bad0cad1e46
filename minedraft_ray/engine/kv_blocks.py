"""KV block bookkeeping on the host, with no device and no torch: which blocks of a pool each slot's block table
maps, the free list and reference counts, the prefix cache, and the slot allocator. kv_cache.py holds the device
side (the tables, the K/V) and says why block 0 (`NULL_BLOCK`) is never handed out.

The in-process engine's `KVCache` is a `BlockManager` that writes its device table at once; the runtime's scheduler
keeps one per model in the manager's process (which imports no torch) and sends its table changes (`TableEdits`)
to the workers, whose caches apply them (`map_blocks`) in task order.

Prefix caching (`prefix_caching=True`): a full block whose K/V is final (`register`) is keyed by a hash chain
of the tokens up to its end (sha256 of the previous block's key and its own tokens, so a key names the whole
prefix and cannot be forged by choosing tokens). A new request maps the longest run of cached blocks its
tokens start with (`match`, `adopt`) and computes only the rest. Shared blocks are never written: only full
blocks that lie below every position a request may still write are registered or matched (the caller bounds
both), so a request that diverges inside a block computes that block afresh in its own. A block nobody holds
stays cached and idle until the pool needs it; idle blocks are evicted least recently used first.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

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

    A block is free at count 0. Counts above 1 are blocks shared by several slots (prefix caching). The counts
    are a Python list: the runtime's scheduler hands out a few blocks per step and takes a finished request's back,
    where numpy's per-element indexing costs several times a list's.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise CacheSizeError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self.refcount[NULL_BLOCK] = 1  # held forever
        self._free = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise BlocksExhaustedError(f"{n} KV blocks wanted, {len(self._free)} free of {self.num_blocks - 1}")
        free, refcount = self._free, self.refcount
        blocks = [free.popleft()] if n == 1 else [free.popleft() for _ in range(n)]   # mostly one (a step's growth)
        for b in blocks:
            refcount[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        self.refcount[block] += 1

    def unref(self, blocks: list[int]) -> list[int]:
        """Drop one reference to each of `blocks`; -> those now unreferenced, in order (the caller frees or caches
        them). A released slot's blocks in one call: a finished request gives back one per block_size tokens."""
        refcount, unreferenced = self.refcount, []
        for b in blocks:
            if b == NULL_BLOCK or refcount[b] <= 0:
                raise ValueError(f"block {b} is not held")
            refcount[b] -= 1
            if not refcount[b]:
                unreferenced.append(b)
        return unreferenced

    def put_back(self, blocks: list[int]) -> None:
        """Unreferenced blocks (`unref`'s, or evicted from the prefix cache) back on the free list, in order."""
        self._free.extend(blocks)



@dataclass(frozen=True)
class TableEdits:
    """Block-table entries to set, `table[rows[i], cols[i]] = ids[i]` (each entry at most once): the changes a
    block manager made, shipped to the device that holds the table (the runtime's scheduler decides the blocks,
    its workers hold the tables)."""
    rows: list[int]
    cols: list[int]
    ids: list[int]

    def __len__(self) -> int:
        return len(self.ids)


class BlockManager:
    """Host bookkeeping of a pool of KV blocks for `num_slots` block tables of `blocks_per_slot` entries: which
    blocks each slot holds (in table order), the free list and reference counts, and the prefix cache. Every
    table change goes through `_map` (rows, cols, ids); here it does nothing, `KVCache` writes its device table,
    and the runtime's scheduler queues it for the worker that holds the table, so both use this one bookkeeping.
    """

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, blocks_per_slot: int,
                 prefix_caching: bool = False):
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size, self.num_slots, self.blocks_per_slot = block_size, num_slots, blocks_per_slot
        self.pool = BlockPool(num_blocks)
        self.held: list[list[int]] = [[] for _ in range(num_slots)]  # blocks of each slot, in table order
        self.prefix_caching = prefix_caching
        self.cached: dict[bytes, int] = {}             # prefix key -> block holding that prefix's last block
        self.block_key: dict[int, bytes] = {}          # block -> its key, for blocks in `cached`
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, least recently used first
        self.slot_keys: list[list[bytes]] = [[] for _ in range(num_slots)]  # keys of each slot's leading blocks
        self.hit_tokens = self.query_tokens = 0        # prefix-cache counters (tokens matched / looked up)

    def _map(self, rows: list[int], cols: list[int], ids: list[int]) -> None:
        """Table entries changed: table[rows[i], cols[i]] = ids[i] (a subclass writes or queues them)."""

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds (the null block is never handed out)."""
        return (self.pool.num_blocks - 1) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return min(math.ceil(num_tokens / self.block_size), self.blocks_per_slot)

    def blocks_missing(self, slot: int, num_tokens: int) -> int:
        """Blocks `reserve(slot, num_tokens)` would take from the pool."""
        return max(0, self.blocks_for(num_tokens) - len(self.held[slot]))

    def covers(self, slot: int, num_tokens: int) -> bool:
        """Positions [0, num_tokens) of `slot` are mapped (capped at the slot's table)."""
        return self.blocks_missing(slot, num_tokens) == 0

    @property
    def num_available(self) -> int:
        """Blocks a reservation can take: free ones and idle cached ones (evicted on demand)."""
        return self.pool.num_free + len(self.idle)

    @property
    def num_in_use(self) -> int:
        """Blocks some slot holds (a block shared by several slots counts once)."""
        return self.pool.num_blocks - 1 - self.num_available

    def _take(self, n: int) -> list[int]:
        """n blocks from the free list, evicting idle cached blocks (least recently used first) when it runs dry."""
        while self.idle and self.pool.num_free < n:
            block, _ = self.idle.popitem(last=False)
            del self.cached[self.block_key.pop(block)]
            self.pool.put_back([block])
        return self.pool.alloc(n)

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Map positions [0, num_tokens) of `slot` (capped at the slot's table), taking blocks from the pool
        as needed; all or nothing: BlocksExhaustedError leaves the slot as it was."""
        self.reserve_many([slot], [num_tokens])

    def reserve_many(self, slots: list[int], num_tokens: list[int]) -> None:
        """`reserve` for several slots, all or nothing, with one table change."""
        missing = [self.blocks_missing(s, n) for s, n in zip(slots, num_tokens)]
        if sum(missing) > self.num_available:
            raise BlocksExhaustedError(f"{sum(missing)} KV blocks wanted, {self.num_available} available")
        rows, cols, ids = [], [], []
        for slot, n in zip(slots, missing):
            if n:
                start = len(self.held[slot])
                new = self._take(n)
                self.held[slot].extend(new)
                rows += [slot] * n
                cols += range(start, start + n)
                ids += new
        if ids:
            self._map(rows, cols, ids)

    def grow(self, slots: list[int], counts: list[int]) -> None:
        """counts[i] more blocks at the end of slots[i]'s table, in one allocation and one table change (a step's
        growth of its riders' tables; the caller checked they are available and fit the tables)."""
        new = self._take(sum(counts))
        rows, cols, taken = [], [], 0
        for slot, n in zip(slots, counts):
            held = self.held[slot]
            rows += [slot] * n
            cols += range(len(held), len(held) + n)
            held += new[taken:taken + n]
            taken += n
        self._map(rows, cols, new)

    def release(self, slot: int) -> list[int]:
        """Give every block of `slot` back; returns the blocks that became unreferenced (already back in the
        pool; cached ones idle instead)."""
        # the slot's last blocks first: when the pool runs short, a prefix's tail is evicted before its head
        unreferenced = self.pool.unref(self.held[slot][::-1])
        freed = unreferenced
        if self.block_key:   # cached blocks stay, idle, for a request that starts the same way
            freed = []
            for b in unreferenced:
                if b in self.block_key:
                    self.idle[b] = None
                else:
                    freed.append(b)
        self.pool.put_back(freed)
        count = len(self.held[slot])
        self.held[slot] = []
        self.slot_keys[slot] = []
        if count:
            self._map([slot] * count, list(range(count)), [NULL_BLOCK] * count)
        return freed

    # ---- prefix caching -------------------------------------------------------------------------
    @staticmethod
    def _key(previous: bytes, tokens) -> bytes:
        return hashlib.sha256(previous + np.asarray(tokens, dtype=np.int64).tobytes()).digest()

    def lookup(self, tokens, max_tokens: int) -> list[int]:
        """Cached blocks holding the longest run of full blocks `tokens` (a list, or anything sliced like one)
        starts with, within its first `max_tokens` tokens; nothing counted."""
        blocks, key, bs = [], b"", self.block_size
        if self.prefix_caching:
            for i in range(min(max_tokens, len(tokens)) // bs):
                key = self._key(key, tokens[i * bs:(i + 1) * bs])
                block = self.cached.get(key)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def count_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        if self.prefix_caching:
            self.query_tokens += max(query_tokens, 0)
            self.hit_tokens += hit_tokens

    def match(self, tokens, max_tokens: int) -> list[int]:
        """`lookup`, counted in `hit_tokens` / `query_tokens`."""
        blocks = self.lookup(tokens, max_tokens)
        self.count_lookup(max_tokens, len(blocks) * self.block_size)
        return blocks

    def adopt(self, slot: int, blocks: list[int]) -> int:
        """Map an empty slot's leading positions to cached `blocks` (from `match`); returns the tokens mapped."""
        if not blocks:
            return 0
        assert not self.held[slot], f"slot {slot} already holds blocks"
        for b in blocks:
            self.pool.incref(b)
            self.idle.pop(b, None)
        self.held[slot] = list(blocks)
        self.slot_keys[slot] = [self.block_key[b] for b in blocks]
        self._map([slot] * len(blocks), list(range(len(blocks))), blocks)
        return len(blocks) * self.block_size

    def registered(self, slot: int) -> int:
        """Tokens of `slot` offered to the prefix cache so far (whole blocks)."""
        return len(self.slot_keys[slot]) * self.block_size

    def register(self, slot: int, tokens, num_tokens: int) -> None:
        """The slot's K/V of `tokens[:num_tokens]` is final (never written again): cache its full blocks in that
        range. A prefix already cached in another block keeps that one. `tokens`: a list, or anything sliced
        like one (only the new blocks' tokens are read)."""
        if not self.prefix_caching:
            return
        keys, held, bs = self.slot_keys[slot], self.held[slot], self.block_size
        for i in range(len(keys), min(num_tokens // bs, len(held))):
            key = self._key(keys[-1] if keys else b"", tokens[i * bs:(i + 1) * bs])
            keys.append(key)
            if key not in self.cached and held[i] not in self.block_key:
                self.cached[key] = held[i]
                self.block_key[held[i]] = key

    def check_blocks(self) -> None:
        """Consistency of the host bookkeeping (tests): every block's reference count equals its holders (never
        negative), and every block is exactly one of: held, idle in the prefix cache, free (none is lost)."""
        holders = np.zeros(self.pool.num_blocks, dtype=np.int64)
        holders[NULL_BLOCK] = 1
        for blocks in self.held:
            assert len(set(blocks)) == len(blocks), "a slot holds a block twice"
            np.add.at(holders, np.asarray(blocks, dtype=np.int64), 1)
        refcount = np.asarray(self.pool.refcount, dtype=np.int64)
        assert (refcount >= 0).all(), "negative reference count"
        assert np.array_equal(refcount, holders), "reference counts differ from holders"
        free, idle = list(self.pool._free), set(self.idle)
        assert len(set(free)) == len(free), "a block is on the free list twice"
        held = set(np.flatnonzero(holders).tolist())
        assert not (held & idle) and not (held & set(free)) and not (idle & set(free)), "a block is in two states"
        assert held | idle | set(free) == set(range(self.pool.num_blocks)), "a block was lost"
        assert all(b in self.block_key for b in idle), "an idle block is not cached"
        assert set(self.block_key) == set(self.cached.values()), "cache index and block keys disagree"



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
