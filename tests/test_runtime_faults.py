"""The Ray runtime's fault drills (fake GPUs, the session's cluster): a drafter killed, failing or hanging
mid-run, or dead before prompts arrive, fails no request and leaves output equal to ar's; a dead verifier
fails requests clearly."""
import time

import pytest
import ray

from minedraft_ray.runtime import LLM
from minedraft_ray.testing.workers import faulty_drafter
from runtime_common import LENGTHS, PROMPTS, greedy


# each channel once in psd, the unthreaded drafter once, sd_split once (suite time)
@pytest.mark.parametrize("mode, overlap, transport", [("psd", True, "object_store"), ("psd", False, "collective"),
                                                     ("sd_split", True, "collective"),
                                                     ("psd", True, "ray_collective")])
def test_drafter_killed_mid_run(ray_cluster, tiny_llama, tiny_llama_draft, reference, reference_10, mode, overlap,
                                transport):
    # with verifier_overlap, later tasks wait for the turn of the verify whose drafts failed: it is resubmitted
    # under its own number; with the collective channel that verify is already waiting for its drafts on the
    # link, which fails when the drafter dies, and it runs without them
    # a slow drafter (200 ms a round, busy nearly all the time): the kill lands while a round is drafted, with its
    # verify submitted already
    llm = LLM(tiny_llama, tiny_llama_draft, mode=mode, k=2, max_batch=3, torch_threads=1, verifier_overlap=overlap,
              transport=transport, _workers=faulty_drafter(delay_s=0.2))
    try:
        params = [greedy(n) for n in LENGTHS]
        ref = llm.manager.generate_batch.remote([llm._encode(p) for p in PROMPTS], params)
        deadline = time.time() + 60
        while llm.info()["steps"] < 3 and time.time() < deadline:
            time.sleep(0.05)
        assert ray.get(llm.manager.kill_drafter.remote())
        outs = ray.get(ref, timeout=120)
        assert [o["token_ids"] for o in outs] == [r.token_ids for r in reference]
        info = llm.info()
        assert info["drafter_failures"] >= 1
        assert info["draft_rounds_failed"] >= 1   # a verify whose round died with the drafter ran without drafts
        deadline = time.time() + 60
        while not llm.info()["drafter_alive"] and time.time() < deadline:
            time.sleep(0.2)
        assert llm.info()["drafter_restarts"] >= 1
        regimes = [h.regime for h in llm.history()]
        assert "ar" in regimes          # served target-only while the drafter was down
        outs = llm.generate(PROMPTS[:4], [greedy(10)] * 4)   # and speculates again after the restart
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference_10[:4]]
        assert sum(o.stats["accepted"] for o in outs) > 0
    finally:
        llm.shutdown()


# each fault on each channel once (suite time: not every pairing)
@pytest.mark.parametrize("fault, transport, timeout_s, bound_s", [
    ("error_at", "collective", 60, 45), ("hang_at", "object_store", 5, 10), ("hang_at", "ray_collective", 5, 10)])
def test_a_round_failing_or_hanging_on_a_live_drafter_does_not_stall_its_verify(
        ray_cluster, tiny_llama, tiny_llama_draft, reference, fault, transport, timeout_s, bound_s):
    """A round that raises on the drafter (which stays alive), or hangs there without returning, leaves its verify
    waiting for the drafts (on the link, or as a task argument). The engine replaces the drafter, on the error at
    once and on the hang after the manager's wait times out (step_timeout_s); that ends the old link, so the
    verify runs without drafts instead of waiting out the link's own timeout, or the hour the round hangs. The
    output is still ar's, and nothing waits longer than about one timeout."""
    llm = LLM(tiny_llama, tiny_llama_draft, mode="psd", k=2, max_batch=3, torch_threads=1, transport=transport,
              step_timeout_s=timeout_s, _workers=faulty_drafter(**{fault: 4}))
    try:
        t0 = time.time()
        outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS])
        elapsed = time.time() - t0
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        info = llm.info()
        assert info["drafter_failures"] >= 1 and info["draft_rounds_failed"] >= 1, info
        # error: well before the 60 s timeout; hang: one 5 s timeout (~5.3 s here), not one per waiting call
        assert elapsed < bound_s, elapsed
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["psd"])   # sd_split shares psd's drafter path (suite time)
def test_drafter_dead_before_new_prompts_arrive(ray_cluster, tiny_llama, tiny_llama_draft, reference_10, mode):
    """New prompts go to the drafter at admission, before any draft: with the drafter already dead, that
    prefill is what fails (one-token requests never draft, so nothing else would notice). The engine
    serves ar, restarts the drafter, and the output is still the target's."""
    llm = LLM(tiny_llama, tiny_llama_draft, mode=mode, k=2, max_batch=3, torch_threads=1)
    try:
        assert ray.get(llm.manager.kill_drafter.remote())
        outs = llm.generate(PROMPTS[:4], [greedy(1)] * 4)
        assert [o.token_ids for o in outs] == [r.token_ids[:1] for r in reference_10[:4]]
        deadline = time.time() + 30
        while llm.info()["drafter_failures"] == 0 and time.time() < deadline:
            time.sleep(0.1)
        info = llm.info()
        assert info["drafter_prefills"] >= 1 and info["drafter_failures"] == 1, info
        outs = llm.generate(PROMPTS[:4], [greedy(10)] * 4)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference_10[:4]]
        deadline = time.time() + 60
        while not llm.info()["drafter_alive"] and time.time() < deadline:
            time.sleep(0.2)
        outs = llm.generate(PROMPTS[4:8], [greedy(10)] * 4)   # prompts prefilled on the restarted drafter
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference_10[4:8]]
        assert sum(o.stats["accepted"] for o in outs) > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("transport", ["collective"])   # the channel whose drafter waits on the verifier's end
def test_verifier_killed_fails_requests_clearly(ray_cluster, tiny_llama, tiny_llama_draft, transport):
    # collective: the drafter waiting on the link for a verify's tokens sees the verifier's end close
    llm = LLM(tiny_llama, tiny_llama_draft, mode="psd", k=2, max_batch=2, torch_threads=1, step_timeout_s=30,
              transport=transport)
    try:
        verifier = ray.get(llm.manager.__ray_call__.remote(lambda self: self.manager.verifier))
        ref = llm.manager.generate_batch.remote([llm._encode(p) for p in PROMPTS[:4]], [greedy(1500)] * 4)
        deadline = time.time() + 60
        while llm.info()["steps"] < 3 and time.time() < deadline:   # kill it mid-run, not before or after
            time.sleep(0.05)
        ray.kill(verifier, no_restart=True)
        with pytest.raises(Exception) as err:
            ray.get(ref, timeout=60)
        assert "verifier" in str(err.value)
        with pytest.raises(Exception, match="verifier"):
            llm.generate(PROMPTS[0], greedy(4))
    finally:
        llm.shutdown()
