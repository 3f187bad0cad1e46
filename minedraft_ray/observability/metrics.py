"""Engine metrics through `ray.util.metrics`, exported by every Ray node's metrics agent for Prometheus.

    metrics = EngineMetrics(model="qwen2.5-7b", mode="psd", replica=replica_name())
    metrics.attach(manager)                               # per step: BatchManager.step_listeners
    metrics.on_tokens(n)                                  # per emit: tokens handed to requests
    metrics.on_request_finished(stats, "finished", prompt_tokens, output_tokens)

Ray prefixes every name with `ray_` and adds `_total` to counters, so `minedraft_requests` is scraped
as `ray_minedraft_requests_total`; `SERIES` lists the scraped names. Every series carries the labels
model, mode (ar, sd, sd_split, psd) and replica, plus Ray's own (WorkerId, NodeAddress, ...).

Cost: never per token. A step makes five histogram observations (each a call into Ray's C++ recorder),
a finished request three; counter increments are summed in Python and handed to Ray about once a
second; gauges are written only when their value changes, and those read from the engine's snapshot (queue,
slots, drafter, KV pools) once per such window. Speculative-decoding names follow vLLM's
(`vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`):
acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts.

Ray drops a gauge series that was not set during the last ~2 export intervals (~20 s), so a daemon thread
re-sets every gauge's last value each `refresh_s` seconds: an idle engine keeps reporting its zero queue.
Ray (2.58) exports a histogram's `_sum` from bucket midpoints, not the observed values: bucket counts
are exact, `_sum` is not. Means and the verifier busy fraction therefore use the exact `*_time_seconds`
counters, and the latency panels use quantiles.
"""
from __future__ import annotations

import os
import socket
import sys
import threading

from ray.util.metrics import Counter, Gauge, Histogram

LABELS = ("model", "mode", "replica")

# seconds; TTFT and end-to-end latency span queueing (long tail), inter-token latency is one step
LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5]
STEP_BUCKETS = [0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0]
# tokens per verify step per request: 1 (all drafts rejected) .. k + 1 (all accepted), k <= 8
ACCEPTANCE_LENGTH_BUCKETS = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0]

# scraped name -> (kind, help); the single list the dashboard and the docs draw from
SERIES = {
    "ray_minedraft_requests_total": ("counter", "finished requests by status: finished | aborted | error"),
    "ray_minedraft_generation_tokens_total": ("counter", "tokens handed to requests (completion tokens)"),
    "ray_minedraft_prompt_tokens_total": ("counter", "prompt tokens of finished requests"),
    "ray_minedraft_time_to_first_token_seconds": ("histogram", "arrival to first token, finished requests"),
    "ray_minedraft_inter_token_latency_seconds": (
        "histogram", "per request: (e2e - ttft) / (output tokens - 1), like vLLM's time per output token"),
    "ray_minedraft_e2e_request_latency_seconds": ("histogram", "arrival to last token, finished requests"),
    "ray_minedraft_spec_decode_num_drafts_total": ("counter", "request rows verified with drafts"),
    "ray_minedraft_spec_decode_num_draft_tokens_total": ("counter", "draft tokens verified"),
    "ray_minedraft_spec_decode_num_accepted_tokens_total": ("counter", "draft tokens accepted"),
    "ray_minedraft_spec_decode_num_draft_tokens_per_pos_total": (
        "counter", "draft tokens at draft position `position`, counted when the request finishes"),
    "ray_minedraft_spec_decode_num_accepted_tokens_per_pos_total": (
        "counter", "accepted tokens at draft position `position`, counted when the request finishes"),
    "ray_minedraft_spec_decode_acceptance_length": (
        "histogram", "per verify step: 1 + accepted / rows with drafts"),
    "ray_minedraft_steps_total": ("counter", "engine steps by regime: psd | seq | sd | ar"),
    "ray_minedraft_step_seconds": ("histogram", "wall time of one engine step, seen by the batch manager"),
    "ray_minedraft_draft_seconds": ("histogram", "drafter device time per step"),
    "ray_minedraft_verify_seconds": ("histogram", "verifier device time per step"),
    "ray_minedraft_ray_overhead_seconds": (
        "histogram", "step wall time - device time (psd: max(draft, verify), else draft + verify)"),
    # exact time totals: Ray exports a histogram's _sum from bucket midpoints, so means and fractions come
    # from these counters (rate(verify) / rate(step) = verifier busy fraction)
    "ray_minedraft_step_time_seconds_total": ("counter", "sum of step wall times"),
    "ray_minedraft_draft_time_seconds_total": ("counter", "sum of drafter device times"),
    "ray_minedraft_verify_time_seconds_total": ("counter", "sum of verifier device times"),
    "ray_minedraft_ray_overhead_time_seconds_total": ("counter", "sum of per-step Ray overheads"),
    "ray_minedraft_verifier_busy_fraction": (
        "gauge", "verify time / step wall time over the last ~1 s of steps (prefill not counted)"),
    "ray_minedraft_batch_size": ("gauge", "requests in batch `batch` (a | b) after the step; non-psd: all in a"),
    "ray_minedraft_batch_imbalance": ("gauge", "| |A| - |B| | after a step of the split (psd keeps it <= 1); 0 "
                                      "while one sequential batch runs"),
    "ray_minedraft_prefill_tokens_total": (
        "counter", "tokens prefilled by the verifier: prompts (whole, or chunks on their own or fused into "
                   "verifies), and what a preempted request recomputes when it resumes"),
    "ray_minedraft_prompt_chunk_limit_tokens": (
        "gauge", "tokens of the launch that carries a step's prompt chunk while requests decode (a fused chunk's with "
                 "its verify's): the budget (prefill_chunk_tokens), or the adaptive launch below it (chunk_gap_ratio) for "
                 "a chunk at a prompt's start, deeper ones taking less; not exported without chunking"),
    "ray_minedraft_queue_depth": ("gauge", "requests waiting for a slot"),
    "ray_minedraft_running_requests": ("gauge", "requests in the batches"),
    "ray_minedraft_slots_in_use": ("gauge", "KV slots held"),
    "ray_minedraft_num_slots": ("gauge", "KV slots per model"),
    "ray_minedraft_drafter_alive": ("gauge", "1 while the drafter serves, 0 during a restart (ar fallback)"),
    # paged KV: per model (`kv_cache`: target | draft); hit rate = rate(hits) / rate(queries), as vLLM's
    "ray_minedraft_kv_cache_usage": ("gauge", "KV blocks held by requests / blocks in the pool of model `kv_cache`"),
    "ray_minedraft_prefix_cache_queries_total": (
        "counter", "tokens looked up in the prefix cache of model `kv_cache` when requests are admitted"),
    "ray_minedraft_prefix_cache_hits_total": ("counter", "of those, tokens found cached (mapped, not recomputed)"),
    "ray_minedraft_preemptions_total": (
        "counter", "requests preempted when a KV pool ran short (blocks freed, recomputed when resumed)"),
    # per process whose event loop serves streams (`process`: ingress | manager; heap.py)
    "ray_minedraft_gc_pause_seconds": (
        "histogram", "garbage-collector pauses of `generation` (full ones, and young ones of >= 1 ms): the process "
                     "stalls meanwhile"),
    "ray_minedraft_gc_frozen_objects": (
        "gauge", "objects kept out of the collector's scans since startup (0: every full collection scans them)"),
}


def replica_name() -> str:
    """The Serve replica id inside a replica, else the Ray actor id, else host-pid."""
    # a replica's process runs Serve's code, so Serve is imported there; importing it anywhere else (the LLM's
    # manager actor) would load FastAPI, uvicorn and gRPC's asyncio API for nothing, most of that actor's start
    serve = sys.modules.get("ray.serve")
    if serve is not None:
        try:
            return serve.get_replica_context().replica_id.unique_id
        except Exception:   # not inside a Serve replica
            pass
    try:
        import ray
        actor_id = ray.get_runtime_context().get_actor_id()
        if actor_id:
            return actor_id[:12]
    except Exception:
        pass
    return f"{socket.gethostname()}-{os.getpid()}"


def request_status(finish_reason: str | None, error: str | None) -> str:
    """finished | aborted | error, the `status` label of ray_minedraft_requests_total."""
    if error:
        return "error"
    return "aborted" if finish_reason == "abort" else "finished"


class EngineMetrics:
    """One engine's metrics. Counter increments are summed in Python and handed to Ray once per window
    (`window_s` of step time), when the engine runs dry, and by the refresher thread, so a step costs
    five histogram observations plus dict updates; Ray itself exports only every ~10 s."""

    def __init__(self, model: str, mode: str, replica: str | None = None, window_s: float = 1.0,
                 refresh_s: float = 4.0):
        self.labels = {"model": model, "mode": mode, "replica": replica or replica_name()}
        self.manager = None
        self.window_s = window_s
        self.refresh_s = refresh_s
        self._busy_ms = self._wall_ms = 0.0
        self._pending: dict[tuple, list] = {}          # (counter id, tags id) -> [counter, tags, amount]
        self._gauge_values: dict[tuple, tuple] = {}    # (gauge id, batch) -> (gauge, tags, last value)
        self._lock = threading.Lock()                  # the step loop and the refresher thread share both
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

        def counter(name, desc, extra=()):
            m = Counter(name, description=desc, tag_keys=LABELS + extra)
            m.set_default_tags(self.labels)
            return m

        def histogram(name, desc, boundaries):
            m = Histogram(name, description=desc, boundaries=boundaries, tag_keys=LABELS)
            m.set_default_tags(self.labels)
            return m

        def gauge(name, desc, extra=()):
            m = Gauge(name, description=desc, tag_keys=LABELS + extra)
            m.set_default_tags(self.labels)
            return m

        d = {name: help_ for name, (_, help_) in SERIES.items()}
        self.requests = counter("minedraft_requests", d["ray_minedraft_requests_total"], ("status",))
        self.generation_tokens = counter("minedraft_generation_tokens", d["ray_minedraft_generation_tokens_total"])
        self.prompt_tokens = counter("minedraft_prompt_tokens", d["ray_minedraft_prompt_tokens_total"])
        self.ttft = histogram("minedraft_time_to_first_token_seconds",
                              d["ray_minedraft_time_to_first_token_seconds"], LATENCY_BUCKETS)
        self.itl = histogram("minedraft_inter_token_latency_seconds",
                             d["ray_minedraft_inter_token_latency_seconds"], ITL_BUCKETS)
        self.e2e = histogram("minedraft_e2e_request_latency_seconds",
                             d["ray_minedraft_e2e_request_latency_seconds"], LATENCY_BUCKETS)
        self.num_drafts = counter("minedraft_spec_decode_num_drafts",
                                  d["ray_minedraft_spec_decode_num_drafts_total"])
        self.num_draft_tokens = counter("minedraft_spec_decode_num_draft_tokens",
                                        d["ray_minedraft_spec_decode_num_draft_tokens_total"])
        self.num_accepted_tokens = counter("minedraft_spec_decode_num_accepted_tokens",
                                           d["ray_minedraft_spec_decode_num_accepted_tokens_total"])
        self.draft_tokens_per_pos = counter("minedraft_spec_decode_num_draft_tokens_per_pos",
                                            d["ray_minedraft_spec_decode_num_draft_tokens_per_pos_total"],
                                            ("position",))
        self.accepted_tokens_per_pos = counter("minedraft_spec_decode_num_accepted_tokens_per_pos",
                                               d["ray_minedraft_spec_decode_num_accepted_tokens_per_pos_total"],
                                               ("position",))
        self.acceptance_length = histogram("minedraft_spec_decode_acceptance_length",
                                           d["ray_minedraft_spec_decode_acceptance_length"],
                                           ACCEPTANCE_LENGTH_BUCKETS)
        self.steps = counter("minedraft_steps", d["ray_minedraft_steps_total"], ("regime",))
        self.step_time = histogram("minedraft_step_seconds", d["ray_minedraft_step_seconds"], STEP_BUCKETS)
        self.draft_time = histogram("minedraft_draft_seconds", d["ray_minedraft_draft_seconds"], STEP_BUCKETS)
        self.verify_time = histogram("minedraft_verify_seconds", d["ray_minedraft_verify_seconds"], STEP_BUCKETS)
        self.overhead = histogram("minedraft_ray_overhead_seconds", d["ray_minedraft_ray_overhead_seconds"],
                                  STEP_BUCKETS)
        self.step_total = counter("minedraft_step_time_seconds", d["ray_minedraft_step_time_seconds_total"])
        self.draft_total = counter("minedraft_draft_time_seconds", d["ray_minedraft_draft_time_seconds_total"])
        self.verify_total = counter("minedraft_verify_time_seconds", d["ray_minedraft_verify_time_seconds_total"])
        self.overhead_total = counter("minedraft_ray_overhead_time_seconds",
                                      d["ray_minedraft_ray_overhead_time_seconds_total"])
        self.busy = gauge("minedraft_verifier_busy_fraction", d["ray_minedraft_verifier_busy_fraction"])
        self.batch_size = gauge("minedraft_batch_size", d["ray_minedraft_batch_size"], ("batch",))
        self.imbalance = gauge("minedraft_batch_imbalance", d["ray_minedraft_batch_imbalance"])
        self.prefill_tokens = counter("minedraft_prefill_tokens", d["ray_minedraft_prefill_tokens_total"])
        self.chunk_limit = gauge("minedraft_prompt_chunk_limit_tokens", d["ray_minedraft_prompt_chunk_limit_tokens"])
        self.queue_depth = gauge("minedraft_queue_depth", d["ray_minedraft_queue_depth"])
        self.running = gauge("minedraft_running_requests", d["ray_minedraft_running_requests"])
        self.slots_in_use = gauge("minedraft_slots_in_use", d["ray_minedraft_slots_in_use"])
        self.num_slots = gauge("minedraft_num_slots", d["ray_minedraft_num_slots"])
        self.drafter_alive = gauge("minedraft_drafter_alive", d["ray_minedraft_drafter_alive"])
        self.kv_cache_usage = gauge("minedraft_kv_cache_usage", d["ray_minedraft_kv_cache_usage"], ("kv_cache",))
        self.prefix_queries = counter("minedraft_prefix_cache_queries", d["ray_minedraft_prefix_cache_queries_total"],
                                      ("kv_cache",))
        self.prefix_hits = counter("minedraft_prefix_cache_hits", d["ray_minedraft_prefix_cache_hits_total"],
                                   ("kv_cache",))
        self.preemptions = counter("minedraft_preemptions", d["ray_minedraft_preemptions_total"])
        # tag dicts are built once and cached: `_add` keys pending increments by their identity
        self._status_tags = {s: {"status": s} for s in ("finished", "aborted", "error")}
        self._regime_tags = {r: {"regime": r} for r in ("psd", "seq", "sd", "ar")}
        # a gauge's tags by the key `_set` takes: None, a batch (0, 1) or a KV pool's model
        self._gauge_tags = {None: None, 0: {"batch": "a"}, 1: {"batch": "b"},
                            "target": {"kv_cache": "target"}, "draft": {"kv_cache": "draft"}}
        self._pos_tags: list[dict] = []
        self._kv_seen: dict[str, tuple[int, int]] = {}   # model -> (hit, query) tokens counted so far
        self._preemptions_seen = 0

    def attach(self, manager) -> "EngineMetrics":
        """Register on a BatchManager (one `on_step` per engine step) and start the refresher. The manager is
        read through its declared snapshot (`manager.snapshot()`, runtime/telemetry.py) only."""
        self.manager = manager
        for gauge in (self.queue_depth, self.running, self.slots_in_use, self.imbalance):
            self._set(gauge, 0)
        self._set(self.batch_size, 0, 0)
        self._set(self.batch_size, 0, 1)
        self._set(self.num_slots, manager.snapshot().num_slots)
        self.on_kv(manager.snapshot())
        manager.step_listeners.append(self.on_step)
        self.start_refresher()
        return self

    def start_refresher(self) -> None:
        if self._refresher is None and self.refresh_s > 0:
            self._refresher = threading.Thread(target=self._refresh_loop, name="minedraft-metrics", daemon=True)
            self._refresher.start()

    def close(self) -> None:
        """Stop the refresher after a last flush."""
        self._stop.set()
        self.flush()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.flush()
            self.refresh()

    def refresh(self) -> None:
        """Re-set every gauge to its last value (Ray ages out gauges that are not re-reported)."""
        with self._lock:
            entries = list(self._gauge_values.values())
        for gauge, tags, value in entries:
            gauge.set(value, tags)

    def flush(self) -> None:
        """Hand the summed counter increments to Ray."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for counter, tags, amount in pending.values():
            if amount > 0:   # Ray counters reject inc(0)
                counter.inc(amount, tags)

    def _add(self, counter: Counter, amount: float, tags: dict | None = None) -> None:
        key = (id(counter), id(tags))
        with self._lock:
            entry = self._pending.get(key)
            if entry is None:
                self._pending[key] = [counter, tags, amount]
            else:
                entry[2] += amount

    def _set(self, gauge: Gauge, value: float, series: int | str | None = None) -> None:
        """Set a gauge when its value changed; the refresher re-reports unchanged ones. series: its key in
        `_gauge_tags` (a batch, or a KV pool's model)."""
        key = (id(gauge), series)
        entry = self._gauge_values.get(key)
        if entry is not None and entry[2] == value:
            return
        tags = self._gauge_tags[series]
        with self._lock:
            self._gauge_values[key] = (gauge, tags, value)
        gauge.set(value, tags)

    # ---- per step ------------------------------------------------------------------------------
    def on_step(self, record, manager=None) -> None:
        manager = manager or self.manager
        step_s = record.step_ms / 1e3
        # psd drafts one batch while verifying the other; every other regime drafts, then verifies
        busy_ms = (max(record.t_draft_ms, record.t_verify_ms) if record.regime == "psd"
                   else record.t_draft_ms + record.t_verify_ms)
        overhead_s = max(step_s - busy_ms / 1e3, 0.0)
        self._add(self.steps, 1, self._regime_tags.setdefault(record.regime, {"regime": record.regime}))
        self.step_time.observe(step_s)
        self.overhead.observe(overhead_s)
        self._add(self.step_total, step_s)
        self._add(self.overhead_total, overhead_s)
        if record.t_draft_ms > 0:
            self.draft_time.observe(record.t_draft_ms / 1e3)
            self._add(self.draft_total, record.t_draft_ms / 1e3)
        if record.t_verify_ms > 0:
            self.verify_time.observe(record.t_verify_ms / 1e3)
            self._add(self.verify_total, record.t_verify_ms / 1e3)
        if record.draft_tokens:
            # each row carrying drafts carries k of them: the rows drafted
            drafts = record.drafted
            self._add(self.num_drafts, drafts)
            self._add(self.num_draft_tokens, record.draft_tokens)
            self._add(self.num_accepted_tokens, record.accepted)
            self.acceptance_length.observe(1.0 + record.accepted / drafts)
        a, b = record.sizes
        self._set(self.batch_size, a, 0)
        self._set(self.batch_size, b, 1)
        # the balance of the split; a sequential batch (one batch holds everyone) has none
        split = record.regime == "psd" and not record.extra.get("one_batch")
        self._set(self.imbalance, abs(a - b) if split else 0)
        self._set(self.running, a + b)
        self._busy_ms += record.t_verify_ms
        self._wall_ms += record.step_ms
        # a window ends after window_s of steps, or when the engine runs dry (the end of a burst)
        if self._wall_ms >= self.window_s * 1e3 or (a + b == 0 and self._wall_ms > 0):
            self._set(self.busy, min(self._busy_ms / self._wall_ms, 1.0))
            self._busy_ms = self._wall_ms = 0.0
            # the chunk limit moves slowly: read once per window, as the snapshot's gauges are
            limit = record.chunk_limit
            if limit is None and manager is not None:
                limit = manager.config.prefill_chunk_tokens
            if limit:   # unchunked (0): no bound to show
                self._set(self.chunk_limit, limit)
            if manager is not None:
                self.on_snapshot(manager.snapshot())
            self.flush()

    def on_snapshot(self, snapshot) -> None:
        """The engine's state, read once per window (Ray exports every ~10 s, so a value a second old loses
        nothing a scrape sees, and a step does not pay for reading the queue and both KV pools)."""
        self._set(self.queue_depth, snapshot.waiting)
        self._set(self.slots_in_use, snapshot.slots_in_use)
        self._set(self.drafter_alive, 1 if snapshot.drafter_alive else 0)
        self.on_kv(snapshot)

    def on_kv(self, snapshot) -> None:
        """The KV pools' usage, and the prefix-cache and preemption counts since the last snapshot."""
        for pool in snapshot.kv_pools:
            self._set(self.kv_cache_usage, pool.blocks_in_use / pool.blocks if pool.blocks else 0.0, pool.model)
            hits, queries = self._kv_seen.get(pool.model, (0, 0))
            if pool.query_tokens < queries:   # a new pool (the drafter restarted) counts from 0
                hits = queries = 0
            if pool.query_tokens > queries:
                tags = self._gauge_tags[pool.model]
                self._add(self.prefix_hits, pool.hit_tokens - hits, tags)
                self._add(self.prefix_queries, pool.query_tokens - queries, tags)
            self._kv_seen[pool.model] = (pool.hit_tokens, pool.query_tokens)
        if snapshot.preemptions > self._preemptions_seen:
            self._add(self.preemptions, snapshot.preemptions - self._preemptions_seen)
        self._preemptions_seen = snapshot.preemptions

    # ---- per emit / per request ----------------------------------------------------------------
    def on_prefill(self, prompt_tokens: int) -> None:
        """A prefill task (or the chunks fused into a verify) ran."""
        self._add(self.prefill_tokens, prompt_tokens)

    def on_tokens(self, n: int) -> None:
        """`n` tokens were handed to requests (after stop / max_tokens cuts): one call per emit."""
        if n:
            self._add(self.generation_tokens, n)

    def on_request_finished(self, stats: dict, status: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """A request left the engine. `stats` is `RequestStats.as_dict()`; status finished | aborted | error.
        Latencies are observed for finished requests only (an abort's latency is the client's choice)."""
        self._add(self.requests, 1, self._status_tags.setdefault(status, {"status": status}))
        self._add(self.prompt_tokens, prompt_tokens)
        drafted = stats.get("drafted_per_position") or []
        accepted = stats.get("accepted_per_position") or []
        while len(self._pos_tags) < len(drafted):
            self._pos_tags.append({"position": str(len(self._pos_tags))})
        for j, n in enumerate(drafted):
            self._add(self.draft_tokens_per_pos, n, self._pos_tags[j])
            self._add(self.accepted_tokens_per_pos, accepted[j], self._pos_tags[j])
        if status != "finished":
            return
        ttft, latency = stats.get("ttft"), stats.get("latency")
        if ttft is not None:
            self.ttft.observe(ttft)
        if latency is not None:
            self.e2e.observe(latency)
            if ttft is not None and output_tokens > 1:
                self.itl.observe((latency - ttft) / (output_tokens - 1))
