"""K/V writes and attention over the slot KV cache.

`attend` dispatches to the Triton kernel (attention_triton.py) for CUDA tensors when it imports, and to
the torch reference below otherwise. The reference reads only the live prefix of each slot, which
needs one host sync (`positions.max()`), so it is not for CUDA graph capture. `triton_op` also serves
model.rope_write_kv (RoPE + this K/V write in one kernel, rope_kv_triton.py).
"""
from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F


@functools.cache
def triton_op(module: str, name: str):
    """`name` from this package's Triton module `module`, imported on first use; None without Triton."""
    try:
        return getattr(importlib.import_module(f".{module}", __package__), name)
    except ImportError:
        return None


def write_kv(k_cache, v_cache, slots, positions, k, v) -> None:
    # k_cache, v_cache: [S, R, Hkv, D]; slots: [B]; positions: [B, q]; k, v: [B, q, Hkv, D]
    rows = slots[:, None].expand_as(positions)
    k_cache[rows, positions] = k.to(k_cache.dtype)
    v_cache[rows, positions] = v.to(v_cache.dtype)


def attend_reference(q, k_cache, v_cache, slots, positions, scale) -> torch.Tensor:
    # q: [B, q, Hq, D]; query (b, i) sees keys 0..positions[b, i] of slot slots[b] -> [B, q, Hq, D]
    live = int(positions.max()) + 1  # host sync: read only the live prefix, not all R rows
    k = k_cache[slots, :live].transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache[slots, :live].transpose(1, 2)
    mask = torch.arange(live, device=q.device) <= positions[:, :, None]  # [B, q, L]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale,
        enable_gqa=q.shape[2] != k.shape[1])  # [B, Hq, q, D]
    return out.transpose(1, 2)


def attend(q, k_cache, v_cache, slots, positions, scale) -> torch.Tensor:
    # q: [B, q, Hq, D]; k_cache, v_cache: [S, R, Hkv, D]; slots: [B]; positions: [B, q] -> [B, q, Hq, D]
    if q.is_cuda:
        kernel = triton_op("attention_triton", "attend_triton")
        if kernel is not None:
            return kernel(q, k_cache, v_cache, slots, positions, scale)
    return attend_reference(q, k_cache, v_cache, slots, positions, scale)
