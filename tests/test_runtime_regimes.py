"""The Ray runtime's psd regimes (split or sequential by load, measured both ways), seeded sampling equal in every
mode and load (ar's on test_runtime.py's ar engine), and stream coalescing (fake GPUs, the session's cluster)."""
import asyncio
import time

import pytest

from minedraft_ray.engine.engine import Engine
from minedraft_ray.runtime import LLM
from engines import TINY_SD
from runtime_common import LENGTHS, PROMPTS, check_balance, check_seeded_sampling_equals_ar, greedy


@pytest.mark.parametrize("load", ["low", "high"])
def test_psd_measures_both_regimes_and_stays_lossless(ray_cluster, tiny_llama, tiny_llama_draft, load):
    """Low load (one batch holds every request): psd measures its own and a sequential batch's per-request
    cadence, psd first. High load (a queue filling both batches): the verifier's time per row in one sequential
    batch, then split (demand rising from one batch: no drain). Both run the cheaper, and the output still
    equals ar's token for token."""
    prompts, n, max_batch = (PROMPTS[:3], 48, 4) if load == "low" else (PROMPTS * 2, 24, 2)
    reference = Engine(tiny_llama, mode="ar", max_batch=8, device="cpu").generate(prompts, greedy(n))
    llm = LLM(tiny_llama, tiny_llama_draft, mode="psd", k=2, max_batch=max_batch, torch_threads=1,
              psd_low_load="auto")
    try:
        outs = llm.generate(prompts, [greedy(n)] * len(prompts))
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        history = llm.history()
        regimes = [h.regime for h in history]
        first, then = ("psd", "seq") if load == "low" else ("seq", "psd")
        assert regimes.index(first) < regimes.index(then), regimes
        check_balance(history, max_batch=max_batch)   # sequential steps: at most max_batch ran, the rest queued
        chosen = llm.info()[f"{load}_load_regime"]
        metric = "cadence_ms" if load == "low" else "ms_per_row"
        assert all(v is not None and v > 0 for v in chosen[metric].values()), chosen
        if load == "low":
            cadence = {r: [h.cadence_ms for h in history if h.regime == r and h.cadence_ms] for r in ("psd", "seq")}
            assert all(cadence.values()), cadence   # a request's period measured in both regimes
    finally:
        llm.shutdown()


def test_psd_high_load_sequential_queues_beyond_one_batch(ray_cluster, tiny_llama, tiny_llama_draft, reference_10):
    """psd_high_load=seq: with more requests than one batch holds, psd keeps one sequential batch of at most
    max_batch and queues the rest (sd_split's schedule) instead of splitting; output == ar's."""
    llm = LLM(tiny_llama, tiny_llama_draft, mode="psd", k=2, max_batch=3, psd_high_load="seq", psd_low_load="seq",
              torch_threads=1)
    try:
        outs = llm.generate(PROMPTS, [greedy(10)] * len(PROMPTS))
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference_10]
        history = llm.history()
        assert {h.regime for h in history} == {"seq"}
        assert max(sum(h.sizes) for h in history) <= 3 and max(h.verified for h in history) == 3
        check_balance(history, max_batch=3)
    finally:
        llm.shutdown()


# psd with the default regimes: one engine for sd_split's schedule, which reads the engine's history and regime
# counters and so runs on it first, and seeded sampling (an engine's start is most of either test)
SHARED_PSD = {"mode": "psd", "k": 2, "max_batch": 4}


@pytest.fixture(scope="module")
def shared_psd(ray_cluster, tiny_llama, tiny_llama_draft):
    llm = LLM(tiny_llama, tiny_llama_draft, torch_threads=1, **SHARED_PSD)
    yield llm
    llm.shutdown()


def test_psd_runs_sd_splits_schedule_until_the_demand_fills_both_batches(shared_psd, reference_10):
    """The defaults: a demand one batch holds runs one sequential batch (psd_low_load=seq), and a demand above
    one batch but short of two is served FIFO by that batch (psd_high_load=auto; the split would share the
    verifier among more requests for little more throughput): sd_split's schedule. Output == ar's."""
    llm = shared_psd
    assert not llm.history(), "the shared engine ran something before: its history is this test's"
    outs = llm.generate(PROMPTS[:3], [greedy(10)] * 3)   # max_batch 4: one batch holds them
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference_10[:3]]
    prompts = PROMPTS[:7]   # more than one batch holds, fewer than two
    outs = llm.generate(prompts, [greedy(10)] * len(prompts))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference_10[:7]]
    history = llm.history()
    assert {h.regime for h in history} == {"seq"}
    assert max(sum(h.sizes) for h in history) <= 4 and not any("high_load" in h.extra for h in history)
    info = llm.info()
    assert info["high_load_regime"]["saturated"] is False
    # info says what ran: every step was sequential, at low load and at high load
    for load in ("low", "high"):
        regime = info[f"{load}_load_regime"]
        assert regime["current"] == regime["last_step"] == "seq", regime
        assert set(regime["steps"]) == {"seq"}, regime


def test_psd_low_load_runs_sequentially(ray_cluster, tiny_llama, tiny_llama_draft, reference_10):
    """Below psd_min_requests the manager runs one sequential batch (psd would move each request
    only every other step); at or above it, the two batches ping-pong."""
    llm = LLM(tiny_llama, tiny_llama_draft, mode="psd", k=2, max_batch=8, psd_min_requests=3, psd_low_load="psd",
              torch_threads=1)
    try:
        outs = llm.generate(PROMPTS[:2], [greedy(10)] * 2)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference_10[:2]]
        regimes = {h.regime for h in llm.history()}
        assert regimes == {"seq"}, regimes
        outs = llm.generate(PROMPTS[:6], [greedy(10)] * 6)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference_10[:6]]
        regimes = [h.regime for h in llm.history()]
        assert "psd" in regimes
    finally:
        llm.shutdown()


# sd with every output streamed as it comes (tests/engines.py: test_runtime.py's sd engine, shared): one engine for
# seeded sampling and the unmerged stream (an engine's start is most of either test)
SHARED_SD = TINY_SD


@pytest.fixture
def shared_sd(shared_engines, tiny_llama, tiny_llama_draft):
    return shared_engines.get(tiny_llama, tiny_llama_draft, **SHARED_SD)


@pytest.mark.parametrize("mode", ["psd", "sd"])   # ar's: test_runtime.py, on its greedy test's ar engine
def test_seeded_sampling_is_the_same_in_every_mode_and_load(request, tiny_llama, mode):
    """Seeded sampling through psd (ten requests fill both batches) and sd gives the in-process ar text."""
    check_seeded_sampling_equals_ar(request.getfixturevalue(f"shared_{mode}"), tiny_llama, drafts=True)


@pytest.mark.parametrize("interval_ms", [0.0, 150.0])
def test_stream_interval_merges_outputs_but_not_the_first_or_last(request, ray_cluster, tiny_llama,
                                                                   tiny_llama_draft, reference, interval_ms):
    """Streamed outputs come at most one per stream_interval_ms (each costs a Ray hop per request); the
    first tokens and the finish are not held back, and the tokens are the same."""
    shared = interval_ms == SHARED_SD["stream_interval_ms"]
    llm = request.getfixturevalue("shared_sd") if shared else LLM(
        tiny_llama, tiny_llama_draft, mode="sd", k=2, max_batch=2, torch_threads=1, stream_interval_ms=interval_ms)
    steps_before = len([h for h in llm.history() if h.regime == "sd"])

    async def main():
        t0, items = time.perf_counter(), []
        async for out in llm.stream(PROMPTS[1], greedy(LENGTHS[1])):
            items.append((time.perf_counter() - t0, out))
        return items

    try:
        items = asyncio.run(main())
        tokens = [t for _, out in items for t in out.new_token_ids]
        assert tokens == reference[1].token_ids and items[-1][1].finished
        steps = len([h for h in llm.history() if h.regime == "sd"]) - steps_before
        if interval_ms:
            # the engine sends the first at once and each later one (the last may come early) an interval after
            # the one before, so the one before the last comes no sooner than that many intervals from the call:
            # a bound a loaded machine only loosens (it delays the outputs, and this consumer bunches them)
            assert (len(items) - 2) * interval_ms / 1e3 <= items[-2][0], [t for t, _ in items]
            assert len(items) < steps   # merged (steps are ~10 ms here)
        else:
            # no time-based merging: outputs go as they come, but a consumer that falls behind (a loaded machine)
            # gets what queued up for it in one item, so "one per step" is an upper bound, not a count
            assert 1 < len(items) <= steps + 1
    finally:
        if not shared:
            llm.shutdown()


def test_outputs_queued_for_a_slow_consumer_are_merged():
    from minedraft_ray.runtime.manager import StepOutput, _merged
    a = StepOutput("r", [1, 2], [{"token_id": 1}, {"token_id": 2}])
    b = StepOutput("r", [3], [{"token_id": 3}], finished=True, finish_reason="length", stats={"x": 1})
    m = _merged(a, b)
    assert (m.new_token_ids, [lp["token_id"] for lp in m.logprobs]) == ([1, 2, 3], [1, 2, 3])
    assert (m.finished, m.finish_reason, m.stats) == (True, "length", {"x": 1})
    assert _merged(StepOutput("r", [1]), StepOutput("r", [2])).logprobs is None
