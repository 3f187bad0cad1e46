"""The same closed workload through the Serve HTTP endpoint and through the offline `LLM` API, in one command.

    python -m bench.serve_vs_offline --mode ar --max-batch 64 --n-requests 256            # one GPU, ~4 min
    python -m bench.serve_vs_offline --mode sd --k 2 --max-batch 64 --n-requests 256      # ~4 min
    python -m bench.serve_vs_offline --mode ar --max-batch 256 --n-requests 1024          # ~5 min
    python -m bench.serve_vs_offline --mode ar,sd --max-batch 64,256 --n-requests 256,1024   # all four, ~16 min
    python -m bench.serve_vs_offline --smoke                                               # CPU, default pair

On a GPU the results go to <out>/serve_vs_offline.*, on a CPU to <out>/serve_vs_offline_cpu.*. Files of separate
runs merge with `python -m bench.serve_vs_offline --merge RUN.parquet [...] --out bench/results`.

Per configuration (mode x max_batch): the engine is built as `LLM` (in this process's Ray, its manager in an
actor) and run on all prompts in one `generate` call; it is shut down and the same configuration is deployed as
the Serve app (engine replica + OpenAI ingress), which gets the same prompts as streaming completions sent at
once by client processes (aiohttp, separate from the server), then Poisson arrivals at `--loads` x the measured
HTTP capacity. Each engine is built twice: both hold the verifier's GPU, one device cannot hold two.

Rows (merged into <out>/serve_vs_offline.parquet by configuration): `closed` has the tok/s of both paths and
`http_over_offline`; TTFT and the chunk gap (time between consecutive streamed chunks of a request) are the HTTP
path's; `online` rows the same percentiles at each load. `engine_step_ms` is the engine replica's median step.
The chunk gap is attributed per hop: the ingress's gaps (vLLM's inter-token-latency histogram on its /metrics, read
before and after each workload) and the engine's (its step records of the workload, read through a Serve handle).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

NAME = "serve_vs_offline"   # on a CPU: serve_vs_offline_cpu
APP = "serve-vs-offline"
CONFIG = ("label", "mode", "k", "tp", "max_batch", "n_requests", "max_tokens", "prompt_len", "workload", "load", "device",
          "ingress_replicas", "ingress_cpus", "ingress_http", "stream_interval_ms")
COLUMNS = ["label", "mode", "k", "tp", "max_batch", "n_requests", "max_tokens", "prompt_len", "workload", "load", "rate_rps",
           "http_tokens_per_s", "offline_tokens_per_s", "http_over_offline", "ttft_p50_ms", "ttft_p99_ms",
           "offline_ttft_p50_ms", "offline_ttft_p99_ms", "offline_engine_step_ms",
           "chunk_gap_p50_ms", "chunk_gap_p99_ms", "chunk_gap_steady_p50_ms", "chunk_gap_steady_p99_ms",
           "burst_admitted_s", "ingress_gap_p50_ms", "ingress_gap_p99_ms", "ingress_loop_lag_p50_ms",
           "ingress_loop_lag_p99_ms", "ingress_loop_lag_mean_ms", "engine_gap_p50_ms", "engine_gap_p99_ms",
           "engine_gap_steady_p50_ms", "engine_gap_steady_p99_ms", "engine_gaps", "engine_steps", "engine_step_p50_ms",
           "engine_step_p99_ms", "prefill_step_share", "flush_late_p50_ms", "flush_late_p99_ms", "flush_ahead_share",
           "chunks_per_request", "engine_step_ms", "stream_interval_ms", "chunk_gap_ratio",
           "completed", "errors", "first_error", "ingress_replicas", "ingress_cpus", "ingress_http", "client_procs",
           "models", "device",
           "git_sha", "command"]
TABLE_COLUMNS = ["label", "mode", "k", "tp", "max_batch", "n_requests", "workload", "load", "rate_rps", "http_tokens_per_s",
                 "offline_tokens_per_s", "http_over_offline", "ttft_p50_ms", "ttft_p99_ms", "offline_ttft_p50_ms",
                 "offline_ttft_p99_ms", "chunk_gap_p50_ms", "chunk_gap_p99_ms", "chunk_gap_steady_p99_ms",
                 "ingress_gap_p50_ms", "ingress_gap_p99_ms", "ingress_loop_lag_p99_ms", "ingress_loop_lag_mean_ms",
                 "engine_gap_p50_ms", "engine_gap_p99_ms", "engine_step_p99_ms", "prefill_step_share",
                 "chunks_per_request", "engine_step_ms", "ingress_replicas", "ingress_cpus", "ingress_http"]


# ---- clients (separate processes) ---------------------------------------------------------------------
@dataclass
class Shard:
    """One client process's share: prompts and their send times (seconds after start_at, wall clock). Request i goes
    to urls[(first + i) % len(urls)]: the ingress replicas' own URLs under direct ingress, else the proxy's."""
    urls: list[str]
    model: str
    prompts: list[list[int]]
    offsets: list[float]
    max_tokens: int
    start_at: float
    read_timeout_s: float = 600.0
    first: int = 0


@dataclass
class Trace:
    """One streamed completion as the client saw it (wall clock, seconds)."""
    sent: float
    chunks: list[float] = field(default_factory=list)   # arrival of each chunk carrying text or the finish
    tokens: int = 0
    error: str | None = None


async def _completion(session, shard: Shard, url: str, prompt: list[int], send_at: float) -> Trace:
    import aiohttp

    await asyncio.sleep(max(0.0, send_at - time.time()))
    trace = Trace(time.time())
    body = {"model": shard.model, "prompt": prompt, "max_tokens": shard.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                trace.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return trace
            done = False
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                now = time.time()
                chunk = json.loads(data)
                if "error" in chunk:
                    trace.error = str(chunk["error"].get("message"))[:200]
                elif chunk.get("usage"):
                    trace.tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and (chunk["choices"][0]["text"] or chunk["choices"][0]["finish_reason"]):
                    trace.chunks.append(now)
            if not done and trace.error is None:
                trace.error = f"the stream ended without [DONE] after {len(trace.chunks)} chunks"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        trace.error = repr(e)[:200]
    return trace


async def _run_shard(shard: Shard) -> list[Trace]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=shard.read_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await asyncio.gather(*(_completion(session, shard, shard.urls[(shard.first + i) % len(shard.urls)], p,
                                                  shard.start_at + off)
                                      for i, (p, off) in enumerate(zip(shard.prompts, shard.offsets))))


def run_shard(shard: Shard) -> list[dict]:
    return [asdict(t) for t in asyncio.run(_run_shard(shard))]


def send(pool, procs: int, urls: list[str], model: str, prompts: list[list[int]], offsets: list[float],
         max_tokens: int, read_timeout_s: float = 600.0) -> tuple[float, list[Trace]]:
    """Requests i at start + offsets[i], spread over the client processes and `urls`; -> (start, traces)."""
    start = time.time() + 0.5   # every process is up and waiting before the first send
    shards = [Shard(urls, model, prompts[i::procs], offsets[i::procs], max_tokens, start, read_timeout_s, first=i)
              for i in range(procs)]
    traces = [Trace(**t) for part in pool.map(run_shard, shards) for t in part]
    return start, traces


# ---- statistics ---------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def weighted_percentile(pairs: list[tuple[float, float]], q: float) -> float | None:
    """The q-th percentile of values given as (value, weight) pairs."""
    pairs = sorted(p for p in pairs if p[1] > 0)
    total = sum(w for _, w in pairs)
    if not pairs:
        return None
    cumulative = 0.0
    for value, weight in pairs:
        cumulative += weight
        if cumulative >= q / 100 * total:
            return value
    return pairs[-1][0]


def burst_admitted(traces: list[Trace]) -> float | None:
    """When the last request of a closed burst got its first chunk (wall clock): from then on every request is
    admitted and streaming, the arrival transient is over."""
    return max((t.chunks[0] for t in traces if t.error is None and t.chunks), default=None)


def trace_stats(traces: list[Trace], start: float | None = None, steady_from: float | None = None) -> dict:
    """tok/s over the span from the first send (or `start`) to the last chunk; TTFT and chunk gaps in ms; with
    `steady_from` (wall clock) also the gaps that begin after it."""
    ok = [t for t in traces if t.error is None and t.chunks]
    ttft = [(t.chunks[0] - t.sent) * 1e3 for t in ok]
    gaps = [(b - a) * 1e3 for t in ok for a, b in zip(t.chunks, t.chunks[1:])]
    steady = [] if steady_from is None else \
        [(b - a) * 1e3 for t in ok for a, b in zip(t.chunks, t.chunks[1:]) if a >= steady_from]
    begin = start if start is not None else min((t.sent for t in traces), default=0.0)
    span = max((t.chunks[-1] for t in ok), default=begin) - begin
    tokens = sum(t.tokens for t in ok)
    return {"http_tokens_per_s": tokens / span if span > 0 else None, "completed": len(ok),
            "errors": len(traces) - len(ok), "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "chunk_gap_p50_ms": percentile(gaps, 50), "chunk_gap_p99_ms": percentile(gaps, 99),
            "chunk_gap_steady_p50_ms": percentile(steady, 50), "chunk_gap_steady_p99_ms": percentile(steady, 99),
            "burst_admitted_s": None if steady_from is None else steady_from - begin,
            "chunks_per_request": statistics.mean(len(t.chunks) for t in ok) if ok else None,
            "first_error": next((t.error for t in traces if t.error), None)}


# ---- the hops: ingress (vLLM's histogram) and engine (its step records) --------------------------------
ITL = "vllm:inter_token_latency_seconds"
LOOP_LAG = "minedraft_api_event_loop_lag_seconds"   # the ingress replica's event-loop lag (serve/loop_lag.py)


@dataclass
class BucketCounts:
    """One ingress replica's histogram (inter-token latency, loop lag): cumulative counts by upper bound (s, the last
    +inf) and the sum of the observations (exact, unlike the buckets)."""
    bounds: list[float]
    counts: list[float]
    total: float = 0.0

    def minus(self, other: "BucketCounts") -> "BucketCounts":
        return BucketCounts(self.bounds, [a - b for a, b in zip(self.counts, other.counts)], self.total - other.total)

    def plus(self, other: "BucketCounts") -> "BucketCounts":
        return BucketCounts(self.bounds, [a + b for a, b in zip(self.counts, other.counts)], self.total + other.total)

    def mean(self) -> float | None:
        return self.total / self.counts[-1] if self.counts and self.counts[-1] > 0 else None

    def quantile(self, q: float) -> float | None:
        """As Prometheus' histogram_quantile: linear within the bucket the rank falls in (the highest finite bound
        when it falls past it): resolution is the bucket's width."""
        total = self.counts[-1] if self.counts else 0
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts):
            if count >= rank:
                if bound == float("inf"):
                    return lower
                return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 1.0)
            lower, below = bound, count
        return lower


def read_itl(text: str, name: str = ITL) -> tuple[float | None, BucketCounts | None]:
    """(the histogram's creation time, which tells ingress replicas apart; its buckets) from a /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    created, buckets, total = None, [], 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_created":
                created = sample.value
            elif sample.name == f"{name}_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name == f"{name}_sum":
                total = sample.value
    buckets.sort()
    return created, BucketCounts([b for b, _ in buckets], [c for _, c in buckets], total) if buckets else None


def scrape_ingress(urls: list[str], replicas: int, tries_per_replica: int = 10,
                   name: str = ITL) -> dict[float, BucketCounts] | None:
    """Every ingress replica's histogram `name`, by its creation time: Serve's proxy routes each /metrics scrape to
    one replica, so scrape until each was seen (None when one never was); under direct ingress each URL is one."""
    import urllib.request

    seen: dict[float, BucketCounts] = {}
    for i in range(replicas * tries_per_replica):
        with urllib.request.urlopen(urls[i % len(urls)] + "/metrics", timeout=30) as r:
            created, hist = read_itl(r.read().decode(), name)
        if hist is None or (created is None and replicas > 1):   # no histogram, or no telling replicas apart
            return None
        seen[created] = hist
        if len(seen) == replicas:
            return seen
    return None


def replicas_delta(before: dict | None, after: dict | None) -> "BucketCounts | None":
    """One histogram's observations between two scrapes (replica -> BucketCounts), summed over the replicas; None
    unless both scrapes reached the same replicas."""
    if not before or not after or before.keys() != after.keys():
        return None
    delta = None
    for replica, hist in after.items():
        part = hist.minus(before[replica])
        delta = part if delta is None else delta.plus(part)
    return delta


def ingress_gaps(before: dict | None, after: dict | None) -> dict:
    """P50/P99 of the ingress's inter-token latencies observed between two scrapes, summed over its replicas."""
    delta = replicas_delta(before, after)
    values = {} if delta is None else {q: delta.quantile(q / 100) for q in (50, 99)}
    return {f"ingress_gap_p{q}_ms": None if values.get(q) is None else values[q] * 1e3 for q in (50, 99)}


def loop_lag(before: dict | None, after: dict | None) -> dict:
    """The ingress replicas' event-loop lag between two scrapes: P50/P99 (bucket resolution) and the mean (exact),
    over the replicas' observations together."""
    delta = replicas_delta(before, after)
    values = {} if delta is None else {"p50": delta.quantile(0.5), "p99": delta.quantile(0.99), "mean": delta.mean()}
    return {f"ingress_loop_lag_{key}_ms": None if values.get(key) is None else values[key] * 1e3
            for key in ("p50", "p99", "mean")}


def engine_gaps(records: list, steady_from: float | None = None) -> list[tuple[float, float]]:
    """(ms, rows) per verify step: the time from the batch's previous token hand-out to this one (`t_emit`),
    once for each request it streamed tokens to that was in the batch's previous step: each waited exactly that for
    its next tokens. Requests given their first token by a prefill since (`joined`) are left out (their first gap
    is not that), as are steps after idle (the batch was empty). `steady_from`: only steps after it (wall clock)."""
    last: dict[int, object] = {}   # batch -> its previous record
    out = []
    for record in records:
        prev, last[record.batch] = last.get(record.batch), record
        if prev is None or prev.sizes[record.batch] == 0 or (steady_from is not None and prev.t_emit < steady_from):
            continue
        out.append(((record.t_emit - prev.t_emit) * 1e3, record.streamed - record.joined))
    return out


def engine_stats(records: list, steady_from: float | None = None) -> dict:
    """The engine's steps of one workload: step time (the verifier's cycle, prefill chunks run in between
    included) P50/P99, the share of steps with a prefill before them, and the row-weighted token hand-out gap."""
    steps = [r.step_ms for r in records]
    gaps, steady = engine_gaps(records), engine_gaps(records, steady_from) if steady_from is not None else []
    return {"engine_steps": len(records), "engine_gaps": sum(n for _, n in gaps),
            "engine_step_p50_ms": percentile(steps, 50),
            "engine_step_p99_ms": percentile(steps, 99),
            "prefill_step_share": sum(bool(r.t_prefill_ms > 0 or r.extra.get("fused_prefill_tokens"))
                                      for r in records) / len(records) if records else None,
            "engine_gap_p50_ms": weighted_percentile(gaps, 50), "engine_gap_p99_ms": weighted_percentile(gaps, 99),
            "engine_gap_steady_p50_ms": weighted_percentile(steady, 50),
            "engine_gap_steady_p99_ms": weighted_percentile(steady, 99)}


def flush_stats(flushes: list) -> dict:
    """How late the engine replica's interval flushes were released against their grid, and the share sent ahead
    of it (at the end of the last step before it, the mailbox holding them), once per request in each."""
    late = [(f.late_ms, f.requests) for f in flushes]
    requests = sum(f.requests for f in flushes)
    return {"flush_late_p50_ms": weighted_percentile(late, 50), "flush_late_p99_ms": weighted_percentile(late, 99),
            "flush_ahead_share": sum(f.requests for f in flushes if f.held_ms > 0) / requests if requests else None}


def poisson_offsets(rate: float, n: int, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


# ---- the two paths ------------------------------------------------------------------------------------
def make_prompts(n: int, lo: int, hi: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def engine_args(args, mode: str, max_batch: int, n_requests: int, prompt_hi: int) -> dict:
    settings = {"mode": mode, "k": args.k, "tp": args.tp, "max_batch": max_batch, "max_len": prompt_hi + args.max_tokens + 16,
                "max_queued": max(n_requests, 64), "device": args.device, "dtype": args.dtype,
                "stream_interval_ms": args.stream_interval_ms}
    if args.chunk_gap_ratio is not None:
        settings["chunk_gap_ratio"] = args.chunk_gap_ratio
    if args.target:
        settings["target"] = args.target
    if mode == "ar":
        settings["draft"] = None
    elif args.draft:
        settings["draft"] = args.draft
    if args.device == "cpu":
        settings["torch_threads"] = 1
    return settings


@dataclass
class OfflineRun:
    """The offline path's numbers: tok/s, the engine's TTFT (arrival -> first token, every request submitted at
    once: the queueing the HTTP path's TTFT holds too) and its median step."""
    tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    engine_step_ms: float | None


def run_offline(settings: dict, prompts: list[list[int]], max_tokens: int) -> OfflineRun:
    """One `LLM.generate` call on every prompt (after a short warm-up call)."""
    from minedraft_ray import LLM, SamplingParams
    from minedraft_ray.config import EngineConfig

    llm = LLM(config=EngineConfig.model_validate(settings))
    try:
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate(prompts[:settings["max_batch"]], warm)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        ttft = [o.stats["ttft"] * 1e3 for o in outs if o.stats and o.stats.get("ttft") is not None]
        steps = [h.step_ms for h in llm.history()[-200:]]
        return OfflineRun(sum(len(o.token_ids) for o in outs) / elapsed, percentile(ttft, 50), percentile(ttft, 99),
                          statistics.median(steps) if steps else None)
    finally:
        llm.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_name(settings: dict) -> str:
    """One app name per configuration: a configuration's app never shares a name with the one deleted before it."""
    return f"{APP}-{settings['mode']}-{settings['max_batch']}"


def deploy(settings: dict) -> list[str]:
    """The Serve app for `settings` on 127.0.0.1; -> its base URLs: Serve's proxy, or under direct ingress
    (`ingress_http`) each ingress replica's own."""
    from ray import serve

    from minedraft_ray.config import EngineConfig
    from minedraft_ray.serve.app import build_app_with_key
    from minedraft_ray.serve.ingress_http import ingress_urls

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})   # the first start in this Ray wins
    serve.run(build_app_with_key(settings, None), name=app_name(settings), route_prefix="/")
    return ingress_urls(app_name(settings), EngineConfig.model_validate(settings).ingress_replicas)


def direct_ingress_environ() -> dict[str, str]:
    """A private Ray's environment for `--ingress-http direct`: Serve's port range for the replicas (Ray's
    default), no drain period, ports reused at once."""
    from minedraft_ray.serve.ingress_http import direct_ingress_environ as environ

    return {k: v for k, v in environ(0, 1).items() if "_HTTP_PORT" not in k}


def engine_side(urls: list[str]) -> dict:
    """What the engine replica reports of itself (/v1/minedraft/info): its median recent step, and the chunk
    setting it runs with (read back, not taken from the settings sent)."""
    import urllib.request

    with urllib.request.urlopen(urls[0] + "/v1/minedraft/info", timeout=30) as r:
        info = json.loads(r.read())
    return {"engine_step_ms": info.get("recent_steps", {}).get("step_ms"), "chunk_gap_ratio": info["chunk_gap_ratio"]}


class HopProbe:
    """Reads the ingress's and the engine's side of one workload's gaps: the ingress replicas' ITL histograms and
    the engine's step count before it, the histograms and the engine's step records after it."""

    def __init__(self, urls: list[str], settings: dict, ingress_replicas: int):
        from ray import serve

        from minedraft_ray.serve.engine_replica import EngineServer

        self.urls, self.ingress_replicas = urls, ingress_replicas
        self.engine = serve.get_deployment_handle(EngineServer.name, app_name(settings))

    def before(self) -> None:
        self.itl = scrape_ingress(self.urls, self.ingress_replicas)
        self.lag = scrape_ingress(self.urls, self.ingress_replicas, name=LOOP_LAG)
        self.step = self.engine.info.remote().result()["steps"]
        self.t0 = time.time()

    def after(self, steady_from: float | None = None) -> dict:
        records = self.engine.steps_since.remote(self.step).result()
        flushes = self.engine.flushes_since.remote(self.t0).result()
        return {**ingress_gaps(self.itl, scrape_ingress(self.urls, self.ingress_replicas)),
                **loop_lag(self.lag, scrape_ingress(self.urls, self.ingress_replicas, name=LOOP_LAG)),
                **engine_stats(records, steady_from), **flush_stats(flushes)}


def run_http(args, pool, settings: dict, prompts: list[list[int]], model: str, ingress_replicas: int) -> list[dict]:
    """Closed burst, then Poisson loads: a stats dict per workload (closed first)."""
    from ray import serve

    urls = deploy(settings)
    try:
        timeout = args.read_timeout_s
        send(pool, args.client_procs, urls, model, prompts[:settings["max_batch"]], [0.0] * settings["max_batch"], 4,
             timeout)
        probe = HopProbe(urls, settings, ingress_replicas)
        probe.before()
        start, traces = send(pool, args.client_procs, urls, model, prompts, [0.0] * len(prompts), args.max_tokens,
                             timeout)
        admitted = burst_admitted(traces)
        closed = {"workload": "closed", "load": None, **trace_stats(traces, start, admitted),
                  **probe.after(admitted), **engine_side(urls)}
        results = [closed]
        capacity_rps = (closed["http_tokens_per_s"] or 0) / args.max_tokens
        for load in args.loads:
            rate = load * capacity_rps
            n = max(args.client_procs, round(rate * args.online_s))
            offsets = poisson_offsets(rate, n, seed=round(load * 1000))
            online_prompts = [prompts[i % len(prompts)] for i in range(n)]
            probe.before()
            _, traces = send(pool, args.client_procs, urls, model, online_prompts, offsets, args.max_tokens, timeout)
            results.append({"workload": "online", "load": load, "rate_rps": rate, **trace_stats(traces),
                            **probe.after(), **engine_side(urls)})
        return results
    finally:
        serve.delete(app_name(settings))


# ---- results ------------------------------------------------------------------------------------------
def merge(old: list[dict], new: list[dict]) -> list[dict]:
    from bench.common import merge_by_config

    def at_tp(rows):   # rows from before the tp column ran the target at tp 1, those before ingress_http its proxy
        return [{**r, "tp": r.get("tp") or 1, "ingress_http": r.get("ingress_http") or "proxy"} for r in rows]
    return merge_by_config(at_tp(old), at_tp(new), CONFIG)


def result_name(device: str) -> str:
    return NAME if device != "cpu" else f"{NAME}_cpu"


def read_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist() if path.is_file() else []


def write(out: Path, rows: list[dict], device: str, name: str = NAME, extra_notes: list[str] = ()) -> Path:
    from bench.common import write_results

    commands = list(dict.fromkeys(r["command"] for r in rows))
    ingress = sorted({(r["ingress_replicas"], r["ingress_cpus"], r.get("ingress_http") or "proxy") for r in rows})
    notes = ["Closed: all `n_requests` streaming completions (`/v1/completions`, prompt token ids, `ignore_eos`, "
             "`max_tokens` each) sent at once by `client_procs` aiohttp client processes; the offline path is one "
             "`LLM.generate` call on the same prompts, with the same engine settings, built anew (one device "
             "holds one engine). `http_over_offline` = HTTP tok/s / offline tok/s.",
             "TTFT: send -> first streamed chunk; chunk gap: time between consecutive streamed chunks of a "
             "request (chunks with text or the finish); `engine_step_ms`: the engine's median step (its last 200). "
             "offline_ttft: the offline engine's arrival -> first token of the same closed burst (its queueing for "
             "a slot included, as in the HTTP TTFT); offline_engine_step_ms: its median step (parquet only).",
             "Chunk gap by hop (ms), engine -> ingress -> client. `engine_gap_*`: per verify step, the time from "
             "its batch's previous token hand-out to the streams to this one's, once per request it streamed to "
             "that was in that previous step (requests just given their first token by a prefill left out): exact, "
             "the gap before the engine replica's coalescing (its outputs go to the mailbox on a "
             "`stream_interval_ms` grid); in psd's split a prefill's riders are taken from the next verify of "
             "either batch. "
             "`ingress_gap_*`: vLLM's `vllm:inter_token_latency_seconds` of the ingress replicas (arrival of one "
             "engine delivery with tokens of a request at the ingress -> the next; outputs of one request taken "
             "from the mailbox at once count a ~0 gap each), the workload's observations summed over the replicas, "
             "P50/P99 interpolated within vLLM's buckets (bounds 10, 25, 50, 75, 100, 150, 200, 300 ms, ...): "
             "bucket resolution, not exact. `chunk_gap_*`: the client's (exact); its P50 near `stream_interval_ms` is "
             "the coalescing, by design. `*_steady_*` (closed only): only "
             "gaps that begin after the last request of the burst got its first chunk (`burst_admitted_s` after "
             "the first send), without the arrival transient.",
             "`ingress_loop_lag_*`: how late a 5 ms timer on each ingress replica's event loop fired during the "
             "workload (`minedraft_api_event_loop_lag_seconds` at /metrics, serve/loop_lag.py), the replicas' "
             "observations together: the delay that loop (and the GIL) added to every running stream's chunks "
             "meanwhile, the closed burst's admissions included; P50/P99 within the histogram's buckets (bounds 0.5, "
             "1, 2.5, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 150, 250 ms, ...), the mean exact.",
             "Engine steps of the workload (parquet): `engine_step_p50_ms`/`_p99_ms` the verifier's cycle per "
             "step (end of the previous verify -> end of this one, prefill chunks run in between included), "
             "`prefill_step_share` the share of steps with a prefill chunk in that cycle (a task of its own or fused "
             "into the verify's launch), `engine_steps` their "
             "count, `engine_gaps` the gaps `engine_gap_*` counts. `flush_late_*`: how late the engine replica's "
             "interval flushes (its outputs to the mailbox) were released against their `stream_interval_ms` grid, "
             "once per request in each: time its event loop, which runs the step loop, was busy at a grid time no "
             "step's end went ahead of; `flush_ahead_share`: the share sent at the end of the last step before "
             "their grid time and held by the mailbox until then (serve/streams.py, FlushGrid). Lateness adds to "
             "the gaps between the engine hop and the ingress one, the mailbox and the ingress's poll the rest.",
             "Online: Poisson arrivals at `load` x the closed HTTP capacity (tok/s / max_tokens requests/s).",
             "Ingress (OpenAIServer): " + "; ".join(f"{n} replica(s) x {c} CPU, {h}" for n, c, h in ingress) + " ("
             "`ingress_http`: proxy, clients reach it through Serve's proxy; direct, at each replica's own port, "
             "spread over them).",
             "Commands: " + "; ".join(f"`{c}`" for c in commands), *extra_notes]
    return write_results(rows, out, name, COLUMNS, "Serve HTTP vs the offline LLM API", commands[-1], device,
                         notes, TABLE_COLUMNS)


def fmt_ms(row: dict, key: str) -> str:
    return "–" if row.get(key) is None else f"{row[key]:.1f}"


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="ar", help="comma-separated: ar, sd, sd_split, psd")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1, help="the target's tensor-parallel size")
    ap.add_argument("--max-batch", default=None, help="comma-separated; each with every mode (default 64; smoke 4)")
    ap.add_argument("--n-requests", default=None, help="one value, or one per --max-batch value (default 256; "
                    "smoke 8)")
    ap.add_argument("--prompt-len", default=None, help="prompt lengths (token ids), uniform in LO-HI (default "
                    "128-512; smoke 8-24)")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 128; smoke 16)")
    ap.add_argument("--target", default=None, help="default random:llama-8b (GPU), the default pair (--smoke)")
    ap.add_argument("--draft", default=None, help="default random:llama-1b (GPU), the default pair (--smoke)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"])
    ap.add_argument("--stream-interval-ms", type=float, default=20.0)
    ap.add_argument("--chunk-gap-ratio", type=float, default=None, help="the engine's chunk_gap_ratio (prompt "
                    "chunks sized from step times; default: the config's)")
    ap.add_argument("--ingress-replicas", type=int, default=None, help="OpenAIServer replicas (default: config's)")
    ap.add_argument("--ingress-cpus", type=float, default=None, help="CPUs per OpenAIServer replica")
    ap.add_argument("--ingress-http", default="proxy", choices=["proxy", "direct"],
                    help="clients reach the ingress through Serve's proxy, or at each ingress replica (direct "
                    "ingress, set on this process's Ray instance)")
    ap.add_argument("--loads", default="0.3,0.6,0.9", help="online loads, fractions of the HTTP capacity ('' none)")
    ap.add_argument("--online-s", type=float, default=None, help="seconds of arrivals per load")
    ap.add_argument("--client-procs", type=int, default=None)
    ap.add_argument("--read-timeout-s", type=float, default=None, help="a stream silent this long is an error "
                    "(default 600; smoke 60)")
    ap.add_argument("--smoke", action="store_true", help="CPU, the default pair, a handful of short requests")
    ap.add_argument("--label", default=None, help="names this run's rows (e.g. the design measured); part of a "
                    "row's configuration, so runs with different labels keep their rows side by side")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--merge", nargs="+", default=None, metavar="PARQUET",
                    help="no run: merge these result files (e.g. device calls') into <out>/serve_vs_offline.parquet "
                    "by configuration, then write its md and png again")
    args = ap.parse_args(argv)
    if args.merge:
        out = Path(args.out)
        rows = read_rows(out / f"{NAME}.parquet")
        for path in args.merge:
            rows = merge(rows, read_rows(Path(path)))
        write(out, rows, rows[-1]["device"])
        print(f"{out / NAME}.parquet: {len(rows)} rows")
        return 0
    from bench.common import command_line

    command = command_line("bench.serve_vs_offline", argv)

    import torch

    gpu = torch.cuda.is_available() and not args.smoke
    args.device = args.device or ("cuda" if gpu else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "auto")
    if not args.smoke:
        args.target = args.target or "random:llama-8b"
        args.draft = args.draft or "random:llama-1b"
    defaults = {"max_batch": "4", "n_requests": "8", "max_tokens": 16, "prompt_len": "8-24"} if args.smoke else \
        {"max_batch": "64", "n_requests": "256", "max_tokens": 128, "prompt_len": "128-512"}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.online_s = args.online_s or (1.0 if args.smoke else 10.0)
    args.read_timeout_s = args.read_timeout_s or (60.0 if args.smoke else 600.0)
    args.client_procs = args.client_procs or (2 if args.device == "cpu" else 4)
    args.loads = [float(x) for x in args.loads.split(",") if x]
    modes = args.mode.split(",")
    batches = parse_ints(args.max_batch)
    n_requests = parse_ints(args.n_requests)
    if len(n_requests) == 1:
        n_requests *= len(batches)
    if len(n_requests) != len(batches):
        ap.error("--n-requests: one value, or one per --max-batch value")
    lo, hi = (int(x) for x in args.prompt_len.split("-"))

    from minedraft_ray.ray_local import lock_down

    if "ray" not in sys.modules:   # a private Ray of this process: loopback only, token auth (set before import)
        lock_down()
    import ray

    from bench.common import device_name, git_sha, say
    from minedraft_ray.engine.model import ModelConfig
    from minedraft_ray.engine.presets import resolve_model
    from minedraft_ray.runtime.llm import init_local_ray

    own_ray = not ray.is_initialized()
    temp_dir = tempfile.mkdtemp(prefix="r", dir="/tmp") if own_ray else None
    if own_ray and args.ingress_http == "direct":   # Ray's processes read it at start
        os.environ.update(direct_ingress_environ())
    if own_ray:
        init_local_ray(num_gpus=None if gpu else 2, _temp_dir=temp_dir, log_to_driver=False)
    device = device_name(torch.device("cuda" if gpu else "cpu"))
    out = Path(args.out)
    name = result_name(args.device)
    rows = read_rows(out / f"{name}.parquet")
    pool = mp.get_context("spawn").Pool(args.client_procs)
    try:
        for max_batch, n in zip(batches, n_requests):
            for mode in modes:
                settings = engine_args(args, mode, max_batch, n, hi)
                if args.ingress_replicas is not None:
                    settings["ingress_replicas"] = args.ingress_replicas
                if args.ingress_cpus is not None:
                    settings["ingress_cpus"] = args.ingress_cpus
                settings["ingress_http"] = args.ingress_http
                from minedraft_ray.config import EngineConfig

                config = EngineConfig.model_validate(settings)
                target_dir = resolve_model(config.target)
                prompts = make_prompts(n, lo, hi, ModelConfig.from_pretrained(target_dir).vocab_size)
                say(f"{mode} max_batch={max_batch}: offline LLM ...")
                offline = run_offline(settings, prompts, args.max_tokens)
                say(f"{mode} max_batch={max_batch}: offline {offline.tokens_per_s:.0f} tok/s; Serve HTTP ...")
                results = run_http(args, pool, settings, prompts, config.served_model_name, config.ingress_replicas)
                context = {"label": args.label, "mode": mode, "k": None if mode == "ar" else args.k, "tp": args.tp,
                           "max_batch": max_batch,
                           "n_requests": n, "max_tokens": args.max_tokens, "prompt_len": args.prompt_len,
                           "stream_interval_ms": args.stream_interval_ms, "client_procs": args.client_procs,
                           "ingress_replicas": getattr(config, "ingress_replicas", 1),
                           "ingress_cpus": getattr(config, "ingress_cpus", 0.1), "ingress_http": config.ingress_http,
                           "models": f"{config.target} / {config.draft}" if mode != "ar" else config.target,
                           "device": device, "git_sha": git_sha(), "command": command}
                new = []
                for res in results:
                    row = {**context, **res}
                    if row["workload"] == "closed":
                        row.update(offline_tokens_per_s=offline.tokens_per_s, offline_ttft_p50_ms=offline.ttft_p50_ms,
                                   offline_ttft_p99_ms=offline.ttft_p99_ms,
                                   offline_engine_step_ms=offline.engine_step_ms)
                        row["http_over_offline"] = (row["http_tokens_per_s"] or 0) / offline.tokens_per_s
                    new.append(row)
                    ms = partial(fmt_ms, row)
                    say(f"  {row['workload']} load={row['load']}: http {row['http_tokens_per_s'] or 0:.0f} tok/s"
                        + (f" ({row['http_over_offline']:.2f}x offline)" if row.get("http_over_offline") else "")
                        + f", ttft p50/p99 {row['ttft_p50_ms'] or 0:.0f}/{row['ttft_p99_ms'] or 0:.0f} ms, "
                        f"chunk gap p50/p99 {row['chunk_gap_p50_ms'] or 0:.1f}/{row['chunk_gap_p99_ms'] or 0:.1f} ms,"
                        f" (steady p99 {ms('chunk_gap_steady_p99_ms')}; ingress p50/p99 {ms('ingress_gap_p50_ms')}/"
                        f"{ms('ingress_gap_p99_ms')}; ingress loop lag p99/mean {ms('ingress_loop_lag_p99_ms')}/"
                        f"{ms('ingress_loop_lag_mean_ms')}; engine p50/p99 {ms('engine_gap_p50_ms')}/"
                        f"{ms('engine_gap_p99_ms')}),"
                        f" step p50/p99 {ms('engine_step_p50_ms')}/{ms('engine_step_p99_ms')} ms"
                        f" ({row['prefill_step_share'] or 0:.0%} with prefill), flush late p50/p99"
                        f" {ms('flush_late_p50_ms')}/{ms('flush_late_p99_ms')} ms, errors {row['errors']}"
                        + (f" ({row['first_error']})" if row.get("first_error") else ""))
                rows = merge(rows, new)
                write(out, rows, device, name)   # after every configuration: a run cut short keeps what it measured
    finally:
        pool.close()
        pool.join()
        if own_ray:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
    say(f"wrote {out / name}.{{parquet,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
