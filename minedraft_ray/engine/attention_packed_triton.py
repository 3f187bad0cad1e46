"""Varlen (packed) prefill attention over the paged KV cache (Triton; no host sync, so CUDA-graph safe).

Tokens of several requests lie back to back in one flat [T] run; token t sees keys 0..positions[t] of slot
token_slots[t]. One program takes BLOCK_M consecutive (token, group member) rows of one KV head, so the
G query heads sharing a KV head read each K/V tile once (GQA), and runs an fp32 online softmax.

A block of rows may straddle a request boundary. The program then walks the distinct slots among its rows
(one pass each, smallest slot id first), every pass reading keys 0..max position of that slot's rows and
masking the other rows out; the per-row softmax state carries over the passes. Inside one request the block
reads only up to its last row's position, so causal work is skipped without a per-request launch plan, and
the grid depends on T alone. Keys are read through the slot's block table, key by key (as in
attention_triton.py), so tiles need not align with blocks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_triton import num_sms

LOG2E = 1.4426950408889634
NO_SLOT = tl.constexpr(2147483647)  # larger than any slot id: rows already done never win the min


@triton.jit
def _attend_packed_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, slots_ptr, pos_ptr, out_ptr,
    qk_scale, T, R,
    stride_qt, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_table,
    BS: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # kv head
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] flattened (token, group member)
    row_ok = rows < T * G
    ti = rows // G
    head = h * G + rows % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    pos = tl.load(pos_ptr + ti, mask=row_ok, other=-1).to(tl.int32)  # [BLOCK_M]
    slot = tl.load(slots_ptr + ti, mask=row_ok, other=NO_SLOT).to(tl.int32)
    q = tl.load(q_ptr + ti[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    pending = row_ok
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        current = tl.min(tl.where(pending, slot, NO_SLOT), axis=0)
        mine = pending & (slot == current)
        live = tl.minimum(tl.max(tl.where(mine, pos, -1), axis=0) + 1, R)
        table = table_ptr + current.to(tl.int64) * stride_table
        k_base = k_ptr + h * stride_kh
        v_base = v_ptr + h * stride_vh
        for n0 in range(0, live, BLOCK_N):
            n = n0 + offs_n
            kv_mask = (n < live)[:, None] & d_ok[None, :]
            block = tl.load(table + n // BS, mask=n < live, other=0).to(tl.int64)  # [BLOCK_N] physical blocks
            k_row = block * stride_kb + (n % BS) * stride_kn
            v_row = block * stride_vb + (n % BS) * stride_vn
            k = tl.load(k_base + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            visible = mine[:, None] & (n[None, :] <= pos[:, None]) & (n < live)[None, :]
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            # rows with nothing visible yet keep m = -inf; subtract 0 instead so exp2 gives 0, not NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + v_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        pending = pending & (slot != current)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (ti * HQ + head)[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def launch_shape(tokens: int, groups: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 sm_count: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a launch of `tokens` query tokens (a CUDA graph's shape fixes them).

    16-bit heads up to 128 wide: 128-row tiles (each K/V tile read serves more rows) once 128-row programs alone
    give every SM one; a shorter launch (a suffix over a long cached prefix, a small chunk) walks the same keys
    with half the rows per program, so twice the programs share the streaming. Wider heads or fp32: smaller
    tiles, so the q tile, accumulator and pipelined K/V tiles fit registers and shared memory."""
    if head_dim > 128 or dtype.itemsize > 2:
        return 64, 32, 4
    if -(-tokens * groups // 128) * kv_heads >= sm_count:
        return 128, 64, 8
    return 64, 64, 8


def attend_packed_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         token_slots: torch.Tensor, positions: torch.Tensor, scale: float, *,
                         block_m: int | None = None, block_n: int | None = None,
                         num_warps: int | None = None) -> torch.Tensor:
    """Token t attends keys 0..positions[t] (inclusive) of slot token_slots[t].

    q: [T, Hq, D] (last dim contiguous); k_cache, v_cache: [NB, BS, Hkv, D] (a pool of blocks); block_tables:
    [S, W] int64; token_slots, positions: [T] int64.
    Returns contiguous [T, Hq, D] in q's dtype. `block_m`/`block_n`/`num_warps` override `launch_shape` (tests use
    them to make blocks straddle requests on tiny shapes; benchmarks to time other tiles).
    """
    T, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    R = block_tables.shape[1] * BS  # positions a slot can hold
    assert Hq % Hkv == 0, f"{Hq} query heads do not group over {Hkv} kv heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.stride(-1) == 1 and BS & (BS - 1) == 0, "block size must be a power of two"
    assert token_slots.shape == (T,) and positions.shape == (T,)
    token_slots, positions = token_slots.contiguous(), positions.contiguous()
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    G = Hq // Hkv
    default_m, default_n, default_warps = launch_shape(T, G, Hkv, D, q.dtype, num_sms(q.device))
    block_m, block_n, num_warps = block_m or default_m, block_n or default_n, num_warps or default_warps
    _attend_packed_kernel[(triton.cdiv(T * G, block_m), Hkv)](
        q, k_cache, v_cache, block_tables, token_slots, positions, out,
        scale * LOG2E, T, R,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        BS=BS, G=G, HQ=Hq, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=2,
    )
    return out
