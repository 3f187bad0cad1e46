"""Draft identity across modes (issue 21.8): with greedy drafting the drafter proposes the same tokens for a
request at a given position whether it runs beside the target (`sd`) or on its own actor (`sd_split`, `psd`),
so every mode verifies the same rounds and accepts the same drafts. The verifier records each row it verifies
(minedraft_ray.testing.workers.recording); rounds are compared per request, position by position."""
from collections import defaultdict

import pytest

from minedraft_ray.engine.sampling import SamplingParams
from minedraft_ray.runtime import LLM
from minedraft_ray.testing.workers import recording, verify_rows

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over", "import os\nimport sys\n\n",
           "class Foo:\n    def __init__(self):"]
K = 4


def rounds_per_request(llm, prompts, max_tokens):
    """-> per prompt: [(output position, drafts, emitted)] of every verify that carried it, in order, and the
    outputs. Requests run side by side, each in a slot of its own; sd and ar queue a step ahead, so a slot's
    rows past its request's end (tokens dropped) are left out."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    by_slot = defaultdict(list)
    for row in verify_rows(llm):
        by_slot[row.slot].append((row.position, row.drafts, row.emitted))
    rounds = []
    for o in outs:
        mine = [[r for r in rs if r[0] < len(o.token_ids)] for rs in by_slot.values()]
        mine = [rs for rs in mine if [t for _, _, e in rs for t in e][:len(o.token_ids) - 1] == o.token_ids[1:]]
        assert len(mine) == 1, o.token_ids
        rounds.append(mine[0])
    return rounds, [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def sd_rounds(ray_cluster, tiny_llama, tiny_llama_draft):
    llm = LLM(tiny_llama, tiny_llama_draft, mode="sd", k=K, max_batch=4, torch_threads=1, _workers=recording())
    try:
        return rounds_per_request(llm, PROMPTS, 40)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode, settings", [("sd_split", {}), ("psd", {}),
                                            ("psd", {"psd_low_load": "psd", "psd_min_requests": 2})],
                         ids=["sd_split", "psd", "psd_split"])
def test_split_drafter_drafts_what_sd_drafts(ray_cluster, tiny_llama, tiny_llama_draft, sd_rounds, mode, settings):
    expected, expected_tokens = sd_rounds
    llm = LLM(tiny_llama, tiny_llama_draft, mode=mode, k=K, max_batch=4, torch_threads=1, _workers=recording(),
              **settings)
    try:
        rounds, tokens = rounds_per_request(llm, PROMPTS, 40)
        history = llm.history()
    finally:
        llm.shutdown()
    assert tokens == expected_tokens   # greedy: every mode emits the target's tokens
    if settings:
        assert any(h.regime == "psd" for h in history)   # the two batches did alternate
    for prompt, got, want in zip(PROMPTS, rounds, expected):
        # per round: the position it starts at, the drafts it verified, the tokens it emitted
        assert got == want, prompt
    accepted = [[len(e) - 1 for _, d, e in rs if d] for rs in rounds]
    assert accepted == [[len(e) - 1 for _, d, e in rs if d] for rs in expected]
