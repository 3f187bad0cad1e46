"""Paged KV (issue 25, engine layer, fp32 CPU): block bookkeeping (hypothesis), rollback across block
boundaries, preemption and resume, prefix sharing with divergence inside a block, and greedy output
identical to the static layout (one max_len per slot) under all of these, in ar and sd."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minedraft_ray.engine.engine import Engine
from minedraft_ray.engine.kv_blocks import NULL_BLOCK, BlocksExhaustedError
from minedraft_ray.engine.kv_cache import KVCache
from minedraft_ray.engine.loader import load_model
from minedraft_ray.engine.sampling import SamplingParams


def small_cache(num_blocks=9, block_size=4, num_slots=3, max_len=20, prefix_caching=True):
    return KVCache(num_layers=1, num_slots=num_slots, max_len=max_len, num_kv_heads=1, head_dim=2,
                   dtype=torch.float32, device="cpu", block_size=block_size, num_blocks=num_blocks,
                   prefix_caching=prefix_caching)


def test_reserve_is_all_or_nothing_and_release_returns_every_block():
    cache = small_cache()
    cache.reserve(0, 5)  # 2 blocks
    assert len(cache.held[0]) == 2 and cache.block_tables[0, 2:].eq(NULL_BLOCK).all()
    cache.reserve(0, 3)  # already covered: nothing taken
    assert len(cache.held[0]) == 2 and cache.num_available == 6
    with pytest.raises(BlocksExhaustedError):
        cache.reserve_many([1, 2], [16, 16])  # 8 blocks wanted, 6 available
    assert cache.held[1] == cache.held[2] == [] and cache.num_available == 6
    cache.reserve_many([1, 2], [12, 12])
    assert cache.num_available == 0
    assert len({b for held in cache.held for b in held}) == 8 and NULL_BLOCK not in cache.held[1]
    assert cache.block_tables[1, :3].tolist() == cache.held[1]
    cache.check_blocks()
    for slot in range(3):
        cache.release(slot)
    assert cache.num_available == 8 and cache.block_tables.eq(NULL_BLOCK).all()
    cache.check_blocks()


def test_prefix_blocks_shared_and_evicted_least_recently_used():
    cache = small_cache(num_blocks=7)
    a = list(range(100, 110))  # 10 tokens: 2 full blocks
    cache.reserve(0, 10)
    cache.register(0, a, 10)
    assert len(cache.cached) == 2
    # b shares 6 tokens with a: the first block only (it diverges inside the second)
    b = a[:6] + [7, 7, 7, 7]
    blocks = cache.match(b, 10)
    assert blocks == cache.held[0][:1]
    cache.adopt(1, blocks)
    cache.reserve(1, 10)
    assert cache.held[1][0] == cache.held[0][0] and cache.held[1][1] != cache.held[0][1]
    assert cache.pool.refcount[cache.held[0][0]] == 2
    cache.check_blocks()
    cache.release(0)  # block 0 still held by slot 1; a's second block idles in the cache
    assert len(cache.idle) == 1
    cache.release(1)
    assert len(cache.idle) == 2 and cache.num_available == 6
    cache.check_blocks()
    # the pool needs 5 of its 6 blocks: one idle block is evicted, a's tail (released first), not its head
    head = cache.match(a, 10)[0]
    cache.reserve(2, 20)
    assert list(cache.idle) == [head] and cache.match(a, 10) == [head]
    cache.reserve(2, 24)  # and the head when every block is wanted
    assert not cache.cached and not cache.idle and cache.num_available == 0
    cache.check_blocks()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "release", "admit", "register"]), st.integers(0, 2),
                          st.integers(1, 24), st.integers(0, 3)), max_size=40))
def test_block_bookkeeping_never_leaks_or_goes_negative(ops):
    """Any sequence of reservations, releases, prefix admissions and registrations keeps every block exactly
    one of held / idle-cached / free, with reference counts equal to its holders."""
    cache = small_cache(num_blocks=12)
    prompts = [[1] * 8 + [2] * 8 + [3] * 8, [1] * 8 + [2] * 4 + [5] * 12, [9] * 24, [1] * 4 + [4] * 20]
    tokens = [None] * 3
    for op, slot, n, which in ops:
        try:
            if op == "reserve":
                cache.reserve(slot, n)
            elif op == "release":
                cache.release(slot)
                tokens[slot] = None
            elif op == "admit" and not cache.held[slot]:
                tokens[slot] = prompts[which]
                cache.adopt(slot, cache.match(tokens[slot], n))
            elif op == "register" and tokens[slot] is not None:
                cache.register(slot, tokens[slot], n)
        except BlocksExhaustedError:
            pass
        cache.check_blocks()
        assert min(cache.pool.refcount) >= 0


@pytest.mark.parametrize("kept", [0, 2, 4])
@torch.no_grad()
def test_rollback_across_block_boundaries(tiny_llama, kept):
    """Prompt of 6 in blocks of 4, a verify writes 5 (positions 6..10, into a third block), all but `kept` are
    rolled back by the length alone, then 3 more append over the stale rows: the logits of a fresh run."""
    model = load_model(tiny_llama, "cpu")
    gen = torch.Generator().manual_seed(0)
    prompt, verified, appended = (torch.randint(4, 512, (1, n), generator=gen) for n in (6, 5, 3))
    cache = model.make_cache(num_slots=2, max_len=32, block_size=4, num_blocks=12)
    slot = torch.tensor([1])
    cache.reserve(0, 8)  # another slot's blocks in between, so slot 1's blocks are not adjacent
    cache.reserve(1, 4)
    cache.reserve(0, 12)
    cache.reserve(1, 16)
    model(prompt, cache, slot)
    cache.lengths[slot] += 6
    model(verified, cache, slot)
    cache.lengths[slot] += 5
    cache.lengths[slot] -= 5 - kept
    got = model.compute_logits(model(appended, cache, slot))

    fresh = model.make_cache(num_slots=1, max_len=32)
    seq = torch.cat([prompt, verified[:, :kept], appended], 1)
    want = model.compute_logits(model(seq, fresh, torch.tensor([0])))[:, 6 + kept:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over", "import os\nimport sys\n\n", "a",
           "hello world, this is a longer prompt that has quite a few more tokens than the others do",
           "x = [1, 2, 3]\nfor i in x:"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def static_reference(tiny_llama):
    """Greedy ar with every slot holding its whole max_len: the layout before paging."""
    engine = Engine(tiny_llama, mode="ar", max_batch=6, max_len=128, device="cpu", paged=False)
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("mode, prefix_caching", [("ar", False), ("sd", False), ("sd", True)])
def test_greedy_paged_with_preemption_equals_static(tiny_llama, tiny_llama_draft, static_reference, mode,
                                                    prefix_caching):
    """A pool far smaller than the batch needs: requests are preempted mid-generation and recomputed (from
    their own cached blocks where those are still idle), and every token is the static layout's."""
    engine = Engine(tiny_llama, tiny_llama_draft if mode == "sd" else None, mode=mode, k=3, max_batch=6,
                    max_len=128, device="cpu", block_size=4, num_blocks=40, prefix_caching=prefix_caching)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == static_reference
    assert engine.num_preemptions > 0
    if prefix_caching:  # a resumed request finds blocks of its own earlier run
        assert engine.cache_stats()["target"]["hit_tokens"] > 0
    for run in engine.runners:
        run.cache.check_blocks()
        assert run.cache.num_available == run.cache.num_blocks - 1  # every block back


def test_default_max_len_is_the_models_context(tiny_llama):
    engine = Engine(tiny_llama, mode="ar", max_batch=2, device="cpu")
    assert engine.max_len == engine.verifier.runner.cfg.max_position_embeddings
    small = Engine(tiny_llama, mode="ar", max_batch=2, device="cpu", block_size=4, num_blocks=20)
    assert small.max_len == 19 * 4 - 10  # what one request can hold in 19 blocks, less the verify headroom
    with pytest.raises(ValueError, match="pool holds"):
        Engine(tiny_llama, mode="ar", max_batch=2, max_len=100, device="cpu", block_size=4, num_blocks=20)


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_prefix_cache_shares_blocks_and_keeps_greedy_output(tiny_llama, tiny_llama_draft, mode):
    """Prompts with a common 21-token start (blocks of 4: five shared, divergence inside the sixth), one
    repeated prompt, and a repeated prompt of whole blocks (whose last block must not be shared: the target
    recomputes its last token, the drafter rewrites its last two): later requests hit the cache in both models,
    and the tokens are those of a run without it."""
    tok = Engine(tiny_llama, mode="ar", max_batch=1, max_len=64, device="cpu", paged=False).tokenizer
    system = tok.encode("You are a helpful assistant. Answer briefly.")[:21]
    assert len(system) == 21
    prompts = [system[:20]] + [system + tok.encode(s) for s in ["What is 2+2?", "Name a colour.", "What is 2+2?",
                                                                "Hi"]] + [system[:20]]
    draft = tiny_llama_draft if mode == "sd" else None

    def run(**kw):
        engine = Engine(tiny_llama, draft, mode=mode, k=3, max_batch=2, max_len=128, device="cpu", block_size=4,
                        **kw)
        return engine, [o.token_ids for o in engine.generate(prompts, GREEDY)]

    _, want = run(prefix_caching=False)
    engine, got = run(prefix_caching=True)
    assert got == want
    stats = engine.cache_stats()
    # the first two run together and miss; the last two find at least the system prompt's 5 blocks
    assert stats["target"]["hit_tokens"] >= 2 * 20
    if mode == "sd":
        assert stats["draft"]["hit_tokens"] >= 2 * 20
    for run_ in engine.runners:
        run_.cache.check_blocks()
