"""The batch manager: the asyncio driver between callers, the scheduler and the worker actors.

The scheduler (scheduler.py) decides everything about batches and rounds and returns plans; the manager
sends them to the actors in the scheduler's order, awaits the verifier's results in that same order, feeds
each back (commit), streams the tokens, and asks for the next plans. One psd step is `_complete`: the
oldest verifier task's result -> commit -> schedule -> submit.

psd (the paper's batch parallelism): two batches A and B, each a chain draft -> verify -> commit ->
draft -> ... The verifier runs its tasks in submission order, so while it verifies A, B's drafts are being
made and B's verify is already queued behind A's (it takes B's drafts by reference, straight from the
drafter). The manager's host work for one batch overlaps the other batch's verify. The verifier keeps each
slot's last token, position and sampling settings (workers.SlotState), so a verify message is slot ids plus
draft references. `sd_split` is one such chain; `ar` (verify only) and `sd` (one actor drafts and verifies)
build a step from the verifier's slot state alone and keep the next step queued behind the running one.
The manager is a plain asyncio object so it can live in a Serve replica or in an actor (`LLM`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from ray.util.placement_group import PlacementGroup

from ..config import ChunkGapReference, EngineConfig
from ..engine.devices import cuda_available
from ..engine.hf_config import ModelSpec
from ..engine.kv_blocks import CacheSizeError
from ..engine.hub import model_dirs
from ..engine.request import Request, commit_tokens
from ..engine.sampling_params import SamplingParams
from ..observability.heap import CollectorWatch
from ..observability.metrics import EngineMetrics, request_status
from .actors import START_TIMEOUT_S, WorkerActors, WorkerSet, wait_for
from .chunk_budget import TYPICAL_CYCLES, ChunkBudget, PromptLaunch
from .errors import EngineDeadError, EngineOverloadedError
from .messages import (DraftRound, KVEdits, PrefillRow, PrefillTask, SamplingRow, SlotResume, SpecStep, VerifierResult,
                       VerifyTask)
from .scheduler import (DraftPlan, KVPoolSpec, KVRole, PrefillOrder, PrefillPlan, RequestState, Scheduler,
                        SchedulerConfig, VerifyPlan)
from .streams import OutputSink, StepOutput, _merged, coalesced
from .telemetry import EngineSnapshot, KVPoolStats, RegimeSteps, StepRecord
from .transport import default_transport, make_channel

__all__ = ["BatchManager", "EngineDeadError", "EngineOverloadedError", "StepOutput", "StepRecord", "_merged",
           "overlap_by_default", "START_TIMEOUT_S"]

log = logging.getLogger("minedraft.runtime")


@dataclass(eq=False)
class InFlight:
    """A verifier task in flight, in the order the verifier runs it."""
    plan: PrefillPlan | VerifyPlan
    kind: str                        # prefill | verify | step (sd: draft + verify in one actor)
    ref: object = None               # the verifier's result
    submitted_wall: float = field(default_factory=time.time)
    tokens_to: object = None         # collective channel: the key its tokens go to the next draft round under
    drafts: list = field(default_factory=list)          # the rounds it names (refs or channel keys)
    draft_timings: list = field(default_factory=list)   # their device-time results
    message: VerifyTask | SpecStep | PrefillTask | None = None   # what was sent (again, if it is resubmitted)


def workers_on_gpu(config: EngineConfig) -> bool:
    """Whether the workers will compute on a GPU. The manager shares their node (STRICT_PACK), and Ray hides no
    GPU from an actor that asks for none, so the workers' device choice (engine.default_device) can be made here,
    without torch (engine/devices.py)."""
    return config.device == "cuda" or (config.device == "auto" and cuda_available())


def overlap_by_default(config: EngineConfig) -> bool:
    """verifier_overlap's default: on where the verifier computes on a GPU (docs/design.md, "Overlap"); on a
    CPU the host is the device, nothing runs ahead and the waiting threads only contend."""
    return workers_on_gpu(config)


def resolve_config(config: EngineConfig, model_cfg: ModelSpec) -> EngineConfig:
    """The config with every `auto` and default that depends on the model or the device made concrete (max_len:
    the model's context until the workers' KV pools bound it, `BatchManager.start`)."""
    if config.max_len is None:
        config = config.model_copy(update={"max_len": model_cfg.max_position_embeddings})
    elif config.max_len > model_cfg.max_position_embeddings:
        # the model's own context limit wins over the (generic) default
        log.warning("max_len %d exceeds the target's context (%d); using %d", config.max_len,
                    model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)
        config = config.model_copy(update={"max_len": model_cfg.max_position_embeddings})
    for size, what in ((model_cfg.num_heads, "attention heads"), (model_cfg.num_kv_heads, "KV heads"),
                       (model_cfg.intermediate_size, "MLP columns")):
        if size % config.tp:
            raise ValueError(f"tp {config.tp} does not divide the target's {size} {what}")
    if config.transport == "auto":
        config = config.model_copy(update={"transport": default_transport(on_gpu=workers_on_gpu(config))})
    if config.verifier_overlap is None:
        config = config.model_copy(update={"verifier_overlap": overlap_by_default(config)})
    if config.drafter_overlap is None:
        config = config.model_copy(update={"drafter_overlap": config.verifier_overlap})
    if config.prefill_chunk_tokens is None:
        config = config.model_copy(update={"prefill_chunk_tokens": default_prefill_chunk(workers_on_gpu(config))})
    return config


def fuses_prefill(config: EngineConfig) -> bool:
    """Chunks ride inside verify launches: asked for, and packed (a fused launch is a packed one)."""
    return config.fused_prefill and config.packed_prefill


def default_prefill_chunk(on_gpu: bool) -> int:
    """prefill_chunk_tokens' default: the same chunked path everywhere, the device picks the budget. On a GPU a
    chunk of 512 prompt tokens (fused: a launch of 512 tokens, the verify's rows included) is a few times a decode
    step's rows, enough for the GEMMs to run near full rate, and graphed (the packed runner's buckets end at 1024).
    A CPU computes a chunk at its token count's cost, so half that keeps a running request's extra wait at a few verify steps (docs/design.md)."""
    return 512 if on_gpu else 256


class BatchManager:
    def __init__(self, config: EngineConfig, placement_group: PlacementGroup | None = None,
                 workers: WorkerSet | None = None, *, vocab_limit: int | None):
        """vocab_limit: the pair's shared_vocab (engine/pair.py), checked by whoever starts the engine."""
        target_dir, _ = model_dirs(config)
        model_cfg = ModelSpec.from_pretrained(target_dir)
        self.eos_token_ids = tuple(model_cfg.eos_token_ids)
        self.max_len_given = config.max_len is not None
        self.config = config = resolve_config(config, model_cfg)   # the one home of k and every setting
        self.mode = config.mode
        self.max_len = config.max_len   # lowered to what the KV pools hold once the workers have sized them
        self.num_slots = config.num_slots or config.max_running
        if self.num_slots < config.max_running:
            raise ValueError(f"num_slots ({self.num_slots}) must hold the {config.max_running} requests mode "
                             f"{config.mode!r} keeps in flight")
        self.sched = Scheduler(SchedulerConfig(config.mode, config.max_batch, config.max_running, self.num_slots,
                                               config.psd_min_requests, config.psd_low_load,
                                               config.psd_high_load, config.prefill_chunk_tokens or None,
                                               fuse_prefill=fuses_prefill(config), k=config.k,
                                               prefix_caching=config.prefix_caching,
                                               prefill_order=PrefillOrder(config.prefill_order)))
        self.sched.drafter_alive = False   # until the drafter is up (start)
        self.channel = make_channel(config.transport)
        self.actors = WorkerActors(config, self.num_slots, self.channel, workers or WorkerSet(), placement_group,
                                   vocab_limit)
        self.requests: dict[str, RequestState] = {}
        self.streams: dict[str, OutputSink] = {}   # request id -> where its outputs go
        self.inflight: deque[InFlight] = deque()       # verifier tasks, in submission (= run) order
        self._last_end = 0.0                           # wall clock at the end of the latest verify
        # per batch: (end of its latest verify, step, regime, prefills done by then)
        self._batch_end = [(0.0, -10, "", 0), (0.0, -10, "", 0)]
        self._prefills_done = 0
        self._prefill_ms = 0.0                         # prefill device time, reported with the next step
        self._prefill_launches: list[PromptLaunch] = []   # each of those prefill launches
        self.chunk_budget = self._chunk_budget(config)
        self._joined = 0                               # first tokens from prefills, reported with the next step
        self.history: deque[StepRecord] = deque(maxlen=100_000)
        self.counters = {"drafter_failures": 0, "drafter_restarts": 0, "aborted": 0, "finished": 0,
                         # verifies submitted while one of the same batch was in flight; prompts sent to the drafter
                         "queued_behind": 0, "drafter_prefills": 0,
                         # prefills sent to the verifier (with chunking, one per chunk step), and of those the
                         # ones fused into a verify's launch
                         "prefill_tasks": 0, "fused_prefills": 0,
                         # verifies whose round failed (its drafter died) and ran without drafts
                         "draft_rounds_failed": 0}
        self.regime_steps = {"low": RegimeSteps(), "high": RegimeSteps()}   # what ran, per load (info)
        self.dead: str | None = None
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._restart_task: asyncio.Task | None = None
        self._rank_watches: list[asyncio.Task] = []
        self.step_listeners: list = []   # callables(StepRecord) — metrics hook
        self.metrics = EngineMetrics(config.served_model_name, config.mode).attach(self)
        self.collector = CollectorWatch("manager", config.served_model_name, config.mode)

    @staticmethod
    def _chunk_budget(config: EngineConfig) -> ChunkBudget | None:
        """The adaptive chunk (chunk_gap_ratio), within the budget; None: the budget alone."""
        if not config.chunk_gap_ratio or not config.prefill_chunk_tokens:
            return None
        window = TYPICAL_CYCLES if config.chunk_gap_reference == "typical" else 0
        return ChunkBudget.for_budget(config.prefill_chunk_tokens, config.chunk_gap_ratio, typical_window=window)

    # ---- what others read ----------------------------------------------------------------------
    @property
    def k(self) -> int:
        return self.config.k

    @property
    def verifier(self):
        return self.actors.verifier

    @property
    def drafter(self):
        return self.actors.drafter

    @property
    def worker_info(self) -> dict:
        return self.actors.info

    @property
    def drafter_alive(self) -> bool:
        return self.sched.drafter_alive

    def snapshot(self) -> EngineSnapshot:
        s = self.sched
        pools = tuple(KVPoolStats(role.value, pool.num_blocks - 1, pool.num_in_use, pool.hit_tokens, pool.query_tokens)
                      for role, pool in s.kv.items())
        return EngineSnapshot(self.k, len(s.waiting), s.num_running(), (len(s.batches[0]), len(s.batches[1])),
                              s.slots.num_used, self.num_slots, s.drafter_alive, pools, s.counters["preemptions"])

    def kv_info(self) -> dict:
        """The KV pools as the scheduler hands them out: blocks, blocks held by requests, prefix-cache hits."""
        out = {"block_size": self.config.block_size, "prefix_caching": self.config.prefix_caching}
        for role, pool in self.sched.kv.items():
            out[role.value] = {"blocks": pool.num_blocks - 1, "blocks_in_use": pool.num_in_use,
                               "blocks_cached_idle": len(pool.idle), "hit_tokens": pool.hit_tokens,
                               "query_tokens": pool.query_tokens,
                               "hit_rate": pool.hit_tokens / pool.query_tokens if pool.query_tokens else 0.0}
        return out

    # ---- life cycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.actors.start()
        device = self.worker_info["verifier"]["device"]
        if device.startswith("cuda") != workers_on_gpu(self.config):
            # engine/devices.py guessed the workers' device for the defaults and was wrong (say, a ROCm build)
            log.warning("the verifier computes on %s, but the defaults (transport, overlap, prefill budget) were "
                        "picked for %s: set `device` in the config", device,
                        "a CPU" if device.startswith("cuda") else "a GPU")
        self.sched.drafter_alive = self.drafter is not None
        try:
            self._attach_kv()
        except Exception:
            await self.actors.shutdown()
            raise
        loop = asyncio.get_running_loop()
        self._rank_watches = [loop.create_task(self._watch_rank(rank, ref))
                              for rank, ref in enumerate(self.actors.follows, start=1)]
        self.collector.freeze()   # the long-lived startup objects stay out of the collector's scans (no step stalls)
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _attach_kv(self) -> None:
        """The scheduler takes over the pools the workers sized; max_len, when not given, is lowered to what the
        smaller pool holds for one request (a given one that does not fit is an error, as in the Engine)."""
        pools = {**self.worker_info["verifier"]["kv_pools"],
                 **((self.worker_info.get("drafter") or {}).get("kv_pools") or {})}
        target = KVPoolSpec(**pools["target"])
        draft = KVPoolSpec(**pools["draft"]) if "draft" in pools else None
        holds = min(spec.holds for spec in (target, draft) if spec is not None)
        if self.max_len > holds:
            if self.max_len_given or holds < 16:
                raise CacheSizeError(f"a request of max_len={self.max_len} needs {self.max_len} tokens of KV (and "
                                     f"the verify's headroom), but the KV pool holds {max(holds, 0)}; lower max_len "
                                     "or raise gpu_memory_utilization")
            self.max_len = holds
        self.sched.attach_kv(target, draft, self.max_len)

    async def shutdown(self) -> None:
        for watch in self._rank_watches:
            watch.cancel()
        if self._loop_task:
            self._loop_task.cancel()
        if self._restart_task:
            self._restart_task.cancel()
        for state in list(self.requests.values()):
            self._finish(state, "abort", error="engine shut down")
        self.metrics.close()
        self.collector.close()
        await self.actors.shutdown()

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
        interval_s: least time between two outputs (default: config.stream_interval_ms; streams.py); in-process
        callers pass 0."""
        queue = asyncio.Queue()
        state = self._register(prompt_ids, params, request_id, queue, bounded)
        interval = self.config.stream_interval_ms / 1e3 if interval_s is None else interval_s
        try:
            async for out in coalesced(queue, interval):
                if out.error:
                    raise EngineDeadError(out.error)
                yield out
        finally:
            if not state.request.finished:
                await self.abort(state.id)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None, sink: OutputSink,
               bounded: bool = True) -> str:
        """Queue a request whose outputs go to `sink.put_nowait` as the steps produce them (not coalesced; the
        last one is finished, with the error if the engine failed). Refusals raise here. For callers that batch
        the outputs of many requests themselves (the Serve engine replica): no task per request wakes per step.
        A caller that stops listening aborts the request. -> the request's id."""
        return self._register(prompt_ids, params, request_id, sink, bounded).id

    def _register(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None, sink: OutputSink,
                  bounded: bool) -> RequestState:
        if self.dead:
            raise EngineDeadError(self.dead)
        if bounded and self.sched.queue_full(self.config.max_queued):
            raise EngineOverloadedError(f"the engine queue is full ({len(self.sched.waiting)} waiting)")
        state = RequestState(self.make_request(prompt_ids, params, request_id))
        self.requests[state.id] = state
        self.streams[state.id] = sink
        self.sched.arrive(state)
        self._wake.set()
        return state

    async def abort(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is None or state.request.finished:
            return
        if self.sched.abort(state):
            self._finish(state, "abort")
        # a running request is retired at the next schedule (its slot is busy until its tasks are done)
        self._wake.set()

    def _finish(self, state: RequestState, reason: str | None = None, error: str | None = None) -> None:
        r = state.request
        if reason and not r.finished:
            r.finish_reason = reason
        r.stats.finished = r.stats.finished or time.perf_counter()
        self.sched.finish(state)
        self.requests.pop(r.id, None)
        self.counters["aborted" if r.finish_reason == "abort" else "finished"] += 1
        stats = r.stats.as_dict()
        self.metrics.on_request_finished(stats, request_status(r.finish_reason, error), len(r.prompt_ids),
                                         len(r.output_ids))
        self.streams.pop(r.id).put_nowait(StepOutput(r.id, [], None, True, r.finish_reason, stats, error))

    def _emit(self, states: list[RequestState], kept: list[list[int]]) -> None:
        emitted = 0
        for state, toks in zip(states, kept):
            r = state.request
            emitted += len(toks)
            lp = r.logprobs[len(r.logprobs) - len(toks):] if r.params.logprobs is not None and toks else None
            if r.finished:
                self.sched.finish(state)
                self.requests.pop(r.id, None)
                self.counters["finished"] += 1
                stats = r.stats.as_dict()
                self.metrics.on_request_finished(stats, "finished", len(r.prompt_ids), len(r.output_ids))
                self.streams.pop(r.id).put_nowait(StepOutput(r.id, toks, lp, True, r.finish_reason, stats))
            elif toks:
                self.streams[r.id].put_nowait(StepOutput(r.id, toks, lp))
        self.metrics.on_tokens(emitted)

    async def reconfigure(self, k: int | None = None, prefill_chunk_tokens: int | None = None,
                          fused_prefill: bool | None = None, chunk_gap_ratio: float | None = None,
                          chunk_gap_reference: ChunkGapReference | None = None) -> None:
        """Benchmarks and tests: change k, the per-step prefill budget (0: unchunked), whether chunks ride
        inside verify launches or the adaptive chunk's ratio (0: off) and reference between workloads, keeping the
        actors, models and CUDA graphs. Only while idle: drafts in flight would carry the old k."""
        if self.sched.waiting or self.sched.num_running() or self.inflight:
            raise RuntimeError("reconfigure needs an idle engine")
        if chunk_gap_ratio == 0 and chunk_gap_reference is None:
            chunk_gap_reference = "recent"   # the adaptive chunk off: its reference with it
        update = {"k": k, "prefill_chunk_tokens": prefill_chunk_tokens, "fused_prefill": fused_prefill,
                  "chunk_gap_ratio": chunk_gap_ratio, "chunk_gap_reference": chunk_gap_reference}
        config = self.config.model_copy(update={n: v for n, v in update.items() if v is not None})
        EngineConfig.model_validate(config.model_dump())   # before anything changes
        self.config = config
        self.sched.config.prefill_budget = config.prefill_chunk_tokens or None
        self.sched.config.fuse_prefill = fuses_prefill(config)
        # a step's times depend on all of these: the adaptive chunk measures afresh
        self.chunk_budget, self.sched.chunk_limit = self._chunk_budget(config), None
        if k is not None:
            self.sched.set_k(k)   # what a step writes past a request's length
            # what either regime costs depends on k: measure afresh (a cost carried over kept psd sequential)
            self.sched.reset_choosers()

    def info(self) -> dict:
        s = self.sched
        return {"mode": self.mode, "k": self.k, "max_batch": self.config.max_batch, "max_len": self.max_len,
                "running": s.num_running(), "batch_sizes": [len(b) for b in s.batches],
                "prefill_pending": len(s.unprefilled), "prefill_chunk_tokens": self.config.prefill_chunk_tokens,
                "chunk_gap_ratio": self.config.chunk_gap_ratio, "chunk_gap_reference": self.config.chunk_gap_reference,
                "chunk_limit": s.chunk_limit.launch_tokens if s.chunk_limit is not None else None,
                "fused_prefill": s.config.fuse_prefill, "prefill_order": s.config.prefill_order.value,
                "queued": len(s.waiting), "slots_in_use": s.slots.num_used, "num_slots": self.num_slots,
                "drafter_alive": s.drafter_alive, "dead": self.dead, "transport": self.channel.name,
                "worker_start_retries": self.actors.start_retries,
                "verifier_overlap": self.config.verifier_overlap, "drafter_overlap": self.config.drafter_overlap,
                "steps": s.steps, **s.counters, **self.counters, "kv_cache": self.kv_info(),
                "recent_steps": self.recent_steps(),
                **({"low_load_regime": self._regime_info("low"), "high_load_regime": self._regime_info("high")}
                   if self.mode == "psd" else {})}

    def _regime_info(self, load: str) -> dict:
        """psd's regime at one load, as it ran: the policy, the regime the next steps take, the regime of the
        latest step at that load and the steps per regime (ar: the drafter was down); the chooser's
        measurements only where it chooses."""
        s = self.sched
        policy = self.config.psd_low_load if load == "low" else self.config.psd_high_load
        chooser = s.chooser if load == "low" else s.high_chooser
        if policy != "auto":
            current = policy
        elif load == "high" and not s.saturated:
            current = "seq"
        else:
            current = chooser.trial or chooser.current
        out = {"policy": policy, "current": current, "last_step": self.regime_steps[load].last,
               "steps": dict(self.regime_steps[load].steps)}
        if policy == "auto":
            out.update(chooser.info(), current=current)
        if load == "high":
            out["saturated"] = s.saturated
        return out

    def steps_since(self, step: int) -> list[StepRecord]:
        """The records of the steps after step number `step` (info's `steps`) still in the history, oldest first:
        a benchmark's window of steps, read once after it (nothing is recorded for it)."""
        count = min(self.sched.steps - step, len(self.history))
        return list(itertools.islice(self.history, len(self.history) - count, None)) if count > 0 else []

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
                elif self.sched.waiting or self.sched.num_running():
                    self._schedule(None)
                    if not self.inflight:   # nothing can start (all slots still held): wait for news
                        self._wake.clear()
                        await self._wake.wait()
                else:
                    # idle: prefills that no verify followed (requests that ended at their first token) are no
                    # part of the next verify's cycle, which starts at its submission
                    self._prefill_ms, self._prefill_launches = 0.0, []
                    self._wake.clear()
                    await self._wake.wait()
            except EngineDeadError as e:
                self._fail_all(str(e))
                return
            except Exception as e:  # a bug must not leave requests hanging
                log.exception("step failed")
                self._fail_all(f"engine step failed: {e!r}")
                return

    async def _watch_rank(self, rank: int, follow_ref) -> None:
        """A target rank's follow() ends only with its group: its end (it died, or rank 0 did) kills the engine
        as a dead verifier does, at once, even while no step is in flight."""
        try:
            await follow_ref
            reason = f"target rank {rank} stopped following"
        except Exception as e:  # noqa: BLE001 - whatever ended it, the target is incomplete
            reason = f"target rank {rank} failed: {e}"
        if self.dead is None:
            if self._loop_task is not None:
                self._loop_task.cancel()
            self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        self.dead = reason
        log.error("engine is dead: %s", reason)
        self.inflight.clear()
        # every request still known: waiting, in a batch, or admitted in the step that failed
        for state in list(self.requests.values()):
            state.inflight = 0
            if not state.request.finished:
                self._finish(state, "abort", error=reason)
        self.sched.fail_all()

    async def _get(self, ref, what: str, timeout_s: float | None = None):
        return await wait_for(ref, what, timeout_s or self.config.step_timeout_s)

    async def _verifier_result(self, ref, what: str) -> VerifierResult:
        try:
            return VerifierResult.from_wire(await self._get(ref, what))
        except Exception as e:
            raise EngineDeadError(f"the verifier failed during {what}: {e}") from e

    async def _complete(self, task: InFlight) -> None:
        """One step: wait for the oldest verifier task, commit it, schedule and submit what follows."""
        t_draft = 0.0
        if task.draft_timings:
            try:
                for timing in task.draft_timings:
                    t_draft += await self._get(timing, "draft")
            except Exception as e:
                self._verify_without_drafts(task, e)
        result = await self._verifier_result(task.ref, task.kind)
        t_arrived = time.perf_counter()
        self.inflight.popleft()
        if isinstance(task.plan, PrefillPlan):
            self._prefills_done += 1
            self._prefill_ms += result.device_ms
            self._prefill_launches.append(PromptLaunch(task.plan.num_tokens, task.plan.prior_keys))
            self.metrics.on_prefill(task.plan.num_tokens)
            self._commit_prefill(task.plan, result)
            return
        verify: VerifyPlan = task.plan
        if task.kind == "step":
            t_draft = result.draft_ms
        # this verify's riders had their first tokens from the prefills before it; a fused one's ride a later verify
        joined, self._joined = self._joined, 0
        if verify.prefill is not None:   # its chunks' rows follow the verify's in the result
            self._prefills_done += 1
            rows = len(verify.rows)
            self._commit_prefill(verify.prefill, VerifierResult(
                result.tokens[rows:], result.logprobs[rows:] if result.logprobs is not None else None, 0.0))
            result = dataclasses.replace(result, tokens=result.tokens[:rows],
                                         logprobs=result.logprobs[:rows] if result.logprobs is not None else None)
        k = self.k
        num_drafts = [k if i >= 0 else 0 for i in verify.draft_index]
        drafted = verify.drafted
        record = StepRecord(verify.regime, (0, 0), len(verify.rows), drafted, t_draft_ms=t_draft,
                            t_verify_ms=result.device_ms, t_prefill_ms=self._prefill_ms, admitted=verify.admitted,
                            batch=verify.batch, joined=joined)
        self._prefill_ms = 0.0
        record.prefill_launches, self._prefill_launches = tuple(self._prefill_launches), []   # this cycle's so far
        record.prefill_tokens = sum(launch.tokens for launch in record.prefill_launches)
        if verify.prefill is not None:   # inside t_verify_ms: the launch carried them
            record.extra["fused_prefill_tokens"] = verify.prefill.num_tokens
            record.prefill_tokens += verify.prefill.num_tokens
            record.prefill_launches += (PromptLaunch(
                verify.prefill.num_tokens + len(verify.rows) * self.sched.verify_width(verify.regime),
                verify.prefill.prior_keys),)
            self.metrics.on_prefill(verify.prefill.num_tokens)
        lengths = list(map(len, result.tokens))
        record.emitted = sum(lengths)
        record.draft_tokens = k * drafted
        # a drafted row's tokens past its first are accepted drafts
        drafted_tokens = record.emitted if drafted == len(lengths) else sum(itertools.compress(lengths, num_drafts))
        record.accepted = drafted_tokens - drafted
        self.sched.commit_verify(verify)
        record.streamed = self._commit(verify.rows, result.tokens, result.logprobs, num_drafts)
        record.t_emit = time.time()
        self._schedule(verify.batch)
        self._record(task, record, result, t_arrived)

    def _commit_prefill(self, prefill: PrefillPlan, result) -> None:
        """A prefill task's result: the chunks that end new requests' prompts bring their first tokens (a
        resumed request's brings nothing: it has its tokens)."""
        self.sched.commit_prefill(prefill)
        ends = [row for row, c in enumerate(prefill.chunks) if c.last and not c.state.resumed]
        self._joined += len(ends)
        for c in prefill.chunks:
            if not c.last or c.state.resumed:
                self.sched.release(c.state)   # aborted meanwhile: its slot is free once nothing writes it
        if ends:
            logprobs = [result.logprobs[row] for row in ends] if result.logprobs is not None else None
            self._commit([prefill.chunks[row].state for row in ends], [result.tokens[row] for row in ends],
                         logprobs, [0] * len(ends))

    def _verify_without_drafts(self, task: InFlight, error: Exception) -> None:
        """A round the verify names failed: the verify never ran (object store) or waits on a link that fails
        with the drafter (collective); either way it runs without drafts."""
        verify: VerifyPlan = task.plan
        if verify.draft_generation == self.sched.drafter_generation:   # not a round of a drafter since replaced
            self._drafter_down(error)
        # under its own number: a task whose argument failed never ran, so its turn is still open
        without = dataclasses.replace(task.message, draft_index=None, rounds=None, tokens_to=None)
        task.ref = self.channel.without_drafts(self.verifier, task.drafts, task.ref,
                                               lambda: self.verifier.verify.remote(without.to_wire()))
        if verify.prefill is not None:   # what later rounds take its chunks' first tokens from
            verify.prefill.handle = task.ref
        self.sched.verify_failed_drafts(verify)
        self.counters["draft_rounds_failed"] += 1

    def _record(self, task: InFlight, record: StepRecord, result, t_arrived: float) -> None:
        verify: VerifyPlan = task.plan
        s = self.sched
        record.sizes = (len(s.batches[0]), len(s.batches[1]))
        if self.mode == "psd":
            record.extra["one_batch"] = s.one_batch   # the balance invariant is psd's, not this chain's
            if verify.high_load:
                record.extra["high_load"] = verify.high_load   # the regime chosen under a queue (regime.py)
        now = time.perf_counter()
        # the verifier's cycle: from the end of its previous verify (or this one's submission, after idle)
        # to the end of this one, on the worker's clock, so commits bunched at a busy manager do not skew it
        record.step_ms = (result.t_end - max(self._last_end, task.submitted_wall)) * 1e3
        self._observe_cadence(verify, record, result.t_end)
        if self.chunk_budget is not None:   # this cycle sizes the chunks of the steps after the one just planned
            self.chunk_budget.observe(record.step_ms, record.prefill_launches)
            s.chunk_limit = self.chunk_budget.next_limit()
            # a probe step's too (it plans no chunk); psd's split halves the budget, and so what may run
            record.chunk_limit = min(s.chunk_limit.launch_tokens, s.launch_budget())
            record.chunk_key_ms = s.chunk_limit.key_ms
            record.chunk_margin = s.chunk_limit.margin
        # the verifier's idle time before this task began (Ray turnaround, or the task arrived late)
        record.launch_gap_ms = (result.t_launch - self._last_end) * 1e3 if self._last_end else 0.0
        self._last_end = result.t_end
        record.host_ms = (now - t_arrived) * 1e3
        s.steps += 1
        self.regime_steps["low" if verify.low_load else "high"].add(verify.regime)
        self.history.append(record)
        for listener in self.step_listeners:
            listener(record)

    def _observe_cadence(self, verify: VerifyPlan, record: StepRecord, t_end: float) -> None:
        """A request's period in this batch: its previous verify's end to this one's, when the chain ran
        unbroken in one regime (at most the other batch's verify in between) at a load one batch holds.
        Periods with a prefill inside are not compared (either regime pays for arrivals the same)."""
        step = self.sched.steps
        prev_end, prev_step, prev_regime, prev_prefills = self._batch_end[verify.batch]
        self._batch_end[verify.batch] = (t_end, step, verify.regime, self._prefills_done)
        if prev_regime == verify.regime and step - prev_step <= 2 and verify.regime in ("psd", "seq"):
            record.cadence_ms = (t_end - prev_end) * 1e3
            if verify.low_load and prev_prefills == self._prefills_done and self.mode == "psd":
                self.sched.chooser.observe(verify.regime, record.cadence_ms, step)
        # high load: the verifier's time per row; the split only while it was the choice (not while draining)
        if verify.high_load == verify.regime and verify.regime in ("psd", "seq") and self.mode == "psd":
            self.sched.high_chooser.observe(verify.regime, record.ms_per_row, step)

    def _commit(self, states: list[RequestState], tokens: list[list[int]], logprobs, num_drafts: list[int]) -> int:
        """Append a task's tokens to its requests and stream them (the scheduler has counted the task done).
        -> the number of requests streamed to (those finished or aborted meanwhile get nothing)."""
        for state in states:
            if state.request.finished:
                break
        else:   # mostly: every row is live
            if states:
                self._emit(states, commit_tokens([s.request for s in states], tokens, logprobs, num_drafts))
            return len(states)
        live, live_tokens, live_logprobs, live_drafts = [], [], [], []
        for row, (state, toks, nd) in enumerate(zip(states, tokens, num_drafts)):
            if state.request.finished:   # finished or aborted meanwhile: its extra tokens are dropped
                self.sched.release(state)
                continue
            live.append(state)
            live_tokens.append(toks)
            live_logprobs.append(logprobs[row] if logprobs is not None else None)
            live_drafts.append(nd)
        if live:
            kept = commit_tokens([s.request for s in live], live_tokens,
                                 live_logprobs if logprobs is not None else None, live_drafts)
            self._emit(live, kept)
        return len(live)

    @staticmethod
    def _num_logprobs(states: list[RequestState]) -> int:
        return max(s.request.params.logprobs or 0 for s in states)

    @staticmethod
    def _step_requests(verify: VerifyPlan) -> list[RequestState]:
        """Every request a verify's launch holds: its rows, and a fused prefill's."""
        return verify.rows + (verify.prefill.requests if verify.prefill is not None else [])

    # ---- plans -> actor calls ------------------------------------------------------------------
    def _schedule(self, committed: int | None) -> None:
        plan = self.sched.schedule(committed)
        for state in plan.finished:
            self._finish(state, "abort")
        for round_ in plan.dropped:
            self._drop_round(round_)
        for prefill in plan.prefills:
            self._submit_prefill(prefill)
        for verify in plan.verifies:
            self._submit_verify(verify)

    def _verifier_tables(self) -> KVEdits | None:
        """The block-table changes for the verifier's next task (in sd its actor holds the drafter too); None when
        there are none (a message the call need not carry)."""
        target = self.sched.take_edits(KVRole.TARGET)
        draft = self.sched.take_edits(KVRole.DRAFT) if self.mode == "sd" else None
        return KVEdits(target, draft) if target is not None or draft is not None else None

    def _drafter_tables(self) -> KVEdits | None:
        """The block-table changes for the drafter's next task (psd, sd_split); None when there are none."""
        draft = self.sched.take_edits(KVRole.DRAFT)
        return KVEdits(draft=draft) if draft is not None else None

    @staticmethod
    def _prefill_row(c) -> PrefillRow:
        r = c.state.request
        if not c.last:
            return PrefillRow(c.state.slot, c.start, c.tokens)
        # a resumed request's prefill holds every token but its last: its slot state comes from its tokens
        resume = SlotResume(r.span(r.seq_len - 2, r.seq_len - 1)[0], r.last_token, len(r.output_ids)) \
            if c.state.resumed else None
        return PrefillRow(c.state.slot, c.start, c.tokens, SamplingRow.of(r), resume)

    def _submit_prefill(self, prefill: PrefillPlan) -> None:
        message = PrefillTask(prefill.seq, self._submit_chunks(prefill), self._num_logprobs(prefill.requests),
                              self._verifier_tables())
        prefill.handle = self.verifier.prefill.remote(message.to_wire())
        self.inflight.append(InFlight(prefill, "prefill", prefill.handle, message=message))

    def _submit_chunks(self, prefill: PrefillPlan) -> list[PrefillRow]:
        """A prefill's rows for the verifier (its own task, or a verify's it rides in); the drafter's chunks are
        sent now, ahead of any round that reads them."""
        rows = [self._prefill_row(c) for c in prefill.chunks]
        self.counters["prefill_tasks"] += 1
        to_drafter = [row for row, c in zip(rows, prefill.chunks) if c.to_drafter]
        if to_drafter and self.drafter is not None:
            # the drafter (its own GPU) takes the chunks while the verifier prefills them
            message = PrefillTask(self.actors.next_drafter_seq(), to_drafter, tables=self._drafter_tables())
            ref = self.drafter.prefill.remote(message.to_wire())
            self.counters["drafter_prefills"] += 1
            asyncio.get_running_loop().create_task(self._watch_drafter_task(ref, "drafter prefill",
                                                                            self.sched.drafter_generation))
        return rows

    def _submit_verify(self, verify: VerifyPlan) -> None:
        task = InFlight(verify, "verify")
        slots, nlp = [s.request.slot for s in verify.rows], self._num_logprobs(self._step_requests(verify))
        # fused: its chunks ride in the verify's launch
        chunks = self._submit_chunks(verify.prefill) if verify.prefill is not None else None
        if chunks is not None:
            self.counters["fused_prefills"] += 1
        if verify.next_round is not None or (verify.regime in ("psd", "seq") and self.sched.drafter_alive):
            task.tokens_to = self.channel.tokens_to(verify.seq, len(verify.rows), self.k)
        if verify.regime == "sd":
            task.kind = "step"
            task.message = SpecStep(verify.seq, slots, self.k, nlp, self._verifier_tables(), chunks)
            task.ref = self.verifier.step.remote(task.message.to_wire())
        else:
            for round_ in (verify.ahead, verify.fresh):
                if round_ is None:
                    continue
                if round_.handle is None:   # drafted now, from committed tokens (and prefills in flight)
                    self._submit_round(round_, None)
                task.drafts.append(round_.handle)
                task.draft_timings.append(round_.timing)
            keys, arguments = self.channel.verify_drafts(task.drafts)
            drafted = max(verify.draft_index) >= 0   # any row with drafts (`drafted`, without counting them)
            task.message = VerifyTask(verify.seq, slots, nlp, verify.draft_index if drafted else None,
                                      keys, task.tokens_to, self._verifier_tables(), chunks)
            task.ref = self.verifier.verify.remote(task.message.to_wire(), *arguments)
        if verify.prefill is not None:   # rounds take its first tokens from the verify's result
            verify.prefill.handle = task.ref
        self.counters["queued_behind"] += self.sched.queued[verify.batch] > 1
        self.inflight.append(task)
        if verify.next_round is not None:
            self._submit_round(verify.next_round, task)
        elif task.tokens_to is not None:
            self.channel.drop_tokens(self.drafter, task.tokens_to)

    def _submit_round(self, round_: DraftPlan, after: InFlight | None) -> None:
        """A draft round to the drafter. Its rows' tokens past their committed ones come from tasks still in
        flight: a prefill's first token, and (drafted ahead) the tokens of the verify `after`, which Ray hands
        over when they exist (or the link brings)."""
        # source 0 is the verify `after`: its result, or under a collective channel its tokens over the link
        over_link = after.tokens_to if after is not None else None
        sources, source_of = ([after.ref] if after is not None and over_link is None else []), {}
        first_argument = 1 if over_link is not None else 0   # the source number of sources[0]
        # the round's columns in one pass over its rows (a round is sent every step)
        slots, valid, tails, takes_of, all_but_two, seeds, positions = [], [], [], [], [], [], []
        for spec in round_.rows:
            r = spec.state.request
            start, tail = r.draft_feed()
            slots.append(r.slot)
            valid.append(start)
            tails.append(tail)
            takes = []
            if spec.from_prefill is not None:
                source = source_of.get(id(spec.from_prefill))
                if source is None:
                    source = source_of[id(spec.from_prefill)] = first_argument + len(sources)
                    sources.append(spec.from_prefill.handle)
                takes.append((source, spec.state.prefill_row))
            if spec.verify_row >= 0:
                takes.append((0, spec.verify_row))
            takes_of.append(takes)
            all_but_two.append(spec.all_but_two)
            seeds.append(r.seed)
            positions.append(len(r.output_ids))
        message = DraftRound(self.actors.next_drafter_seq(), self.k, slots, valid, tails, takes_of, all_but_two, seeds,
                             positions, self._drafter_tables(), over_link)
        round_.handle, round_.timing = self.channel.submit(self.drafter, self.verifier, message, sources)

    def _drop_round(self, round_: DraftPlan) -> None:
        """A round drafted ahead that no verify will name."""
        if round_.handle is None:
            return
        self.channel.discard(self.verifier, round_.handle)
        if round_.generation == self.sched.drafter_generation:   # a fault in it still says the drafter is unwell
            asyncio.get_running_loop().create_task(self._watch_drafter_task(round_.timing, "draft round",
                                                                            round_.generation))

    async def _watch_drafter_task(self, ref, what: str, generation: int) -> None:
        """A drafter task nobody else awaits: its failure is the drafter's (serve ar and restart it)."""
        try:
            await self._get(ref, what)
        except Exception as e:
            if generation == self.sched.drafter_generation:
                self._drafter_down(e)

    # ---- drafter faults --------------------------------------------------------------------------
    def _drafter_down(self, error: Exception) -> None:
        if not self.sched.drafter_down():
            return
        self.counters["drafter_failures"] += 1
        log.warning("drafter failed (%s); serving in ar mode while it restarts", error)
        if self._restart_task is None or self._restart_task.done():
            self._restart_task = asyncio.get_running_loop().create_task(self._restart_drafter())

    async def _restart_drafter(self) -> None:
        delay = 0.5
        while not self.dead:
            try:
                info = await self.actors.replace_drafter()
                pool = KVPoolSpec(**info["kv_pools"]["draft"])
                if pool.holds < self.max_len:   # requests admitted up to max_len would wait for its blocks forever
                    raise CacheSizeError(f"the new drafter's KV pool holds {pool.holds} tokens, max_len is "
                                         f"{self.max_len}")
            except Exception as e:
                log.warning("drafter restart failed (%s); retrying in %.1f s", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            self.sched.drafter_up(pool)
            self.counters["drafter_restarts"] += 1
            log.warning("drafter restarted; speculative decoding resumed")
            self._wake.set()
            return
