"""serve/streams.py with a real Mailbox actor in the session's Ray cluster: the engine side sends a request's outputs
merged, at most once per interval except its first and last; the ingress side applies each delivery to its
requests off the loop, and fails the requests of a mailbox that died."""
import asyncio
import concurrent.futures
import pickle
import threading
import time

import pytest

from minedraft_ray.runtime.manager import StepOutput
from minedraft_ray.serve.streams import Accepted, OutputBatcher, StreamRouter, merge_outputs, start_mailbox


class Outputs:
    """A request's side of the router (serve.streams.OutputReceiver): its outputs, in an asyncio queue once woken;
    the threads its deliveries were applied on."""

    def __init__(self):
        self.applied: list[StepOutput] = []
        self.threads: set[str] = set()
        self.queue: asyncio.Queue = asyncio.Queue()

    def apply(self, outs: list[StepOutput]) -> None:
        self.threads.add(threading.current_thread().name)
        self.applied += outs

    def wake(self) -> None:
        while self.applied:
            self.queue.put_nowait(self.applied.pop(0))

    async def get(self) -> StepOutput:
        return await self.queue.get()

    def empty(self) -> bool:
        return self.queue.empty() and not self.applied


def unpickled(batches: list[bytes]) -> list[StepOutput]:
    return [out for batch in batches for out in pickle.loads(batch)]


def test_mailbox_applies_batches_in_their_order(ray_cluster):
    import ray

    from minedraft_ray.serve.streams import Mailbox

    async def scenario():
        mailbox = Mailbox.remote()
        await mailbox.put.remote(1, {"s": pickle.dumps([StepOutput("a", [2])])})   # overtook batch 0
        assert await mailbox.take.remote("s", 0.1) == []
        await mailbox.put.remote(0, {"s": pickle.dumps([StepOutput("a", [1])])})
        assert [o.new_token_ids for o in unpickled(await mailbox.take.remote("s"))] == [[1], [2]]
        ray.kill(mailbox)

    asyncio.run(scenario())


def test_merge_outputs():
    a = StepOutput("r", [1, 2], [{"lp": 1}, {"lp": 2}])
    b = StepOutput("r", [3], [{"lp": 3}], finished=True, finish_reason="length", stats={"x": 1})
    m = merge_outputs(a, b)
    assert m.new_token_ids == [1, 2, 3] and len(m.logprobs) == 3 and m.finished and m.stats == {"x": 1}
    assert merge_outputs(StepOutput("r", [1]), StepOutput("r", [2])).logprobs is None


def test_batches_per_interval_and_urgent_outputs_go_at_once_alone(ray_cluster):
    async def scenario():
        mailbox = start_mailbox()
        await mailbox.alive.remote()   # the actor is up
        batcher = OutputBatcher(mailbox, interval_s=1.0)
        t0 = time.perf_counter()
        batcher.put("ingress", StepOutput("a", [1]), urgent=True)        # a's first output: at once
        first = unpickled(await mailbox.take.remote("ingress"))
        assert [o.new_token_ids for o in first] == [[1]] and time.perf_counter() - t0 < 0.8
        for token in (2, 3, 4):                                          # within one interval: one output
            batcher.put("ingress", StepOutput("a", [token]))
            batcher.put("ingress", StepOutput("b", [10 + token]))
        batched = unpickled(await mailbox.take.remote("ingress"))
        assert time.perf_counter() - t0 >= 0.95
        assert {o.request_id: o.new_token_ids for o in batched} == {"a": [2, 3, 4], "b": [12, 13, 14]}
        t1 = time.perf_counter()
        batcher.put("ingress", StepOutput("b", [15]))                    # waits for the next interval
        batcher.put("ingress", StepOutput("a", [5], finished=True, finish_reason="length"))   # a finish: at once,
        last = unpickled(await mailbox.take.remote("ingress"))          # alone (b keeps its interval)
        assert [(o.request_id, o.finished) for o in last] == [("a", True)] and time.perf_counter() - t1 < 0.8
        grid = unpickled(await mailbox.take.remote("ingress"))
        assert [o.new_token_ids for o in grid] == [[15]] and time.perf_counter() - t0 >= 1.95
        assert await mailbox.take.remote("ingress", 0.1) == []          # nothing left: an empty answer
        import ray
        ray.kill(mailbox)

    asyncio.run(scenario())


def test_flush_records_say_how_late_the_busy_loop_let_a_flush_go(ray_cluster):
    async def scenario():
        mailbox = start_mailbox()
        batcher = OutputBatcher(mailbox, interval_s=0.05)
        batcher.put("ingress", StepOutput("b", [2]))                   # an idle grid: at once
        await asyncio.sleep(0.01)
        for token in (3, 4):                                           # the next interval's
            batcher.put("ingress", StepOutput("a", [token]))
            batcher.put("ingress", StepOutput("b", [token]))
        batcher.put("ingress", StepOutput("c", [1]), urgent=True)      # at once, alone: not an interval flush
        time.sleep(0.2)   # the loop is held past the flush's grid time
        await asyncio.sleep(0.01)
        on_time, late = batcher.history
        assert on_time.requests == 1 and on_time.late_ms < 100
        assert late.requests == 2 and late.late_ms >= 150 and late.t > on_time.t
        import ray
        ray.kill(mailbox)

    asyncio.run(scenario())


def test_router_hands_outputs_to_their_requests_and_fails_them_when_the_mailbox_dies(ray_cluster):
    import ray

    async def scenario():
        mailbox = start_mailbox()
        router = StreamRouter("ingress-1", concurrent.futures.ThreadPoolExecutor(1))
        qa, qb = Outputs(), Outputs()
        router.open("a", qa)
        router.open("b", qb)
        router.watch("a", Accepted(mailbox, "engine-1"))
        router.watch("b", Accepted(mailbox, "engine-1"))
        assert len(router.pollers) == 1                                  # one long-poll per mailbox
        await mailbox.put.remote(0, {"ingress-1": pickle.dumps([StepOutput("a", [1]), StepOutput("b", [2]),
                                                                StepOutput("x", [3])]),
                                     "ingress-2": pickle.dumps([StepOutput("c", [4])])})
        assert (await asyncio.wait_for(qa.get(), 10)).new_token_ids == [1]
        assert (await asyncio.wait_for(qb.get(), 10)).new_token_ids == [2]
        # one delivery, applied on the pool (off the loop that serves the clients)
        assert qa.threads == qb.threads and threading.current_thread().name not in qa.threads
        router.close("b")
        ray.kill(mailbox)                                               # its engine replica died with it
        failed = await asyncio.wait_for(qa.get(), 30)
        assert failed.finished and "died" in failed.error
        assert qb.empty() and "engine-1" not in router.pollers

    asyncio.run(scenario())


@pytest.mark.parametrize("stale", [True, False])
def test_mailbox_drops_outputs_nobody_polls(ray_cluster, stale):
    import ray

    from minedraft_ray.serve.streams import Mailbox

    async def scenario():
        mailbox = Mailbox.remote(stale_s=0.5)
        await mailbox.put.remote(0, {"gone": pickle.dumps([StepOutput("a", [1])])})
        if stale:   # the subscriber's replica is gone: a later put, for anyone, drops its outputs
            await asyncio.sleep(0.7)
        await mailbox.put.remote(1, {"other": pickle.dumps([StepOutput("b", [2])])})
        got = unpickled(await mailbox.take.remote("gone", 0.1))
        assert [o.new_token_ids for o in got] == ([] if stale else [[1]])
        ray.kill(mailbox)

    asyncio.run(scenario())


def test_ingress_settings():
    from ray.serve.config import AutoscalingConfig

    from minedraft_ray.config import EngineConfig
    from minedraft_ray.serve.app import ingress_options

    assert ingress_options(EngineConfig()) == {"num_replicas": 1}
    assert ingress_options(EngineConfig(ingress_replicas=3)) == {"num_replicas": 3}
    opts = ingress_options(EngineConfig(ingress_replicas=2, ingress_max_replicas=4))["autoscaling_config"]
    assert opts["initial_replicas"] == 2 and opts["max_replicas"] == 4
    AutoscalingConfig(**opts)   # Serve accepts it
    with pytest.raises(ValueError, match="ingress_replicas"):
        EngineConfig(ingress_replicas=5, ingress_max_replicas=4)
    env = EngineConfig.from_env(environ={"MINEDRAFT_INGRESS_MAX_REPLICAS": "none", "MINEDRAFT_INGRESS_CPUS": "2"})
    assert env.ingress_max_replicas is None and env.ingress_cpus == 2.0


def test_loop_lag_watch_sees_a_blocked_loop():
    """The ingress's loop-lag probe (serve/loop_lag.py): a loop held for 0.3 s shows as one observation of about that
    much lateness; the probe stops when told."""
    from minedraft_ray.serve.loop_lag import LoopLagWatch

    async def main():
        lags: list[float] = []
        watch = LoopLagWatch(lags.append, period_s=0.005)
        watch.start()
        await asyncio.sleep(0.05)
        time.sleep(0.3)   # the loop is held: a stall of the kind the probe is for
        await asyncio.sleep(0.05)
        watch.stop()
        await asyncio.sleep(0.02)
        seen = len(lags)
        await asyncio.sleep(0.05)
        return lags, seen

    lags, seen = asyncio.run(main())
    assert max(lags) >= 0.25 and len(lags) == seen and min(lags) >= 0.0
