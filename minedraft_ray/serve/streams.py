"""Engine outputs to the ingress in step batches: one Ray message per stream interval for every request of an ingress
replica, instead of one Serve streaming item per request per interval.

A per-request Serve stream costs CPU at each end per item (the engine replica's Serve generator machinery runs in
the process whose event loop drives the step loop; the ingress deserialises, routes and wakes a task per item), so
at a few hundred streams the items, not the engine, set the pace. Here a request's Serve call
(`EngineServer.generate`) carries only its admission (`Accepted`) and stays open as the request's handle
(cancelling it aborts the request on the replica that holds it); the manager puts its outputs into a `RequestSink`,
straight into the replica's `OutputBatcher`, which merges each request's outputs and sends everything pending to
the replica's `Mailbox` actor once per `stream_interval_ms` (a request's first output and its last go at once).
Each ingress replica long-polls the mailboxes of the engine replicas it has requests on (`StreamRouter`) and
applies each delivery to its requests in one call off the event loop. The mailbox is owned by the engine replica's
process, so it dies with it and the pollers see the failure.

When the outputs go out (`FlushGrid`): on a fixed grid of one release per interval. The engine replica's event loop
runs the step loop, and at a large batch committing a step keeps it busy for most of the step, so a timer on that
loop fires at the end of the commit it fell into: the releases would land on step ends, and the gaps between a
request's chunks on multiples of the step (two 11 ms steps: 22 ms gaps against a 20 ms interval). So the batcher
sends a grid time's outputs at the end of the last step whose commit ends before it (the measured step time says
which one that is) and the mailbox, whose loop is idle, holds them until the grid time. A step that ends after a grid
time with nothing sent for it sends at once; the timer on the loop is the fallback when no step ends near a grid time.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import pickle
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Literal, Protocol

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..runtime.streams import StepOutput

log = logging.getLogger("minedraft.serve")

POLL_S = 5.0           # a mailbox long-poll returns empty after this long
DRAIN_POLL_S = 0.02    # a stopping engine replica asks its mailbox this often whether its outputs were taken
STALE_S = 120.0        # outputs of a subscriber that has not polled for this long are dropped (its replica is gone)


@dataclass
class Accepted:
    """A request's first item on its Serve stream: queued on an engine replica, whose outputs come through `mailbox`
    (`key` names that replica's mailbox)."""
    mailbox: object
    key: str


@dataclass(frozen=True)
class Refusal:
    """A request's only item on its Serve stream when the engine replica does not take it: its queue is full, or it
    is dead."""
    reason: Literal["queue_full", "engine_dead"]


@dataclass(frozen=True)
class FlushRecord:
    """One interval flush of an engine replica's outputs, for benchmarks (EngineServer.flushes_since)."""
    t: float                         # wall clock when it was sent
    late_ms: float                   # its release after its grid time: the replica's event loop was busy then
    held_ms: float                   # sent this long before its grid time, the mailbox holding it until then
    requests: int                    # requests with outputs in it


@dataclass
class FlushGrid:
    """When an engine replica's merged outputs are released (monotonic clock, seconds): grid times one interval
    apart, kept without drift. Pure bookkeeping: `OutputBatcher` asks it at each step's end and when its timer fires.

    At the end of a step's commit (the replica's loop is free again until the next result arrives) the pending
    outputs are sent when the next commit is expected to end after the grid time (`step_s` ahead), released at the
    grid time; at once when the grid time has passed, or when steps take longer than the interval. Otherwise they
    wait for a later step or for the timer."""
    interval_s: float
    next_due: float | None = None    # the next grid time; None until the first output
    step_s: float | None = None      # the engine's step, smoothed over its recent steps

    STEP_WEIGHT = 0.25               # of the newest step in `step_s`: a few steps' memory, so a prefill spike fades

    def due(self, now: float) -> float:
        if self.next_due is None:   # the grid starts an interval after the first output
            self.next_due = now + self.interval_s
        return self.next_due

    def observe_step(self, step_s: float) -> None:
        self.step_s = step_s if self.step_s is None else self.step_s + self.STEP_WEIGHT * (step_s - self.step_s)

    def at_step_end(self, now: float, pending: bool) -> float | None:
        """A step's commit ended at `now`: the release time of the pending outputs if they go now, else None."""
        due = self.due(now)
        slow = self.step_s is not None and self.step_s >= self.interval_s   # every step is a chunk of its own
        if now >= due or (pending and slow):   # at once (a grid time that passed with nothing pending is skipped)
            self._pass(now)
            return now if pending else None
        if pending and self.step_s is not None and now + self.step_s > due:   # the next commit ends past it
            self._pass(due)
            return due
        return None

    def at_timer(self, now: float) -> float:
        """The loop's timer for the grid time fired at `now` (at or after it): the release time, now."""
        self._pass(max(now, self.due(now)))
        return now

    def _pass(self, t: float) -> None:
        """The next grid time is the first one after `t` (an interval of 0: every step is one)."""
        due = self.due(t)
        if t >= due:
            self.next_due = t if self.interval_s <= 0 else \
                due + (int((t - due) / self.interval_s) + 1) * self.interval_s


def outside_request(fn, *args):
    """fn(*args) in an empty context. Ray files an actor call as a child of the task whose context it is made in
    (a Serve request's, when its handler, or a callback it scheduled, makes it) and cancels a task's children with
    it: a client that leaves cancels its request's task, and a mailbox put or take made there would go too (a lost
    put holds every later batch of the replica, which the mailbox applies in order). Ray Serve's long-poll client
    starts its calls the same way (ray-project/ray#52476)."""
    return contextvars.Context().run(fn, *args)


def merge_outputs(a: StepOutput, b: StepOutput) -> StepOutput:
    """Two consecutive outputs of one request as one (b's finish, stats and error win)."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return StepOutput(a.request_id, a.new_token_ids + b.new_token_ids, logprobs, b.finished, b.finish_reason,
                      b.stats, b.error)


@ray.remote(num_cpus=0)
class Mailbox:
    """Outputs of one engine replica waiting for their ingress replicas (subscribers), each batch until its release
    time (time.monotonic of this node: the engine replica sends a grid time's outputs ahead of it, FlushGrid). A batch
    is kept as the bytes the engine pickled: the mailbox neither unpickles nor imports what it carries."""

    def __init__(self, stale_s: float = STALE_S):
        self.stale_s = stale_s
        self.boxes: dict[str, list[tuple[float, bytes]]] = defaultdict(list)   # (release time, batch), in order
        self.ready: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.last_seen: dict[str, float] = {}
        self.next_seq = 0
        self.early: dict[int, tuple[dict[str, bytes], float]] = {}   # batches that overtook an earlier one

    async def alive(self) -> bool:
        return True

    async def undelivered(self) -> tuple[int, int]:
        """(batches applied, in the sender's sequence; batches still held for their subscribers)."""
        return self.next_seq, sum(map(len, self.boxes.values())) + len(self.early)

    async def put(self, seq: int, batch: dict[str, bytes], release_at: float = 0.0) -> None:
        """Batch `seq` of the engine replica's sequence, released to its subscribers at `release_at` (0: at once):
        applied in seq order (Ray does not keep the order of one caller's tasks on an async actor). A request's
        later outputs never have an earlier release time than its earlier ones (OutputBatcher), so each request's
        outputs stay in order."""
        self.early[seq] = (batch, release_at)
        while self.next_seq in self.early:
            self._apply(*self.early.pop(self.next_seq))
            self.next_seq += 1

    def _apply(self, batch: dict[str, bytes], release_at: float) -> None:
        now = time.monotonic()
        for subscriber, outs in batch.items():
            self.boxes[subscriber].append((release_at, outs))
            self.last_seen.setdefault(subscriber, now)
            self.ready[subscriber].set()
        for subscriber in [s for s, seen in self.last_seen.items() if now - seen > self.stale_s]:
            self.boxes.pop(subscriber, None)
            self.ready.pop(subscriber, None)
            self.last_seen.pop(subscriber, None)

    def _released(self, subscriber: str, now: float) -> list[bytes]:
        box = self.boxes.get(subscriber)
        if not box:
            return []
        out = [outs for release_at, outs in box if release_at <= now]
        if out:
            self.boxes[subscriber] = [entry for entry in box if entry[0] > now]
        return out

    async def take(self, subscriber: str, timeout_s: float = POLL_S) -> list[bytes]:
        """Everything released for `subscriber` (pickled lists of StepOutput, oldest first), at once if there is
        some, else as soon as some is (or [] after timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            self.last_seen[subscriber] = now
            out = self._released(subscriber, now)
            if out or now >= deadline:
                return out
            held = self.boxes.get(subscriber)
            wake = min([deadline] + [release_at for release_at, _ in held or ()])
            ready = self.ready[subscriber]
            ready.clear()
            try:   # a new batch, or the earliest held one's release time
                await asyncio.wait_for(ready.wait(), max(wake - now, 0.0))
            except asyncio.TimeoutError:
                pass


def start_mailbox():
    """A mailbox on this node, owned by (and dying with) the calling process."""
    node = ray.get_runtime_context().get_node_id()
    return Mailbox.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()


class OutputBatcher:
    """Engine side: outputs of every request on this replica, merged per request and sent to the mailbox once per
    interval, released there on `FlushGrid`'s grid. A request's first output and its last go at once, alone (with what
    that request had pending), so neither an arrival nor a finish sends the other requests an extra chunk or shifts
    their grid; so does the output of a request that got nothing for an interval (its steps are slower than the
    interval, or a long one missed a grid time). `step_done` is called at the end of every step's commit."""

    def __init__(self, mailbox, interval_s: float):
        self.mailbox, self.interval_s = mailbox, interval_s
        self.grid = FlushGrid(interval_s)
        self.pending: dict[str, dict[str, StepOutput]] = {}   # subscriber -> request id -> merged output
        self.urgent: dict[str, set[str]] = {}                 # subscriber -> request ids to send at once
        self.released: dict[str, float] = {}                  # request id -> release time of its latest output sent
        self.pending_since: float | None = None               # the oldest pending output's arrival (for lateness)
        self.seq = 0
        self.timer: asyncio.TimerHandle | None = None         # the grid time's fallback on the loop
        self.rush: asyncio.Handle | None = None
        self.history: deque[FlushRecord] = deque(maxlen=100_000)   # one per interval flush

    def put(self, subscriber: str, out: StepOutput, urgent: bool = False) -> None:
        outs = self.pending.setdefault(subscriber, {})
        prev = outs.get(out.request_id)
        outs[out.request_id] = out if prev is None else merge_outputs(prev, out)
        now = time.monotonic()
        if urgent or out.finished or now - self.released.get(out.request_id, now) >= self.interval_s:
            self.urgent.setdefault(subscriber, set()).add(out.request_id)
            if self.rush is None:
                self.rush = asyncio.get_running_loop().call_soon(self._flush_urgent)
            return
        if self.pending_since is None:
            self.pending_since = now
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(max(self.grid.due(now) - now, 0.0), self._on_timer)

    def step_done(self, step_s: float) -> None:
        """A step's commit ended (its outputs are in); `step_s`: the engine's measure of that step."""
        self.grid.observe_step(step_s)
        now = time.monotonic()
        due = self.grid.due(now)
        release_at = self.grid.at_step_end(now, self._has_pending())
        if release_at is not None:
            self._flush(now, due, release_at)

    def _on_timer(self) -> None:
        self.timer = None
        now = time.monotonic()
        due = self.grid.due(now)
        release_at = self.grid.at_timer(now)
        if self._has_pending():
            self._flush(now, due, release_at)

    def _has_pending(self) -> bool:
        return any(self.pending.values())

    def _send(self, batch: dict[str, list[StepOutput]], release_at: float) -> None:
        if batch:   # a request's last output is sent from its own task when that is cancelled (an abort)
            outside_request(self.mailbox.put.remote, self.seq, {
                subscriber: pickle.dumps(outs, protocol=pickle.HIGHEST_PROTOCOL) for subscriber, outs in batch.items()},
                release_at)
            self.seq += 1
            for outs in batch.values():
                for out in outs:
                    if out.finished:
                        self.released.pop(out.request_id, None)
                    else:
                        self.released[out.request_id] = release_at

    def _flush_urgent(self) -> None:
        """The urgent requests' outputs, at once; a last output not before its request's output the mailbox
        holds (sent ahead of its grid time), which it must not overtake."""
        self.rush = None
        now = time.monotonic()
        by_release: dict[float, dict[str, list[StepOutput]]] = {}
        for subscriber, ids in self.urgent.items():
            outs = self.pending.get(subscriber, {})
            for request_id in ids:
                if request_id in outs:
                    release_at = max(now, self.released.get(request_id, now))
                    by_release.setdefault(release_at, {}).setdefault(subscriber, []).append(outs.pop(request_id))
            if not outs:
                self.pending.pop(subscriber, None)
        self.urgent = {}
        for release_at, batch in sorted(by_release.items()):
            self._send(batch, release_at)

    async def drain(self, timeout_s: float) -> bool:
        """Send every pending output now and wait, up to timeout_s, until the mailbox has handed out all that was
        sent: it dies with this replica, and a request's last output may still wait there for its ingress's next
        take when the replica stops. False when something was left (or the mailbox is gone)."""
        for subscriber, outs in self.pending.items():
            self.urgent.setdefault(subscriber, set()).update(outs)
        for handle in (self.rush, self.timer):
            if handle is not None:
                handle.cancel()
        self.timer = None
        self._flush_urgent()   # each at once, none before an output of its request the mailbox holds
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                applied, held = await self.mailbox.undelivered.remote()
            except ray.exceptions.RayActorError:
                return False
            if applied >= self.seq and not held:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)

    def _flush(self, now: float, due: float, release_at: float) -> None:
        """The interval's flush: everything pending, released at `release_at`. When that is ahead (the mailbox
        holds it), the urgent outputs (first tokens, finishes) stay behind for the rush, which sends them at once."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if release_at <= now:   # the urgent outputs go now, with the rest
            self.urgent = {}
            if self.rush is not None:
                self.rush.cancel()
                self.rush = None
        batch = {}
        for subscriber, outs in list(self.pending.items()):
            stay = self.urgent.get(subscriber, ())
            sent = [outs.pop(request_id) for request_id in [i for i in outs if i not in stay]]
            if sent:
                batch[subscriber] = sent
            if not outs:
                del self.pending[subscriber]
        self._send(batch, release_at)
        # late: after its grid time, or after its oldest output came when that was later (a grid time that passed
        # with nothing pending is not a delay)
        late = release_at - max(due, self.pending_since if self.pending_since is not None else now)
        self.pending_since = None
        self.history.append(FlushRecord(time.time(), max(late, 0.0) * 1e3, max(release_at - now, 0.0) * 1e3,
                                        sum(map(len, batch.values()))))


class RequestSink:
    """Engine side, one request: the manager puts its outputs here as the steps commit them (BatchManager.submit);
    they go straight to the replica's batcher, the first and the last flushed at once. `done` is set by the last."""

    def __init__(self, batcher: OutputBatcher, subscriber: str):
        self.batcher, self.subscriber = batcher, subscriber
        self.done = asyncio.Event()
        self.first = True

    def put_nowait(self, out: StepOutput) -> None:
        self.batcher.put(self.subscriber, out, urgent=self.first)
        self.first = False
        if out.finished:
            self.done.set()


class OutputReceiver(Protocol):
    """Ingress side, one request: what the router hands its outputs to."""

    def apply(self, outs: list[StepOutput]) -> None:
        """The request's outputs of one delivery, in order. Runs on the router's pool (or its loop without one),
        for every request of the delivery in one call; must not raise."""

    def wake(self) -> None:
        """On the loop, after `apply`: outputs were applied."""


class StreamRouter:
    """Ingress side: one long-poll per engine replica's mailbox; each delivery (every request's outputs of an
    interval) is unpickled and applied to its requests in one call on `pool`, then the requests are woken. Per
    request and chunk that leaves no thread hop and no task wake-up but its own; the detokenizing stays off the
    loop that serves the other clients."""

    def __init__(self, subscriber: str, pool: concurrent.futures.Executor | None = None):
        self.subscriber, self.pool = subscriber, pool
        self.receivers: dict[str, OutputReceiver] = {}
        self.mailbox_of: dict[str, str] = {}          # request id -> mailbox key
        self.pollers: dict[str, asyncio.Task] = {}    # mailbox key -> its poll task

    def open(self, request_id: str, receiver: OutputReceiver) -> None:
        self.receivers[request_id] = receiver

    def close(self, request_id: str) -> None:
        self.receivers.pop(request_id, None)
        self.mailbox_of.pop(request_id, None)

    def watch(self, request_id: str, accepted: Accepted) -> None:
        """The request's outputs come from `accepted`'s mailbox: poll it (once per mailbox)."""
        if request_id not in self.receivers:
            return
        self.mailbox_of[request_id] = accepted.key
        if accepted.key not in self.pollers:   # not the watching request's child: it outlives that request
            self.pollers[accepted.key] = asyncio.get_running_loop().create_task(self._poll(accepted),
                                                                                context=contextvars.Context())

    def _deliver(self, batches: list[bytes]) -> list[OutputReceiver]:
        """Unpickle a delivery and apply each request's outputs (on the pool) -> the receivers to wake."""
        outs_of: dict[str, list[StepOutput]] = {}
        for batch in batches:
            for out in pickle.loads(batch):
                outs_of.setdefault(out.request_id, []).append(out)
        applied = []
        for request_id, outs in outs_of.items():
            receiver = self.receivers.get(request_id)   # closed meanwhile (the client left): dropped
            if receiver is not None:
                receiver.apply(outs)
                applied.append(receiver)
        return applied

    async def _poll(self, accepted: Accepted) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    batches = await accepted.mailbox.take.remote(self.subscriber)
                except ray.exceptions.TaskCancelledError:   # a take cancelled is no dead engine: poll again
                    log.debug("a take from mailbox %s was cancelled; polling again", accepted.key)
                    continue
                if not batches:
                    continue
                applied = self._deliver(batches) if self.pool is None else \
                    await loop.run_in_executor(self.pool, self._deliver, batches)
                for receiver in applied:
                    receiver.wake()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine replica (and its mailbox) died: its requests end with the error
            log.warning("engine outputs unreachable (%s): failing its requests", e)
            for request_id, key in list(self.mailbox_of.items()):
                receiver = self.receivers.get(request_id)
                if key == accepted.key and receiver is not None:
                    receiver.apply([StepOutput(request_id, [], finished=True, finish_reason="abort",
                                               error=f"the engine replica died: {e}")])
                    receiver.wake()
        finally:
            self.pollers.pop(accepted.key, None)
