"""Paged KV in the served runtime (issue 25): the scheduler hands out both models' KV blocks, admits by free
blocks, preempts (recompute) when they run short and caches prefixes.

- The scheduler alone, with hypothesis (tests/test_scheduler.py's driver and invariants, over pools small enough to
  run short): blocks never leaked, lost or held by two requests (but as a cached prefix), the workers' tables
  always the scheduler's, no block of a task in flight taken away, a preempted request resumed exactly once,
  every request finished exactly once, and psd's balance kept across preemptions.
- The runtime on the session's Ray cluster (fp32 CPU, tiny pair): greedy sd, sd_split and psd with a pool that
  forces preemption give ar's tokens; prefix caching on gives the tokens of caching off, with hits in both
  models; max_len comes from the model and the pool; KV usage counts blocks; vLLM's prefix-cache and preemption
  series (serve/vllm_metrics.py, fed from the engine's info and the requests' stats) count what the run did.
"""
import asyncio
import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from minedraft_ray.engine.engine import Engine
from minedraft_ray.engine.kv_blocks import HEADROOM
from minedraft_ray.engine.request import Request
from minedraft_ray.runtime import LLM
from minedraft_ray.runtime.scheduler import KVRole, RequestState
from minedraft_ray.serve.vllm_metrics import APIMetrics
from runtime_common import LENGTHS, PROMPTS, check_balance, greedy, settled
from test_scheduler import BUDGETS, EVENTS, Driver, check_all, check_drained_blocks, drawn, make_scheduler, run_events


# ---- the scheduler over blocks ------------------------------------------------------------------------------
# test_scheduler's events, with more and longer requests, so that the pool runs short
LONG = st.tuples(st.just("arrive"), st.integers(8, 20), st.integers(10, 16), st.just(False))
PAGING_EVENTS = st.one_of(EVENTS, LONG, LONG, st.tuples(st.just("complete")), st.tuples(st.just("complete")))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["psd", "psd", "sd_split", "sd", "ar"]), max_batch=st.integers(1, 4),
       budget=BUDGETS, num_blocks=st.integers(14, 20), prefix_caching=st.booleans(), fuse=st.booleans(),
       schedule_after_prefill=st.booleans(), events=st.lists(PAGING_EVENTS, min_size=30, max_size=150),
       data=st.data())
def test_scheduler_invariants_hold_when_blocks_run_short(mode, max_batch, budget, num_blocks, prefix_caching, fuse,
                                                         schedule_after_prefill, events, data):
    """A pool of 14-20 blocks of 4 tokens: a request may hold up to 13 of them (40 tokens and the verify's
    headroom), so a few requests fill it and preemption is frequent; chunks fused into verifies or not."""
    run_events(mode, max_batch, 2, events, drawn(data), budget, schedule_after_prefill, num_blocks=num_blocks,
               prefix_caching=prefix_caching, fuse=fuse)


def burst(mode: str, num_blocks: int, prefix_caching: bool, budget: int | None = None):
    """Ten requests of shared prompt starts and 16 tokens each into one engine, run to the end (scheduled as the
    manager schedules)."""
    sched = make_scheduler(mode, 3, 2, budget, num_blocks=num_blocks, prefix_caching=prefix_caching)
    driver = Driver(sched, schedule_after_prefill=False)
    for n in range(10):
        driver.arrive(3 + 2 * n % 17, 16, False)
    for _ in range(3000):
        if not (driver.inflight or sched.waiting or sched.num_running()):
            break
        driver.complete(lambda num_drafts: [7] * (num_drafts + 1))
        check_all(driver)
    check_drained_blocks(driver)
    assert len(driver.finished) == 10
    return driver


def test_a_burst_into_a_small_pool_preempts_and_resumes_every_request_once():
    """Not vacuous: with 16 blocks every mode preempts, also requests between their prompt chunks (prefilled 1
    or 3 tokens a step), and with prefix caching every pool finds blocks again (the prompts share their
    starts, and a resumed request finds its own)."""
    preempted, between_chunks = Counter(), 0
    for mode, prefix_caching, budget in itertools.product(("psd", "sd_split", "sd", "ar"), (False, True),
                                                          (None, 1, 3)):
        driver = burst(mode, 16, prefix_caching, budget)
        sched = driver.sched
        preempted[mode] += sched.counters["preemptions"]
        between_chunks += driver.preempted_between_chunks
        assert all(driver.admissions[id(s)] == s.request.stats.preemptions + 1 for s in driver.states)
        assert set(sched.kv) == ({KVRole.TARGET} if mode == "ar" else {KVRole.TARGET, KVRole.DRAFT})
        for pool in sched.kv.values():
            assert (pool.hit_tokens > 0) == prefix_caching, (mode, pool.hit_tokens)
        # psd split while it could (max_batch 3, ten requests): the balance was checked after every step
        if mode == "psd":
            assert sched.counters["balance_violations"] == 0
    assert all(preempted[mode] > 0 for mode in ("psd", "sd_split", "sd", "ar")), preempted
    assert between_chunks > 0


@pytest.mark.parametrize("mode", ["psd", "sd"])
def test_preempted_requests_take_no_queue_room_from_new_arrivals(mode):
    """max_queued bounds new arrivals only: an admitted request not finished keeps its place in max_running,
    running or preempted and waiting to resume, so the arrivals taken are max_queued plus the places of the
    requests that finished, however many were preempted; the preempted resume before any arrival, and every
    request finishes once."""
    max_queued = 2
    sched = make_scheduler(mode, 2, 2, num_blocks=14)
    driver = Driver(sched, schedule_after_prefill=False)
    admitted = [driver.arrive(12, 16, False) or driver.states[-1] for _ in range(sched.config.max_running)]
    for _ in range(500):   # until they all ran and their growth preempted some, who wait to resume
        if sched.waiting and all(s.request.stats.preemptions for s in sched.waiting):
            break
        driver.complete(lambda num_drafts: [7] * (num_drafts + 1))
    resuming = list(sched.waiting)
    assert resuming and all(s.admitted_at >= 0 for s in admitted), "no preempted request waits"
    arrivals = []
    while not sched.queue_full(max_queued) and len(arrivals) <= max_queued + sched.config.max_running:
        sched.arrive(RequestState(Request(list(range(2, 10)), greedy(4))))
        arrivals.append(sched.waiting[-1])
    live = sum(s.id not in driver.finished for s in admitted)
    assert len(arrivals) == max_queued + sched.config.max_running - live, (len(arrivals), len(resuming), live)
    driver.states += arrivals
    driver.drain(lambda num_drafts: [7] * (num_drafts + 1))
    assert set(driver.finished) == {s.id for s in driver.states}
    assert max(s.admitted_at for s in resuming) < min(s.admitted_at for s in arrivals)


# ---- the runtime ------------------------------------------------------------------------------------------
def scrape(metrics: APIMetrics) -> dict:
    """The registry as Prometheus parses /metrics: {sample name: value}."""
    return {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}


# blocks of 4 tokens, 18 per model: the longest request (45 prompt tokens + 9) fits alone (max_len becomes
# 17 * 4 - 10 = 58), three or six of them at once do not
SMALL_POOL = {"block_size": 4, "num_kv_blocks": 18}


@pytest.fixture(scope="module")
def psd_small_pool(ray_cluster, tiny_llama, tiny_llama_draft):
    """The module's psd engine (one start for its tests): the small pool, prefix caching on, the split forced
    whenever more than one batch's worth runs."""
    llm = LLM(tiny_llama, tiny_llama_draft, mode="psd", k=3, max_batch=3, torch_threads=1, psd_high_load="psd",
              prefix_caching=True, **SMALL_POOL)
    yield llm
    llm.shutdown()


def check_preempted_run(llm, reference) -> dict:
    """PROMPTS through a pool far smaller than the batches need: requests are preempted mid-generation, resumed
    by recompute (the drafter catching up), and every token is ar's. vLLM's series count the preemptions the
    requests saw, and (caching on) each request's prompt once as prefix-cache queries, resumed or not."""
    before = llm.info()
    metrics = APIMetrics("tiny", 3)
    metrics.set_engine_state(before)
    outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS])
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    info = settled(llm)
    assert info["preemptions"] > before["preemptions"], info
    for o in outs:
        metrics.request(len(o.prompt_token_ids)).on_finished(o.finish_reason, o.stats)
    metrics.set_engine_state(info)
    scraped = scrape(metrics)
    preempted = sum(o.stats["preemptions"] for o in outs)
    assert scraped["vllm:num_preemptions_total"] - before["preemptions"] == preempted == \
        info["preemptions"] - before["preemptions"]
    assert scraped["vllm:request_num_preemptions_sum"] == preempted
    assert scraped["vllm:request_num_preemptions_count"] == len(outs)
    queries = sum(len(o.prompt_token_ids) for o in outs) if info["kv_cache"]["prefix_caching"] else 0
    assert scraped["vllm:prefix_cache_queries_total"] - before["prefix_cache_queries"] == queries
    assert info["max_len"] == 17 * 4 - HEADROOM
    # every block back: none held once nothing runs
    assert info["kv_cache"]["target"]["blocks_in_use"] == info["kv_cache"]["draft"]["blocks_in_use"] == 0
    return info


@pytest.mark.parametrize("mode", ["sd", "sd_split"])
def test_greedy_with_preemption_equals_ar(ray_cluster, tiny_llama, tiny_llama_draft, reference, mode):
    llm = LLM(tiny_llama, tiny_llama_draft, mode=mode, k=3, max_batch=3, torch_threads=1, **SMALL_POOL)
    try:
        check_preempted_run(llm, reference)
    finally:
        llm.shutdown()


def test_psd_with_preemption_and_prefix_caching_equals_ar(psd_small_pool, reference):
    """psd splits and keeps its balance through preemptions; resumed requests find their own blocks cached."""
    info = check_preempted_run(psd_small_pool, reference)
    history = psd_small_pool.history()
    assert any(h.regime == "psd" for h in history)
    check_balance(history, max_batch=3)
    assert info["balance_violations"] == 0
    assert info["kv_cache"]["target"]["hit_tokens"] > 0 and info["kv_cache"]["draft"]["hit_tokens"] > 0


@pytest.fixture(scope="module")
def shared_prefix_prompts(tiny_llama):
    """A 22-token system prompt and suffixes (blocks of 4: five shared blocks, the prompts diverge inside the
    sixth), a repeated prompt, and a prompt of whole blocks that is a prefix of the others."""
    from minedraft_ray.engine.loader import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    system = tok.encode("You are a helpful assistant. Answer briefly and well.")[:22]
    assert len(system) == 22
    suffixes = ["What is 2+2?", "Name a colour.", "What is 2+2?", "Hi", "Why?"]
    return [system + tok.encode(s) for s in suffixes] + [system[:20]]


@pytest.mark.parametrize("mode", ["sd", "psd"])   # the drafter beside the target, and on its own actor
def test_prefix_cache_keeps_greedy_output_and_hits_in_both_models(ray_cluster, tiny_llama, tiny_llama_draft,
                                                                  shared_prefix_prompts, mode, request):
    """Caching on: requests admitted after the first map the system prompt's blocks in the target's and the
    drafter's pools instead of recomputing them, and every token is the uncached ar engine's. sd on the default
    pool, whose max_len is the model's context (the CPU's pool holds far more); psd on the small pool."""
    params = greedy(12)
    want = [o.token_ids for o in Engine(tiny_llama, mode="ar", max_batch=2, device="cpu").generate(
        shared_prefix_prompts, params)]
    llm = request.getfixturevalue("psd_small_pool") if mode == "psd" else \
        LLM(tiny_llama, tiny_llama_draft, mode=mode, k=3, max_batch=2, torch_threads=1, block_size=4,
            prefix_caching=True)
    try:
        metrics = APIMetrics("tiny", 3)   # vLLM's prefix-cache series, as /metrics serves them
        metrics.set_engine_state(before_info := settled(llm))
        before = before_info["kv_cache"]
        first = llm.generate(shared_prefix_prompts[:1], params)   # alone: the others find its blocks
        rest = llm.generate(shared_prefix_prompts[1:], params)
        assert [o.token_ids for o in first + rest] == want
        info = settled(llm)
        kv = info["kv_cache"]
        for model in ("target", "draft"):   # at least the system prompt's five blocks, for each later request
            assert kv[model]["hit_tokens"] - before[model]["hit_tokens"] >= 5 * 20, kv
            assert 0 < kv[model]["hit_rate"] < 1 and kv[model]["blocks_in_use"] == 0, kv
        metrics.set_engine_state(info)
        scraped = scrape(metrics)
        queries = scraped["vllm:prefix_cache_queries_total"] - before_info["prefix_cache_queries"]
        hits = scraped["vllm:prefix_cache_hits_total"] - before_info["prefix_cache_hits"]
        # every prompt once, at its first admission; the first of the later ones at least finds the system
        # prompt's blocks (its first admission may be the only one before preemptions evict them in the small pool)
        assert queries == sum(map(len, shared_prefix_prompts)) and 5 * 4 <= hits < queries, (queries, hits)
        if info["preemptions"] == before_info["preemptions"]:   # no request resumed: the pool counted the same
            assert hits == kv["target"]["hit_tokens"] - before["target"]["hit_tokens"]
        if mode == "sd":
            assert info["max_len"] == 2048   # the tiny models' max_position_embeddings
        else:
            check_kv_usage_counts_blocks(llm, shared_prefix_prompts[0])
    finally:
        if mode != "psd":
            llm.shutdown()


def check_kv_usage_counts_blocks(llm, prompt):
    """vllm:kv_cache_usage_perc, as the ingress sets it from the engine's info at a scrape, is the share of the
    target's blocks that requests hold, not of its slots."""
    async def mid_stream():
        async for out in llm.stream(prompt, greedy(20), "kv-usage"):
            if out.new_token_ids and not out.finished:
                return llm.info()

    info = asyncio.run(mid_stream())
    llm.abort("kv-usage")
    target = info["kv_cache"]["target"]
    assert target["blocks_in_use"] > 0 and info["slots_in_use"] == 1, info
    metrics = APIMetrics("tiny", 3)
    metrics.set_engine_state(info)
    scraped = scrape(metrics)
    assert scraped["vllm:kv_cache_usage_perc"] == target["blocks_in_use"] / target["blocks"]
    assert scraped["vllm:kv_cache_usage_perc"] != info["slots_in_use"] / info["num_slots"]


def test_a_max_len_the_pool_cannot_hold_is_refused(ray_cluster, tiny_llama):
    """18 blocks of 4 hold one request of 58 tokens: max_len 100 is an error at start, and the engine's placement
    group (and with it every actor in it) is removed."""
    import ray

    before = set(ray.util.placement_group_table())
    with pytest.raises(Exception, match="KV pool holds 58"):
        LLM(tiny_llama, None, mode="ar", max_batch=2, torch_threads=1, max_len=100, **SMALL_POOL)
    created = {pg: state for pg, state in ray.util.placement_group_table().items() if pg not in before}
    assert created and all(state["state"] == "REMOVED" for state in created.values()), created
