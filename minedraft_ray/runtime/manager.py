"""The batch manager: owns the requests, the two batches and the step loop.

psd (the paper's batch parallelism): two batches A and B, each a chain draft -> verify -> commit ->
draft -> ... The verifier runs its tasks in submission order, so while it verifies A, B's drafts
are being made and B's verify is already queued behind A's (it takes B's drafts by reference, straight
from the drafter). The manager commits results in that same order; its host work for one batch
overlaps the other batch's verify, so it is off the verifier's critical path. The verifier keeps
each slot's last token, position and sampling settings (workers.SlotState), so a verify message
is slot ids plus a draft reference.

In psd and sd_split a request is in at most one verify in flight (plus, when new, its prefill ahead of
it); a request whose state is not committed yet (new, or moved between batches) rides without drafts or
waits a step. The other modes share the loop with one chain: `sd_split` (draft then verify, chained by
an object ref), and `ar` (verify only) and `sd` (one actor drafts and verifies), which build a step from
the verifier's slot state alone and so keep the next step queued behind the running one. The manager is a plain asyncio
object so it can live in a Serve replica (bundle 0 of the replica's placement group) or in an
actor (`LLM`).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup

from ..config import EngineConfig
from ..engine.engine import commit_tokens, default_device, draft_rows
from ..engine.kv_cache import SlotAllocator
from ..engine.loader import load_tokenizer
from ..engine.model import ModelConfig
from ..engine.presets import resolve_model
from ..engine.request import Request
from ..engine.sampling import SamplingParams
from ..observability.metrics import EngineMetrics, request_status
from .placement import actor_options, create_placement_group
from .regime import RegimeChooser
from .transport import default_transport, make_channel
from .workers import WorkerSet

log = logging.getLogger("minedraft.runtime")


# an actor start loads weights and captures its CUDA graphs: far longer than any step may take
START_TIMEOUT_S = 900.0


class EngineOverloadedError(RuntimeError):
    """The bounded queue is full: the caller should retry later (HTTP 429/503)."""


class EngineDeadError(RuntimeError):
    """The verifier (target model) is gone: no request can complete."""


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    logprobs: list[dict] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stats: dict | None = None
    error: str | None = None


@dataclass
class StepRecord:
    """One step, for tests, benchmarks and metrics."""
    regime: str                      # psd | seq | sd | ar
    sizes: tuple[int, int]           # batch sizes after the step (psd: A, B)
    verified: int
    drafted: int
    t_draft_ms: float = 0.0
    t_verify_ms: float = 0.0
    t_prefill_ms: float = 0.0        # verifier device time of the prefill of admitted requests
    step_ms: float = 0.0
    host_ms: float = 0.0             # manager time in the step not spent waiting on actors
    launch_gap_ms: float = 0.0       # verifier: start of this task - end of the previous verify
    cadence_ms: float | None = None  # end of the batch's previous verify -> end of this one (a request's period)
    emitted: int = 0
    accepted: int = 0
    draft_tokens: int = 0
    admitted: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def ms_per_row(self) -> float:
        """The verifier's wall time per row advanced, prefills left out (every request is prefilled once in
        either regime): what psd's high-load choice compares (runtime/regime.py)."""
        return (self.step_ms - self.t_prefill_ms) / self.verified


@dataclass
class _Task:
    """Verifier work in flight, in the order the verifier runs it."""
    kind: str                        # prefill | verify | step (sd: draft + verify in one actor)
    batch: int | None                # the batch whose chain a verify continues (None: prefill)
    requests: list[Request]
    ref: object                      # the verifier's result
    num_drafts: list[int]
    regime: str = ""
    draft_ms_refs: list = field(default_factory=list)   # the drafter's timing results, one per round
    drafts: list = field(default_factory=list)   # what the verify names as its drafts: refs or channel keys
    drafted: int = 0
    admitted: int = 0
    submitted: float = 0.0
    submitted_wall: float = field(default_factory=time.time)
    low_load: bool = False           # submitted while one batch held every running request
    high_load: str | None = None     # submitted while more wanted to run than one batch holds: the regime chosen
    seq: int = -1                    # the verifier's launch order (workers.LaunchOrder)
    draft_generation: int = 0        # the drafter its drafts came from (restarts count up)
    tokens_to: object = None         # collective channel: the key its tokens go to the next draft round under


@dataclass
class _DraftAhead:
    """A batch's next draft round, submitted together with the batch's verify (psd, sd_split): it takes that
    verify's result (and new rows' prefill results) by reference, so it starts on the drafter as soon as they
    exist instead of after the manager's commit; the commit then only submits the next verify."""
    drafts_ref: object
    ms_ref: object
    rows: dict          # id(request) -> (row in the round, seq of the request's last task it was built after)
    generation: int     # the drafter it went to


@dataclass
class RegimeSteps:
    """The regimes verify steps ran in at one load (psd's info reports these, not what a chooser would pick)."""
    steps: Counter = field(default_factory=Counter)
    last: str | None = None

    def add(self, regime: str) -> None:
        self.steps[regime] += 1
        self.last = regime


def _merged(a: StepOutput, b: StepOutput) -> StepOutput:
    """Two consecutive outputs of one request as one (b's finish, stats and error win)."""
    logprobs = (a.logprobs or []) + (b.logprobs or []) if a.logprobs is not None or b.logprobs is not None else None
    return StepOutput(a.request_id, a.new_token_ids + b.new_token_ids, logprobs, b.finished, b.finish_reason,
                      b.stats, b.error)


def _sampling_row(r: Request) -> tuple:
    p = r.params
    return (p.temperature, p.top_p, p.top_k, r.seed)


def workers_on_gpu(config: EngineConfig) -> bool:
    """Whether the workers will compute on a GPU. The manager shares their node (STRICT_PACK), and Ray hides no
    GPU from an actor that asks for none, so the workers' device choice can be made here."""
    return config.device == "cuda" or (config.device == "auto" and default_device().type == "cuda")


def overlap_by_default(config: EngineConfig) -> bool:
    """verifier_overlap's default: on where the verifier computes on a GPU (docs/design.md, "Overlap"); on a
    CPU the host is the device, nothing runs ahead and the waiting threads only contend."""
    return workers_on_gpu(config)


class BatchManager:
    def __init__(self, config: EngineConfig, placement_group: PlacementGroup | None = None,
                 workers: WorkerSet | None = None):
        self.config = config
        self.workers = workers or WorkerSet()   # Serve passes none: the production workers
        self.mode, self.k = config.mode, config.k
        target_dir = resolve_model(config.target)
        self.tokenizer = load_tokenizer(target_dir)
        model_cfg = ModelConfig.from_pretrained(target_dir)
        self.eos_token_ids = tuple(model_cfg.eos_token_ids)
        if config.max_len > model_cfg.max_position_embeddings:
            # the model's own context limit wins over the (generic) default
            log.warning("max_len %d exceeds the target's context (%d); using %d", config.max_len,
                        model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)
            config = config.model_copy(update={"max_len": model_cfg.max_position_embeddings})
            self.config = config
        if config.transport == "auto":
            config = config.model_copy(update={"transport": default_transport(on_gpu=workers_on_gpu(config))})
            self.config = config
        self.channel = make_channel(config.transport)
        if config.verifier_overlap is None:
            config = config.model_copy(update={"verifier_overlap": overlap_by_default(config)})
            self.config = config
        if config.drafter_overlap is None:
            config = config.model_copy(update={"drafter_overlap": config.verifier_overlap})
            self.config = config
        self.max_len = config.max_len
        self.num_slots = config.num_slots or config.max_running
        if self.num_slots < config.max_running:
            raise ValueError(f"num_slots ({self.num_slots}) must hold the {config.max_running} requests mode "
                             f"{config.mode!r} keeps in flight")
        self.slots = SlotAllocator(self.num_slots)
        self._pg = placement_group
        self._own_pg = False
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.batches: list[list[Request]] = [[], []]  # psd uses both; other modes only batches[0]
        # verifies queued per chain: `sd` and `ar` build a step from the verifier's slot state alone, so one
        # step waits behind the running one and the manager's host work overlaps the device; psd and
        # sd_split draft from committed tokens on another actor, so they queue one (psd has two chains)
        self.depth = 2 if self.mode in ("sd", "ar") else 1
        self._seq = 0                                  # verifier tasks numbered so far (_next_seq)
        self.queued = [0, 0]                           # verify tasks in flight per batch
        self.inflight: deque[_Task] = deque()          # verifier tasks, in submission (= run) order
        self._last_end = 0.0                           # wall clock at the end of the latest verify
        # per batch: (end of its latest verify, step, regime, prefills done by then)
        self._batch_end = [(0.0, -10, "", 0), (0.0, -10, "", 0)]
        self._prefills_done = 0
        # psd or one sequential batch at low load; at high load, once saturated, by the verifier's time per row,
        # sequential until the split measures cheaper (re-measured rarely: trying the sequential batch means
        # draining to max_batch first)
        self._chooser_args = {"low": {}, "high": dict(explore_every=2000, explore_steps=12, metric="ms_per_row",
                                                      current="seq", order=("seq", "psd"))}
        self.chooser = RegimeChooser(**self._chooser_args["low"])
        self.high_chooser = RegimeChooser(**self._chooser_args["high"])
        self.saturated = False   # psd: the demand filled both batches and has not yet fallen back to one batch
        self.one_batch = False                         # psd: everyone gathered in one sequential batch now
        self._prefill_ms = 0.0                         # prefill device time, reported with the next step
        self.history: deque[StepRecord] = deque(maxlen=100_000)
        self.counters = {"steps": 0, "drafter_failures": 0, "drafter_restarts": 0, "balance_violations": 0,
                         "moves": 0, "aborted": 0, "finished": 0,
                         # verifies submitted while one of the same batch was in flight; prompts sent to the drafter
                         "queued_behind": 0, "drafter_prefills": 0,
                         # verifies whose drafts came from a round drafted ahead; rows of such rounds not used
                         "drafts_ahead_used": 0, "draft_rows_unused": 0,
                         # verifies whose round failed (its drafter died) and ran without drafts
                         "draft_rounds_failed": 0}
        self.regime_steps = {"low": RegimeSteps(), "high": RegimeSteps()}   # what ran, per load (info)
        self.verifier = self.drafter = None
        self._drafter_seq = 0                          # drafter tasks numbered so far (_next_drafter_seq)
        self.drafter_alive = False
        self.drafter_generation = 0      # counts drafter restarts: rounds for a dead drafter are not waited for
        self.draft_ahead: list[_DraftAhead | None] = [None, None]   # per batch (psd, sd_split)
        self.dead: str | None = None
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None
        self.step_listeners: list = []   # callables(StepRecord) — metrics hook
        self.metrics = EngineMetrics(config.served_model_name, config.mode).attach(self)
        self._verifier_cls, self._drafter_cls, self._spec_cls = self.channel.actor_classes(self.workers)

    # ---- life cycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._pg is None:
            self._pg = ray.util.get_current_placement_group()
        if self._pg is None:
            self._pg = await asyncio.to_thread(create_placement_group, self.mode)
            self._own_pg = True
        cfg = self.config.model_dump()
        # overlap: a threaded verifier; a task waits for its turn in a thread of its own, and the tasks in
        # flight at once are bounded by the batches' queue depths plus the prefills between them
        threads = {"max_concurrency": 16} if self.config.verifier_overlap else {}
        if self.mode == "sd":
            self.verifier = self._spec_cls.options(**actor_options(self._pg, self.mode, "spec"), **threads).remote(
                cfg, self.num_slots, **self.workers.verifier_kwargs)
        else:
            self.verifier = self._verifier_cls.options(**actor_options(self._pg, self.mode, "verifier"),
                                                       **threads).remote(cfg, self.num_slots,
                                                                         **self.workers.verifier_kwargs)
        waits = [self._get(self.verifier.ready.remote(), "verifier start", START_TIMEOUT_S)]
        if self.mode in ("sd_split", "psd"):
            self.drafter = self._new_drafter()
            waits.append(self._get(self.drafter.ready.remote(), "drafter start", START_TIMEOUT_S))
        infos = await asyncio.gather(*waits)
        self.worker_info = {"verifier": infos[0], "drafter": infos[1] if len(infos) > 1 else None}
        if self.drafter is not None:
            await self.channel.connect(self.drafter, self.verifier, infos[0]["device"])
        self.drafter_alive = self.drafter is not None
        gc.collect()
        gc.freeze()   # the long-lived startup objects stay out of the collector's scans (no step stalls)
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _new_drafter(self):
        self._drafter_seq = 0   # a new drafter's tasks are numbered from 0 (workers.LaunchOrder)
        threads = {"max_concurrency": 16} if self.config.drafter_overlap else {}
        return self._drafter_cls.options(**actor_options(self._pg, self.mode, "drafter"), **threads).remote(
            self.config.model_dump(), self.num_slots, **self.workers.drafter_kwargs)

    async def shutdown(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()
        if self._restart_task:
            self._restart_task.cancel()
        for r in list(self.requests.values()):
            self._finish(r, "abort", error="engine shut down")
        await self.channel.disconnect()
        self.metrics.close()
        for actor in (self.verifier, self.drafter):
            if actor is not None:
                ray.kill(actor, no_restart=True)
        if self._own_pg:
            ray.util.remove_placement_group(self._pg)

    # ---- requests ------------------------------------------------------------------------------
    def make_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None) -> Request:
        params.validate()
        if len(prompt_ids) + params.max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"context limit of {self.max_len} tokens")
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        return Request(prompt_ids, params, self.eos_token_ids, request_id)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       bounded: bool = True, interval_s: float | None = None):
        """Async iterator of StepOutput for one request; closing it early aborts the request.

        bounded: refuse the request (EngineOverloadedError) when the queue is full; offline batch
        generation passes False, since it submits its whole workload at once by design.
        interval_s: least time between two outputs (default: config.stream_interval_ms). Each output a
        stream hands over costs a Ray hop per request (Serve, LLM.stream): at a step every few ms that cost
        rivals the step's, so outputs within the interval are merged. The first output and the last one
        (finished) go out at once, so TTFT and latency do not change; in-process callers pass 0."""
        if self.dead:
            raise EngineDeadError(self.dead)
        capacity = self.config.max_queued + max(self.config.max_running - self._num_running(), 0)
        if bounded and len(self.waiting) >= capacity:
            raise EngineOverloadedError(f"the engine queue is full ({len(self.waiting)} waiting)")
        r = self.make_request(prompt_ids, params, request_id)
        r.queue = asyncio.Queue()
        r.aborted = False
        r.inflight = 0          # verifier tasks in flight that hold this request
        r.prefilling = False
        r.prefill_at = None     # (prefill task, row) while its prefill is in flight
        r.last_seq = -1         # seq of the latest verifier task committed for it
        self.requests[r.id] = r
        self.waiting.append(r)
        self._wake.set()
        interval = self.config.stream_interval_ms / 1e3 if interval_s is None else interval_s
        last = None   # when the previous output went out
        try:
            while True:
                out: StepOutput = await r.queue.get()
                while not out.finished:
                    if not r.queue.empty():   # the consumer fell behind: hand over what is queued at once
                        out = _merged(out, r.queue.get_nowait())
                        continue
                    wait = 0.0 if last is None else last + interval - time.perf_counter()
                    if wait <= 0:
                        break
                    # not asyncio.wait_for: when the stream is cancelled just as an output arrives, it returns
                    # the output and swallows the cancellation, and the request would never be aborted
                    getter = asyncio.ensure_future(r.queue.get())
                    try:
                        await asyncio.wait((getter,), timeout=wait)
                    finally:
                        if not getter.done():
                            getter.cancel()   # an output that was on its way stays in the queue
                    if not getter.done() or getter.cancelled():
                        break
                    out = _merged(out, getter.result())
                if out.error:
                    raise EngineDeadError(out.error)
                yield out
                last = time.perf_counter()
                if out.finished:
                    return
        finally:
            if not r.finished:
                await self.abort(r.id)

    async def abort(self, request_id: str) -> None:
        r = self.requests.get(request_id)
        if r is None or r.finished:
            return
        r.aborted = True
        if r in self.waiting:
            self.waiting.remove(r)
            self._finish(r, "abort")
        # a running request is retired at the end of the step in flight (its slot is busy until then)
        self._wake.set()

    def _finish(self, r: Request, reason: str | None = None, error: str | None = None) -> None:
        if reason and not r.finished:
            r.finish_reason = reason
        r.stats.finished = r.stats.finished or time.perf_counter()
        self._release(r)
        self.requests.pop(r.id, None)
        self.counters["aborted" if r.finish_reason == "abort" else "finished"] += 1
        stats = r.stats.as_dict()
        self.metrics.on_request_finished(stats, request_status(r.finish_reason, error), len(r.prompt_ids),
                                             len(r.output_ids))
        r.queue.put_nowait(StepOutput(r.id, [], None, True, r.finish_reason, stats, error))

    def _emit(self, requests: list[Request], kept: list[list[int]]) -> None:
        emitted = 0
        for r, toks in zip(requests, kept):
            emitted += len(toks)
            lp = r.logprobs[len(r.logprobs) - len(toks):] if r.params.logprobs is not None and toks else None
            if r.finished:
                self._release(r)
                self.requests.pop(r.id, None)
                self.counters["finished"] += 1
                stats = r.stats.as_dict()
                self.metrics.on_request_finished(stats, "finished", len(r.prompt_ids), len(r.output_ids))
                r.queue.put_nowait(StepOutput(r.id, toks, lp, True, r.finish_reason, stats))
            elif toks:
                r.queue.put_nowait(StepOutput(r.id, toks, lp))
        self.metrics.on_tokens(emitted)

    def _release(self, r: Request) -> None:
        """Free a finished request's slot once no verifier task in flight still writes to it."""
        if r.slot is not None and r.inflight == 0 and r.finished:
            self.slots.free(r.slot)
            r.slot = None

    async def reconfigure(self, k: int | None = None) -> None:
        """Benchmarks: change k between workloads, keeping the actors, models and CUDA graphs. Only while
        idle: drafts in flight would carry the old k."""
        if self.waiting or self._num_running() or self.inflight:
            raise RuntimeError("reconfigure needs an idle engine")
        if k is not None:
            self.config = self.config.model_copy(update={"k": k})
            EngineConfig.model_validate(self.config.model_dump())
            self.k = k
            # what either regime costs depends on k: measure afresh (a cost carried over kept psd sequential)
            self.chooser = RegimeChooser(**self._chooser_args["low"])
            self.high_chooser = RegimeChooser(**self._chooser_args["high"])

    def _num_running(self) -> int:
        return len(self.batches[0]) + len(self.batches[1])

    def info(self) -> dict:
        return {"mode": self.mode, "k": self.k, "max_batch": self.config.max_batch,
                "running": self._num_running(), "batch_sizes": [len(b) for b in self.batches],
                "queued": len(self.waiting), "slots_in_use": self.slots.num_used, "num_slots": self.num_slots,
                "drafter_alive": self.drafter_alive, "dead": self.dead, "transport": self.channel.name,
                "verifier_overlap": self.config.verifier_overlap, "drafter_overlap": self.config.drafter_overlap,
                **self.counters,
                "recent_steps": self.recent_steps(),
                **({"low_load_regime": self._regime_info("low"), "high_load_regime": self._regime_info("high")}
                   if self.mode == "psd" else {})}

    def _regime_info(self, load: str) -> dict:
        """psd's regime at one load, as it ran: the policy, the regime the next steps take, the regime of the
        latest step at that load and the steps per regime (ar: the drafter was down); the chooser's
        measurements only where it chooses."""
        policy = self.config.psd_low_load if load == "low" else self.config.psd_high_load
        chooser = self.chooser if load == "low" else self.high_chooser
        if policy != "auto":
            current = policy
        elif load == "high" and not self.saturated:
            current = "seq"
        else:
            current = chooser.trial or chooser.current
        out = {"policy": policy, "current": current, "last_step": self.regime_steps[load].last,
               "steps": dict(self.regime_steps[load].steps)}
        if policy == "auto":
            out.update(chooser.info(), current=current)
        if load == "high":
            out["saturated"] = self.saturated
        return out

    def recent_steps(self, n: int = 200) -> dict:
        """Medians over the last n steps (ms): where a step's wall time goes, for /v1/info and smoke runs."""
        steps = list(self.history)[-n:]
        if not steps:
            return {"steps": 0}
        fields = ("step_ms", "t_verify_ms", "t_draft_ms", "t_prefill_ms", "host_ms", "launch_gap_ms")
        out = {f: statistics.median(getattr(r, f) for r in steps) for f in fields}
        out.update(steps=len(steps), rows=statistics.median(r.verified for r in steps),
                   regimes=dict(Counter(r.regime for r in steps)))
        return out

    # ---- the step loop -------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                if self.inflight:
                    await self._complete(self.inflight[0])
                elif self.waiting or self._num_running():
                    self._schedule(None)
                    if not self.inflight:   # nothing can start (all slots still held): wait for news
                        self._wake.clear()
                        await self._wake.wait()
                else:
                    self._wake.clear()
                    await self._wake.wait()
            except EngineDeadError as e:
                self._fail_all(str(e))
                return
            except Exception as e:  # a bug must not leave requests hanging
                log.exception("step failed")
                self._fail_all(f"engine step failed: {e!r}")
                return

    def _fail_all(self, reason: str) -> None:
        self.dead = reason
        log.error("engine is dead: %s", reason)
        self.inflight.clear()
        # every request still known: waiting, in a batch, or admitted in the step that failed
        for r in list(self.requests.values()):
            r.inflight = 0
            if not r.finished:
                self._finish(r, "abort", error=reason)
        self.waiting.clear()
        self.batches = [[], []]

    async def _await(self, ref):
        return await ref

    async def _get(self, ref, what: str, timeout_s: float | None = None):
        timeout_s = timeout_s or self.config.step_timeout_s
        try:
            return await asyncio.wait_for(self._await(ref), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what} took longer than {timeout_s:.0f} s") from None

    async def _verifier_result(self, ref, what: str):
        try:
            return await self._get(ref, what)
        except Exception as e:
            raise EngineDeadError(f"the verifier failed during {what}: {e}") from e

    async def _complete(self, task: _Task) -> None:
        """Wait for the oldest verifier task, commit it, and (for a verify) continue its batch's chain."""
        t_draft = 0.0
        if task.draft_ms_refs:
            try:
                for ms_ref in task.draft_ms_refs:
                    t_draft += await self._get(ms_ref, "draft")
            except Exception as e:
                # the verify never ran (its drafts failed): run it again without drafts
                if task.draft_generation == self.drafter_generation:   # not a round for a drafter since replaced
                    self._drafter_down(e)
                # under its own number: a task whose argument failed never ran, so its turn is still open
                task.ref = self.channel.without_drafts(
                    self.verifier, task.drafts, task.ref,
                    lambda: self.verifier.verify.remote(task.seq, [r.slot for r in task.requests], None,
                                                        self._num_logprobs(task.requests), None))
                task.num_drafts, task.regime, task.drafted = [0] * len(task.requests), "ar", 0
                self.counters["draft_rounds_failed"] += 1
        result = await self._verifier_result(task.ref, task.kind)
        t_arrived = time.perf_counter()
        self.inflight.popleft()
        if task.kind == "prefill":
            self._prefills_done += 1
            tokens, logprobs, ms = result
            self._prefill_ms += ms
            for r in task.requests:
                r.prefilling = False
            self._commit(task, tokens, logprobs)
            return
        if task.kind == "step":
            tokens, logprobs, t_draft, t_verify, t_launch, t_end = result
        else:
            tokens, logprobs, t_verify, t_launch, t_end = result
        record = StepRecord(task.regime, (0, 0), len(task.requests), task.drafted, t_draft_ms=t_draft,
                            t_verify_ms=t_verify, t_prefill_ms=self._prefill_ms, admitted=task.admitted)
        self._prefill_ms = 0.0
        record.emitted = sum(len(t) for t in tokens)
        record.draft_tokens = sum(task.num_drafts)
        record.accepted = sum(len(t) - 1 for t, nd in zip(tokens, task.num_drafts) if nd)
        self._commit(task, tokens, logprobs)
        self.queued[task.batch] -= 1
        self._schedule(task.batch)
        record.sizes = (len(self.batches[0]), len(self.batches[1]))
        if self.mode == "psd":
            record.extra["one_batch"] = self.one_batch   # the balance invariant is psd's, not this chain's
            if task.high_load:
                record.extra["high_load"] = task.high_load   # the regime chosen under a queue (regime.py)
        now = time.perf_counter()
        # the verifier's cycle: from the end of its previous verify (or this one's submission, after idle)
        # to the end of this one, on the worker's clock, so commits bunched at a busy manager do not skew it
        record.step_ms = (t_end - max(self._last_end, task.submitted_wall)) * 1e3
        self._observe_cadence(task, record, t_end)
        # the verifier's idle time before this task began (Ray turnaround, or the task arrived late)
        record.launch_gap_ms = (t_launch - self._last_end) * 1e3 if self._last_end else 0.0
        self._last_end = t_end
        record.host_ms = (now - t_arrived) * 1e3
        self.counters["steps"] += 1
        self.regime_steps["low" if task.low_load else "high"].add(task.regime)
        self.history.append(record)
        for listener in self.step_listeners:
            listener(record)

    def _observe_cadence(self, task: _Task, record: StepRecord, t_end: float) -> None:
        """A request's period in this batch: its previous verify's end to this one's, when the chain ran
        unbroken in one regime (at most the other batch's verify in between) at a load one batch holds.
        Periods with a prefill inside are not compared (either regime pays for arrivals the same)."""
        step = self.counters["steps"]
        prev_end, prev_step, prev_regime, prev_prefills = self._batch_end[task.batch]
        self._batch_end[task.batch] = (t_end, step, task.regime, self._prefills_done)
        if prev_regime == task.regime and step - prev_step <= 2 and task.regime in ("psd", "seq"):
            record.cadence_ms = (t_end - prev_end) * 1e3
            if task.low_load and prev_prefills == self._prefills_done and self.mode == "psd":
                self.chooser.observe(task.regime, record.cadence_ms, step)
        # high load: the verifier's time per row; the split only while it was the choice (not while draining)
        if task.high_load == task.regime and task.regime in ("psd", "seq") and self.mode == "psd":
            self.high_chooser.observe(task.regime, record.ms_per_row, step)

    def _low_load_regime(self) -> str:
        policy = self.config.psd_low_load
        return self.chooser.choose(self.counters["steps"]) if policy == "auto" else policy

    def _demand(self) -> int:
        return self._num_running() + len(self.waiting)

    def _high_load(self) -> bool:
        """More requests want to run than one batch holds."""
        return self._demand() > self.config.max_batch

    def _update_saturation(self) -> None:
        """Saturated from a demand that fills both batches until one batch holds it again (hysteresis: leaving
        at max_batch needs no drain, and a demand between the two keeps the regime it has)."""
        demand = self._demand()
        if demand >= 2 * self.config.max_batch:
            self.saturated = True
        elif demand <= self.config.max_batch:
            self.saturated = False

    def _high_load_regime(self) -> str:
        """psd under a queue: forced by psd_high_load, else sequential (FIFO) until saturated, then measured."""
        policy = self.config.psd_high_load
        if policy != "auto":
            return policy
        return self.high_chooser.choose(self.counters["steps"]) if self.saturated else "seq"

    def _high_load_choice(self) -> str | None:
        """The regime a verify submitted now runs under a queue, where it was a choice (forced, or measured while
        the demand fills both batches): recorded with the step, and what the high-load chooser's samples are
        filed under. Not in the hysteresis band: a closed burst's tail (batches emptying) would charge the split
        for rows it no longer has, and keep it from being tried again for explore_every steps."""
        if self.mode != "psd" or not self._high_load():
            return None
        if self.config.psd_high_load == "auto" and (not self.saturated or self._demand() < 2 * self.config.max_batch):
            return None
        return self._high_load_regime()

    def _sequential(self) -> bool:
        """psd: run one sequential batch now (everyone fits one batch and the measurements favour it)."""
        if self._num_running() > self.config.max_batch:
            return False
        return (self._high_load_regime() if self._high_load() else self._low_load_regime()) == "seq"

    def _commit(self, task: _Task, tokens: list[list[int]], logprobs) -> None:
        live, live_tokens, live_logprobs, live_drafts = [], [], [], []
        for row, (r, toks, nd) in enumerate(zip(task.requests, tokens, task.num_drafts)):
            r.inflight -= 1
            r.last_seq = task.seq   # the tokens committed for r come from this task (drafts ahead check it)
            if r.finished:       # finished or aborted meanwhile: its extra tokens are dropped
                self._release(r)
                continue
            live.append(r)
            live_tokens.append(toks)
            live_logprobs.append(logprobs[row] if logprobs is not None else None)
            live_drafts.append(nd)
        if live:
            kept = commit_tokens(live, live_tokens, live_logprobs if logprobs is not None else None, live_drafts)
            self._emit(live, kept)

    def _num_logprobs(self, requests: list[Request]) -> int:
        return max(r.params.logprobs or 0 for r in requests)

    # ---- scheduling ----------------------------------------------------------------------------
    def _schedule(self, committed: int | None) -> int:
        """Membership changes (retire, admit, rebalance) and new verifier work for every batch without
        a verify in flight. Runs when batch `committed` has just been committed (None: from idle).
        Returns the number of requests admitted."""
        self._retire()
        self._update_saturation()
        new = self._admit()
        if new:
            for r in new:
                r.inflight, r.prefilling = 1, True
            seq = self._next_seq()
            prefill = _Task("prefill", None, new, self.verifier.prefill.remote(
                seq, [r.slot for r in new], [r.prompt_ids for r in new], [_sampling_row(r) for r in new],
                self._num_logprobs(new)), [0] * len(new), submitted=time.perf_counter(), seq=seq)
            self.inflight.append(prefill)
            for row, r in enumerate(new):
                r.prefill_at = (prefill, row)   # a draft ahead of r's first verify takes its first token here
            self._prefill_drafter(new)
            self._place(new, committed)
        self._rebalance(committed)
        order = [committed, 1 - committed] if committed is not None else [0, 1]
        for b in order:
            admitted = len(new) if b == committed or committed is None else 0
            while self.queued[b] < self.depth and self.batches[b] and self._submit_verify(b, admitted):
                admitted = 0
            if not self.batches[b]:
                self._drop_ahead(b)   # no verify will name its round: its members all left the batch
        return len(new)

    def _drop_ahead(self, b: int) -> None:
        """Batch b's round drafted ahead, which no verify will name."""
        ahead, self.draft_ahead[b] = self.draft_ahead[b], None
        if ahead is not None:
            self.counters["draft_rows_unused"] += len(ahead.rows)
            self.channel.discard(self.verifier, ahead.drafts_ref)
            if ahead.generation == self.drafter_generation:   # a fault in it still says the drafter is unwell
                asyncio.get_running_loop().create_task(self._watch_dropped_round(ahead))

    async def _watch_dropped_round(self, ahead: _DraftAhead) -> None:
        try:
            await self._get(ahead.ms_ref, "draft round")
        except Exception as e:
            if ahead.generation == self.drafter_generation:
                self._drafter_down(e)

    def _prefill_drafter(self, new: list[Request]) -> None:
        """psd, sd_split: the drafter (its own GPU) takes the new prompts while the verifier prefills them, so
        their first draft round feeds two tokens instead of the whole prompt (that catch-up would sit on the
        critical path)."""
        if self.mode not in ("psd", "sd_split") or not self.drafter_alive or self.drafter is None:
            return
        ref = self.drafter.prefill.remote(self._next_drafter_seq(), [r.slot for r in new], [r.prompt_ids for r in new])
        self.counters["drafter_prefills"] += 1
        for r in new:
            r.draft_valid = len(r.prompt_ids)   # the drafter runs its tasks in order: before any draft of r
        asyncio.get_running_loop().create_task(self._watch_drafter_prefill(ref))

    async def _watch_drafter_prefill(self, ref) -> None:
        # a failure here is the drafter's: serve ar and restart it (the restart resets draft_valid)
        try:
            await self._get(ref, "drafter prefill")
        except Exception as e:
            self._drafter_down(e)

    def _admit(self) -> list[Request]:
        new, limit = [], self.config.max_running
        if self.mode == "psd" and self.drafter_alive and self._high_load() and self._high_load_regime() == "seq":
            limit = self.config.max_batch   # one sequential batch; the rest wait (and psd drains to it)
        while (self.waiting and self._num_running() + len(new) < limit
               and self.slots.num_free > 0):
            r = self.waiting.popleft()
            r.slot = self.slots.alloc()
            r.draft_valid = 0  # the drafter catches up on its first round
            new.append(r)
        return new

    def _regime(self, b: int) -> str:
        if self.mode in ("ar", "sd"):
            return self.mode
        if not self.drafter_alive:
            return "ar"
        return "psd" if self.mode == "psd" and self.batches[1 - b] else "seq"

    def _submit_verify(self, b: int, admitted: int) -> bool:
        """Queue batch b's next verify (and its drafts); False when no member can ride yet."""
        if self.depth > 1:   # everything the step needs is in the verifier's slot state
            rows = list(self.batches[b])
        else:  # a request rides when its state is committed (then it may be drafted) or only its prefill is ahead
            rows = [r for r in self.batches[b] if r.inflight == 0 or (r.inflight == 1 and r.prefilling)]
        if not rows:
            return False   # every member is still in flight in the other batch (moved): next commit
        regime = self._regime(b)
        ahead = self.draft_ahead[b]
        if ahead is not None and (regime == "ar" or ahead.generation != self.drafter_generation):
            self._drop_ahead(b)   # for a drafter that died since (its rows fail) or no longer wanted
            ahead = None
        self.draft_ahead[b] = None
        # every member that rides is drafted (psd, seq), a new one from its prefill's token, as `sd` drafts
        # it: so a request is drafted at the same positions in every mode. Members the round drafted ahead
        # covers (nothing committed for them since it was built) take its rows; the others (new, or moved
        # here) a round of their own, submitted now; the verify takes both
        drafted = [] if regime == "ar" else rows
        covered = [] if ahead is None else \
            [r for r in rows if r.inflight == 0 and ahead.rows.get(id(r), (0, None))[1] == r.last_seq]
        if ahead is not None and not covered:
            self._drop_ahead(b)   # none of its rows ride (all moved on since): no verify will name it
            ahead = None
        row_of = {id(r): ahead.rows[id(r)][0] for r in covered}
        missing = [r for r in drafted if id(r) not in row_of] if regime != "sd" else []
        offset = len(ahead.rows) if ahead is not None else 0
        row_of.update((id(r), offset + i) for i, r in enumerate(missing))
        if regime == "sd":
            row_of = {id(r): i for i, r in enumerate(rows)}
        index = [row_of.get(id(r), -1) for r in rows]
        num_drafts = [self.k if i >= 0 else 0 for i in index]
        slots, nlp = [r.slot for r in rows], self._num_logprobs(rows)
        task = _Task("verify", b, rows, None, num_drafts, regime, drafted=len(drafted), admitted=admitted,
                     submitted=time.perf_counter(), low_load=not self._high_load(),
                     seq=self._next_seq(), draft_generation=self.drafter_generation,
                     high_load=self._high_load_choice())
        drafts_next = regime in ("psd", "seq") and self.drafter_alive   # a round follows it (_draft_next_round)
        task.tokens_to = self.channel.tokens_to(task.seq, len(rows), self.k) if drafts_next else None
        if regime == "sd":
            task.kind = "step"
            task.ref = self.verifier.step.remote(task.seq, slots, self.k, nlp)
        else:
            if ahead is not None:
                task.drafts.append(ahead.drafts_ref)
                task.draft_ms_refs.append(ahead.ms_ref)
                self.counters["drafts_ahead_used"] += 1
                self.counters["draft_rows_unused"] += len(ahead.rows) - len(covered)
            if missing:
                drafts, ms_ref = self.channel.submit(self.drafter, self.verifier, self._fresh_round_args(missing))
                task.drafts.append(drafts)
                task.draft_ms_refs.append(ms_ref)
            task.ref = self.verifier.verify.remote(task.seq, slots, index if drafted else None, nlp,
                                                   task.tokens_to, *task.drafts)
        for r in rows:
            r.inflight += 1
        self.counters["queued_behind"] += self.queued[b] > 0
        self.queued[b] += 1
        self.inflight.append(task)
        if drafts_next:
            self._draft_next_round(b, task)
        return True

    def _draft_next_round(self, b: int, verify: _Task) -> None:
        """Submit batch b's next draft round now, behind `verify` (psd, sd_split): every member whose tasks in
        flight are at most its prefill and this verify gets a row whose tokens are its committed ones plus
        those tasks' tokens, which the drafter reads from their results (Ray hands them over when they exist).
        The chain verify -> draft -> verify then runs without waiting for the manager's commit, which happens
        meanwhile; at the next verify, rows whose state moved on otherwise (moved, re-verified) go without."""
        at_verify = {id(r): row for row, r in enumerate(verify.requests)}
        sources, source_of = [verify.tokens_to or verify.ref], {}
        rows, built = [], {}
        for r in self.batches[b]:
            vrow = at_verify.get(id(r))
            if r.finished or r.inflight != (vrow is not None) + r.prefilling:
                continue   # in flight elsewhere too (moved from the other batch): its tokens are not all here
            takes, last = [], r.last_seq
            if r.prefilling:
                prefill, prow = r.prefill_at
                if id(prefill) not in source_of:
                    source_of[id(prefill)] = len(sources)
                    sources.append(prefill.ref)
                takes.append((source_of[id(prefill)], prow))
                last = prefill.seq
            if vrow is not None:
                takes.append((0, vrow))
                last = verify.seq
            # the drafter's slot holds every token but the last two of the sequence the row ends with: after
            # a round that drafted it (accepted drafts included), or a prompt the drafter prefilled
            all_but_two = (vrow is not None and verify.num_drafts[vrow] > 0) or \
                (r.prefilling and r.draft_valid >= len(r.prompt_ids))
            built[id(r)] = (len(rows), last)
            rows.append((r, takes, all_but_two))
        if not rows:
            if verify.tokens_to is not None:
                self.channel.drop_tokens(self.drafter, verify.tokens_to)
            return
        args = self._draft_args([r for r, _, _ in rows], [(takes, abt) for _, takes, abt in rows])
        drafts_ref, ms_ref = self.channel.submit(self.drafter, self.verifier, (*args, *sources))
        self.draft_ahead[b] = _DraftAhead(drafts_ref, ms_ref, built, self.drafter_generation)

    def _fresh_round_args(self, batch: list[Request]) -> tuple:
        """A draft round for a verify submitted now: committed members feed their committed tokens; a new one
        also takes its first token from its prefill in flight (the drafter holds its prompt when it prefilled
        it, so then only the last two tokens are fed)."""
        sources, source_of, extra = [], {}, []
        for r in batch:
            if not r.prefilling:
                extra.append(((), False))
                continue
            prefill, prow = r.prefill_at
            if id(prefill) not in source_of:
                source_of[id(prefill)] = len(sources)
                sources.append(prefill.ref)
            extra.append(([(source_of[id(prefill)], prow)], r.draft_valid >= len(r.prompt_ids)))
        return (*self._draft_args(batch, extra), *sources)

    def _next_seq(self) -> int:
        """Number the next verifier task: the verifier launches its tasks' device work in this order."""
        self._seq += 1
        return self._seq - 1

    def _next_drafter_seq(self) -> int:
        """Number the next drafter task: the drafter launches its tasks' device work in this order."""
        self._drafter_seq += 1
        return self._drafter_seq - 1

    def _draft_args(self, batch: list[Request], ahead: list[tuple] | None = None) -> tuple:
        """(drafter task number, rows (slot, valid, committed tail, takes, all_but_two), k, seeds, output
        positions of the first drafts); `ahead`: per request the (takes, all_but_two) of a round drafted ahead
        (DrafterWorker._draft)."""
        ahead = ahead or [((), False)] * len(batch)
        rows = [(row.slot, row.valid, row.catchup, *extra) for row, extra in zip(draft_rows(batch), ahead)]
        return self._next_drafter_seq(), rows, self.k, [r.seed for r in batch], [len(r.output_ids) for r in batch]

    # ---- batches -------------------------------------------------------------------------------
    def _keep(self, r: Request) -> bool:
        """False for a request that is done; an aborted one is finished here (its slot freed once idle)."""
        if r.finished:
            return False
        if r.aborted:
            self._finish(r, "abort")
            return False
        return True

    def _retire(self) -> None:
        self.batches = [[r for r in batch if self._keep(r)] for batch in self.batches]

    def _place(self, new: list[Request], committed: int | None) -> None:
        """New requests join the smaller batch; on a tie, the batch committed now (its next verify is
        submitted first). Below psd_min_requests, `_rebalance` gathers everyone in one batch."""
        for r in new:
            if self.mode != "psd":
                self.batches[0].append(r)
                continue
            a, b = len(self.batches[0]), len(self.batches[1])
            if a != b:
                self.batches[0 if a < b else 1].append(r)
            else:
                self.batches[committed if committed is not None else 0].append(r)

    def _rebalance(self, committed: int | None) -> None:
        """psd: keep | |A| - |B| | <= 1 by moving requests to the smaller batch, preferring requests
        with nothing in flight (a request moved out of a verify in flight skips a step). Below
        psd_min_requests everyone goes to one batch: a sequential chain (psd would move each request
        only every other step); so it does while one batch holds every running request and the measured
        cadences favour it (psd_low_load, regime.py)."""
        if self.mode != "psd":
            return
        total = self._num_running()
        if total < self.config.psd_min_requests or self._sequential():
            self.one_batch = True
            keep = 0 if len(self.batches[0]) >= len(self.batches[1]) else 1
            if self.batches[1 - keep]:
                self.counters["moves"] += len(self.batches[1 - keep])
                self.batches[keep] += self.batches[1 - keep]
                self.batches[1 - keep] = []
            return
        self.one_batch = False
        while abs(len(self.batches[0]) - len(self.batches[1])) > 1:
            big = 0 if len(self.batches[0]) > len(self.batches[1]) else 1
            batch = self.batches[big]
            idle = [i for i, r in enumerate(batch) if r.inflight == 0]
            r = batch.pop(idle[-1] if idle else -1)
            self.batches[1 - big].append(r)
            self.counters["moves"] += 1
        if total >= 2 and abs(len(self.batches[0]) - len(self.batches[1])) > 1:
            self.counters["balance_violations"] += 1

    # ---- drafter faults --------------------------------------------------------------------------
    def _drafter_down(self, error: Exception) -> None:
        if not self.drafter_alive:
            return
        self.drafter_alive = False
        self.drafter_generation += 1   # rounds already sent to it fail or are dropped, and say nothing more
        self.counters["drafter_failures"] += 1
        log.warning("drafter failed (%s); serving in ar mode while it restarts", error)
        if self._restart_task is None or self._restart_task.done():
            self._restart_task = asyncio.get_running_loop().create_task(self._restart_drafter())

    async def _restart_drafter(self) -> None:
        delay = 0.5
        while not self.dead:
            old, self.drafter = self.drafter, None
            try:
                ray.kill(old, no_restart=True)
            except Exception:
                pass
            try:
                self.drafter = self._new_drafter()
                info = await self._get(self.drafter.ready.remote(), "drafter restart", START_TIMEOUT_S)
                await self.channel.connect(self.drafter, self.verifier, info["device"])
            except Exception as e:
                log.warning("drafter restart failed (%s); retrying in %.1f s", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            for r in self.batches[0] + self.batches[1] + list(self.waiting):
                r.draft_valid = 0  # the new drafter holds no KV: catch up from the start
            self.counters["drafter_restarts"] += 1
            self.worker_info = {**self.worker_info, "drafter": info}   # info() reports the live drafter
            self.drafter_alive = True
            log.warning("drafter restarted; speculative decoding resumed")
            self._wake.set()
            return
