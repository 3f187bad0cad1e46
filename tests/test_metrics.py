"""Engine metrics end to end: the runtime `LLM` serves requests, Ray's metrics agent exports the
`ray_minedraft_*` series, a real Prometheus server (Debian's `prometheus`, started here on 127.0.0.1 with
a 1 s scrape of the Ray node's metrics export port) stores them, and its HTTP API must report exactly
what the requests saw: tokens, request counts by status, latency histogram counts, speculative-decoding
counters and steps. Then every query of the Grafana dashboard must return data from those live series.

Needs the `prometheus` binary (`.ci/install-prometheus.sh`); skipped with that reason when it is missing.
Ray exports every ~10 s, so the checks poll Prometheus until the values settle (at most POLL_S).
"""
import asyncio
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
import uuid

import pytest
import ray

from minedraft_ray.engine.sampling import SamplingParams
from minedraft_ray.observability import SERIES
from minedraft_ray.observability.metrics import LATENCY_BUCKETS
from minedraft_ray.runtime import LLM

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over", "import os\nimport sys\n\n",
           "class Foo:\n    def __init__(self):", "x = [1, 2, 3]\nfor i in x:", "# comment",
           "The quick brown fox jumps over"]   # the repeat finds the first one's blocks in the prefix cache
LENGTHS = [6, 20, 11, 16, 3, 9, 8]
# paged KV: blocks of 4, 18 per model (a request holds up to 58 tokens): four requests at once run short, so
# requests are preempted, and resumed ones find their own blocks in the prefix cache too
KV = {"prefix_caching": True, "block_size": 4, "num_kv_blocks": 18}
POLL_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, binary: str, target: str, workdir, job: str = ""):
        """job: more settings of the scrape job, YAML lines indented by 4 (e.g. metrics_path, authorization)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: ray\n" + job + "    static_configs:\n"
            f"      - targets: ['{target}']\n")
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {(workdir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def api(self, path: str, **params) -> dict | list:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def prom(ray_cluster, tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is missing: run .ci/install-prometheus.sh (Debian package `prometheus`)")
    node = ray.nodes()[0]
    # the fixture's cluster takes the metrics export port Ray picks; `_metrics_export_port=` would fix it
    target = f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"
    p = Prometheus(binary, target, tmp_path_factory.mktemp("prometheus"))
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def served(ray_cluster, prom, tiny_llama, tiny_llama_draft):
    """N finished requests and one aborted mid-stream, on a psd engine with its own model name."""
    model = f"metrics-{uuid.uuid4().hex[:8]}"
    # psd_high_load=psd: the batches split whenever more than one batch's worth runs, so psd-regime series exist
    llm = LLM(str(tiny_llama), str(tiny_llama_draft), mode="psd", k=3, max_batch=2, model_name=model, torch_threads=1,
              psd_high_load="psd", **KV)
    try:
        wired = ray.get(llm.manager.__ray_call__.remote(lambda actor: getattr(actor.manager, "metrics", None)
                                                        is not None))
        if not wired:
            pytest.fail("BatchManager has no `metrics` (EngineMetrics): wire the hooks as docs/observability.md "
                        "says (attach in __init__, on_tokens in _emit, on_request_finished in _emit and _finish)")

        async def aborted_stream():
            rid, ids, last = f"abort-{model}", [], None
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            async for out in llm.stream("Once upon a time", params, rid):
                ids += out.new_token_ids
                last = out
                if len(ids) >= 2 and not out.finished:
                    await llm.manager.abort.remote(rid)
            return ids, last

        ab_ids, ab_last = asyncio.run(aborted_stream())
        assert ab_last.finish_reason == "abort" and len(ab_ids) < 40
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENGTHS]
        outs = llm.generate(PROMPTS, params)
        yield {"model": model, "llm": llm, "outs": outs, "aborted_tokens": len(ab_ids),
               "aborted_stats": ab_last.stats, "history": llm.history(), "info": llm.info(),
               "replica": llm.manager._actor_id.hex()[:12]}
    finally:
        llm.shutdown()


def poll(prom, checks: dict, timeout=POLL_S):
    """Query until every expr returns its expected value; returns the last values seen."""
    deadline = time.monotonic() + timeout
    while True:
        seen = {expr: prom.scalar(expr) for expr in checks}
        if all(seen[e] is not None and abs(seen[e] - v) < 1e-6 for e, v in checks.items()):
            return seen
        if time.monotonic() > deadline:
            return seen
        time.sleep(1.0)


def test_prometheus_sees_what_the_requests_saw(prom, served):
    sel = f'model="{served["model"]}"'
    outs, n = served["outs"], len(served["outs"])
    stats = [o.stats for o in outs] + [served["aborted_stats"]]
    history = served["history"]
    kv = served["info"]["kv_cache"]
    expected = {
        f"sum(ray_minedraft_generation_tokens_total{{{sel}}})":
            sum(len(o.token_ids) for o in outs) + served["aborted_tokens"],
        f'sum(ray_minedraft_requests_total{{{sel}, status="finished"}})': n,
        f'sum(ray_minedraft_requests_total{{{sel}, status="aborted"}})': 1,
        f"sum(ray_minedraft_prompt_tokens_total{{{sel}}})":
            sum(len(o.prompt_token_ids) for o in outs) + len(served["llm"]._encode("Once upon a time")),
        f"sum(ray_minedraft_time_to_first_token_seconds_count{{{sel}}})": n,
        f"sum(ray_minedraft_e2e_request_latency_seconds_count{{{sel}}})": n,
        f"sum(ray_minedraft_inter_token_latency_seconds_count{{{sel}}})": sum(len(o.token_ids) > 1 for o in outs),
        f"sum(ray_minedraft_spec_decode_num_drafts_total{{{sel}}})": sum(s["verify_steps"] for s in stats),
        f"sum(ray_minedraft_spec_decode_num_draft_tokens_total{{{sel}}})": sum(s["drafted"] for s in stats),
        f"sum(ray_minedraft_spec_decode_num_accepted_tokens_total{{{sel}}})": sum(s["accepted"] for s in stats),
        f"sum(ray_minedraft_spec_decode_num_accepted_tokens_per_pos_total{{{sel}}})":
            sum(s["accepted"] for s in stats),
        f"sum(ray_minedraft_spec_decode_num_draft_tokens_per_pos_total{{{sel}}})": sum(s["drafted"] for s in stats),
        f"sum(ray_minedraft_steps_total{{{sel}}})": len(history),
        f'sum(ray_minedraft_steps_total{{{sel}, regime="psd"}})': sum(h.regime == "psd" for h in history),
        f"sum(ray_minedraft_step_seconds_count{{{sel}}})": len(history),
        f"sum(ray_minedraft_verify_seconds_count{{{sel}}})": sum(h.t_verify_ms > 0 for h in history),
        f"sum(ray_minedraft_draft_seconds_count{{{sel}}})": sum(h.t_draft_ms > 0 for h in history),
        f"sum(ray_minedraft_spec_decode_acceptance_length_count{{{sel}}})": sum(h.draft_tokens > 0 for h in history),
        # gauges after the last step: everything retired
        f"sum(ray_minedraft_running_requests{{{sel}}})": 0,
        f"sum(ray_minedraft_queue_depth{{{sel}}})": 0,
        f"sum(ray_minedraft_slots_in_use{{{sel}}})": 0,
        f"sum(ray_minedraft_num_slots{{{sel}}})": served["info"]["num_slots"],
        f"sum(ray_minedraft_drafter_alive{{{sel}}})": 1,
        # paged KV: every block back, and the engine's own totals of prefix-cache lookups and preemptions
        f"sum(ray_minedraft_kv_cache_usage{{{sel}}})": 0,
        f"sum(ray_minedraft_preemptions_total{{{sel}}})": served["info"]["preemptions"],
        **{f'sum(ray_minedraft_prefix_cache_{kind}_total{{{sel}, kv_cache="{pool}"}})': kv[pool][f"{field}_tokens"]
           for pool in ("target", "draft") for kind, field in (("hits", "hit"), ("queries", "query"))},
    }
    assert sum(s["drafted"] for s in stats) > 0 and any(h.regime == "psd" for h in history)
    assert served["info"]["preemptions"] > 0 and kv["target"]["hit_tokens"] > 0 and kv["draft"]["hit_tokens"] > 0
    seen = poll(prom, expected)
    wrong = {e: (seen[e], v) for e, v in expected.items() if seen[e] is None or abs(seen[e] - v) > 1e-6}
    assert not wrong, f"(prometheus, expected): {wrong}"

    # latency buckets hold exactly the requests' own latencies (Ray's _sum is bucket midpoints: not checked)
    for metric, key in (("time_to_first_token_seconds", "ttft"), ("e2e_request_latency_seconds", "latency")):
        buckets = {float(r["metric"]["le"]): float(r["value"][1]) for r in
                   prom.query(f"sum by (le) (ray_minedraft_{metric}_bucket{{{sel}}})")}
        assert set(buckets) == set(LATENCY_BUCKETS) | {float("inf")}, metric
        for le, count in buckets.items():
            assert count == sum(o.stats[key] <= le for o in outs), (metric, le)
    # time counters are exact: the sums of the steps' own timings
    for metric, field in (("step_time", "step_ms"), ("verify_time", "t_verify_ms"), ("draft_time", "t_draft_ms")):
        total = prom.scalar(f"sum(ray_minedraft_{metric}_seconds_total{{{sel}}})")
        assert total == pytest.approx(sum(getattr(h, field) for h in history) / 1e3, rel=1e-6), metric
    overhead = prom.scalar(f"sum(ray_minedraft_ray_overhead_time_seconds_total{{{sel}}})")
    device_ms = [max(h.t_draft_ms, h.t_verify_ms) if h.regime == "psd" else h.t_draft_ms + h.t_verify_ms
                 for h in history]
    assert overhead == pytest.approx(sum(max(h.step_ms - d, 0) for h, d in zip(history, device_ms)) / 1e3, rel=1e-6)
    # labels: mode and replica (the manager actor's id) on every series of this engine
    labels = prom.query(f"ray_minedraft_steps_total{{{sel}}}")[0]["metric"]
    assert labels["mode"] == "psd" and labels["replica"] == served["replica"]
    busy = prom.scalar(f"max(ray_minedraft_verifier_busy_fraction{{{sel}}})")
    assert busy is not None and 0 < busy <= 1


def test_every_dashboard_query_has_live_series(prom, served):
    from minedraft_ray.observability import grafana

    names = set(prom.api("label/__name__/values"))
    for series, (kind, _) in SERIES.items():
        wanted = [f"{series}_bucket", f"{series}_sum", f"{series}_count"] if kind == "histogram" else [series]
        assert set(wanted) <= names, f"{series} ({kind}) is not in Prometheus"

    model = served["model"]
    deadline = time.monotonic() + 20   # rate() needs two scrapes of a series Ray may have exported just now
    for expr in grafana.dashboard_queries(grafana.dashboard_json()):
        if expr.startswith("label_values("):
            metric, label = expr[len("label_values("):-1].split(", ")
            values = prom.api(f"label/{label}/values", **{"match[]": metric})
            assert (model if label == "model" else {"mode": "psd", "replica": served["replica"]}[label]) in values
            continue
        promql = (expr.replace("$model", model).replace("$mode", ".*").replace("$replica", ".*")
                  .replace("$__rate_interval", "5m"))
        while not prom.query(promql) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert prom.query(promql), f"no data for dashboard query: {expr}"


def test_batch_imbalance_is_the_splits_and_zero_in_one_sequential_batch(ray_cluster):
    """ray_minedraft_batch_imbalance: | |A| - |B| | after a step of the split; a sequential batch holds every
    running request in one batch, which is no imbalance."""
    from minedraft_ray.observability.metrics import EngineMetrics
    from minedraft_ray.runtime.manager import StepRecord

    metrics = EngineMetrics("m", "psd", replica="test", refresh_s=0)

    def imbalance(regime, sizes, one_batch):
        metrics.on_step(StepRecord(regime, sizes, verified=sum(sizes), drafted=0, step_ms=1.0,
                                   extra={"one_batch": one_batch}))
        return metrics._gauge_values[(id(metrics.imbalance), None)][2]

    assert imbalance("psd", (3, 2), False) == 1
    assert imbalance("seq", (5, 0), True) == 0
    assert imbalance("psd", (5, 0), True) == 0    # the step was split, and everyone is in one batch since
    assert imbalance("psd", (2, 4), False) == 2   # a violation shows
    metrics.close()


def test_the_offline_manager_freezes_its_startup_heap(prom, served):
    """The offline engine's manager (an actor, not a Serve replica, so nothing freezes it for it) keeps its startup
    objects out of the collector's scans, and says so."""
    sel = f'model="{served["model"]}", process="manager"'
    deadline = time.monotonic() + POLL_S
    while (prom.scalar(f"max(ray_minedraft_gc_frozen_objects{{{sel}}})") or 0) <= 1000 and time.monotonic() < deadline:
        time.sleep(1)
    assert prom.scalar(f"max(ray_minedraft_gc_frozen_objects{{{sel}}})") > 1000


def test_collector_watch_records_full_collections_and_closes(ray_cluster):
    import gc

    from minedraft_ray.observability.heap import CollectorWatch

    watch = CollectorWatch("test", "m", "ar", replica="r")
    try:
        seen = False
        for _ in range(3):   # its thread hands what it recorded to Ray every few seconds: look right after
            gc.collect()
            seen = seen or any(generation == 2 for generation, _ in watch._recorded)
        assert seen
    finally:
        watch.close()
    assert watch._on_collection not in gc.callbacks
    watch._recorded.clear()
    gc.collect()
    assert not watch._recorded


def test_collector_watch_counts_the_frozen_heap_only_until_it_settles(ray_cluster):
    """gc.get_freeze_count() walks the whole permanent generation holding the GIL: the watch's periodic export
    re-sends the count it knows instead, or every stream of its process would stall for that walk every few seconds.
    CPU time of this thread, so a loaded machine does not blur it."""
    import gc

    from minedraft_ray.observability.heap import CollectorWatch

    watch = CollectorWatch("test", "m", "ar", replica="r")
    watch.close()   # its export thread would count beside this test; frozen_count is what that thread calls
    heap = [[] for _ in range(1_000_000)]   # a serving process's startup heap, in tracked objects
    gc.freeze()
    try:
        t = time.thread_time()
        frozen = gc.get_freeze_count()
        walk = time.thread_time() - t
        for _ in range(4):   # counted until two counts in a row agree (frozen objects that die meanwhile drop out)
            counted = watch.frozen_count()
        assert counted == pytest.approx(frozen, rel=1e-3)
        t = time.thread_time()
        for _ in range(20):
            assert watch.frozen_count() == counted
        settled = (time.thread_time() - t) / 20
        assert walk > 0.5e-3 and settled < walk / 20, (walk, settled)
    finally:
        gc.unfreeze()
        del heap
