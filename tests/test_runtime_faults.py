"""The Ray runtime's fault drills (fake GPUs, the session's cluster): a drafter killed, failing or hanging
mid-run, or dead before prompts arrive, fails no request and leaves output equal to ar's; a dead verifier
fails requests clearly.

A drill leaves its engine serving with a new drafter, so drills on the same configuration share one engine (an
engine's start is most of a drill): each injects its fault into the running drafter (set_drafter_faults) and reads
the engine's counters and history as changes."""
import time

import pytest
import ray

from minedraft_ray.runtime import LLM
from minedraft_ray.testing.workers import faulty_drafter, set_drafter_faults
from runtime_common import LENGTHS, PROMPTS, greedy, settled

# the configurations several drills share (k=2, max_batch=3, psd): the collective channel with the unthreaded
# drafter (its verifier killed last), the object store with the short step timeout the hang drill waits out, and
# the ray_collective channel with that timeout and the threaded drafter (its kill drill and its hang drill: the hang
# on each channel once, with the verifier's overlap off on the object store and on here)
SHARED = {"collective": {"transport": "collective", "verifier_overlap": False, "step_timeout_s": 60},
          "object_store": {"transport": "object_store", "step_timeout_s": 5},
          "ray_collective": {"transport": "ray_collective", "verifier_overlap": True, "step_timeout_s": 5}}


@pytest.fixture(scope="module")
def shared_engines(ray_cluster, tiny_llama, tiny_llama_draft):
    started = {}

    def get(name: str, take: bool = False) -> LLM:
        """The shared engine, started on first use; idle, its drafter up (a drill's restart done). take: it leaves
        the cache, to the caller, who ends it (the drill that kills its verifier)."""
        if name not in started:
            started[name] = LLM(tiny_llama, tiny_llama_draft, mode="psd", k=2, max_batch=3, torch_threads=1,
                                _workers=faulty_drafter(), **SHARED[name])
        llm = started[name]
        deadline = time.time() + 60
        while not llm.info()["drafter_alive"] and time.time() < deadline:
            time.sleep(0.1)
        info = settled(llm)
        assert info["drafter_alive"] and info["running"] == info["queued"] == info["slots_in_use"] == 0, info
        return started.pop(name) if take else llm

    yield get
    for llm in started.values():
        llm.shutdown()


def changes(before: dict, llm) -> dict:
    """The engine's counters since `before` (its info at the drill's start)."""
    info = llm.info()
    return {name: info[name] - before[name] for name in ("drafter_failures", "draft_rounds_failed",
                                                          "drafter_restarts", "drafter_prefills")}


# each channel once in psd, the unthreaded drafter once, sd_split once (suite time)
@pytest.mark.parametrize("mode, overlap, transport", [("psd", True, "object_store"), ("psd", False, "collective"),
                                                     ("sd_split", True, "collective"),
                                                     ("psd", True, "ray_collective")])
def test_drafter_killed_mid_run(ray_cluster, shared_engines, tiny_llama, tiny_llama_draft, reference, reference_10,
                                mode, overlap, transport):
    # with verifier_overlap, later tasks wait for the turn of the verify whose drafts failed: it is resubmitted
    # under its own number; with the collective channel that verify is already waiting for its drafts on the
    # link, which fails when the drafter dies, and it runs without them
    # a slow drafter (200 ms a round, busy nearly all the time): the kill lands while a round is drafted, with its
    # verify submitted already
    shared = mode == "psd" and transport in SHARED and SHARED[transport].get("verifier_overlap") == overlap
    llm = shared_engines(transport) if shared else LLM(
        tiny_llama, tiny_llama_draft, mode=mode, k=2, max_batch=3, torch_threads=1, verifier_overlap=overlap,
        transport=transport, _workers=faulty_drafter())
    try:
        set_drafter_faults(llm, delay_s=0.2)
        before, steps_before = llm.info(), len(llm.history())
        params = [greedy(n) for n in LENGTHS]
        ref = llm.manager.generate_batch.remote([llm._encode(p) for p in PROMPTS], params)
        deadline = time.time() + 60
        while llm.info()["steps"] < before["steps"] + 3 and time.time() < deadline:
            time.sleep(0.05)
        assert ray.get(llm.manager.kill_drafter.remote())
        outs = ray.get(ref, timeout=120)
        assert [o["token_ids"] for o in outs] == [r.token_ids for r in reference]
        change = changes(before, llm)
        assert change["drafter_failures"] >= 1
        assert change["draft_rounds_failed"] >= 1   # a verify whose round died with the drafter ran without drafts
        deadline = time.time() + 60
        while not llm.info()["drafter_alive"] and time.time() < deadline:
            time.sleep(0.2)
        assert changes(before, llm)["drafter_restarts"] >= 1
        regimes = [h.regime for h in llm.history()[steps_before:]]
        assert "ar" in regimes          # served target-only while the drafter was down
        outs = llm.generate(PROMPTS[:4], [greedy(10)] * 4)   # and speculates again after the restart
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference_10[:4]]
        assert sum(o.stats["accepted"] for o in outs) > 0
    finally:
        if not shared:
            llm.shutdown()


# each fault on each channel once (suite time: not every pairing)
@pytest.mark.parametrize("fault, transport, timeout_s", [
    ("error_at", "collective", 60), ("hang_at", "object_store", 5), ("hang_at", "ray_collective", 5)])
def test_a_round_failing_or_hanging_on_a_live_drafter_does_not_stall_its_verify(
        ray_cluster, shared_engines, tiny_llama, tiny_llama_draft, reference, fault, transport, timeout_s):
    """A round that raises on the drafter (which stays alive), or hangs there without returning, leaves its verify
    waiting for the drafts (on the link, or as a task argument). The engine replaces the drafter, on the error at
    once and on the hang after the manager's wait times out (step_timeout_s); that ends the old link, so the
    verify runs without drafts instead of waiting out the link's own timeout, or the hour the round hangs. The
    output is still ar's, and nothing waits longer than about one timeout. The waits are read as the stalls
    between the engine's steps (the steps' hand-out times), so a loaded machine's slower steps do not count."""
    shared = transport in SHARED
    if shared:
        assert SHARED[transport]["step_timeout_s"] == timeout_s
        llm = shared_engines(transport)
    else:
        llm = LLM(tiny_llama, tiny_llama_draft, mode="psd", k=2, max_batch=3, torch_threads=1, transport=transport,
                  step_timeout_s=timeout_s, _workers=faulty_drafter())
    try:
        set_drafter_faults(llm, **{fault: 4})
        before = llm.info()
        t0 = time.time()
        outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS])
        t1 = time.time()
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        change = changes(before, llm)
        assert change["drafter_failures"] >= 1 and change["draft_rounds_failed"] >= 1, change
        emits = sorted(h.t_emit for h in llm.history() if t0 <= h.t_emit <= t1)
        stalls = [b - a for a, b in zip([t0, *emits], [*emits, t1]) if b - a > timeout_s / 2]
        # error: no wait of half the 60 s timeout; hang: one wait of one timeout (and the drafter's replacement),
        # not one per waiting call
        assert len(stalls) == (fault == "hang_at") and sum(stalls) < 1.5 * timeout_s, (stalls, t1 - t0)
    finally:
        if not shared:
            llm.shutdown()


@pytest.mark.parametrize("mode", ["psd"])   # sd_split shares psd's drafter path (suite time)
def test_drafter_dead_before_new_prompts_arrive(shared_engines, reference_10, mode):
    """New prompts go to the drafter at admission, before any draft: with the drafter already dead, that
    prefill is what fails (one-token requests never draft, so nothing else would notice). The engine
    serves ar, restarts the drafter, and the output is still the target's. (psd over the object store, as a CPU
    engine's default channel.)"""
    llm = shared_engines("object_store")
    before = llm.info()
    assert before["mode"] == mode and before["transport"] == "object_store"
    assert ray.get(llm.manager.kill_drafter.remote())
    outs = llm.generate(PROMPTS[:4], [greedy(1)] * 4)
    assert [o.token_ids for o in outs] == [r.token_ids[:1] for r in reference_10[:4]]
    deadline = time.time() + 30
    while changes(before, llm)["drafter_failures"] == 0 and time.time() < deadline:
        time.sleep(0.1)
    change = changes(before, llm)
    assert change["drafter_prefills"] >= 1 and change["drafter_failures"] == 1, change
    outs = llm.generate(PROMPTS[:4], [greedy(10)] * 4)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference_10[:4]]
    deadline = time.time() + 60
    while not llm.info()["drafter_alive"] and time.time() < deadline:
        time.sleep(0.2)
    outs = llm.generate(PROMPTS[4:8], [greedy(10)] * 4)   # prompts prefilled on the restarted drafter
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference_10[4:8]]
    assert sum(o.stats["accepted"] for o in outs) > 0


@pytest.mark.parametrize("transport", ["collective"])   # the channel whose drafter waits on the verifier's end
def test_verifier_killed_fails_requests_clearly(shared_engines, transport):
    # collective: the drafter waiting on the link for a verify's tokens sees the verifier's end close. The drill
    # ends its engine: it takes the channel's shared one (its drills done: this test comes last) out of the cache
    llm = shared_engines(transport, take=True)
    try:
        verifier = ray.get(llm.manager.__ray_call__.remote(lambda self: self.manager.verifier))
        steps_before = llm.info()["steps"]
        ref = llm.manager.generate_batch.remote([llm._encode(p) for p in PROMPTS[:4]], [greedy(1500)] * 4)
        deadline = time.time() + 60
        while llm.info()["steps"] < steps_before + 3 and time.time() < deadline:   # kill it mid-run
            time.sleep(0.05)
        ray.kill(verifier, no_restart=True)
        with pytest.raises(Exception) as err:
            ray.get(ref, timeout=60)
        assert "verifier" in str(err.value)
        with pytest.raises(Exception, match="verifier"):
            llm.generate(PROMPTS[0], greedy(4))
    finally:
        llm.shutdown()


def test_a_worker_process_dying_while_it_starts_costs_a_second_start(ray_cluster, tiny_llama, tiny_llama_draft,
                                                                     reference, tmp_path):
    """The verifier's process killed in its constructor (as the OOM killer would): the workers start again, once,
    and the engine serves ar's output (psd: the first start's drafter holds the drafter bundle's GPU, so the second
    start's drafter is placed only if the first was killed); killed at both starts, the LLM fails with the death;
    a constructor that raises (it would raise again) is not retried."""
    from minedraft_ray.testing.workers import dies_while_starting

    deaths = tmp_path / "deaths"
    deaths.write_text("1")
    llm = LLM(tiny_llama, tiny_llama_draft, mode="psd", k=3, max_batch=2, torch_threads=1,
              _workers=dies_while_starting(str(deaths)))
    try:
        assert deaths.read_text() == "0" and llm.info()["worker_start_retries"] == 1
        outs = llm.generate(PROMPTS[:4], [greedy(n) for n in LENGTHS[:4]])
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference[:4]]
    finally:
        llm.shutdown()
    deaths.write_text("2")
    with pytest.raises(ray.exceptions.RayTaskError, match="worker process has died"):
        LLM(tiny_llama, mode="ar", max_batch=4, torch_threads=1, _workers=dies_while_starting(str(deaths)))
    assert deaths.read_text() == "0"   # both starts died
    deaths.write_text("2")
    with pytest.raises(ray.exceptions.RayTaskError, match="constructor failed"):
        LLM(tiny_llama, mode="ar", max_batch=4, torch_threads=1,
            _workers=dies_while_starting(str(deaths), raises=True))
    assert deaths.read_text() == "1"   # one start, not retried
