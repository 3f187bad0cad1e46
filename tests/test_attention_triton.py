"""attend_triton and rope_write_kv (rope_kv_triton.py) against plain torch references.

The kernels read a paged cache (a pool of blocks and a block table per slot); the cases are built contiguous,
as the references read them, and laid out in shuffled blocks for the kernels (tests/paging.py), with block
sizes smaller than, equal to and larger than the kernels' key tiles.

Without a GPU the kernels run in Triton's interpreter, which must be switched on before triton is
first imported (@triton.jit and triton.language's own helpers read TRITON_INTERPRET then). If an
earlier test module already imported triton compiled, the CPU tests rerun this file in a fresh process.
K/V rows past each slot's live length are NaN, so a kernel that reads them fails the comparison.
rope_write_kv must match the model's torch path (rope_qk + write_kv) bit for bit.
"""
import os
import subprocess
import sys

import pytest
import torch

ON_CPU = not torch.cuda.is_available()
if ON_CPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # no GPU: the interpreter is the only way to run a kernel here

triton = pytest.importorskip("triton", reason="triton is not importable")
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from paging import paginate  # noqa: E402

INTERPRETED = isinstance(tl.standard.max, InterpretedFunction)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="triton was not imported for the interpreter")


@pytest.mark.skipif(INTERPRETED or not ON_CPU, reason="only when triton was imported compiled on a CPU machine")
def test_in_fresh_interpreter_process():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.fixture
def attend_cpu(monkeypatch):
    # The interpreter keeps bf16 as uint16 and tl.dot multiplies the bit patterns
    # (triton-lang/triton#11584, unsupported upstream). Convert dot operands to fp32 first, which is
    # what the tensor cores compute with; every other bf16 op the kernel uses is a load, store or cast.
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot_bf16)
    patch_device_calls_once_per_launch(monkeypatch, interpreter)
    from minedraft_ray.engine.attention_triton import attend_triton

    return attend_triton


def patch_device_calls_once_per_launch(monkeypatch, interpreter):
    """The interpreter maps triton.language onto its own ops (_patch_lang) at a launch, undoing that at its end, and
    again at every call of a @triton.jit function inside it (tl.max, tl.cdiv, ...: thousands per launch), where the
    mapping is already in place; re-mapping there was a third of this file's time. Inside a launch, each set of
    language modules is mapped at its first device call only; a launch still maps (and unmaps) as before."""
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state = {"launch": None}   # inside a launch: the module sets its device calls mapped so far

    def patch_lang_once(fn):
        mapped = state["launch"]
        if mapped is None:   # the launch's own mapping (undone at its end), or a call outside any launch
            state["launch"] = set() if state.pop("launching", False) else None
            return patch_lang(fn)
        modules = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        if modules not in mapped:   # a device call's mapping outlives the call, until the launch ends
            mapped.add(modules)
            return patch_lang(fn)
        return None

    def launch_then_forget(self, *args, **kwargs):
        state["launching"] = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.pop("launching", None)
            state["launch"] = None

    monkeypatch.setattr(interpreter, "_patch_lang", patch_lang_once)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch_then_forget)


def paged(kernel, case, block_size=8, **kw):
    """kernel(q, k_pool, v_pool, block_tables, slots, positions, ...) on a contiguous case laid out in blocks."""
    q, k_cache, v_cache, *rest = case
    return kernel(q, *paginate(k_cache, v_cache, block_size), *rest, **kw)


def reference_attend(q, k_cache, v_cache, slots, positions, scale):
    B, qlen, Hq, D = q.shape
    G = Hq // k_cache.shape[2]
    out = torch.empty(B, qlen, Hq, D)
    for b in range(B):
        live = int(positions[b].max()) + 1
        k = k_cache[slots[b], :live].float().repeat_interleave(G, dim=1)  # [live, Hq, D]
        v = v_cache[slots[b], :live].float().repeat_interleave(G, dim=1)
        scores = torch.einsum("ihd,nhd->ihn", q[b].float(), k) * scale  # [qlen, Hq, live]
        hidden = torch.arange(live)[None, :] > positions[b][:, None]  # [qlen, live]
        scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
        out[b] = torch.einsum("ihn,nhd->ihd", scores.softmax(-1), v)
    return out.to(q.dtype)


def make_case(first_positions, qlen, groups, head_dim, dtype, kv_heads=2, rows=40, slots=(5, 0, 3, 2, 4, 1),
              device="cpu"):
    """Rows b start at first_positions[b] (their cache length) and hold qlen consecutive query tokens."""
    torch.manual_seed(0)
    B = len(first_positions)
    q = torch.randn(B, qlen, kv_heads * groups, head_dim, dtype=dtype, device=device)
    k_cache = torch.full((max(slots) + 1, rows, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.tensor(slots[:B], device=device)  # slot ids differ from row ids
    positions = torch.tensor(first_positions, device=device)[:, None] + torch.arange(qlen, device=device)
    for b in range(B):  # only keys 0..max position are live; the rest stays NaN
        live = int(positions[b, -1]) + 1
        k_cache[slots[b], :live] = torch.randn(live, kv_heads, head_dim, dtype=dtype, device=device)
        v_cache[slots[b], :live] = torch.randn(live, kv_heads, head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, slots, positions


# dtype and GQA groups in pairs, not crossed (each is independent of the other in the kernel; suite time): the 8B's
# bf16 with 4 groups among them. fp32 (the tight tolerance: scale, online softmax, split combine) once, without
# GQA; the groups (which query rows map to which head, and at qlen 5 the 32-row block of 4 groups) in bf16, whose
# tolerance a row read for the wrong head fails as surely as fp32's
DTYPE_GROUPS = [(torch.float32, 1), (torch.bfloat16, 2), (torch.bfloat16, 4)]


@interpreter_only
@pytest.mark.parametrize("dtype, groups", DTYPE_GROUPS)
@pytest.mark.parametrize("qlen", [1, 5])
@pytest.mark.parametrize("num_splits", [1, 3])  # 1: stage 1 writes the output; 3: split + combine
@pytest.mark.parametrize("block_size", [4, 16, 64])  # below, at and above the key tile
def test_matches_reference(attend_cpu, qlen, groups, dtype, num_splits, block_size):
    rows = 40
    # live lengths 1, 2, R (a query at the last row), and two in between
    first = [0, 1 if qlen == 1 else 0, rows - qlen, 17, 30 - qlen]
    case = make_case(first, qlen, groups, head_dim=16, dtype=dtype, rows=rows)
    out = paged(attend_cpu, case, block_size, scale=0.25, num_splits=num_splits, block_n=16)
    assert out.dtype == dtype and out.shape == case[0].shape
    torch.testing.assert_close(out, reference_attend(*case, scale=0.25), **TOL[dtype])


@interpreter_only
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_default_heuristics_head_dims(attend_cpu, head_dim):
    case = make_case([0, 70, 128 - 5], qlen=5, groups=4, head_dim=head_dim, dtype=torch.bfloat16, rows=128)
    out = paged(attend_cpu, case, 16, scale=head_dim ** -0.5)
    torch.testing.assert_close(out, reference_attend(*case, scale=head_dim ** -0.5), **TOL[torch.bfloat16])


@interpreter_only
def test_prefill_sized_query(attend_cpu):
    # 40 tokens x 2 heads per kv head = 80 query rows: two row blocks, each skipping keys past its last position
    case = make_case([0, 9], qlen=40, groups=2, head_dim=16, dtype=torch.float32, rows=64)
    for num_splits in (1, 2):
        out = paged(attend_cpu, case, 8, scale=0.25, num_splits=num_splits, block_n=16)
        torch.testing.assert_close(out, reference_attend(*case, scale=0.25), **TOL[torch.float32])


@pytest.mark.parametrize("qlen", [1, 5])
def test_launch_shape_fills_sms_and_stays_in_slot(qlen):
    from minedraft_ray.engine.attention_triton import launch_shape

    # Llama-8B shape on a 132-SM GPU: small batches split keys to fill the SMs, large ones need no combine
    cpu = torch.device("cpu")
    splits = {B: launch_shape(B, qlen, 32, 8, 4106, 128, cpu)[2] for B in (1, 16, 64, 128)}
    assert splits[1] > splits[16] > 1 and splits[128] == 1
    block_m, block_n, splits = launch_shape(1, qlen, 32, 8, 40, 128, cpu)
    assert splits <= triton.cdiv(40, block_n) and block_m >= 4 * qlen


def test_launch_config_from_env(monkeypatch):
    from minedraft_ray.engine.attention_triton import LaunchConfig, config_from_env, launch_shape

    monkeypatch.setenv("MINEDRAFT_ATTN_CONFIG", '{"BLOCK_N": 128, "num_stages": 3, "TARGET_WAVES": 8}')
    config = config_from_env()
    assert config == LaunchConfig(BLOCK_N=128, num_stages=3, TARGET_WAVES=8)
    # 8B decode at batch 64: 512 stage-1 programs, 8 waves of 132 SMs -> 3 splits
    assert launch_shape(64, 1, 32, 8, 4106, 128, torch.device("cpu"), config) == (16, 128, 3)
    monkeypatch.setenv("MINEDRAFT_ATTN_CONFIG", '{"BLOCK_K": 64}')
    with pytest.raises(TypeError):
        config_from_env()


@pytest.fixture
def attend_packed_cpu(attend_cpu):  # attend_cpu patches the interpreter's bf16 dot
    from minedraft_ray.engine.attention_packed_triton import attend_packed_triton

    return attend_packed_triton


def make_packed_case(requests, groups, head_dim, dtype, kv_heads=2, rows=40, num_slots=6, device="cpu"):
    """requests: (slot, first position, tokens) each, packed back to back; keys past each slot's last
    position stay NaN, so a kernel that reads them (or another request's) fails the comparison."""
    torch.manual_seed(0)
    T = sum(n for _, _, n in requests)
    q = torch.randn(T, kv_heads * groups, head_dim, dtype=dtype, device=device)
    k_cache = torch.full((num_slots, rows, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    token_slots = torch.cat([torch.full((n,), s) for s, _, n in requests]).to(device)
    positions = torch.cat([torch.arange(p, p + n) for _, p, n in requests]).to(device)
    for slot, first, n in requests:
        k_cache[slot, :first + n] = torch.randn(first + n, kv_heads, head_dim, dtype=dtype, device=device)
        v_cache[slot, :first + n] = torch.randn(first + n, kv_heads, head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, token_slots, positions


def reference_packed(q, k_cache, v_cache, token_slots, positions, scale):
    # each token as a one-query row of its own slot
    return reference_attend(q[:, None], k_cache, v_cache, token_slots, positions[:, None], scale)[:, 0]


# a fresh prompt, a chunk continuing slot 0 at position 3, one token, a chunk ending at the last cache row,
# and three padding tokens at position 0 of slot 1 (what a graphed launch pads with)
PACKED_REQUESTS = [(5, 0, 9), (0, 3, 6), (3, 0, 1), (2, 40 - 7, 7), (1, 0, 1)]


@interpreter_only
@pytest.mark.parametrize("dtype, groups", DTYPE_GROUPS)
@pytest.mark.parametrize("block_m", [16, 64])  # 16: blocks straddle requests; 64: one block holds several
@pytest.mark.parametrize("block_size", [4, 32])
@pytest.mark.parametrize("num_splits", [1, 3])   # 3: each block's keys split, then combined (a short launch)
def test_packed_matches_reference(attend_packed_cpu, dtype, groups, block_m, block_size, num_splits):
    case = make_packed_case(PACKED_REQUESTS, groups, head_dim=16, dtype=dtype)
    out = paged(attend_packed_cpu, case, block_size, scale=0.25, block_m=block_m, block_n=16, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == case[0].shape
    torch.testing.assert_close(out, reference_packed(*case, scale=0.25), **TOL[dtype])


@interpreter_only
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_packed_chunks_starting_at_tile_edges(attend_packed_cpu, block_m, num_splits):
    """Keys up to a block's earliest position are read without the causal mask, in whole tiles: chunks starting
    one before, at and one past a tile's end (16 keys) check the masked remainder starts where it must."""
    case = make_packed_case([(0, 14, 3), (1, 15, 2), (2, 16, 4), (3, 30, 5), (4, 31, 2), (5, 17, 9)], groups=2,
                            head_dim=16, dtype=torch.float32)
    out = paged(attend_packed_cpu, case, 4, scale=0.25, block_m=block_m, block_n=16, num_splits=num_splits)
    torch.testing.assert_close(out, reference_packed(*case, scale=0.25), **TOL[torch.float32])


@interpreter_only
@pytest.mark.parametrize("num_splits", [1, 2])
def test_packed_head_dim_not_a_power_of_two(attend_packed_cpu, num_splits):
    """A head of 24: the tiles run 32 wide with the last 8 masked, in the unmasked key tiles too."""
    case = make_packed_case([(0, 20, 5), (1, 0, 9), (2, 33, 4)], groups=2, head_dim=24, dtype=torch.float32)
    out = paged(attend_packed_cpu, case, 4, scale=24 ** -0.5, block_m=16, block_n=16, num_splits=num_splits)
    torch.testing.assert_close(out, reference_packed(*case, scale=24 ** -0.5), **TOL[torch.float32])


@interpreter_only
def test_packed_padding_tokens_share_a_row(attend_packed_cpu):
    # several tokens at the same (slot, position), as graph padding is: each sees that one key
    case = make_packed_case([(4, 0, 5), (1, 0, 1)], groups=2, head_dim=16, dtype=torch.float32)
    q, k_cache, v_cache, token_slots, positions = case
    token_slots, positions = torch.cat([token_slots, torch.ones(3, dtype=torch.int64)]), torch.cat(
        [positions, torch.zeros(3, dtype=torch.int64)])
    q = torch.cat([q, torch.randn(3, *q.shape[1:])])
    out = paged(attend_packed_cpu, (q, k_cache, v_cache, token_slots, positions), 8, scale=0.25, block_m=16,
                block_n=16)
    torch.testing.assert_close(out, reference_packed(q, k_cache, v_cache, token_slots, positions, 0.25),
                               **TOL[torch.float32])


@interpreter_only
@pytest.mark.parametrize("poison", ["nan_v", "inf_k"])
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="known (docs/design.md, packed prefill): a non-finite "
                   "K or V of one request reaches the other requests' rows of its block (0 x NaN; inf + SHUT)")
def test_packed_non_finite_kv_of_one_request_stays_in_it(attend_packed_cpu, poison):
    """Slot 0's cache holds a NaN value (or an infinite key) among the keys before its chunk, in a tile read without
    the mask: its own rows may go non-finite, the other request's rows in the same block must not."""
    case = make_packed_case([(0, 20, 5), (1, 20, 5)], groups=2, head_dim=16, dtype=torch.float32)
    q, k_cache, v_cache, token_slots, positions = case
    (v_cache if poison == "nan_v" else k_cache)[0, 2] = float("nan") if poison == "nan_v" else float("inf")
    out = paged(attend_packed_cpu, case, 4, scale=0.25, block_m=64, block_n=16)
    other = token_slots == 1
    torch.testing.assert_close(out[other], reference_packed(*case, scale=0.25)[other], **TOL[torch.float32])


@interpreter_only
def test_packed_torch_reference_matches(attend_packed_cpu):
    from minedraft_ray.engine.attention import attend_packed_reference

    case = make_packed_case(PACKED_REQUESTS, groups=2, head_dim=16, dtype=torch.float32)
    torch.testing.assert_close(paged(attend_packed_reference, case, 4, scale=0.25), reference_packed(*case, scale=0.25),
                               **TOL[torch.float32])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("batch", [1, 64])
def test_cuda_matches_reference(batch):
    from minedraft_ray.engine.attention_triton import attend_triton

    first = [(37 * b) % 1000 for b in range(batch)]
    first[0] = 1024 - 5
    case = make_case(first, qlen=5, groups=4, head_dim=128, dtype=torch.bfloat16, kv_heads=8, rows=1024,
                     slots=torch.randperm(batch).tolist(), device="cuda")
    out = paged(attend_triton, case, 16, scale=128 ** -0.5)
    ref = reference_attend(*(t.cpu() for t in case), scale=128 ** -0.5)
    torch.testing.assert_close(out.cpu(), ref, **TOL[torch.bfloat16])


@cuda
def test_cuda_graph_replay_follows_positions():
    from minedraft_ray.engine.attention_triton import attend_triton

    q, k_cache, v_cache, slots, positions = make_case([100, 7, 500], qlen=1, groups=4, head_dim=64,
                                                      dtype=torch.bfloat16, kv_heads=8, rows=1024, device="cuda")
    k_cache.nan_to_num_(0.0), v_cache.nan_to_num_(0.0)  # the replay below looks further than the capture
    k_pool, v_pool, tables = paginate(k_cache, v_cache, 16)
    attend_triton(q, k_pool, v_pool, tables, slots, positions, 0.125)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_triton(q, k_pool, v_pool, tables, slots, positions, 0.125)
    positions.copy_(torch.tensor([[900], [3], [1000]], device="cuda"))
    # the same slots in other blocks: the graph reads the table it was captured with, in place
    new_k, new_v, new_tables = paginate(k_cache, v_cache, 16, seed=1)
    k_pool.copy_(new_k), v_pool.copy_(new_v), tables.copy_(new_tables)
    graph.replay()
    ref = reference_attend(q.cpu(), k_cache.cpu(), v_cache.cpu(), slots.cpu(), positions.cpu(), 0.125)
    torch.testing.assert_close(out.cpu(), ref, **TOL[torch.bfloat16])


# ---- RoPE + K/V write ------------------------------------------------------------------------------------
@pytest.fixture
def rope_write_kv_cpu(monkeypatch):
    # The interpreter casts fp32 -> bf16 by truncation; the GPU (and torch) round to nearest even
    from triton.runtime import interpreter

    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def cast_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(src.data).to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(bits.view(interpreter._get_np_dtype(dst_type)), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_rne)
    from minedraft_ray.engine.rope_kv_triton import rope_write_kv

    return rope_write_kv


def make_rope_case(qlen, head_dim, dtype, kv_heads=2, groups=4, device="cpu"):
    """q/k/v as strided views of one fused qkv output (as in Attention.forward), slots out of order."""
    torch.manual_seed(0)
    slots = torch.tensor([5, 0, 3], device=device)
    N, Hq = len(slots) * qlen, kv_heads * groups
    qkv = torch.randn(N, (Hq + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, v = qkv.split([Hq * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(N, -1, head_dim) for t in (q, k, v))  # views: row stride = the fused width
    rope = torch.randn(64, head_dim, dtype=torch.float32, device=device)  # any table: positions index it
    # 6 slots of 40 positions in blocks of 8, shuffled over the pool (block 0 is the null block)
    k_cache = torch.randn(6 * 5 + 1, 8, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(6 * 5, generator=torch.Generator().manual_seed(0)) + 1).view(6, 5).to(device)
    positions = torch.tensor([7, 0, 40 - qlen], device=device)[:, None] + torch.arange(qlen, device=device)
    return q, k, v, rope, k_cache, v_cache, tables, slots, positions


def reference_rope_write_kv(q, k, v, rope, k_cache, v_cache, tables, slots, positions):
    """The model's torch path on CPU copies: (rotated q, k_cache, v_cache)."""
    from minedraft_ray.engine import model

    q, k, v, rope, k_cache, v_cache, tables, slots, positions = (t.cpu().clone() for t in (
        q, k, v, rope, k_cache, v_cache, tables, slots, positions))
    return model.rope_write_kv(q, k, v, rope, k_cache, v_cache, tables, slots, positions), k_cache, v_cache


def check_rope_write_kv(kernel, case):
    q, k, v, rope, k_cache, v_cache, tables, slots, positions = case
    before_k, before_v = k_cache.clone(), v_cache.clone()
    want_q, want_k, want_v = reference_rope_write_kv(*case)
    got_q = kernel(*case)
    assert got_q.shape == q.shape and got_q.dtype == q.dtype
    assert torch.equal(got_q.cpu(), want_q)
    assert torch.equal(k_cache.cpu(), want_k) and torch.equal(v_cache.cpu(), want_v)
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    block_size = k_cache.shape[1]
    written[tables[slots[:, None], positions // block_size], positions % block_size] = True
    assert written.sum() == positions.numel()  # the reference wrote these rows and no others
    assert torch.equal(k_cache[~written], before_k[~written]) and torch.equal(v_cache[~written], before_v[~written])
    assert not torch.equal(k_cache[written], before_k[written])


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qlen", [1, 5])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_write_kv_matches_torch_path(rope_write_kv_cpu, qlen, head_dim, dtype):
    check_rope_write_kv(rope_write_kv_cpu, make_rope_case(qlen, head_dim, dtype))


@interpreter_only
def test_rope_write_kv_contiguous_inputs_and_no_gqa(rope_write_kv_cpu):
    # Qwen3 normalises q and k first (contiguous copies); Hq == Hkv exercises a 1-row query tile
    q, k, v, *rest = make_rope_case(qlen=2, head_dim=64, dtype=torch.bfloat16, groups=1)
    check_rope_write_kv(rope_write_kv_cpu, (q.contiguous(), k.contiguous(), v.contiguous(), *rest))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qlen", [1, 5])
def test_cuda_rope_write_kv_matches_torch_path(qlen, dtype):
    from minedraft_ray.engine.rope_kv_triton import rope_write_kv

    check_rope_write_kv(rope_write_kv, make_rope_case(qlen, 128, dtype, kv_heads=8, device="cuda"))


@cuda
def test_cuda_model_step_with_and_without_rope_kernel(monkeypatch):
    # Qwen3 shape (q/k norms before RoPE, GQA): the fused kernel against the compiled torch path, in the model
    from minedraft_ray.engine import model as model_mod

    cfg = model_mod.ModelConfig(arch="qwen3", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                                num_heads=8, num_kv_heads=2, head_dim=16, qk_norm=True, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_mod.Transformer(cfg).eval()
    ids, slots = torch.randint(0, 64, (3, 5), device="cuda"), torch.tensor([2, 0, 3], device="cuda")

    def run():
        cache = model.make_cache(4, 32)
        cache.lengths[slots] = torch.tensor([0, 9, 20], device="cuda")
        with torch.inference_mode():
            return model(ids, cache, slots), cache

    fused, fused_cache = run()
    triton_op = model_mod.triton_op
    monkeypatch.setattr(model_mod, "triton_op", lambda *name: None if name[0] == "rope_kv_triton" else triton_op(*name))
    torch_path, torch_cache = run()
    torch.testing.assert_close(fused, torch_path, atol=1e-5, rtol=1e-5)
    for a, b in zip(fused_cache.k + fused_cache.v, torch_cache.k + torch_cache.v):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@cuda
def test_cuda_packed_matches_reference_at_8b_shape():
    from minedraft_ray.engine.attention_packed_triton import attend_packed_triton

    # 8B heads, long-tailed lengths: one prompt of 3000, a chunk continuing at 1500, short ones
    requests = [(0, 0, 3000), (3, 1500, 700), (1, 0, 5), (7, 0, 300), (2, 0, 1), (5, 200, 64)]
    case = make_packed_case(requests, groups=4, head_dim=128, dtype=torch.bfloat16, kv_heads=8, rows=4106,
                            num_slots=8, device="cuda")
    out = paged(attend_packed_triton, case, 16, scale=128 ** -0.5)
    from minedraft_ray.engine.attention import attend_packed_reference
    ref = paged(attend_packed_reference, [t.float() if t.is_floating_point() else t for t in case], 16,
                scale=128 ** -0.5)
    torch.testing.assert_close(out.float(), ref, **TOL[torch.bfloat16])


@cuda
def test_cuda_packed_graph_replay_follows_new_requests():
    from minedraft_ray.engine.attention_packed_triton import attend_packed_triton

    q, k_cache, v_cache, token_slots, positions = make_packed_case(
        [(0, 0, 40), (1, 10, 24)], groups=4, head_dim=64, dtype=torch.bfloat16, kv_heads=8, rows=256, device="cuda")
    k_cache.normal_(), v_cache.normal_()  # every slot live: the replay reads slots the capture did not
    k_pool, v_pool, tables = paginate(k_cache, v_cache, 16)
    attend_packed_triton(q, k_pool, v_pool, tables, token_slots, positions, 0.125)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_packed_triton(q, k_pool, v_pool, tables, token_slots, positions, 0.125)
    # same token count, another mix: three requests on other slots, one continuing at 200
    token_slots.copy_(torch.tensor([2] * 20 + [3] * 4 + [4] * 40, device="cuda"))
    positions.copy_(torch.cat([torch.arange(20), torch.arange(200, 204), torch.arange(40)]).cuda())
    graph.replay()
    from minedraft_ray.engine.attention import attend_packed_reference
    ref = attend_packed_reference(q.float(), k_pool.float(), v_pool.float(), tables, token_slots, positions, 0.125)
    torch.testing.assert_close(out.float(), ref, **TOL[torch.bfloat16])



@cuda
@pytest.mark.parametrize("width", [1, 4])
def test_cuda_rows_mode_graph_replay_matches_reference(width):
    """Rows mode on a GPU at 8B heads: 32 rows of `width` tokens over contexts up to 1000 keys (the keys split, then
    combined), captured once and replayed over other slots and lengths, gives the reference's attention."""
    from minedraft_ray.engine.attention import attend_packed_reference
    from minedraft_ray.engine.attention_packed_triton import attend_packed_triton, rows_launch_shape

    gen = torch.Generator().manual_seed(width)
    firsts = torch.randint(0, 1000 - width, (32,), generator=gen).tolist()
    q, k_cache, v_cache, token_slots, positions = make_packed_case(
        [(b, f, width) for b, f in enumerate(firsts)], groups=4, head_dim=128, dtype=torch.bfloat16, kv_heads=8,
        rows=1024, num_slots=40, device="cuda")
    k_cache.normal_(), v_cache.normal_()  # every slot live: the replay reads slots the capture did not
    k_pool, v_pool, tables = paginate(k_cache, v_cache, 16)
    assert rows_launch_shape(32 * width, width, 4, 8, 128, tables.shape[1] * 16, 132)[3] > 1   # keys split
    attend_packed_triton(q, k_pool, v_pool, tables, token_slots, positions, 0.125, row_width=width)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_packed_triton(q, k_pool, v_pool, tables, token_slots, positions, 0.125, row_width=width)
    token_slots.copy_(token_slots.flip(0) + 8)
    positions.copy_(torch.randint(0, 1024, positions.shape, generator=gen).cuda())
    graph.replay()
    ref = attend_packed_reference(q.float(), k_pool.float(), v_pool.float(), tables, token_slots, positions, 0.125)
    torch.testing.assert_close(out.float(), ref, **TOL[torch.bfloat16])


def test_packed_tiles_follow_the_launch():
    """16-bit heads up to 128 wide: 64 x 64 tiles on 4 warps whatever the launch; wide heads and fp32 the small
    tiles."""
    from minedraft_ray.engine.attention_packed_triton import launch_shape

    bf16 = torch.bfloat16
    for tokens, sms in [(100, 132), (512, 132), (528, 132), (8192, 132), (528, 264)]:
        assert launch_shape(tokens, 4, 8, 128, bf16, sms) == (64, 64, 4)
    for tokens in (100, 8192):
        assert launch_shape(tokens, 4, 8, 128, torch.float32, 132) == (64, 32, 4)
        assert launch_shape(tokens, 4, 8, 256, bf16, 132) == (64, 32, 4)


@interpreter_only
@pytest.mark.parametrize("rows_per_program", [1, 4, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_split_merge_takes_several_rows_per_program(rows_per_program, num_splits):
    """combine_splits against the log-sum-exp merge in torch, with rows that do not fill the last program and
    splits that saw no key (lse -inf, their partial output never written: NaN here, so reading one fails)."""
    from minedraft_ray.engine.attention_triton import combine_splits

    g = torch.Generator().manual_seed(rows_per_program * 10 + num_splits)
    rows, D = 37, 24   # 37 rows: the last program's rows past the end store nothing
    o_part = torch.randn(rows, num_splits, D, generator=g)
    lse = torch.randn(rows, num_splits, generator=g) * 3
    if num_splits > 1:
        lse[::2, -1] = float("-inf")   # a split past these rows' keys
        o_part[::2, -1] = float("nan")
    guarded = torch.full((rows + 16, D), float("nan"))   # rows past the end must stay untouched
    combine_splits(o_part, lse, guarded[:rows], num_splits, rows_per_program=rows_per_program)
    w = torch.softmax(lse * torch.log(torch.tensor(2.0)), dim=1)   # lse is in log2 units
    ref = (w[:, :, None] * torch.nan_to_num(o_part)).sum(1)
    torch.testing.assert_close(guarded[:rows], ref, atol=1e-5, rtol=1e-5)
    assert guarded[rows:].isnan().all()
    with pytest.raises(ValueError, match="power of two"):
        combine_splits(o_part, lse, guarded[:rows], num_splits, rows_per_program=3)


def test_split_merge_programs_keep_the_sms_busy():
    """Several rows per program only where that still leaves COMBINE_WAVES programs per SM: a decode step's 1,024
    rows keep one each, a packed launch's 9,216 (288 tokens x 32 heads) go 16 to a program."""
    import minedraft_ray.engine.attention_triton as attention_triton

    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((grid[0], kw["BLOCK_R"], kw["num_warps"]))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_triton, "_combine_kernel", Recorder())
        for rows, splits in [(1024, 2), (9216, 2), (9216, 64), (16, 2)]:
            out = torch.empty(rows, 128)
            attention_triton.combine_splits(None, None, out, splits)
    assert launched == [(1024, 1, 2), (576, 16, 4), (9216, 1, 4), (16, 1, 2)]


def test_short_prefill_launches_split_their_keys():
    """A launch whose prefill blocks fill the SMs keeps one split; a short one (a small chunk late in a long
    prompt) splits its keys until the programs fill them, never into more pieces than a slot has key tiles."""
    from minedraft_ray.engine.attention_packed_triton import prefill_splits

    # 8B heads on 132 SMs, 64-row blocks: programs = ceil(tokens * 4 / 64) * 8
    assert prefill_splits(2112, 4, 8, 64, 64, 4096, 132) == 1        # 1056 programs
    assert prefill_splits(96, 4, 8, 64, 64, 4096, 132) == 3          # 48 programs: a chunk beside 32 rows
    assert prefill_splits(16, 4, 8, 64, 64, 4096, 132) == 17         # 8 programs
    assert prefill_splits(16, 4, 8, 64, 64, 256, 132) == 4           # no more splits than key tiles
    assert prefill_splits(1, 4, 8, 64, 64, 1 << 20, 132) == 17
    # more waves (MINEDRAFT_ATTN_CONFIG's PREFILL_WAVES): a chunk beside 32 rows splits further
    assert prefill_splits(224, 4, 8, 64, 64, 4096, 132) == 2         # 112 programs
    assert prefill_splits(224, 4, 8, 64, 64, 4096, 132, waves=4) == 5
    assert prefill_splits(2112, 4, 8, 64, 64, 4096, 132, waves=4) == 1   # 1056 programs: four waves already


@interpreter_only
@pytest.mark.parametrize("tiles", [{}, {"block_m": 128, "block_n": 64, "num_warps": 8}])
def test_packed_default_tiles_8b_heads(attend_packed_cpu, tiles):
    # the tiles a GPU launch uses (bf16, head dim 128): this short launch's own (64 rows) and a long launch's
    # (128 rows), blocks straddling four requests
    case = make_packed_case([(0, 0, 50), (2, 30, 9), (1, 0, 1), (3, 0, 40)], groups=4, head_dim=128,
                            dtype=torch.bfloat16, kv_heads=2, rows=80)
    out = paged(attend_packed_cpu, case, 16, scale=128 ** -0.5, **tiles)
    torch.testing.assert_close(out, reference_packed(*case, scale=128 ** -0.5), **TOL[torch.bfloat16])


@interpreter_only
@pytest.mark.parametrize("dtype, groups", [(torch.float32, 1), (torch.bfloat16, 4)])
@pytest.mark.parametrize("width", [1, 3, 4])     # a program per token, or per row of several (3: rows straddle slots)
@pytest.mark.parametrize("num_splits", [1, 3])   # 1: the kernel writes the output; 3: keys split, then combined
def test_packed_rows_mode_matches_reference(attend_packed_cpu, dtype, groups, width, num_splits):
    """Rows mode (a fused step's decode/verify rows): a program per `width` tokens, whichever slots they belong to,
    and each slot's keys split over programs whose softmaxes are merged."""
    case = make_packed_case(PACKED_REQUESTS, groups, head_dim=16, dtype=dtype)
    out = paged(attend_packed_cpu, case, 4, scale=0.25, row_width=width, num_splits=num_splits, block_n=16)
    assert out.dtype == dtype and out.shape == case[0].shape
    torch.testing.assert_close(out, reference_packed(*case, scale=0.25), **TOL[dtype])


def test_rows_launch_shape_is_a_decode_steps():
    """The 8B shape on 132 SMs: a fused step's rows take the programs and splits a decode step of the same rows
    takes (attention_triton.launch_shape), not a few programs walking many contexts each."""
    from minedraft_ray.engine.attention_packed_triton import rows_launch_shape
    from minedraft_ray.engine.attention_triton import launch_shape

    cpu = torch.device("cpu")
    for batch, width in ((32, 1), (16, 1), (64, 1), (32, 4), (8, 4)):
        block_m, rows, block_n, splits, _ = rows_launch_shape(batch * width, width, 4, 8, 128, 4106, 132)
        assert rows == 4 * width and (block_m, block_n, splits) == launch_shape(batch, width, 32, 8, 4106, 128, cpu)
    assert rows_launch_shape(32, 1, 4, 8, 128, 4106, 132)[3] == 2   # 256 programs: two splits fill 2 x 132 SMs
    assert rows_launch_shape(16, 1, 4, 8, 128, 40, 132)[3] == 1     # never more splits than key tiles
    # a row of 9 tokens x 8 query heads per KV head (k = 8, a 70B-class GQA) holds 72 query rows: a program takes
    # at most 64, as the decode kernel's BLOCK_M
    block_m, rows, *_ = rows_launch_shape(8 * 9, 9, 8, 8, 128, 4106, 132)
    assert rows == 64 and block_m == launch_shape(8, 9, 64, 8, 4106, 128, cpu)[0] == 64


@interpreter_only
def test_packed_rows_mode_rows_wider_than_a_program(attend_packed_cpu):
    """Rows of 9 tokens x 8 query heads (72 query rows) split over programs of 64: still the reference."""
    case = make_packed_case(PACKED_REQUESTS, 8, head_dim=16, dtype=torch.float32)
    out = paged(attend_packed_cpu, case, 4, scale=0.25, row_width=9, num_splits=3, block_n=16)
    torch.testing.assert_close(out, reference_packed(*case, scale=0.25), **TOL[torch.float32])


@interpreter_only
@pytest.mark.parametrize("rows", [None, (4, 4), (12, 4), (13, 4), (40, 4), (16, 1), (6, 3)])
def test_fused_rows_then_chunks_match_reference(attend_packed_cpu, rows):
    """A fused step's launch: verify rows of 4 tokens on four slots at their lengths, then two prompt chunks; the
    rows' tokens a row per program with the keys split and the rest in the kernel's own blocks
    (attend_rows_then_packed), every token as the reference attends it, wherever the split falls (13: past the
    rows into a chunk; width 1 or 3: programs of other widths than the rows')."""
    from minedraft_ray.engine.attention import DecodeRows, attend_rows_then_packed

    requests = [(0, 9, 4), (3, 20, 4), (2, 1, 4), (4, 30, 4), (5, 0, 11), (1, 6, 5)]
    case = make_packed_case(requests, groups=2, head_dim=16, dtype=torch.float32)

    def kernel(*args, row_width=None, **kwargs):   # small key tiles and 3 splits: the tiny keys still split
        tiles = {"block_n": 16, "num_splits": 3} if row_width else {}
        return attend_packed_cpu(*args, row_width=row_width, **kwargs, **tiles)

    def split(*args, **kwargs):
        return attend_rows_then_packed(kernel, *args, rows=DecodeRows(*rows) if rows else None, **kwargs)
    out = paged(split, case, 4, scale=0.25)
    torch.testing.assert_close(out, reference_packed(*case, scale=0.25), **TOL[torch.float32])
