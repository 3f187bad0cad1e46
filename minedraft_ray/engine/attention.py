"""K/V writes and attention over the paged KV cache.

The cache of a layer is a pool of blocks `[NB, BS, Hkv, D]`; `block_tables [S, W]` maps position p of slot s
to row p % BS of block block_tables[s, p // BS] (kv_cache.py).

`attend` dispatches to the Triton kernel (attention_triton.py) for CUDA tensors when it imports, and to
the torch reference below otherwise. The reference gathers only the live prefix of each slot, which
needs one host sync (`positions.max()`), so it is not for CUDA graph capture. `triton_op` also serves
model.rope_write_kv (RoPE + this K/V write in one kernel, rope_kv_triton.py).

`attend_packed` is the varlen form used by packed prefill: a flat run of tokens from several requests,
each token carrying its own slot and position, and seeing keys 0..position of its own slot only. Its
Triton kernel (attention_packed_triton.py) reads only per-token tensors (and the table), so a CUDA graph
captured for a token count serves any mix of requests that fills it.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@functools.cache
def triton_op(module: str, name: str):
    """`name` from this package's Triton module `module`, imported on first use; None without Triton."""
    try:
        return getattr(importlib.import_module(f".{module}", __package__), name)
    except ImportError:
        return None


def write_kv(k_cache, v_cache, block_tables, slots, positions, k, v) -> None:
    # k_cache, v_cache: [NB, BS, Hkv, D]; block_tables: [S, W]; slots: [B]; positions: [B, q]; k, v: [B, q, Hkv, D]
    block_size = k_cache.shape[1]
    blocks = block_tables[slots[:, None], positions // block_size]  # [B, q]
    rows = positions % block_size
    k_cache[blocks, rows] = k.to(k_cache.dtype)
    v_cache[blocks, rows] = v.to(v_cache.dtype)


def gather_slots(cache, block_tables, slots, live: int) -> torch.Tensor:
    """Positions [0, live) of each slot, contiguous: [B, live, Hkv, D] (slots: [B])."""
    block_size = cache.shape[1]
    n = -(-live // block_size)
    return cache[block_tables[slots, :n]].flatten(1, 2)[:, :live]


def attend_reference(q, k_cache, v_cache, block_tables, slots, positions, scale) -> torch.Tensor:
    # q: [B, q, Hq, D]; query (b, i) sees keys 0..positions[b, i] of slot slots[b] -> [B, q, Hq, D]
    live = int(positions.max()) + 1  # host sync: read only the live prefix, not the whole table
    k = gather_slots(k_cache, block_tables, slots, live).transpose(1, 2)  # [B, Hkv, L, D]
    v = gather_slots(v_cache, block_tables, slots, live).transpose(1, 2)
    mask = torch.arange(live, device=q.device) <= positions[:, :, None]  # [B, q, L]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale,
        enable_gqa=q.shape[2] != k.shape[1])  # [B, Hq, q, D]
    return out.transpose(1, 2)


def attend(q, k_cache, v_cache, block_tables, slots, positions, scale) -> torch.Tensor:
    # q: [B, q, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]; block_tables: [S, W]; slots: [B]; positions: [B, q]
    if q.is_cuda:
        kernel = triton_op("attention_triton", "attend_triton")
        if kernel is not None:
            return kernel(q, k_cache, v_cache, block_tables, slots, positions, scale)
    return attend_reference(q, k_cache, v_cache, block_tables, slots, positions, scale)


def attend_packed_reference(q, k_cache, v_cache, block_tables, token_slots, positions, scale) -> torch.Tensor:
    # q: [T, Hq, D]; token t sees keys 0..positions[t] of slot token_slots[t] -> [T, Hq, D]
    out = torch.empty_like(q)
    for slot in token_slots.unique().tolist():  # host syncs: one attention per request in the pack
        rows = (token_slots == slot).nonzero().squeeze(1)  # [L]
        pos = positions[rows]
        live = int(pos.max()) + 1
        slot_t = torch.tensor([slot], device=q.device)
        k = gather_slots(k_cache, block_tables, slot_t, live)[0].transpose(0, 1)  # [Hkv, live, D]
        v = gather_slots(v_cache, block_tables, slot_t, live)[0].transpose(0, 1)
        mask = torch.arange(live, device=q.device) <= pos[:, None]  # [L, live]
        o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[0])  # [Hq, L, D]
        out[rows] = o.transpose(0, 1)
    return out


@dataclass(frozen=True)
class DecodeRows:
    """The front of a fused step's packed launch: `tokens` tokens that hold its decode/verify rows of `width`
    tokens each (a graph's static count may run past the real rows into prompt chunk tokens)."""
    tokens: int
    width: int


def attend_packed(q, k_cache, v_cache, block_tables, token_slots, positions, scale, rows: DecodeRows | None = None
                  ) -> torch.Tensor:
    # q: [T, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]; block_tables: [S, W]; token_slots, positions: [T]
    # rows: tokens at the front that a fused step's decode/verify rows hold. Each such row sees its slot's whole
    # context, so a program of prefill-sized blocks (or of several rows) would walk many contexts alone while most
    # SMs idle; a program per row with the keys split, as in a decode step, keeps them parallel. The rest, prompt
    # chunks, keep the prefill blocks.
    if q.is_cuda:
        kernel = triton_op("attention_packed_triton", "attend_packed_triton")
        if kernel is not None:
            return attend_rows_then_packed(kernel, q, k_cache, v_cache, block_tables, token_slots, positions, scale,
                                           rows)
    return attend_packed_reference(q, k_cache, v_cache, block_tables, token_slots, positions, scale)


def attend_rows_then_packed(kernel, q, k_cache, v_cache, block_tables, token_slots, positions, scale,
                            rows: DecodeRows | None) -> torch.Tensor:
    """The packed kernel over the first `rows.tokens` tokens a row per program, then over the rest in its own
    blocks, both into one output."""
    if rows is None or rows.tokens <= 0:
        return kernel(q, k_cache, v_cache, block_tables, token_slots, positions, scale)
    n = min(rows.tokens, q.shape[0])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kernel(q[:n], k_cache, v_cache, block_tables, token_slots[:n], positions[:n], scale, row_width=rows.width,
           out=out[:n])
    if n < q.shape[0]:
        kernel(q[n:], k_cache, v_cache, block_tables, token_slots[n:], positions[n:], scale, out=out[n:])
    return out
