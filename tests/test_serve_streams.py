"""serve/streams.py with a real Mailbox actor in the session's Ray cluster: the engine side sends a request's outputs
merged, at most once per interval except its first and last, released on a grid one interval apart even while the
engine replica's loop is busy committing steps; the ingress side applies each delivery to its requests off the
loop, and fails the requests of a mailbox that died."""
import asyncio
import concurrent.futures
import pickle
import sys
import threading
import time

import pytest

from minedraft_ray.runtime.manager import StepOutput
from minedraft_ray.serve.streams import (Accepted, FlushGrid, OutputBatcher, StreamRouter, merge_outputs,
                                         start_mailbox)


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
    """"At once" is checked against another request's output of the same moment, held for the grid time an
    interval on, not against a clock: a's first and last outputs must come back while b's is still held. A slow
    round trip on a loaded machine does not fail that; an urgent output that waited for the grid time comes back
    with b's every time."""
    async def scenario():
        mailbox = start_mailbox()
        await mailbox.alive.remote()   # the actor is up
        batcher = OutputBatcher(mailbox, interval_s=1.0)
        t0 = time.perf_counter()
        batcher.put("ingress", StepOutput("a", [1]), urgent=True)        # a's first output: at once
        batcher.put("ingress", StepOutput("b", [11]))                    # b's: the grid time (1 s on)
        first = unpickled(await mailbox.take.remote("ingress"))
        assert [(o.request_id, o.new_token_ids) for o in first] == [("a", [1])]   # b's still held
        for token in (2, 3, 4):                                          # within one interval: one output
            batcher.put("ingress", StepOutput("a", [token]))
            batcher.put("ingress", StepOutput("b", [10 + token]))
        batched = unpickled(await mailbox.take.remote("ingress"))
        assert time.perf_counter() - t0 >= 0.95
        assert {o.request_id: o.new_token_ids for o in batched} == {"a": [2, 3, 4], "b": [11, 12, 13, 14]}
        batcher.put("ingress", StepOutput("b", [15]))                    # waits for the next interval
        batcher.put("ingress", StepOutput("a", [5], finished=True, finish_reason="length"))   # a finish: at once,
        last = unpickled(await mailbox.take.remote("ingress"))          # alone (b keeps its interval)
        assert [(o.request_id, o.finished) for o in last] == [("a", True)]   # b's 15 still held
        grid = unpickled(await mailbox.take.remote("ingress"))
        assert [o.new_token_ids for o in grid] == [[15]] and time.perf_counter() - t0 >= 1.95
        assert await mailbox.take.remote("ingress", 0.1) == []          # nothing left: an empty answer
        import ray
        ray.kill(mailbox)

    asyncio.run(scenario())


def busy_loop_releases(steps_s: list[float], commit_s: float, interval_s: float) -> list[float]:
    """When FlushGrid releases the outputs of a request in every step, on an engine replica whose event loop runs the
    step loop: step i's result arrives after steps_s[i] (the steps run back to back), its commit holds the loop for
    `commit_s` and ends with `step_done`; the fallback timer for a grid time fires then, or at the end of the commit
    it falls into (asyncio runs a due timer only between callbacks). Release times, seconds."""
    grid, releases, pending, free_from = FlushGrid(interval_s), [], False, 0.0
    arrive = 0.0
    for step in steps_s:
        arrive += step
        if pending and grid.due(free_from) < arrive:   # the loop is idle at the grid time: the timer fires on time
            releases.append(grid.at_timer(max(grid.due(free_from), free_from)))
            pending = False
        free_from = arrive + commit_s
        pending = True                                   # this step's output, put during its commit
        grid.observe_step(step)
        release = grid.at_step_end(free_from, pending)
        if release is not None:
            releases.append(release)
            pending = False
    return releases


def gaps_ms(times: list[float]) -> list[float]:
    return [(b - a) * 1e3 for a, b in zip(times, times[1:])]


@pytest.mark.parametrize("step_ms, commit_ms", [(11.1, 8.0), (6.1, 5.0), (11.1, 1.0), (30.0, 10.0)])
def test_releases_keep_the_interval_while_commits_keep_the_loop_busy(step_ms, commit_ms):
    """Chunk gaps centre on the stream interval, not on a multiple of the step: a timer on the busy loop alone
    releases at the end of the commit a grid time falls into (11.1 ms steps: gaps of 11.1 and 22.2 ms, median 22.2).
    Steps slower than the interval release every step."""
    releases = busy_loop_releases([step_ms / 1e3] * 600, commit_ms / 1e3, 0.020)
    gaps = gaps_ms(releases)
    expected = max(step_ms, 20.0)
    assert all(abs(g - expected) < 0.01 for g in gaps[1:]), sorted(set(round(g, 1) for g in gaps))
    span = 600 * step_ms
    assert abs(len(releases) - span / expected) <= 2   # one chunk per interval: as many as before


def test_an_interval_of_zero_releases_every_step():
    releases = busy_loop_releases([0.0111] * 50, 0.008, 0.0)
    assert len(releases) == 50 and all(abs(g - 11.1) < 0.01 for g in gaps_ms(releases))


def test_long_steps_among_short_ones_keep_the_median_on_the_interval():
    """Prefill chunks lengthen every third step past the interval: the median gap stays the interval, a step that
    spans a grid time releases as it ends (the gap: the interval plus part of that step, not two intervals), and the
    grid keeps its phase (as many releases as intervals)."""
    steps = [0.023 if i % 3 == 2 else 0.0111 for i in range(900)]
    gaps = sorted(gaps_ms(busy_loop_releases(steps, 0.008, 0.020)))
    assert abs(gaps[len(gaps) // 2] - 20.0) < 0.01
    assert gaps[-1] < 20.0 + 23.0
    assert abs(len(gaps) + 1 - sum(steps) / 0.020) <= 0.05 * sum(steps) / 0.020


def test_mailbox_holds_a_batch_until_its_release_time(ray_cluster):
    import ray

    from minedraft_ray.serve.streams import Mailbox

    # held 1 s: the three calls before the first take's answer fit in it on a loaded machine; a mailbox that
    # releases a held batch early hands it over with b's every time
    hold_s = 1.0

    async def scenario():
        mailbox = Mailbox.remote()
        await mailbox.alive.remote()
        t0 = time.monotonic()
        await mailbox.put.remote(0, {"s": pickle.dumps([StepOutput("a", [1])])}, t0 + hold_s)   # sent ahead
        await mailbox.put.remote(1, {"s": pickle.dumps([StepOutput("b", [2])])})               # at once
        first = unpickled(await mailbox.take.remote("s"))
        assert [o.request_id for o in first] == ["b"]
        second = unpickled(await mailbox.take.remote("s"))
        assert [o.request_id for o in second] == ["a"] and time.monotonic() >= t0 + hold_s
        ray.kill(mailbox)

    asyncio.run(scenario())


def test_a_grid_time_goes_ahead_of_a_busy_step_and_a_finish_does_not_overtake_it(ray_cluster):
    async def scenario():
        mailbox = start_mailbox()
        await mailbox.alive.remote()
        batcher = OutputBatcher(mailbox, interval_s=1.0)
        batcher.put("ingress", StepOutput("a", [1]), urgent=True)           # the first output: at once
        assert [o.new_token_ids for o in unpickled(await mailbox.take.remote("ingress"))] == [[1]]
        batcher.put("ingress", StepOutput("a", [2]))
        batcher.put("ingress", StepOutput("b", [7]))
        due = batcher.grid.next_due
        await asyncio.sleep(0.3)
        before = time.monotonic()
        assert before < due, "the loop woke past the grid time"
        batcher.step_done(0.8)            # the next step's commit would end past the grid time: sent now, held
        after = time.monotonic()
        sent = batcher.history[-1]
        # held from the step's end until the grid time, however late the loop woke from its sleep
        assert sent.requests == 2 and sent.late_ms == 0
        assert (due - after) * 1e3 <= sent.held_ms <= (due - before) * 1e3
        batcher.put("ingress", StepOutput("b", [8]))                         # the next grid time's
        batcher.put("ingress", StepOutput("a", [3], finished=True, finish_reason="length"))
        got = unpickled(await mailbox.take.remote("ingress"))
        assert time.monotonic() >= due                                       # released at the grid time
        # a's finish went at once but not before a's held output: released with it, after it
        assert [(o.request_id, o.new_token_ids) for o in got] == [("a", [2]), ("b", [7]), ("a", [3])]
        assert batcher.pending["ingress"].keys() == {"b"}
        import ray
        ray.kill(mailbox)

    asyncio.run(scenario())


def test_the_timer_sends_late_when_the_loop_is_held(ray_cluster):
    async def scenario():
        mailbox = start_mailbox()
        await mailbox.alive.remote()
        batcher = OutputBatcher(mailbox, interval_s=0.5)
        batcher.put("ingress", StepOutput("a", [1]), urgent=True)
        await mailbox.take.remote("ingress")
        # no step ends near the grid time: the timer sends it. b's: a's own, put after a slow round trip (over
        # an interval since a's first), would go at once as an output that missed a grid time
        batcher.put("ingress", StepOutput("b", [2]))
        time.sleep(0.8)                                # the loop is held past the grid time
        await asyncio.sleep(0.05)
        late = batcher.history[-1]
        assert late.requests == 1 and late.late_ms >= 250 and late.held_ms == 0
        assert [o.new_token_ids for o in unpickled(await mailbox.take.remote("ingress"))] == [[2]]
        import ray
        ray.kill(mailbox)

    asyncio.run(scenario())


def test_a_request_that_missed_a_grid_time_goes_at_once(ray_cluster):
    """b's outputs keep the grid going; a's step took longer than an interval (a's batch in psd, a long prefill):
    its output goes as it comes, not at the next grid time."""
    async def scenario():
        mailbox = start_mailbox()
        await mailbox.alive.remote()
        batcher = OutputBatcher(mailbox, interval_s=1.0)
        batcher.put("ingress", StepOutput("a", [1]), urgent=True)
        await mailbox.take.remote("ingress")
        batcher.put("ingress", StepOutput("b", [5]))                     # the grid's first time: 1 s on
        assert [o.request_id for o in unpickled(await mailbox.take.remote("ingress"))] == ["b"]
        await asyncio.sleep(0.1)                                        # a has had nothing for over an interval
        batcher.put("ingress", StepOutput("a", [2]))
        batcher.put("ingress", StepOutput("b", [6]))                     # b's: the next grid time, 0.9 s away
        # a's comes back while b's is held (not with it at the grid time)
        assert [(o.request_id, o.new_token_ids) for o in unpickled(await mailbox.take.remote("ingress"))] == \
            [("a", [2])]
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
        # fresh: the same two puts with no wait, against a stale time no round trip of a loaded machine reaches
        mailbox = Mailbox.remote(stale_s=0.5 if stale else 60.0)
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


def test_direct_ingress_settings():
    """`ingress_http: direct` needs Ray's direct ingress on the instance (a setting of its processes' environment):
    refused clearly without it; auto takes what the instance runs, and on an instance of its own runs direct ingress
    for one fixed ingress replica (one URL) and the proxy for several (one URL spread over them). The private
    instance's environment puts the replicas on --port and up."""
    from minedraft_ray.config import EngineConfig
    from minedraft_ray.serve.ingress_http import (check_ingress_http, direct_ingress_environ,
                                                  private_instance_runs_direct)

    assert EngineConfig().ingress_http == "auto" and private_instance_runs_direct(EngineConfig())
    assert not private_instance_runs_direct(EngineConfig(ingress_replicas=2))
    assert not private_instance_runs_direct(EngineConfig(ingress_max_replicas=3))
    assert private_instance_runs_direct(EngineConfig(ingress_http="direct", ingress_replicas=2))
    assert not private_instance_runs_direct(EngineConfig(ingress_http="proxy"))
    for setting in ("auto", "proxy"):
        check_ingress_http(setting, environ={})
    with pytest.raises(ValueError, match="RAY_SERVE_ENABLE_DIRECT_INGRESS=1"):
        check_ingress_http("direct", environ={})
    env = direct_ingress_environ(8000, 2)
    check_ingress_http("direct", environ=env)
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8000" and env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == "8004"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"
    with pytest.raises(ValueError):
        EngineConfig(ingress_http="haproxy")


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


def test_a_stopping_replica_hands_out_its_outputs_first(ray_cluster):
    """OutputBatcher.drain (a stopping engine replica, whose mailbox dies with it): what is pending goes at once,
    and the call returns once the subscriber has taken everything; with nobody taking it gives up at its timeout,
    and at once when the mailbox is gone."""
    async def scenario():
        import ray

        mailbox = start_mailbox()
        await mailbox.alive.remote()
        batcher = OutputBatcher(mailbox, interval_s=60.0)
        batcher.put("ingress", StepOutput("a", [1]), urgent=True)
        assert [o.new_token_ids for o in unpickled(await mailbox.take.remote("ingress"))] == [[1]]
        batcher.put("ingress", StepOutput("a", [2]))                    # pending: its grid time is a minute away
        batcher.put("ingress", StepOutput("b", [7], finished=True, finish_reason="length"))
        t0 = time.monotonic()
        assert not await batcher.drain(0.3)                              # sent, but nobody took it
        assert time.monotonic() - t0 >= 0.3

        async def take_soon():
            await asyncio.sleep(0.2)
            return unpickled(await mailbox.take.remote("ingress"))
        taker = asyncio.create_task(take_soon())
        assert await batcher.drain(60.0)                                 # returns once it was taken
        taken = await taker
        tokens = {}
        for out in taken:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert tokens == {"a": [2], "b": [7]}
        ray.kill(mailbox)
        batcher.put("ingress", StepOutput("a", [3], finished=True, finish_reason="length"))
        t1 = time.monotonic()
        assert not await batcher.drain(60.0) and time.monotonic() - t1 < 30   # a dead mailbox: at once
    asyncio.run(scenario())


def test_outputs_sent_and_polled_from_a_cancelled_request_survive_its_cancellation(ray_cluster):
    """Ray cancels the calls a cancelled task made in its context with it, and a client that leaves cancels its
    request's task while that task still runs (Serve's request task outlives the handler, and may be cancelled again).
    Engine side: the request's last output (the abort) is flushed from its own task, through a mailbox that has
    not run the put yet when the second cancel comes: the put must not go with it, or that batch and every later one
    of the replica (applied in order) never reach the ingress. Ingress side: the mailbox's poller, started by the
    first request that watched it, must not go with that request: its in-flight take cancelled would fail every
    other request on that mailbox as if the engine had died."""
    import ray

    from minedraft_ray.serve.streams import Mailbox, RequestSink

    @ray.remote(num_cpus=0)
    class SlowMailbox(Mailbox.__ray_actor_class__):
        async def put(self, seq, batch, release_at=0.0):
            await asyncio.sleep(1.0)   # still to run when the request's task is cancelled the second time
            await super().put(seq, batch, release_at)

    @ray.remote(num_cpus=0)
    class EngineSide:   # EngineServer.generate's part: a cancelled request ends with its abort output
        def __init__(self, mailbox):
            self.batcher = OutputBatcher(mailbox, interval_s=60.0)

        async def generate(self, request_id: str):
            sink = RequestSink(self.batcher, "ingress")
            sink.put_nowait(StepOutput(request_id, [1]))
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                sink.put_nowait(StepOutput(request_id, [], finished=True, finish_reason="abort"))
                await asyncio.sleep(30)   # the task still runs, as Serve's does after the handler returns
                raise

        async def all_sent(self) -> bool:   # every output handed to the mailbox (its puts may still run)
            return not self.batcher.pending and not self.batcher.released

    @ray.remote(num_cpus=0)
    class IngressSide:   # the ingress replica: requests share the router, whose poller the first one started
        def __init__(self):
            self.router = StreamRouter("ingress", concurrent.futures.ThreadPoolExecutor(1))
            self.outputs: dict[str, Outputs] = {}

        async def request(self, request_id: str, mailbox, hold: bool):
            self.outputs[request_id] = Outputs()
            self.router.open(request_id, self.outputs[request_id])
            self.router.watch(request_id, Accepted(mailbox, "engine-1"))
            if hold:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    await asyncio.sleep(30)   # the task still runs, as Serve's does after the handler returns
                    raise

        async def watching(self) -> list[str]:
            return list(self.router.mailbox_of)

        async def next_output(self, request_id: str) -> StepOutput:
            return await asyncio.wait_for(self.outputs[request_id].get(), 20)

    async def scenario():
        mailbox = SlowMailbox.remote()
        engine, ingress = EngineSide.remote(mailbox), IngressSide.remote()   # Outputs goes along by value
        first = ingress.request.remote("a", mailbox, hold=True)      # its task starts the poller
        while "a" not in await ingress.watching.remote():
            await asyncio.sleep(0.05)
        await ingress.request.remote("b", mailbox, hold=False)
        requests = {rid: engine.generate.remote(rid) for rid in ("a", "b")}
        for rid in requests:
            assert (await ingress.next_output.remote(rid)).new_token_ids == [1]
        # "a"'s client left (its ingress task and both engine tasks cancelled), and each task is cancelled
        # again while it still runs: the poller's take is then in flight, the engine's abort puts sent (each runs
        # for a second in the slow mailbox)
        for ref in (first, *requests.values()):
            ray.cancel(ref)
        while not await engine.all_sent.remote():
            await asyncio.sleep(0.02)
        for ref in (first, *requests.values()):
            ray.cancel(ref)
        for rid in requests:                 # every last output arrives, none as a dead engine's error
            last = await ingress.next_output.remote(rid)
            assert last.finished and last.finish_reason == "abort" and last.error is None, (rid, last)
        for actor in (engine, ingress, mailbox):
            ray.kill(actor)

    # the actors use this module's Outputs, which Ray's workers cannot import (tests/ is no package of theirs)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        asyncio.run(scenario())
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
