"""Starting, restarting and stopping an engine's worker actors (the verifier, and the drafter where it has its
own GPU) in the engine's placement group, and the draft channel between them. A target at tensor-parallel size
tp > 1 is the verifier (rank 0) plus tp - 1 TargetRank actors, which meet in Ray's GCS (runtime/rendezvous.py:
nothing listens for them) and run as long as their group does (`follows`).

The actors' classes here (`VerifierActor`, `DrafterActor`, `SpecActor`, `TargetRankActor`) are the calls the manager
makes, each handed to a worker (workers.py) that the actor's own process builds from its class's import path
(`WorkerSet`): the manager's process starts them without importing the workers' module, and so without torch."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup

from ..config import EngineConfig
from .messages import ChannelSpec, WorkerConfig
from .placement import actor_options, create_placement_group
from .rendezvous import Rendezvous
from .transport import DraftChannel

log = logging.getLogger("minedraft.runtime")

# an actor start loads weights and captures its CUDA graphs: far longer than any step may take
START_TIMEOUT_S = 900.0
# starts of the workers when a worker's process dies while it starts (not an error its constructor raised, which
# would raise again): a process killed from outside (the OOM killer, a node's hiccup) costs a second start, not
# the engine
START_ATTEMPTS = 2


async def wait_for(ref, what: str, timeout_s: float):
    """A Ray result, or TimeoutError naming what took too long. The ref's future is awaited as it is: a coroutine
    would make asyncio.wait_for wrap it in a task of its own, and the manager awaits a few results every step."""
    future = asyncio.wrap_future(ref.future()) if isinstance(ref, ray.ObjectRef) else ref
    try:
        return await asyncio.wait_for(future, timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{what} took longer than {timeout_s:.0f} s") from None


async def first_error_cancels_the_rest(waits: list) -> list:
    """gather(), but the first error cancels the waits still running and takes the others' errors as read: a
    start that failed (and may be retried) leaves no task behind to report an exception nobody retrieved."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()
        raise


def class_path(cls: type) -> str:
    """A class's import path, as WorkerSet names it: "module:Class" (a class at its module's top level)."""
    path = f"{cls.__module__}:{cls.__qualname__}"
    check_class_path(path)
    return path


def check_class_path(path: str) -> None:
    """A worker class path names a top-level class of minedraft_ray's own modules: a wrong one fails here, in the
    caller, rather than as a dead actor at its start."""
    module, sep, name = path.partition(":")
    if not sep or not module.startswith("minedraft_ray.") or not name.isidentifier():
        raise ValueError(f"a worker class path is 'minedraft_ray.module:Class', not {path!r}")


@contextlib.contextmanager
def collector_paused():
    """No automatic garbage collection inside the block (the collector's state is restored after it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def import_class(path: str) -> type:
    check_class_path(path)
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class WorkerSet:
    """The worker classes an engine starts, by import path ("module:Class", `class_path`), and extra constructor
    arguments per role: each actor's process imports its class, the manager's never does. Serving always uses the
    default; tests and benchmarks name subclasses from minedraft_ray.testing.workers (faults, synthetic acceptance,
    recording), which the HTTP server cannot name."""
    verifier: str = "minedraft_ray.runtime.workers:VerifierWorker"
    drafter: str = "minedraft_ray.runtime.workers:DrafterWorker"
    spec: str = "minedraft_ray.runtime.workers:SpecWorker"
    verifier_kwargs: dict = field(default_factory=dict)   # for the verifier and the spec worker
    drafter_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        for path in (self.verifier, self.drafter, self.spec):
            check_class_path(path)


TARGET_RANK = "minedraft_ray.runtime.workers:TargetRank"


class _WorkerActor:
    """A worker actor: `worker`, the class path of what it runs, built in the actor's process with the rest of the
    arguments; each call of the manager's is handed to it."""

    def __init__(self, worker: str, /, *args, **kwargs):
        # the worker's module brings torch and the engine: objects that live as long as the process, which the
        # collector would scan over and over while they are created (full collections included) and free little of.
        # One collection after the import frees its garbage, and freezing the rest (as `ready` freezes what the
        # build adds) keeps it out of the collections the build and the steps trigger. Both before the collector
        # resumes: its first passes would otherwise scan every object the import made as young
        with collector_paused():
            cls = import_class(worker)
            gc.collect()
            gc.freeze()
        self.worker = cls(*args, **kwargs)

    def ready(self) -> dict:
        return self.worker.ready()


class VerifierActor(_WorkerActor):
    def prefill(self, task: list) -> list:
        return self.worker.prefill(task)

    def verify(self, task: list, *drafts) -> list:
        return self.worker.verify(task, *drafts)

    def open_link(self, generation: int) -> str:
        return self.worker.open_link(generation)

    def drain_drafts(self, round_: list) -> None:
        self.worker.drain_drafts(round_)

    def open_channel_end(self, spec: ChannelSpec) -> None:
        self.worker.open_channel_end(spec)

    def close_channel_end(self, generation: int, reason: str) -> None:
        self.worker.close_channel_end(generation, reason)


class SpecActor(VerifierActor):
    def step(self, task: list) -> list:
        return self.worker.step(task)


class DrafterActor(_WorkerActor):
    def prefill(self, task: list) -> float:
        return self.worker.prefill(task)

    @ray.method(num_returns=2)   # (drafts, device ms): declared here, not as an option on every round's call
    def draft(self, round_: list, *sources):
        return self.worker.draft(round_, *sources)

    def draft_over(self, key: list, round_: list, *sources) -> float:
        return self.worker.draft_over(key, round_, *sources)

    def join_link(self, generation: int, prefix: str) -> None:
        self.worker.join_link(generation, prefix)

    def drain_tokens(self, source: list) -> None:
        self.worker.drain_tokens(source)

    def open_channel_end(self, spec: ChannelSpec) -> None:
        self.worker.open_channel_end(spec)


class TargetRankActor(_WorkerActor):
    def follow(self) -> int:
        return self.worker.follow()


class WorkerActors:
    def __init__(self, config: EngineConfig, num_slots: int, channel: DraftChannel, workers: WorkerSet,
                 placement_group: PlacementGroup | None, vocab_limit: int | None):
        """vocab_limit: the pair's shared_vocab (engine/pair.py), checked before the engine started."""
        self.config, self.num_slots, self.channel, self.workers = config, num_slots, channel, workers
        self.worker_config = WorkerConfig(config.model_dump(), vocab_limit)
        self.mode = config.mode
        self.pg, self.own_pg = placement_group, False
        self.verifier = self.drafter = None
        self.ranks: list = []     # the target's ranks 1..tp-1 (tp > 1)
        self.follows: list = []   # their follow() calls, which end only with the group
        self.tp_group: Rendezvous | None = None   # where the ranks met; their NCCL group uses it while it lives
        self.drafter_seq = 0     # drafter tasks numbered so far (next_drafter_seq)
        self.info: dict = {}
        self.start_retries = 0   # starts of the workers again after a process died while starting (START_ATTEMPTS)
        options = {"max_restarts": 0, **channel.actor_options}
        self._verifier_cls, self._drafter_cls, self._spec_cls = (ray.remote(**options)(cls)
                                                                 for cls in (VerifierActor, DrafterActor, SpecActor))

    async def start(self) -> dict:
        """Both actors up, connected -> {"verifier": info, "drafter": info | None}. A worker whose process died
        while it started (ActorDiedError, its constructor raised nothing) has every worker started again, once."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return await self._start()
            except ray.exceptions.ActorDiedError as e:
                if e.actor_init_failed or attempt == START_ATTEMPTS:
                    raise
                log.warning("a worker's process died while it started (start %d of %d); starting the workers "
                            "again: %s", attempt, START_ATTEMPTS, e)
                self.start_retries += 1
                await self._stop_workers()

    async def _start(self) -> dict:
        if self.pg is None:
            self.pg = ray.util.get_current_placement_group()
        tp = self.config.tp
        if self.pg is None:
            self.pg = await asyncio.to_thread(create_placement_group, self.mode, tp=tp)
            self.own_pg = True
        # overlap: a threaded verifier; a task waits for its turn in a thread of its own, and the tasks in
        # flight at once are bounded by the batches' queue depths plus the prefills between them
        threads = {"max_concurrency": 16} if self.config.verifier_overlap else {}
        cls, role, worker = ((self._spec_cls, "spec", self.workers.spec) if self.mode == "sd"
                             else (self._verifier_cls, "verifier", self.workers.verifier))
        group = {}
        if tp > 1:
            self.tp_group = group["tp_group"] = Rendezvous.fresh("tp", START_TIMEOUT_S)
        self.verifier = cls.options(**actor_options(self.pg, self.mode, role, tp), **threads).remote(
            worker, self.worker_config, self.num_slots, **self.workers.verifier_kwargs, **group)
        waits = [wait_for(self.verifier.ready.remote(), "verifier start", START_TIMEOUT_S)]
        rank_cls = ray.remote(max_restarts=0)(TargetRankActor)
        # two threads: a rank answers calls (ready, a health probe) while it follows
        self.ranks = [rank_cls.options(**actor_options(self.pg, self.mode, "rank", tp, rank), max_concurrency=2)
                      .remote(TARGET_RANK, self.worker_config, self.num_slots, rank, group["tp_group"])
                      for rank in range(1, tp)]
        rank_waits = [wait_for(r.ready.remote(), f"target rank {i + 1} start", START_TIMEOUT_S)
                      for i, r in enumerate(self.ranks)]
        self.follows = [r.follow.remote() for r in self.ranks]
        if self.mode in ("sd_split", "psd"):
            self.drafter = self._new_drafter()
            waits.append(wait_for(self.drafter.ready.remote(), "drafter start", START_TIMEOUT_S))
        infos = await first_error_cancels_the_rest(waits + rank_waits)
        self.info = {"verifier": infos[0], "drafter": infos[1] if len(waits) > 1 else None,
                     "ranks": infos[len(waits):]}
        if self.drafter is not None:
            await self.channel.connect(self.drafter, self.verifier, infos[0]["device"])
        return self.info

    def _new_drafter(self):
        self.drafter_seq = 0   # a new drafter's tasks are numbered from 0 (workers.LaunchOrder)
        threads = {"max_concurrency": 16} if self.config.drafter_overlap else {}
        placement = actor_options(self.pg, self.mode, "drafter", self.config.tp)
        return self._drafter_cls.options(**placement, **threads).remote(
            self.workers.drafter, self.worker_config, self.num_slots, **self.workers.drafter_kwargs)

    async def replace_drafter(self) -> dict:
        """Kill the drafter (if any is left) and start a new one, connected -> its info."""
        old, self.drafter = self.drafter, None
        try:
            ray.kill(old, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.channel.drafter_gone(self.verifier)
        self.drafter = self._new_drafter()
        info = await wait_for(self.drafter.ready.remote(), "drafter restart", START_TIMEOUT_S)
        await self.channel.connect(self.drafter, self.verifier, info["device"])
        self.info = {**self.info, "drafter": info}
        return info

    def next_drafter_seq(self) -> int:
        """Number the next drafter task: the drafter launches its tasks' device work in this order."""
        self.drafter_seq += 1
        return self.drafter_seq - 1

    async def shutdown(self) -> None:
        await self._stop_workers()
        if self.own_pg:
            ray.util.remove_placement_group(self.pg)

    async def _stop_workers(self) -> None:
        await self.channel.disconnect()
        for actor in (self.verifier, self.drafter, *self.ranks):
            if actor is not None:
                ray.kill(actor, no_restart=True)
        if self.tp_group is not None:
            self.tp_group.close()
        self.verifier = self.drafter = self.tp_group = None
        self.ranks, self.follows = [], []
