"""Packed (varlen) and chunked prefill (engine layer, fp32 CPU): the same logits and KV cache as the padded
path and as one prompt at a time, at every chunk size, and generation unchanged through Engine."""
import pytest
import torch

from minedraft_ray.engine.attention import attend_packed_reference
from minedraft_ray.engine.engine import Engine
from minedraft_ray.engine.loader import load_model
from minedraft_ray.engine.runner import PACKED_GRAPH_TOKENS, ModelRunner, plan_pieces, token_bucket
from minedraft_ray.engine.sampling import SamplingParams

from paging import paginate

FAMILIES = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_mistral"]
LENGTHS = [7, 1, 19, 4, 12]  # mixed, one single-token prompt
# fp32 reduction-order noise: GEMMs of other token counts sum in another order (logits here reach ~10)
TOL = dict(atol=3e-5, rtol=1e-5)
MAX_LEN = 48


def _prompts(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]


def _runner(model, **kw):
    return ModelRunner(model, "cpu", num_slots=len(LENGTHS) + 1, max_len=MAX_LEN, max_batch=len(LENGTHS), **kw)


def _kv(runner, slot, length):
    return torch.stack([torch.stack(runner.cache.slot_kv(layer, slot, length))
                        for layer in range(len(runner.cache.k))])


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return load_model(request.getfixturevalue(request.param), "cpu")


def test_packed_equals_padded_and_one_at_a_time(model):
    prompts = _prompts(LENGTHS, model.cfg.vocab_size)
    slots = [4, 0, 2, 5, 1]  # slot ids differ from row ids
    runner = _runner(model)
    packed = runner.prefill(slots, prompts).clone()
    packed_kv = [_kv(runner, s, len(p)) for s, p in zip(slots, prompts)]
    assert runner.cache.lengths[slots].tolist() == LENGTHS
    padded = runner.prefill(slots, prompts, packed=False).clone()
    torch.testing.assert_close(packed, padded, **TOL)
    single = torch.cat([runner.prefill([s], [p]) for s, p in zip(slots, prompts)])
    torch.testing.assert_close(packed, single, **TOL)
    for s, p, kv in zip(slots, prompts, packed_kv):
        torch.testing.assert_close(kv, _kv(runner, s, len(p)), **TOL)


def test_chunked_prefill_at_every_chunk_size(model):
    """A launch budget of c tokens cuts the packed run every c tokens, mid-prompt included; the continuing
    launch extends the slot at its new length."""
    lengths = [7, 11]
    prompts = _prompts(lengths, model.cfg.vocab_size, seed=1)
    slots = [3, 1]
    one_shot = _runner(model)
    want = one_shot.prefill(slots, prompts).clone()
    want_kv = [_kv(one_shot, s, n) for s, n in zip(slots, lengths)]
    for chunk in range(1, sum(lengths) + 1):
        runner = _runner(model, max_prefill_tokens=chunk)
        got = runner.prefill(slots, prompts)
        torch.testing.assert_close(got, want, **TOL, msg=f"chunk {chunk}")
        assert runner.cache.lengths[slots].tolist() == lengths
        for s, n, kv in zip(slots, lengths, want_kv):
            torch.testing.assert_close(_kv(runner, s, n), kv, **TOL, msg=f"chunk {chunk}")


@pytest.mark.parametrize("cuts", [(1,), (5,), (3, 4), (1, 1, 1), (12,)])
def test_extend_continues_a_slot_in_arbitrary_chunks(tiny_llama, cuts):
    """What a scheduler does with a long prompt: extend the same slot in chunks of its choosing, other
    requests' chunks riding in the same call, the last chunk's logits equal to one-shot prefill."""
    model = load_model(tiny_llama, "cpu")
    long, short = _prompts([13, 5], model.cfg.vocab_size, seed=2)
    one_shot = _runner(model)
    want = one_shot.prefill([0, 1], [long, short]).clone()
    runner = _runner(model)
    runner.set_lengths([0, 1], [0, 0])
    start = 0
    for i, cut in enumerate(cuts):
        runner.extend([0] + ([1] if i == 0 else []), [long[start:start + cut]] + ([short] if i == 0 else []))
        start += cut
    got = runner.extend([0], [long[start:]])
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert runner.cache.lengths[:2].tolist() == [13, 5]
    torch.testing.assert_close(_kv(runner, 0, 13), _kv(one_shot, 0, 13), **TOL)
    torch.testing.assert_close(_kv(runner, 1, 5), _kv(one_shot, 1, 5), **TOL)


@pytest.mark.parametrize("packed", [True, False])
def test_prefill_chunks_from_their_starts_equal_one_shot(tiny_llama, packed):
    """The runtime's chunked prefill (`prefill_chunks`): first chunks restart slots that held earlier, longer
    requests, also when they ride with later chunks of other prompts, which continue their slots; packed and
    padded paths alike. The chunk that ends a prompt gives one-shot prefill's logits and KV."""
    model = load_model(tiny_llama, "cpu")
    long, short = _prompts([13, 6], model.cfg.vocab_size, seed=3)
    one_shot = _runner(model)
    want = one_shot.prefill([0, 1], [long, short]).clone()
    runner = _runner(model, packed_prefill=packed)
    runner.prefill([0, 1], _prompts([20, 20], model.cfg.vocab_size, seed=4))   # junk from earlier requests
    runner.prefill_chunks([0], [0], [long[:5]])
    runner.prefill_chunks([0, 1], [5, 0], [long[5:9], short[:4]])   # slot 1 restarts beside slot 0's next chunk
    got = runner.prefill_chunks([1, 0], [4, 9], [short[4:], long[9:]])
    torch.testing.assert_close(got, want[[1, 0]], **TOL)
    assert runner.cache.lengths[:2].tolist() == [13, 6]
    torch.testing.assert_close(_kv(runner, 0, 13), _kv(one_shot, 0, 13), **TOL)
    torch.testing.assert_close(_kv(runner, 1, 6), _kv(one_shot, 1, 6), **TOL)


@pytest.mark.parametrize("budget", [1, 3, 8, 100])
def test_plan_pieces_cover_lists_in_order_under_budget(budget):
    lengths = [5, 1, 9, 3]
    launches = plan_pieces(lengths, budget)
    assert all(sum(p.stop - p.start for p in launch) <= budget for launch in launches)
    assert all(sum(p.stop - p.start for p in launch) == budget for launch in launches[:-1])  # no launch wasted
    pieces = [p for launch in launches for p in launch]
    for index, length in enumerate(lengths):
        mine = [p for p in pieces if p.index == index]
        assert mine[0].start == 0 and mine[-1].stop == length
        assert all(a.stop == b.start for a, b in zip(mine, mine[1:]))


def test_graph_buckets_pad_a_launch_within_the_gpu_default_budget_little():
    """The packed graphs' token buckets at the GPU's default per-step budget: the budget is a bucket (a full
    launch, which the scheduler fills to it, pads nothing), and a launch of any other size up to it (a prompt's
    last chunk, with or without a verify's rows) pads by fewer than 64 tokens from 257 to 384 tokens, where a
    launch's time grows with its tokens, and by fewer than 128 above (448 is no bucket: it ran slower than 512);
    below 256, by at most its own size (the steps double)."""
    from minedraft_ray.runtime.manager import default_prefill_chunk

    budget = default_prefill_chunk(on_gpu=True)
    assert token_bucket(budget, PACKED_GRAPH_TOKENS) == budget
    for tokens in range(1, budget + 1):
        padded = token_bucket(tokens, PACKED_GRAPH_TOKENS)
        assert padded >= tokens and padded <= max(2 * tokens, PACKED_GRAPH_TOKENS[0])
        if tokens > 256:
            assert padded - tokens < (64 if tokens <= 384 else 128), f"a launch of {tokens} tokens runs as {padded}"
    assert token_bucket(PACKED_GRAPH_TOKENS[-1] + 1, PACKED_GRAPH_TOKENS) is None   # eager past the largest


def test_bad_extend_calls(tiny_llama):
    runner = _runner(load_model(tiny_llama, "cpu"))
    with pytest.raises(ValueError):
        runner.extend([0, 1], [[1, 2], []])
    with pytest.raises(ValueError):
        runner.extend([0, 0], [[1, 2], [3]])
    with pytest.raises(ValueError):
        _runner(runner.model, max_prefill_tokens=0)


def test_packed_reference_keeps_requests_apart():
    """Two requests on different slots whose caches differ: each token's output depends on its own slot only."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(3, 8, 2, 4), torch.randn(3, 8, 2, 4)
    q = torch.randn(5, 4, 4)
    token_slots, positions = torch.tensor([2, 2, 2, 0, 0]), torch.tensor([0, 1, 2, 3, 4])
    out = attend_packed_reference(q, *paginate(k_cache, v_cache, block_size=2), token_slots, positions, 0.5)
    for t in range(5):
        k = k_cache[token_slots[t], :positions[t] + 1].repeat_interleave(2, dim=1)  # [L, Hq, D]
        v = v_cache[token_slots[t], :positions[t] + 1].repeat_interleave(2, dim=1)
        w = (torch.einsum("hd,nhd->hn", q[t], k) * 0.5).softmax(-1)
        torch.testing.assert_close(out[t], torch.einsum("hn,nhd->hd", w, v), **TOL)


PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over", "a", "hello world, this is a longer prompt "
           "that has quite a few more tokens than the others do", "x = [1, 2, 3]\nfor i in x:"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_engine_greedy_same_tokens_packed_chunked_and_padded(tiny_llama, tiny_llama_draft, mode):
    draft = tiny_llama_draft if mode == "sd" else None

    def run(**kw):
        engine = Engine(tiny_llama, draft, mode=mode, k=3, max_batch=3, device="cpu", **kw)
        return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]

    padded = run(packed_prefill=False)
    assert run() == padded
    assert run(max_prefill_tokens=7) == padded  # prompts and drafter catch-ups cut mid-list
