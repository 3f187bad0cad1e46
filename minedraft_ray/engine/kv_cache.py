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

The bookkeeping (`BlockManager`: free list, reference counts, each slot's blocks, the prefix cache) is
kv_blocks.py's, which needs no device: `KVCache` is a BlockManager that writes its device table at once; the
runtime's scheduler keeps one per model in the manager's process and sends its table changes (`TableEdits`) to
the workers, whose caches apply them (`map_blocks`) in task order.

`static=True` reserves every slot's full `max_len + HEADROOM` up front: the memory and layout of the former
contiguous cache, for callers that do not manage blocks (and as the comparison in benchmarks).
"""

from __future__ import annotations

import math

import torch

from .kv_blocks import DEFAULT_BLOCK_SIZE, HEADROOM, NULL_BLOCK, BlockManager, TableEdits


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class KVCache(BlockManager):
    """K/V for `num_slots` sequences of up to `max_len` tokens each, in `num_blocks` blocks of `block_size`.

    k[l], v[l]: [num_blocks, block_size, Hkv, D]; block_tables: [S, W] int64 with W = blocks per slot at
    max_len + HEADROOM; lengths: [S] int64 (tokens valid per slot). The block bookkeeping is the
    BlockManager's; its table changes are written to `block_tables` at once. A cache whose blocks a manager
    elsewhere hands out (the runtime's scheduler) leaves its own bookkeeping unused and takes the manager's
    changes through `map_blocks`.
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, block_size: int = DEFAULT_BLOCK_SIZE,
                 num_blocks: int | None = None, static: bool = False, prefix_caching: bool = False):
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.max_len = max_len
        self.device = torch.device(device)
        blocks_per_slot = math.ceil((max_len + HEADROOM) / block_size)
        if num_blocks is None or static:
            num_blocks = num_slots * blocks_per_slot + 1
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.block_tables = torch.full((num_slots, blocks_per_slot), NULL_BLOCK, dtype=torch.int64, device=device)
        super().__init__(num_blocks, block_size, num_slots, blocks_per_slot, prefix_caching and not static)
        self.static = static
        if static:
            for slot in range(num_slots):
                self.reserve(slot, self.blocks_per_slot * block_size)

    def release(self, slot: int) -> list[int]:
        """Give every block of `slot` back (its length goes to 0); returns the blocks that became unreferenced."""
        if self.static:
            self.lengths[slot] = 0
            return []
        return super().release(slot)

    def map_blocks(self, edits: TableEdits) -> None:
        """Set the table entries a block manager elsewhere decided (the runtime's scheduler)."""
        if len(edits):
            self._map(edits.rows, edits.cols, edits.ids)

    def _map(self, rows: list[int], cols: list[int], ids: list[int]) -> None:
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
