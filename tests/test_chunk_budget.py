"""The adaptive chunk (runtime/chunk_budget.py) against a made-up device whose verifier cycle takes base + n x
per_token ms for a chunk of n prompt tokens, with noise: the chunk it settles on keeps a cycle within the ratio,
follows the base when the batch grows, and stays within its cap and floor."""
import random

import pytest

from minedraft_ray.config import EngineConfig
from minedraft_ray.runtime.chunk_budget import ChunkBudget


def run(budget: ChunkBudget, base_ms: float, per_token_ms: float, steps: int, rng: random.Random,
        chunk_every: int | None = 2) -> list[tuple[int, float]]:
    """Steps of a device: every chunk_every-th cycle carries no chunk (no prompt pending; None: prompts never run
    out), nor does a probe step; the others the chunk the budget allows -> (chunk, cycle ms) of the chunk cycles."""
    out = []
    for step in range(steps):
        idle = chunk_every is not None and step % chunk_every == 0
        chunk = 0 if idle or budget.probe_due() else budget.limit()
        cycle = (base_ms + chunk * per_token_ms) * rng.uniform(0.95, 1.05)
        budget.observe(cycle, chunk)
        if chunk:
            out.append((chunk, cycle))
    return out


def test_the_chunk_settles_where_a_cycle_takes_the_ratio_of_one_without():
    budget = ChunkBudget.for_budget(cap=1024, ratio=2.0)
    assert budget.limit() == 1024   # nothing measured yet: the budget
    cycles = run(budget, base_ms=10.0, per_token_ms=0.05, steps=200, rng=random.Random(0))
    # (2 - 1) x 10 ms / 0.05 ms per token = 200 tokens
    assert 180 <= budget.limit() <= 220, budget
    settled = [ms for _, ms in cycles[-50:]]
    assert max(settled) <= 2.0 * 10.0 * 1.1, settled


def test_the_chunk_follows_the_base_when_the_batch_grows():
    budget, rng = ChunkBudget.for_budget(cap=1024, ratio=1.5), random.Random(1)
    run(budget, base_ms=10.0, per_token_ms=0.05, steps=200, rng=rng)
    assert 90 <= budget.limit() <= 110   # 0.5 x 10 / 0.05
    run(budget, base_ms=30.0, per_token_ms=0.05, steps=200, rng=rng)   # more rows: a longer cycle to hide it in
    assert 270 <= budget.limit() <= 330


def test_a_steady_stream_of_prompts_still_re_measures_the_base():
    """Every cycle could carry a chunk: the base measured when the batch was small would age while it grows, the
    rows' added time charged to the chunks (which would sink to the floor and keep prompts waiting); a probe step
    every probe_every chunk cycles measures it afresh."""
    budget, rng = ChunkBudget.for_budget(cap=1024, ratio=2.0), random.Random(4)
    run(budget, base_ms=10.0, per_token_ms=0.05, steps=100, rng=rng)
    assert 180 <= budget.limit() <= 220
    chunks = run(budget, base_ms=30.0, per_token_ms=0.05, steps=400, rng=rng, chunk_every=None)
    assert 540 <= budget.limit() <= 660, budget   # (2 - 1) x 30 / 0.05
    probes = 400 - len(chunks)
    assert 400 // (budget.probe_every + 1) - 1 <= probes <= 400 // budget.probe_every, probes


def test_a_base_measured_high_leaves_the_cap_and_never_overflows():
    """Cycles with chunks faster than the base on record (it was measured in a stall): chunks measure as free."""
    budget = ChunkBudget.for_budget(cap=512, ratio=2.0)
    budget.observe(100.0, 0)
    for _ in range(5000):
        budget.observe(10.0, 512)
    assert budget.limit() == 512


def test_the_cap_and_the_floor_bound_it():
    budget = ChunkBudget.for_budget(cap=512, ratio=2.0)
    run(budget, base_ms=10.0, per_token_ms=0.001, steps=100, rng=random.Random(2))
    assert budget.limit() == 512              # the times would allow 10,000 tokens
    budget = ChunkBudget.for_budget(cap=512, ratio=2.0)
    run(budget, base_ms=10.0, per_token_ms=5.0, steps=100, rng=random.Random(3))
    assert budget.limit() == budget.floor == 16   # 2 tokens by the times: prompts still progress


@pytest.mark.parametrize("settings, error", [
    ({"chunk_gap_ratio": 1.0}, r"0 \(a fixed budget\) or above 1"),
    ({"chunk_gap_ratio": 2.0, "prefill_chunk_tokens": 0}, "prefill_chunk_tokens 0 has none"),
])
def test_the_ratio_is_checked(settings, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(mode="ar", **settings)
    assert EngineConfig(mode="ar", chunk_gap_ratio=2.0).chunk_gap_ratio == 2.0
