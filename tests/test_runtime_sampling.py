"""Sampling through the Ray runtime's psd follows the target's exact distribution (chi-square)."""
import pytest

from minedraft_ray.engine.sampling import SamplingParams
from minedraft_ray.runtime import LLM


# the collective channel runs with chunked prompts only: one run covers both (suite time; a 64-token budget
# still ends tasks mid-prompt, in a quarter of the prefill tasks a 16-token one took)
@pytest.mark.parametrize("draft_temperature, transport, chunk", [(0.0, "object_store", None),
                                                                  (1.0, "object_store", None),
                                                                  (1.0, "collective", 64)])
def test_psd_sampled_output_follows_target(ray_cluster, tiny_llama, tiny_llama_draft, draft_temperature, transport,
                                           chunk):
    """Sampling through psd (drafts made ahead; greedy or probabilistic drafting, whose q travel with the
    ids, through either draft channel; prompts cut by the default budget, their chunks riding inside verify
    launches, or by a 64-token one, so a prefill task ends in the middle of a prompt) gives the target's exact
    distribution of the first three tokens."""
    from stats import assert_first_three_tokens_follow_target
    params = dict(temperature=0.8, top_k=3)
    n = 1500
    llm = LLM(tiny_llama, tiny_llama_draft, mode="psd", k=2, max_batch=32, torch_threads=1,
              draft_temperature=draft_temperature, transport=transport, prefill_chunk_tokens=chunk)
    try:
        prompt = llm._encode("def fibonacci(n):")
        assert chunk is None or chunk % len(prompt), len(prompt)   # a task's budget ends mid-prompt
        outs = llm.generate([prompt] * n, [SamplingParams(max_tokens=3, ignore_eos=True, seed=s, **params)
                                           for s in range(n)])
        assert any(h.regime == "psd" for h in llm.history())
        assert llm.info()["drafts_ahead_used"] > 0
        if chunk is None:   # the default budget: chunks rode inside verify launches (fused_prefill)
            assert llm.info()["fused_prefills"] > 0
    finally:
        llm.shutdown()
    assert_first_three_tokens_follow_target(outs, tiny_llama, prompt, SamplingParams(**params))
