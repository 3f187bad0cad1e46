"""Flash-decoding attention over the paged KV cache (Triton; no host sync, so CUDA-graph safe).

Stage 1 runs one program per (row, kv head, block of query rows, key split). A program stacks the
qlen x G query rows that share one KV head, so each K/V tile is read once per KV head (GQA), and runs
an fp32 online softmax over its share of the row's live keys. The live length is read on the device
(max position of the block + 1) and divided evenly among the splits, so no program touches the
preallocated rows past it and splits with nothing to do exit at once. Stage 2 merges the splits by
log-sum-exp. When one split is enough to fill the GPU, stage 1 writes the output directly.

Keys are read through the slot's block table: each key of a tile looks up its block (`block_tables[slot,
n // BS]`, a small cached load) and its row in it, so tiles need not align with blocks and any block size
(a power of two) works.

The grid depends only on shapes (B, qlen, heads, R), never on tensor values. Tile and launch choices
live in one LaunchConfig (CONFIG), which MINEDRAFT_ATTN_CONFIG='{"BLOCK_N": 128, ...}' overrides at import;
bench/attention_sweep.py times alternatives.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
DEFAULT_SMS = 132  # an H100/H200's SM count; used when the tensors are not on a CUDA device (the interpreter)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tile and launch choices of attend_triton; the defaults are the original hand-picked ones."""
    BLOCK_N: int = 64  # keys per tile; halved for head_dim > 128 so the K/V tiles stay in shared memory
    num_warps: int = 0  # 0: 8 when a program's query tile is 64 x 128 or larger, else 4
    num_stages: int = 2  # software-pipeline depth of the K/V tile loads
    TARGET_WAVES: int = 2  # stage-1 programs per SM we aim for when choosing the number of splits
    MAX_SPLITS: int = 64
    PREFILL_WAVES: int = 1  # programs per SM a short prefill launch's key splits aim for (packed kernel)
    COMBINE_WAVES: int = 4  # split-merge programs per SM at least, before a program takes several rows
    COMBINE_ELEMENTS: int = 4096  # a split-merge program's rows x splits x head dim at most (several rows)


def config_from_env() -> LaunchConfig:
    """LaunchConfig with the fields given as JSON in MINEDRAFT_ATTN_CONFIG (unknown names raise)."""
    return LaunchConfig(**json.loads(os.environ.get("MINEDRAFT_ATTN_CONFIG") or "{}"))


CONFIG = config_from_env()


@triton.jit
def _attend_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, slots_ptr, pos_ptr, out_ptr, o_part_ptr, lse_ptr,
    qk_scale, R, QLEN, NUM_SPLITS,
    stride_qb, stride_qi, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_pb, stride_table,
    BS: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    num_m_blocks = tl.cdiv(QLEN * G, BLOCK_M)
    h = tl.program_id(1) // num_m_blocks  # kv head
    m_block = tl.program_id(1) % num_m_blocks
    split = tl.program_id(2)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] flattened (query token, group member)
    row_ok = rows < QLEN * G
    qi = rows // G
    head = h * G + rows % G  # q head j uses kv head j // G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    pos = tl.load(pos_ptr + b * stride_pb + qi, mask=row_ok, other=-1).to(tl.int32)  # [BLOCK_M]
    live = tl.minimum(tl.max(pos, axis=0) + 1, R)  # keys this block of queries can see
    chunk = tl.cdiv(tl.cdiv(live, NUM_SPLITS), BLOCK_N) * BLOCK_N  # keys per split
    start = split * chunk
    end = tl.minimum(start + chunk, live)

    q = tl.load(q_ptr + b * stride_qb + qi[:, None] * stride_qi + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    slot = tl.load(slots_ptr + b).to(tl.int64)
    table = table_ptr + slot * stride_table
    k_base = k_ptr + h * stride_kh
    v_base = v_ptr + h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):  # empty when this split starts past the live length
        n = n0 + offs_n
        kv_mask = (n < end)[:, None] & d_ok[None, :]
        block = tl.load(table + n // BS, mask=n < end, other=0).to(tl.int64)  # [BLOCK_N] physical blocks
        k_row = block * stride_kb + (n % BS) * stride_kn
        v_row = block * stride_vb + (n % BS) * stride_vn
        k = tl.load(k_base + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (n[None, :] <= pos[:, None]) & (n < end)[None, :]
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

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    out_row = (b * QLEN + qi) * HQ + head  # [BLOCK_M] row of the contiguous [B, qlen, Hq] output
    if DIRECT:
        tl.store(out_ptr + out_row[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        part_row = out_row * NUM_SPLITS + split  # [B, qlen, Hq, NUM_SPLITS]
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # log2 units
        tl.store(lse_ptr + part_row, lse, mask=row_ok)
        # empty splits leave o unwritten; the combine never reads it (their lse is -inf)
        tl.store(o_part_ptr + part_row[:, None] * D + d[None, :], o,
                 mask=(row_ok & seen)[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(o_part_ptr, lse_ptr, out_ptr, NUM_SPLITS, N_ROWS,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    # BLOCK_R consecutive (token, q head) rows per program: one row's splits are too little work for a program
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row_ok = row < N_ROWS
    lse = tl.load(lse_ptr + row[:, None] * NUM_SPLITS + s[None, :],
                  mask=row_ok[:, None] & (s < NUM_SPLITS)[None, :], other=float("-inf"))  # [BLOCK_R, BLOCK_S]
    seen = lse > float("-inf")
    # split 0 always sees key 0, so a real row's max is finite; a row past the end gets 0 and stores nothing
    m = tl.where(row_ok, tl.max(lse, axis=1), 0.0)
    w = tl.math.exp2(lse - m[:, None])
    o = tl.load(o_part_ptr + (row[:, None, None] * NUM_SPLITS + s[None, :, None]) * D + d[None, None, :],
                mask=seen[:, :, None] & (d < D)[None, None, :], other=0.0)  # [BLOCK_R, BLOCK_S, BLOCK_D]
    out = tl.sum(w[:, :, None] * o, axis=1) / tl.where(row_ok, tl.sum(w, axis=1), 1.0)[:, None]
    tl.store(out_ptr + row[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d < D)[None, :])


def combine_splits(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, num_splits: int,
                   rows_per_program: int | None = None) -> None:
    """out[r] = the splits' partial outputs o_part[r, s] weighed by their log2-sum-exp lse[r, s], for every
    (token, q head) row r. A program takes several rows (up to CONFIG.COMBINE_ELEMENTS elements) while the
    programs still number CONFIG.COMBINE_WAVES x the SMs: a packed launch's thousands of one-row programs spent more
    on themselves than on their few hundred elements each, while a decode step's 1,024 rows (batch 32, 32 heads)
    merged slower in fewer, larger programs (docs/design.md). rows_per_program: a power of two, or the rule's."""
    rows, D = out.numel() // out.shape[-1], out.shape[-1]
    block_d, block_s = triton.next_power_of_2(D), triton.next_power_of_2(num_splits)
    if rows_per_program is None:
        by_size = max(1, CONFIG.COMBINE_ELEMENTS // (block_s * block_d))
        by_programs = max(1, rows // (CONFIG.COMBINE_WAVES * num_sms(out.device)))
        rows_per_program = min(by_size, 1 << (by_programs.bit_length() - 1))   # a power of two
    if rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program is a power of two, not {rows_per_program}")
    _combine_kernel[(triton.cdiv(rows, rows_per_program),)](
        o_part, lse, out, num_splits, rows, D=D, BLOCK_D=block_d, BLOCK_S=block_s, BLOCK_R=rows_per_program,
        num_warps=4 if rows_per_program * block_s * block_d > 2048 else 2,
    )


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_shape(batch: int, qlen: int, q_heads: int, kv_heads: int, rows: int, head_dim: int,
                 device: torch.device, config: LaunchConfig | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, splits) for these shapes; depends on nothing but shapes, device and config."""
    config = config or CONFIG
    block_m = min(64, max(16, triton.next_power_of_2(qlen * q_heads // kv_heads)))  # tl.dot needs >= 16 rows
    block_n = config.BLOCK_N if head_dim <= 128 else config.BLOCK_N // 2
    programs = batch * kv_heads * triton.cdiv(qlen * q_heads // kv_heads, block_m)
    # enough programs to fill the SMs when the batch is small; never more splits than key blocks in a slot
    splits = min(triton.cdiv(config.TARGET_WAVES * num_sms(device), programs), triton.cdiv(rows, block_n),
                 config.MAX_SPLITS)
    return block_m, block_n, max(1, splits)


def attend_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  slots: torch.Tensor, positions: torch.Tensor, scale: float, *, num_splits: int | None = None,
                  block_n: int | None = None, config: LaunchConfig | None = None) -> torch.Tensor:
    """Query (b, i) attends keys 0..positions[b, i] (inclusive) of slot slots[b].

    q: [B, qlen, Hq, D] (last dim contiguous); k_cache, v_cache: [NB, BS, Hkv, D] (a pool of blocks);
    block_tables: [S, W] int64 (blocks of each slot); slots: [B] int64; positions: [B, qlen] int64.
    Returns [B, qlen, Hq, D] in q's dtype. `config` replaces CONFIG;
    `num_splits`/`block_n` override it (tests use them to cover both paths on tiny shapes).
    """
    B, qlen, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    R = block_tables.shape[1] * BS  # positions a slot can hold
    assert Hq % Hkv == 0, f"{Hq} query heads do not group over {Hkv} kv heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert slots.shape == (B,) and positions.shape == (B, qlen) and positions.stride(-1) == 1
    assert block_tables.stride(-1) == 1 and BS & (BS - 1) == 0, "block size must be a power of two"
    G = Hq // Hkv
    out = torch.empty((B, qlen, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0 or qlen == 0:
        return out

    config = config or CONFIG
    block_m, default_block_n, default_splits = launch_shape(B, qlen, Hq, Hkv, R, D, q.device, config)
    block_n = block_n or default_block_n
    num_splits = num_splits or default_splits
    direct = num_splits == 1
    if direct:  # stage 1 writes `out`; the partial buffers are not touched
        o_part = lse = out
    else:
        o_part = torch.empty((B, qlen, Hq, num_splits, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, qlen, Hq, num_splits), dtype=torch.float32, device=q.device)

    block_d = triton.next_power_of_2(D)
    num_warps = config.num_warps or (8 if block_m * block_d >= 64 * 128 else 4)
    _attend_split_kernel[(B, Hkv * triton.cdiv(qlen * G, block_m), num_splits)](
        q, k_cache, v_cache, block_tables, slots, positions, out, o_part, lse,
        scale * LOG2E, R, qlen, num_splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        positions.stride(0), block_tables.stride(0),
        BS=BS, G=G, HQ=Hq, D=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        DIRECT=direct, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=config.num_stages,
    )
    if not direct:
        combine_splits(o_part, lse, out, num_splits)
    return out
