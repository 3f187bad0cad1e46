"""vLLM's Prometheus series, served at /metrics on the API port, so that vLLM dashboards and alerts work unchanged.

Names, help texts, label names and histogram buckets are vLLM 0.32's (vllm/v1/metrics/loggers.py, buckets.py and
spec_decode/metrics.py; tests_vllm/test_vllm_metric_names.py checks them against the installed package). Labels:
model_name (the served model id) and engine ("0", vLLM's engine index; here the ingress's engine deployment).

Where the values come from: vLLM measures request timings in its API-server process (the output processor);
so does this module, in the OpenAI ingress replica, from the engine's outputs as they arrive:

- TTFT: request arrival at the ingress -> its first token; e2e: arrival -> the last output;
- inter-token latency: one observation per engine output after the first (vLLM: one per engine step that
  gave the request tokens; here outputs of a request within `stream_interval_ms` come merged);
- prompt tokens when the first token arrives (the prefill is done), generation tokens as they arrive;
- spec-decode counters from each request's final stats (vLLM counts them per step; the totals agree, but a
  request whose client went away before it finished is not counted here);
- running and waiting requests, KV-cache usage (the target's KV blocks held by requests / its blocks, as
  vLLM's: cached blocks nobody holds count as free): the engine's own state (BatchManager.info), read at each
  scrape;
- prefix-cache queries and hits (prompt tokens looked up / found cached, at a request's first admission, as
  vLLM counts them: a resumed request's lookups are not counted; the hits are the cached prompt tokens too)
  and preemptions: the engine's totals
  (BatchManager.info), read at each scrape. A scrape reads one engine replica (the one Serve routes it to), so
  the totals are kept per replica and the counters are their sum; a replica's total that went down (its engine
  restarted) counts on from 0;
- preemptions per request (a histogram): from each request's final stats, as the spec-decode counters.

The project's own series (`ray_minedraft_*`, docs/observability.md) stay where they are, on Ray's metrics
export; this registry adds `minedraft_api_ignored_fields_total` (request fields accepted and ignored) and
`minedraft_api_event_loop_lag_seconds` (serve/loop_lag.py) and `minedraft_api_admission_waits_total` (requests
that waited for an admission slot).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .loop_lag import LAG_BUCKETS

# vllm/v1/metrics/buckets.py (vLLM 0.32)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                               20.0, 40.0, 80.0)
LABELS = ("model_name", "engine")
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")   # vLLM's FinishReason strings
CONTENT_TYPE = CONTENT_TYPE_LATEST

# name -> (kind, help) of every vLLM series served; names as vLLM declares them (counters gain `_total`)
VLLM_SERIES = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:prefix_cache_queries": ("counter", "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("counter", "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:prompt_tokens_cached": ("counter", "Number of cached prompt tokens (local + external)."),
    "vllm:num_preemptions": ("counter", "Cumulative number of preemption from the engine."),
    "vllm:request_num_preemptions": ("histogram", "Histogram of the number of times a request was preempted."),
    "vllm:prompt_tokens": ("counter", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("counter", "Number of generation tokens processed."),
    "vllm:request_success": ("counter", "Count of successfully processed requests."),
    "vllm:time_to_first_token_seconds": ("histogram", "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": ("histogram", "Histogram of inter-token latency in seconds."),
    "vllm:e2e_request_latency_seconds": ("histogram", "Histogram of e2e request latency in seconds."),
    "vllm:spec_decode_num_drafts": ("counter", "Number of spec decoding drafts."),
    "vllm:spec_decode_num_draft_tokens": ("counter", "Number of draft tokens."),
    "vllm:spec_decode_num_accepted_tokens": ("counter", "Number of accepted tokens."),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", "Accepted tokens per draft position."),
}


class APIMetrics:
    """One ingress replica's registry: vLLM's series for one served model, plus the ignored-fields counter."""

    def __init__(self, model_name: str, num_spec_tokens: int, spec_decode: bool = True):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        doc = {name: help_ for name, (_, help_) in VLLM_SERIES.items()}

        def make(cls, name, extra=(), **kw):
            return cls(name, doc[name], labelnames=LABELS + extra, registry=self.registry, **kw)

        self.running = make(Gauge, "vllm:num_requests_running").labels(**labels)
        self.waiting = make(Gauge, "vllm:num_requests_waiting").labels(**labels)
        self.kv_cache_usage = make(Gauge, "vllm:kv_cache_usage_perc").labels(**labels)
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens").labels(**labels)
        self.generation_tokens = make(Counter, "vllm:generation_tokens").labels(**labels)
        success = make(Counter, "vllm:request_success", ("finished_reason",))
        self.request_success = {r: success.labels(**labels, finished_reason=r) for r in FINISH_REASONS}
        self.ttft = make(Histogram, "vllm:time_to_first_token_seconds",
                         buckets=TIME_TO_FIRST_TOKEN_BUCKETS).labels(**labels)
        self.itl = make(Histogram, "vllm:inter_token_latency_seconds",
                        buckets=INTER_TOKEN_LATENCY_BUCKETS).labels(**labels)
        self.e2e = make(Histogram, "vllm:e2e_request_latency_seconds",
                        buckets=REQUEST_LATENCY_BUCKETS).labels(**labels)
        self.request_preemptions = make(Histogram, "vllm:request_num_preemptions",
                                        buckets=REQUEST_NUM_PREEMPTIONS_BUCKETS).labels(**labels)
        # engine totals: BatchManager.info's counter -> the series it feeds, summed over the engine replicas seen
        # (cached prompt tokens are the prefix cache's hits: there is no external KV here)
        self.engine_totals = {"prefix_cache_queries": [make(Counter, "vllm:prefix_cache_queries").labels(**labels)],
                              "prefix_cache_hits": [make(Counter, "vllm:prefix_cache_hits").labels(**labels),
                                                    make(Counter, "vllm:prompt_tokens_cached").labels(**labels)],
                              "preemptions": [make(Counter, "vllm:num_preemptions").labels(**labels)]}
        self._totals_seen: dict[tuple[str | None, str], int] = {}   # (engine replica, info key) -> its last total
        self.spec_decode = spec_decode
        if spec_decode:   # vLLM declares these only with a speculative config
            self.num_drafts = make(Counter, "vllm:spec_decode_num_drafts").labels(**labels)
            self.num_draft_tokens = make(Counter, "vllm:spec_decode_num_draft_tokens").labels(**labels)
            self.num_accepted_tokens = make(Counter, "vllm:spec_decode_num_accepted_tokens").labels(**labels)
            per_pos = make(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos", ("position",))
            self.accepted_per_pos = [per_pos.labels(**labels, position=str(p)) for p in range(num_spec_tokens)]
        self.ignored_fields = Counter("minedraft_api_ignored_fields",
                                      "Request fields accepted and ignored (unknown or without effect here), "
                                      "by endpoint and field name", labelnames=("endpoint", "field"),
                                      registry=self.registry)
        self.loop_lag = Histogram("minedraft_api_event_loop_lag_seconds",
                                  "How late a short timer on the ingress replica's event loop fired "
                                  "(serve/loop_lag.py): the delay the loop added to every stream's chunks meanwhile",
                                  buckets=LAG_BUCKETS, registry=self.registry)
        self.admission_waits = Counter("minedraft_api_admission_waits",
                                       "Requests that waited for an admission slot (serve/app.py ADMITTING_AT_ONCE): "
                                       "a burst admitted in slices", registry=self.registry)

    def request(self, prompt_tokens: int, arrival: float | None = None) -> "RequestTimer":
        """`arrival` (perf_counter): when the HTTP request came in, so TTFT counts its wait for admission too."""
        return RequestTimer(self, prompt_tokens, arrival)

    def set_engine_state(self, info: dict) -> None:
        """From BatchManager.info(). KV usage is the share of the target's KV blocks that requests hold (its pool
        is the larger part of the KV memory; the drafter's is in info's `kv_cache` too)."""
        self.running.set(info["running"])
        self.waiting.set(info["queued"])
        pool = (info.get("kv_cache") or {}).get("target")
        self.kv_cache_usage.set(pool["blocks_in_use"] / pool["blocks"] if pool and pool["blocks"] else 0.0)
        for key, counters in self.engine_totals.items():
            total = info.get(key, 0)
            seen = self._totals_seen.get((info.get("replica"), key), 0)
            for counter in counters:
                counter.inc(total - seen if total >= seen else total)   # lower: a new engine, counting from 0
            self._totals_seen[(info.get("replica"), key)] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One engine request (one choice) as the ingress sees it; every method is O(1) and per engine output."""

    def __init__(self, metrics: APIMetrics, prompt_tokens: int, arrival: float | None = None):
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.last_token: float | None = None
        self.done = False

    def on_tokens(self, n: int) -> None:
        if n <= 0 or self.done:
            return
        now = time.perf_counter()
        m = self.metrics
        if self.last_token is None:
            m.ttft.observe(now - self.arrival)
            m.prompt_tokens.inc(self.prompt_tokens)
        else:
            m.itl.observe(now - self.last_token)
        self.last_token = now
        m.generation_tokens.inc(n)

    def refused(self) -> None:
        """The engine refused the request (e.g. its queue was full): it is no request of these series."""
        self.done = True

    def on_finished(self, finish_reason: str, stats: dict | None) -> None:
        """The request ended (finish_reason: stop, length or abort); stats: the engine's RequestStats."""
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.e2e.observe(time.perf_counter() - self.arrival)
        m.request_success[finish_reason if finish_reason in m.request_success else "abort"].inc()
        if stats:
            m.request_preemptions.observe(stats.get("preemptions", 0))
        if stats and m.spec_decode:
            m.num_drafts.inc(stats.get("verify_steps", 0))
            m.num_draft_tokens.inc(stats.get("drafted", 0))
            m.num_accepted_tokens.inc(stats.get("accepted", 0))
            for counter, n in zip(m.accepted_per_pos, stats.get("accepted_per_position") or ()):
                counter.inc(n)
