"""Paged KV in the served runtime (issue 25): the scheduler hands out both models' KV blocks, admits by free
blocks, preempts (recompute) when they run short and caches prefixes.

- The scheduler alone, with hypothesis (tests/test_scheduler.py's driver and invariants, over pools small enough to
  run short): blocks never leaked, lost or held by two requests (but as a cached prefix), the workers' tables
  always the scheduler's, no block of a task in flight taken away, a preempted request resumed exactly once,
  every request finished exactly once, and psd's balance kept across preemptions.
- The runtime on the session's Ray cluster (fp32 CPU, tiny pair): greedy sd, sd_split and psd with a pool that
  forces preemption give ar's tokens; prefix caching on gives the tokens of caching off, with hits in both
  models; max_len comes from the model and the pool; KV usage counts blocks.
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minedraft_ray.engine.kv_cache import HEADROOM
from minedraft_ray.runtime import LLM
from minedraft_ray.runtime.scheduler import KVRole
from runtime_common import LENGTHS, PROMPTS, check_balance, greedy, settled
from test_scheduler import BUDGETS, EVENTS, Driver, check_all, check_drained_blocks, make_scheduler, run_events


# ---- the scheduler over blocks ------------------------------------------------------------------------------
# test_scheduler's events, with more and longer requests, so that the pool runs short
LONG = st.tuples(st.just("arrive"), st.integers(8, 20), st.integers(10, 16), st.just(False))
PAGING_EVENTS = st.one_of(EVENTS, LONG, LONG, st.tuples(st.just("complete")), st.tuples(st.just("complete")))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["psd", "psd", "sd_split", "sd", "ar"]), max_batch=st.integers(1, 4),
       budget=BUDGETS, num_blocks=st.integers(14, 20), prefix_caching=st.booleans(),
       events=st.lists(PAGING_EVENTS, min_size=30, max_size=150), data=st.data())
def test_scheduler_invariants_hold_when_blocks_run_short(mode, max_batch, budget, num_blocks, prefix_caching,
                                                         events, data):
    """A pool of 14-30 blocks of 4 tokens: a request may hold up to 13 of them (40 tokens and the verify's
    headroom), so a few requests fill it and preemption is frequent."""
    run_events(mode, max_batch, 2, events, data, budget, num_blocks=num_blocks, prefix_caching=prefix_caching)


def burst(mode: str, num_blocks: int, prefix_caching: bool, accept_all: bool = True):
    """Ten requests of shared prompt starts and 16 tokens each into one engine, run to the end."""
    sched = make_scheduler(mode, 3, 2, None, num_blocks=num_blocks, prefix_caching=prefix_caching)
    driver = Driver(sched)
    for n in range(10):
        driver.arrive(3 + 2 * n % 17, 16, False)
    for _ in range(3000):
        if not (driver.inflight or sched.waiting or sched.num_running()):
            break
        driver.complete(lambda num_drafts: [7] * ((num_drafts if accept_all else 0) + 1))
        check_all(driver)
    check_drained_blocks(driver)
    assert len(driver.finished) == 10
    return driver


def test_a_burst_into_a_small_pool_preempts_and_resumes_every_request_once():
    """Not vacuous: with 16 blocks every mode preempts, and with prefix caching every pool finds blocks again
    (the prompts share their starts, and a resumed request finds its own)."""
    for mode in ("psd", "sd_split", "sd", "ar"):
        for prefix_caching in (False, True):
            driver = burst(mode, 16, prefix_caching)
            sched = driver.sched
            assert sched.counters["preemptions"] > 0, mode
            assert all(driver.admissions[id(s)] == s.request.num_preemptions + 1 for s in driver.states)
            assert set(sched.kv) == ({KVRole.TARGET} if mode == "ar" else {KVRole.TARGET, KVRole.DRAFT})
            for pool in sched.kv.values():
                assert (pool.hit_tokens > 0) == prefix_caching, (mode, pool.hit_tokens)
            # psd split while it could (max_batch 3, ten requests): the balance was checked after every step
            if mode == "psd":
                assert sched.counters["balance_violations"] == 0


# ---- the runtime ------------------------------------------------------------------------------------------
# blocks of 4 tokens, 18 per model: the longest request (45 prompt tokens + 9) fits alone (max_len becomes
# 17 * 4 - 10 = 58), three or six of them at once do not
SMALL_POOL = {"block_size": 4, "num_kv_blocks": 18}


@pytest.mark.parametrize("mode", ["sd", "sd_split", "psd"])
def test_greedy_with_preemption_equals_ar(ray_cluster, tiny_llama, tiny_llama_draft, reference, mode):
    """A pool far smaller than the batches need: requests are preempted mid-generation, resumed by recompute (the
    drafter catching up), and every token is ar's; psd splits and keeps its balance through it."""
    llm = LLM(tiny_llama, tiny_llama_draft, mode=mode, k=3, max_batch=3, torch_threads=1, **SMALL_POOL,
              **({"psd_high_load": "psd"} if mode == "psd" else {}))
    try:
        outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS])
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        info = settled(llm)
        assert info["preemptions"] > 0, info
        assert info["max_len"] == 17 * 4 - HEADROOM
        # every block back: none held once nothing runs
        assert info["kv_cache"]["target"]["blocks_in_use"] == info["kv_cache"]["draft"]["blocks_in_use"] == 0
        if mode == "psd":
            history = llm.history()
            assert any(h.regime == "psd" for h in history)
            check_balance(history, max_batch=3)
            assert info["balance_violations"] == 0
    finally:
        llm.shutdown()
