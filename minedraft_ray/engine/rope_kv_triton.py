"""RoPE on q and k plus the K/V cache write, in one Triton launch per layer (CUDA-graph safe).

Replaces, per layer, the two torch.compile RoPE kernels and the two index_put kernels of `write_kv`.
One program per (token, kv head) rotates the G query heads of that group and the kv head's key, stores
the key and the raw value at position positions[b, i] of slot slots[b] of the paged cache (through its
block table), and reads cos/sin straight from
the rope table at that position, so no per-step cos/sin gather is needed either.

Math matches model._rotate bit for bit: fp32 products and differences, one rounding to the output
dtype, no fused multiply-add (enable_fp_fusion=False; the kernel is bound by memory, not math).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, rope_ptr, table_ptr, slots_ptr, pos_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    QLEN,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_rope, stride_pb, stride_table,
    stride_kb, stride_kr, stride_kh_cache, stride_vb, stride_vr, stride_vh_cache,
    BS: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # token n = b * QLEN + i
    h = tl.program_id(1)  # kv head
    b = n // QLEN
    pos = tl.load(pos_ptr + b * stride_pb + n % QLEN)
    slot = tl.load(slots_ptr + b)
    block = tl.load(table_ptr + slot * stride_table + pos // BS).to(tl.int64)
    row = pos % BS

    d = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF] index into each half of the head dim
    d_ok = d < HALF
    cos = tl.load(rope_ptr + pos * stride_rope + d, mask=d_ok, other=0.0)  # [BLOCK_HALF] fp32
    sin = tl.load(rope_ptr + pos * stride_rope + HALF + d, mask=d_ok, other=0.0)

    # the G query heads of group h: [BLOCK_G, BLOCK_HALF] per half; out is contiguous [N, Hq, D]
    head = h * G + tl.arange(0, BLOCK_G)
    q_mask = (tl.arange(0, BLOCK_G) < G)[:, None] & d_ok[None, :]
    q_src = q_ptr + n * stride_qn + head[:, None] * stride_qh + d[None, :]
    q1 = tl.load(q_src, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_src + HALF, mask=q_mask, other=0.0).to(tl.float32)
    q_dst = q_out_ptr + (n * HQ + head[:, None]) * (2 * HALF) + d[None, :]
    q_ty = q_out_ptr.dtype.element_ty
    tl.store(q_dst, (q1 * cos[None, :] - q2 * sin[None, :]).to(q_ty), mask=q_mask)
    tl.store(q_dst + HALF, (q2 * cos[None, :] + q1 * sin[None, :]).to(q_ty), mask=q_mask)

    # key h, rotated, and value h, as is, into row `row` of block `block`, head h
    k_src = k_ptr + n * stride_kn + h * stride_kh + d
    k1 = tl.load(k_src, mask=d_ok, other=0.0).to(tl.float32)
    k2 = tl.load(k_src + HALF, mask=d_ok, other=0.0).to(tl.float32)
    k_dst = k_cache_ptr + block * stride_kb + row * stride_kr + h * stride_kh_cache + d
    k_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_dst, (k1 * cos - k2 * sin).to(k_ty), mask=d_ok)
    tl.store(k_dst + HALF, (k2 * cos + k1 * sin).to(k_ty), mask=d_ok)
    v_src = v_ptr + n * stride_vn + h * stride_vh + d
    v_dst = v_cache_ptr + block * stride_vb + row * stride_vr + h * stride_vh_cache + d
    tl.store(v_dst, tl.load(v_src, mask=d_ok), mask=d_ok)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=d_ok), mask=d_ok)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope_cache: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, slots: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """Rotate q and k at their positions, store k and v in the cache; return rotated q.

    q: [N, Hq, D], k, v: [N, Hkv, D] with N = B*qlen (any strides, last dim contiguous); rope_cache: [P, D]
    fp32 (cos | sin); k_cache, v_cache: [NB, BS, Hkv, D] in k's/v's dtype; block_tables: [S, W] int64;
    slots: [B]; positions: [B, qlen]. Token n = b*qlen + i goes to position positions[b, i] of slot slots[b].
    Returns contiguous [N, Hq, D].
    """
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    B, qlen = positions.shape
    assert N == B * qlen and k.shape == v.shape == (N, Hkv, D) and Hq % Hkv == 0 and D % 2 == 0
    assert k_cache.shape[2:] == v_cache.shape[2:] == (Hkv, D) and rope_cache.shape[1] == D
    assert k.dtype == k_cache.dtype and v.dtype == v_cache.dtype and rope_cache.dtype == torch.float32
    assert all(t.stride(-1) == 1 for t in (q, k, v, rope_cache, k_cache, v_cache, positions, block_tables))
    BS = k_cache.shape[1]
    assert BS & (BS - 1) == 0, "block size must be a power of two"
    q_out = torch.empty((N, Hq, D), dtype=q.dtype, device=q.device)
    if N == 0:
        return q_out
    G = Hq // Hkv
    _rope_write_kv_kernel[(N, Hkv)](
        q, k, v, rope_cache, block_tables, slots, positions, q_out, k_cache, v_cache,
        qlen,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        rope_cache.stride(0), positions.stride(0), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BS=BS, HQ=Hq, G=G, BLOCK_G=triton.next_power_of_2(G), HALF=D // 2, BLOCK_HALF=triton.next_power_of_2(D // 2),
        num_warps=1 if G * D <= 1024 else 4, enable_fp_fusion=False,
    )
    return q_out
