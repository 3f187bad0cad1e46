"""Engine outputs to the ingress in step batches: one Ray message per stream interval for every request of an ingress
replica, instead of one Serve streaming item per request per interval.

A per-request Serve stream costs CPU at each end per item (the engine replica's Serve generator machinery runs in
the process whose event loop drives the step loop; the ingress deserialises, routes and wakes a task per item), so
at a few hundred streams the items, not the engine, set the pace. Here a request's Serve call
(`EngineServer.generate`) carries only its admission (`Accepted`) and stays open as the request's handle
(cancelling it aborts the request on the replica that holds it); the manager puts its outputs into a `RequestSink`,
straight into the replica's `OutputBatcher`, which merges each request's outputs and sends everything pending to
the replica's `Mailbox` actor in one call per `stream_interval_ms` (a request's first output and its last go at
once). Each ingress replica long-polls the mailboxes of the engine replicas it has requests on (`StreamRouter`) and
applies each delivery to its requests in one call off the event loop. The mailbox is owned by the engine replica's
process, so it dies with it and the pollers see the failure.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import pickle
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Protocol

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..runtime.streams import StepOutput

log = logging.getLogger("minedraft.serve")

POLL_S = 5.0           # a mailbox long-poll returns empty after this long
STALE_S = 120.0        # outputs of a subscriber that has not polled for this long are dropped (its replica is gone)


@dataclass
class Accepted:
    """A request's first item on its Serve stream: queued on an engine replica, whose outputs come through `mailbox`
    (`key` names that replica's mailbox)."""
    mailbox: object
    key: str


@dataclass(frozen=True)
class FlushRecord:
    """One interval flush of an engine replica's outputs, for benchmarks (EngineServer.flushes_since)."""
    t: float                         # wall clock
    late_ms: float                   # after its grid time: the replica's event loop (the step loop's) was busy
    requests: int                    # requests with outputs in it


def merge_outputs(a: StepOutput, b: StepOutput) -> StepOutput:
    """Two consecutive outputs of one request as one (b's finish, stats and error win)."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return StepOutput(a.request_id, a.new_token_ids + b.new_token_ids, logprobs, b.finished, b.finish_reason,
                      b.stats, b.error)


@ray.remote(num_cpus=0)
class Mailbox:
    """Outputs of one engine replica waiting for their ingress replicas (subscribers). A batch is kept as the bytes
    the engine pickled: the mailbox neither unpickles nor imports what it carries."""

    def __init__(self, stale_s: float = STALE_S):
        self.stale_s = stale_s
        self.boxes: dict[str, list[bytes]] = defaultdict(list)
        self.ready: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.last_seen: dict[str, float] = {}
        self.next_seq = 0
        self.early: dict[int, dict[str, bytes]] = {}   # batches that overtook an earlier one

    async def alive(self) -> bool:
        return True

    async def put(self, seq: int, batch: dict[str, bytes]) -> None:
        """Batch `seq` of the engine replica's sequence: applied in that order (Ray does not keep the order of one
        caller's tasks on an async actor), so a request's outputs stay in order."""
        self.early[seq] = batch
        while self.next_seq in self.early:
            self._apply(self.early.pop(self.next_seq))
            self.next_seq += 1

    def _apply(self, batch: dict[str, bytes]) -> None:
        now = time.monotonic()
        for subscriber, outs in batch.items():
            self.boxes[subscriber].append(outs)
            self.last_seen.setdefault(subscriber, now)
            self.ready[subscriber].set()
        for subscriber in [s for s, seen in self.last_seen.items() if now - seen > self.stale_s]:
            self.boxes.pop(subscriber, None)
            self.ready.pop(subscriber, None)
            self.last_seen.pop(subscriber, None)

    async def take(self, subscriber: str, timeout_s: float = POLL_S) -> list[bytes]:
        """Everything waiting for `subscriber` (pickled lists of StepOutput, oldest first), at once if there is
        some, else as soon as some comes (or [])."""
        self.last_seen[subscriber] = time.monotonic()
        if not self.boxes.get(subscriber):
            ready = self.ready[subscriber]
            ready.clear()
            try:
                await asyncio.wait_for(ready.wait(), timeout_s)
            except asyncio.TimeoutError:
                return []
        self.last_seen[subscriber] = time.monotonic()
        return self.boxes.pop(subscriber, [])


def start_mailbox():
    """A mailbox on this node, owned by (and dying with) the calling process."""
    node = ray.get_runtime_context().get_node_id()
    return Mailbox.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()


class OutputBatcher:
    """Engine side: outputs of every request on this replica, merged per request and sent to the mailbox on a
    grid of one flush per interval; a request's first output and its last go at once, alone (with what that request
    had pending), so neither an arrival nor a finish sends the other requests an extra chunk or shifts their grid."""

    def __init__(self, mailbox, interval_s: float):
        self.mailbox, self.interval_s = mailbox, interval_s
        self.pending: dict[str, dict[str, StepOutput]] = {}   # subscriber -> request id -> merged output
        self.urgent: dict[str, set[str]] = {}                 # subscriber -> request ids to send at once
        self.seq = 0
        self.next_tick = 0.0          # the grid: the earliest time of the next interval's flush
        self.due = 0.0                # when the scheduled interval's flush is due
        self.tick: asyncio.TimerHandle | asyncio.Handle | None = None
        self.rush: asyncio.Handle | None = None
        self.history: deque[FlushRecord] = deque(maxlen=100_000)   # one per interval flush

    def put(self, subscriber: str, out: StepOutput, urgent: bool = False) -> None:
        outs = self.pending.setdefault(subscriber, {})
        prev = outs.get(out.request_id)
        outs[out.request_id] = out if prev is None else merge_outputs(prev, out)
        loop = asyncio.get_running_loop()
        now = loop.time()
        if urgent or out.finished:
            self.urgent.setdefault(subscriber, set()).add(out.request_id)
            if self.rush is None:
                self.rush = loop.call_soon(self._flush_urgent)
            if self.tick is None and self.next_tick <= now:   # an idle grid starts here: next output an interval on
                self.next_tick = now + self.interval_s
            return
        if self.tick is None:
            self.due = max(now, self.next_tick)
            self.tick = loop.call_soon(self.flush) if self.due <= now else loop.call_at(self.due, self.flush)

    def _send(self, batch: dict[str, list[StepOutput]]) -> None:
        if batch:
            self.mailbox.put.remote(self.seq, {subscriber: pickle.dumps(outs, protocol=pickle.HIGHEST_PROTOCOL)
                                               for subscriber, outs in batch.items()})
            self.seq += 1

    def _flush_urgent(self) -> None:
        self.rush = None
        batch = {}
        for subscriber, ids in self.urgent.items():
            outs = self.pending.get(subscriber, {})
            batch[subscriber] = [outs.pop(i) for i in ids if i in outs]
            if not outs:
                self.pending.pop(subscriber, None)
        self.urgent = {}
        self._send({subscriber: outs for subscriber, outs in batch.items() if outs})

    def flush(self) -> None:
        """The interval's flush: everything pending. The next one is due an interval after this one was (lateness
        does not add up)."""
        now = asyncio.get_running_loop().time()
        self.tick = None
        self.next_tick = self.due + self.interval_s
        if self.next_tick < now:   # the loop was held up for over an interval: start the grid afresh
            self.next_tick = now + self.interval_s
        self.urgent = {}   # their outputs go now, with the rest
        if self.rush is not None:
            self.rush.cancel()
            self.rush = None
        batch = {subscriber: list(outs.values()) for subscriber, outs in self.pending.items() if outs}
        self.pending = {}
        self._send(batch)
        self.history.append(FlushRecord(time.time(), (now - self.due) * 1e3, sum(map(len, batch.values()))))


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
        if accepted.key not in self.pollers:
            self.pollers[accepted.key] = asyncio.get_running_loop().create_task(self._poll(accepted))

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
                batches = await accepted.mailbox.take.remote(self.subscriber)
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
