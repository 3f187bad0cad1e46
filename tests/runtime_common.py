"""What the runtime test files share: prompts, the ar references, and probes of a running LLM."""
import time

import ray

from minedraft_ray.engine.kv_blocks import TableEdits
from minedraft_ray.engine.sampling import SamplingParams
from minedraft_ray.runtime.scheduler import KVPoolSpec, PlannedBlocks
from minedraft_ray.testing.channel import wildcard_listeners


PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over", "import os\nimport sys\n\n", "a",
           "class Foo:\n    def __init__(self):", "x = [1, 2, 3]\nfor i in x:", "hello world, this is a longer "
           "prompt that has quite a few more tokens than the others do", "# comment", "while True:", "1 + 1 ="]
LENGTHS = [5, 30, 12, 1, 24, 17, 9, 28, 3, 20]   # varied lengths: finishes break the batches' balance


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def reconfigure_when_idle(llm, timeout_s=30.0, **settings):
    """sd and ar keep a step queued behind a request's last one: the engine is idle once it has run."""
    deadline = time.time() + timeout_s
    while True:
        try:
            return llm.reconfigure(**settings)
        except ray.exceptions.RayTaskError as e:
            if "idle" not in str(e) or time.time() > deadline:
                raise
            time.sleep(0.05)


def settled(llm, timeout_s=10.0) -> dict:
    """The engine's info once no slot is held: a finished request's slot is freed when the step queued
    behind its last one (sd, ar) commits, just after its final output reached the caller."""
    deadline = time.time() + timeout_s
    while (info := llm.info())["slots_in_use"] and time.time() < deadline:
        time.sleep(0.05)
    return info


# what the manager actor's process must not import: torch and transformers (tests/test_layering.py), and Ray Serve
# (FastAPI, uvicorn), which only a Serve replica, whose process has Serve loaded anyway, asks for its replica id
NOT_IN_THE_MANAGER = ("torch", "transformers", "ray.serve")


def manager_imports(llm, names=NOT_IN_THE_MANAGER) -> list[str]:
    """Which of `names` the manager actor's process has imported."""
    def loaded(_):   # run in the manager's process (a local function travels by value)
        import sys
        return [name for name in names if name in sys.modules]
    return ray.get(llm.manager.__ray_call__.remote(loaded))


def worker_collectors(llm) -> dict:
    """Each worker actor's garbage collector: (on, objects frozen). Its start pauses the collector for its imports
    and freezes what it built (runtime/actors.py); the collector must run again after."""
    def state(self):
        def collector(_):
            import gc
            return gc.isenabled(), gc.get_freeze_count() > 0
        return {name: ray.get(actor.__ray_call__.remote(collector))
                for name, actor in (("verifier", self.manager.verifier), ("drafter", self.manager.drafter))
                if actor is not None}
    return ray.get(llm.manager.__ray_call__.remote(state))


def links_in_flight(llm) -> dict:
    """The collective channel: messages each end of the link sent (or drains it posted) not yet taken."""
    def count(self):
        m = self.manager
        return {name: ray.get(actor.__ray_call__.remote(lambda a: a.worker.link.in_flight))
                for name, actor in (("verifier", m.verifier), ("drafter", m.drafter))}
    return ray.get(llm.manager.__ray_call__.remote(count))


def links_listening_everywhere(llm) -> dict:
    """TCP sockets of the verifier's and the drafter's processes listening on 0.0.0.0 or ::."""
    def found(self):
        return {name: ray.get(actor.__ray_call__.remote(lambda w: wildcard_listeners()))
                for name, actor in (("verifier", self.manager.verifier), ("drafter", self.manager.drafter))}
    return ray.get(llm.manager.__ray_call__.remote(found))


def check_balance(history, max_batch=None, min_requests=2):
    """psd's invariant after every step; steps after which psd ran one sequential batch (low load) are
    exempt, and that happens only below min_requests, or at most max_batch running when given."""
    for rec in history:
        a, b = rec.sizes
        if rec.extra.get("one_batch"):
            assert a + b < min_requests or (max_batch is not None and a + b <= max_batch), rec
            assert 0 in (a, b), rec
        elif a + b >= 2:
            assert abs(a - b) <= 1, rec


def listeners_beside_ray(llm) -> dict:
    """Ports each process of the engine listens on besides its Ray worker's own: the manager, the target's ranks
    (rank 0 is the verifier), the drafter."""
    from minedraft_ray.testing.channel import ray_worker_port, tcp_listeners

    def others(_):
        own = ray_worker_port()
        return sorted(port for _, port in tcp_listeners() if port != own)

    def found(self):
        m = self.manager
        actors = {"verifier": m.verifier, **{f"rank {i + 1}": r for i, r in enumerate(m.actors.ranks)},
                  **({"drafter": m.drafter} if m.drafter is not None else {})}
        return {"manager": others(None), **{name: ray.get(a.__ray_call__.remote(others))
                                            for name, a in actors.items()}}
    return ray.get(llm.manager.__ray_call__.remote(found))


def whole_tables(worker, model: str, slots: list[int], tokens: int) -> TableEdits:
    """For tests that drive a worker actor's methods directly, in the scheduler's place: blocks for positions
    [0, tokens) of each slot in the worker's pool of `model` (target, draft), as table changes for its first task."""
    spec = KVPoolSpec(**worker.kv_pools()[model])
    blocks = PlannedBlocks(spec, max(slots) + 1, prefix_caching=False)
    blocks.reserve_many(slots, [tokens] * len(slots))
    return blocks.take_edits()


def check_seeded_sampling_equals_ar(llm, target, drafts: bool) -> None:
    """Greedy drafting samples the target with the noise plain decoding uses at each position, so a seeded request
    gives the in-process ar engine's text through the runtime, alone or among others (whatever the draft schedule,
    and with sd/ar steps queued ahead from the verifier's slot state)."""
    from minedraft_ray.engine.engine import Engine

    params = [SamplingParams(temperature=0.9, top_k=40, max_tokens=20, ignore_eos=True, seed=100 + i)
              for i in range(len(PROMPTS))]
    ar = Engine(target, mode="ar", max_batch=8, device="cpu").generate(PROMPTS, params)
    crowd = llm.generate(PROMPTS, params)
    alone = llm.generate(PROMPTS[2], params[2])[0]
    assert [o.token_ids for o in crowd] == [o.token_ids for o in ar]
    assert alone.token_ids == ar[2].token_ids
    assert (sum(o.stats["accepted"] for o in crowd) > 0) == drafts
    assert len({tuple(o.token_ids) for o in ar}) == len(PROMPTS)
