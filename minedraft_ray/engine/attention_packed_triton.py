"""Varlen (packed) prefill attention over the paged KV cache (Triton; no host sync, so CUDA-graph safe).

Tokens of several requests lie back to back in one flat [T] run; token t sees keys 0..positions[t] of slot
token_slots[t]. One program takes BLOCK_M consecutive (token, group member) rows of one KV head, so the
G query heads sharing a KV head read each K/V tile once (GQA), and runs an fp32 online softmax.

A fused step's decode/verify rows (`rows` mode) take small programs instead: each holds the W tokens of one row
(all G heads), and the keys of its slot are split over NUM_SPLITS programs whose partial softmaxes a second
kernel merges (attention_triton's combine), as a decode step's flash-decoding kernel does. A decode row's keys
are the whole context, so without the split a few programs would walk every row's context alone while most SMs
idle.

Prefill blocks split their keys the same way when a launch is too short to fill the SMs (prefill_splits): a
small chunk late in a long prompt would otherwise leave a few programs each walking the whole prefix.

A block of rows may straddle a request boundary. The program then walks the distinct slots among its rows
(one pass each, smallest slot id first), every pass reading keys 0..max position of that slot's rows and
masking the other rows out; the per-row softmax state carries over the passes. Inside one request the block
reads only up to its last row's position, so causal work is skipped without a per-request launch plan, and
the grid depends on T alone. Keys are read through the slot's block table, key by key (as in
attention_triton.py), so tiles need not align with blocks. Within a pass, the whole tiles of keys up to the
earliest of its rows' positions are visible to every one of them and run without the causal mask; only the
tiles after (the diagonal, a split's ragged end) compute it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_triton import CONFIG, combine_splits, num_sms

LOG2E = 1.4426950408889634
NO_SLOT = tl.constexpr(2147483647)  # larger than any slot id: rows already done never win the min
SHUT = tl.constexpr(-1.0e30)  # added to the scores of rows outside a pass: exp2 of it is 0, and it stays finite


@triton.jit
def _attend_packed_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, slots_ptr, pos_ptr, out_ptr, o_part_ptr, lse_ptr,
    qk_scale, T, R, NUM_SPLITS,
    stride_qt, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_table,
    BS: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
):
    # ROWS <= BLOCK_M consecutive (token, group member) rows per program: BLOCK_M (prefill blocks) or a row's W * G
    m_block = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # kv head
    split = tl.program_id(2)
    lanes = tl.arange(0, BLOCK_M)
    rows = m_block * ROWS + lanes  # [BLOCK_M] flattened (token, group member)
    row_ok = (lanes < ROWS) & (rows < T * G)
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
    k_base = k_ptr + h * stride_kh
    v_base = v_ptr + h * stride_vh
    pending = row_ok
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        current = tl.min(tl.where(pending, slot, NO_SLOT), axis=0)
        mine = pending & (slot == current)
        live = tl.minimum(tl.max(tl.where(mine, pos, -1), axis=0) + 1, R)
        # this program's share of the slot's keys: all of them, or one of NUM_SPLITS even pieces
        piece = tl.cdiv(tl.cdiv(live, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * piece
        end = tl.minimum(start + piece, live)
        # Whole tiles of keys up to the earliest of these rows' positions are visible to all of them: that loop
        # runs without the causal mask, the rest (the diagonal, the split's ragged end) with it. Rows of other
        # slots are pushed far below instead (SHUT, finite so no NaN): a row still pending gets a placeholder
        # state that its own pass wipes (alpha = 0); a finished row's state is left as it was (p = 0).
        earliest = tl.min(tl.where(mine, pos, R), axis=0)
        full_end = start + tl.maximum(tl.minimum(end, earliest + 1) - start, 0) // BLOCK_N * BLOCK_N
        shut = tl.where(mine, 0.0, SHUT)
        table = table_ptr + current.to(tl.int64) * stride_table
        for n0 in range(start, full_end, BLOCK_N):
            n = n0 + offs_n
            block = tl.load(table + n // BS).to(tl.int64)  # [BLOCK_N] physical blocks
            k_row = block * stride_kb + (n % BS) * stride_kn
            v_row = block * stride_vb + (n % BS) * stride_vn
            if EVEN_D:
                k = tl.load(k_base + k_row[:, None] + d[None, :])
            else:
                k = tl.load(k_base + k_row[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale + shut[:, None]
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if EVEN_D:
                v = tl.load(v_base + v_row[:, None] + d[None, :])
            else:
                v = tl.load(v_base + v_row[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        for n0 in range(full_end, end, BLOCK_N):  # empty when this split starts past the slot's live keys
            n = n0 + offs_n
            kv_mask = (n < end)[:, None] & d_ok[None, :]
            block = tl.load(table + n // BS, mask=n < end, other=0).to(tl.int64)
            k_row = block * stride_kb + (n % BS) * stride_kn
            v_row = block * stride_vb + (n % BS) * stride_vn
            k = tl.load(k_base + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            visible = mine[:, None] & (n[None, :] <= pos[:, None]) & (n < end)[None, :]
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

    # a row that saw only other slots' keys (a split past its own) holds a placeholder: keep it out of the partials
    # (its lse would weigh nothing in the combine anyway)
    seen = m_i > SHUT / 2
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    out_row = ti * HQ + head  # [BLOCK_M] row of the contiguous [T, Hq] output
    if DIRECT:
        tl.store(out_ptr + out_row[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        part_row = out_row * NUM_SPLITS + split  # [T, Hq, NUM_SPLITS], as attention_triton's combine reads it
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # log2 units
        tl.store(lse_ptr + part_row, lse, mask=row_ok)
        # splits that saw nothing leave o unwritten; the combine never reads it (their lse is -inf)
        tl.store(o_part_ptr + part_row[:, None] * D + d[None, :], o, mask=(row_ok & seen)[:, None] & d_ok[None, :])


def launch_shape(tokens: int, groups: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 sm_count: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a launch of `tokens` query tokens (a CUDA graph's shape fixes them).

    16-bit heads up to 128 wide: 64 x 64 tiles on 4 warps at every launch size, from fresh prompts to chunks deep
    in long ones (bench/packed_attention.py times the alternatives; docs/design.md has what it found). Wider heads
    or fp32: smaller key tiles, so the q tile, accumulator and pipelined K/V tiles fit registers and shared memory.
    `tokens` and `sm_count` stay in the signature, which earlier rules used and the benchmarks call alike."""
    if head_dim > 128 or dtype.itemsize > 2:
        return 64, 32, 4
    return 64, 64, 4


def prefill_splits(tokens: int, groups: int, kv_heads: int, block_m: int, block_n: int, max_keys: int,
                   sm_count: int, waves: int | None = None) -> int:
    """Key splits for a launch of prefill blocks: one while its programs fill the SMs; more for a short launch
    (a small chunk, a suffix over a cached prefix), whose few programs would each walk a long prefix alone while
    most SMs idle. One wave by default (CONFIG.PREFILL_WAVES), not a decode step's two: a short launch's tokens
    are often a fresh prompt with few keys, whose extra splits only exit empty while their merge still costs."""
    waves = waves or CONFIG.PREFILL_WAVES
    programs = triton.cdiv(tokens * groups, block_m) * kv_heads
    if programs >= waves * sm_count:
        return 1
    return max(1, min(triton.cdiv(waves * sm_count, programs), triton.cdiv(max_keys, block_n), CONFIG.MAX_SPLITS))


def rows_launch_shape(tokens: int, width: int, groups: int, kv_heads: int, head_dim: int, max_keys: int,
                      sm_count: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, rows per program, BLOCK_N, splits, num_warps) for `tokens` decode/verify tokens in rows of `width`.

    As attention_triton.launch_shape picks them for a decode step of the same rows: a program per row and KV head
    (its width x G query rows, at least 16 for tl.dot), the keys split until the programs fill the SMs twice over
    (CONFIG), never into more pieces than key tiles a slot holds."""
    rows = min(width * groups, 64)   # as the decode kernel caps BLOCK_M: registers and shared memory per program
    block_m = max(16, triton.next_power_of_2(rows))
    block_n = CONFIG.BLOCK_N if head_dim <= 128 else CONFIG.BLOCK_N // 2
    programs = triton.cdiv(tokens * groups, rows) * kv_heads
    splits = min(triton.cdiv(CONFIG.TARGET_WAVES * sm_count, programs), triton.cdiv(max_keys, block_n),
                 CONFIG.MAX_SPLITS)
    num_warps = CONFIG.num_warps or (8 if block_m * triton.next_power_of_2(head_dim) >= 64 * 128 else 4)
    return block_m, rows, block_n, max(1, splits), num_warps


def attend_packed_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         token_slots: torch.Tensor, positions: torch.Tensor, scale: float, *,
                         row_width: int | None = None, block_m: int | None = None, block_n: int | None = None,
                         num_warps: int | None = None, num_splits: int | None = None,
                         num_stages: int = 2, out: torch.Tensor | None = None) -> torch.Tensor:
    """Token t attends keys 0..positions[t] (inclusive) of slot token_slots[t].

    q: [T, Hq, D] (last dim contiguous); k_cache, v_cache: [NB, BS, Hkv, D] (a pool of blocks); block_tables:
    [S, W] int64; token_slots, positions: [T] int64.
    Returns contiguous [T, Hq, D] in q's dtype (`out` when given). row_width: the tokens are a fused step's
    decode/verify rows of that many tokens each (rows_launch_shape: a program per row, keys split); else prefill
    blocks (launch_shape). `block_m`/`block_n`/`num_warps`/`num_splits`/`num_stages` override those (tests use
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
    if out is None:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    assert out.shape == (T, Hq, D) and out.is_contiguous()
    if T == 0:
        return out
    G = Hq // Hkv
    if row_width is not None:
        default_m, rows, default_n, default_splits, default_warps = rows_launch_shape(
            T, row_width, G, Hkv, D, R, num_sms(q.device))
        block_m = block_m or default_m
        rows = min(rows, block_m)
    else:
        default_m, default_n, default_warps = launch_shape(T, G, Hkv, D, q.dtype, num_sms(q.device))
        block_m = block_m or default_m
        rows = block_m
        default_splits = prefill_splits(T, G, Hkv, block_m, block_n or default_n, R, num_sms(q.device))
    block_n, num_warps = block_n or default_n, num_warps or default_warps
    num_splits = num_splits or default_splits
    direct = num_splits == 1
    if direct:  # the kernel writes `out`; the partial buffers are not touched
        o_part = lse = out
    else:
        o_part = torch.empty((T, Hq, num_splits, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((T, Hq, num_splits), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(D)
    _attend_packed_kernel[(triton.cdiv(T * G, rows), Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, token_slots, positions, out, o_part, lse,
        scale * LOG2E, T, R, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        BS=BS, G=G, HQ=Hq, D=D, BLOCK_D=block_d, BLOCK_M=block_m, ROWS=rows, BLOCK_N=block_n, DIRECT=direct,
        EVEN_D=block_d == D, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        combine_splits(o_part, lse, out, num_splits)
    return out
