"""bench/serve_vs_offline.py in its --smoke form on the CPU (the default pair, the session's Ray cluster, two ingress
replicas): both paths run, the files are written, and the closed row carries both tok/s and their ratio and the
chunk gap of each hop. The statistics are checked without Ray."""
import pyarrow.parquet as pq
import pytest

from bench.serve_vs_offline import (COLUMNS, LOOP_LAG, Trace, engine_gaps, engine_stats, ingress_gaps, loop_lag, main,
                                    merge, percentile, read_itl, trace_stats, weighted_percentile)
from minedraft_ray.runtime.telemetry import StepRecord
from minedraft_ray.serve.vllm_metrics import APIMetrics


def test_trace_stats():
    traces = [Trace(0.0, [0.1, 0.15, 0.35], tokens=6), Trace(0.0, [0.2, 0.3], tokens=4), Trace(0.0, error="HTTP 429")]
    stats = trace_stats(traces, start=0.0)
    assert stats["completed"] == 2 and stats["errors"] == 1 and stats["first_error"] == "HTTP 429"
    assert stats["http_tokens_per_s"] == pytest.approx(10 / 0.35)
    assert stats["ttft_p50_ms"] == pytest.approx(100) and stats["ttft_p99_ms"] == pytest.approx(200)
    assert sorted([stats["chunk_gap_p50_ms"], stats["chunk_gap_p99_ms"]]) == pytest.approx([100, 200])
    assert percentile([], 50) is None and percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert stats["chunk_gap_steady_p50_ms"] is None and stats["burst_admitted_s"] is None
    # steady: only the gaps that begin once every request has its first chunk (the last came at 0.2)
    steady = trace_stats(traces, start=0.0, steady_from=0.2)
    assert steady["burst_admitted_s"] == pytest.approx(0.2) and steady["chunk_gap_steady_p99_ms"] == pytest.approx(100)
    assert weighted_percentile([(5.0, 1), (50.0, 3), (9.0, 0)], 50) == 50.0 and weighted_percentile([], 50) is None


def test_ingress_gaps_from_two_replicas_histograms():
    # two ingress replicas' real registries, told apart by the histogram's creation time; each replica's
    # observations before the workload are subtracted, the rest summed
    replicas = [APIMetrics("m", 0, spec_decode=False) for _ in range(2)]
    for metrics, before in zip(replicas, ([0.2] * 10, [])):
        for value in before:
            metrics.itl.observe(value)
    scraped_before = dict(read_itl(m.render().decode()) for m in replicas)
    assert len(scraped_before) == 2
    for metrics, during in zip(replicas, ([0.02] * 60, [0.02] * 38 + [0.12] * 2)):
        for value in during:
            metrics.itl.observe(value)
    scraped_after = dict(read_itl(m.render().decode()) for m in replicas)
    gaps = ingress_gaps(scraped_before, scraped_after)
    assert 10 < gaps["ingress_gap_p50_ms"] <= 25          # the (10, 25] ms bucket holds 98 of the 100
    assert 100 < gaps["ingress_gap_p99_ms"] <= 150        # the 0.12 s ones; the 0.2 s ones were before
    assert ingress_gaps(scraped_before, {}) == {"ingress_gap_p50_ms": None, "ingress_gap_p99_ms": None}


def test_engine_gaps_per_batch_chain():
    def step(batch, t_emit, rows, size_after, step_ms=5.0, prefill_ms=0.0, joined=0):
        sizes = (size_after, 0) if batch == 0 else (0, size_after)
        return StepRecord("psd", sizes, rows, 0, step_ms=step_ms, t_prefill_ms=prefill_ms, batch=batch, t_emit=t_emit,
                          streamed=rows, joined=joined)
    records = [step(0, 1.000, 2, 2), step(1, 1.005, 2, 2),
               step(0, 1.010, 3, 3, prefill_ms=3.0, joined=1),   # A: 10 ms for its 2 rows; a third joined
               step(1, 1.050, 4, 0, step_ms=40.0),               # B: 45 ms for 4 rows, then empty
               step(1, 3.000, 1, 1)]                             # after idle: no gap
    gaps = engine_gaps(records)
    assert [(round(ms), rows) for ms, rows in gaps] == [(10, 2), (45, 4)]
    assert [round(ms) for ms, _ in engine_gaps(records, steady_from=1.004)] == [45]
    stats = engine_stats(records, steady_from=1.004)
    assert stats["engine_steps"] == 5 and stats["engine_gaps"] == 6
    assert stats["prefill_step_share"] == pytest.approx(0.2)
    assert stats["engine_gap_p50_ms"] == pytest.approx(45) and stats["engine_gap_steady_p99_ms"] == pytest.approx(45)
    assert stats["engine_step_p50_ms"] == 5.0 and stats["engine_step_p99_ms"] == 40.0
    # a chunk fused into the verify's launch makes a step with prefill too
    fused = StepRecord("ar", (1, 0), 1, 0, step_ms=5.0, extra={"fused_prefill_tokens": 64})
    assert engine_stats([fused, step(0, 1.0, 1, 1)])["prefill_step_share"] == 0.5


def test_merge_replaces_a_configuration():
    row = {"mode": "ar", "tp": 1, "max_batch": 4, "workload": "closed", "http_tokens_per_s": 1.0, "ingress_http": "proxy"}
    other = {**row, "mode": "sd"}
    assert merge([row, other], [{**row, "http_tokens_per_s": 2.0}]) == [{**row, "http_tokens_per_s": 2.0}, other]
    # a row from before the tp column ran at tp 1, one from before ingress_http through the proxy; another tp, or
    # direct ingress, is another configuration
    old = {k: v for k, v in row.items() if k not in ("tp", "ingress_http")}
    assert merge([old], [{**row, "http_tokens_per_s": 3.0}, {**row, "tp": 2}, {**row, "ingress_http": "direct"}]) == [
        {**row, "http_tokens_per_s": 3.0}, {**row, "tp": 2}, {**row, "ingress_http": "direct"}]


def test_smoke(ray_cluster, tmp_path):
    # two ingress replicas: both subscribe to the engine replica's mailbox, each gets only its own requests' outputs;
    # the engine's chunks sized from its step times (the setting travels in the app's config to the engine replica)
    assert main(["--smoke", "--n-requests", "6", "--max-tokens", "12", "--loads", "0.5", "--online-s", "0.5",
                 "--ingress-replicas", "2", "--chunk-gap-ratio", "1.5", "--out", str(tmp_path)]) == 0
    assert list(pq.read_schema(tmp_path / "serve_vs_offline_cpu.parquet").names) == COLUMNS
    rows = pq.read_table(tmp_path / "serve_vs_offline_cpu.parquet").to_pylist()
    closed = next(r for r in rows if r["workload"] == "closed")
    assert closed["completed"] == 6 and closed["errors"] == 0, closed["first_error"]
    assert closed["ingress_replicas"] == 2 and closed["chunk_gap_ratio"] == 1.5
    assert closed["http_tokens_per_s"] > 0 and closed["offline_tokens_per_s"] > 0
    assert closed["http_over_offline"] == pytest.approx(closed["http_tokens_per_s"] / closed["offline_tokens_per_s"])
    assert closed["ttft_p50_ms"] <= closed["ttft_p99_ms"] and closed["chunk_gap_p50_ms"] <= closed["chunk_gap_p99_ms"]
    # the offline engine's own TTFT of the burst (its queueing included) and step, to read the HTTP ones against
    assert 0 < closed["offline_ttft_p50_ms"] <= closed["offline_ttft_p99_ms"] and closed["offline_engine_step_ms"] > 0
    # the gap by hop: the engine's step records of the burst, the two ingress replicas' histograms, the client's
    # each request: its first token from the prefill, 11 from verify steps, so 10 gaps between verify hand-outs
    assert closed["engine_gaps"] == 6 * 10 and closed["engine_steps"] >= 11 and 0 <= closed["prefill_step_share"] <= 1
    assert 0 < closed["engine_step_p50_ms"] <= closed["engine_step_p99_ms"]
    assert 0 < closed["engine_gap_p50_ms"] <= closed["engine_gap_p99_ms"]
    assert closed["engine_gap_p50_ms"] <= closed["chunk_gap_p99_ms"]
    assert 0 < closed["ingress_gap_p50_ms"] <= closed["ingress_gap_p99_ms"]
    # the two ingress replicas' event-loop lag during the burst
    assert 0 <= closed["ingress_loop_lag_p50_ms"] <= closed["ingress_loop_lag_p99_ms"]
    assert closed["ingress_loop_lag_mean_ms"] >= 0
    assert 0 <= closed["flush_late_p50_ms"] <= closed["flush_late_p99_ms"]
    # steady gaps begin after the last first chunk: none when the last streams' few tokens were all made before
    # their responses started and went out as one chunk (coalescing, by design; the split is unit-tested above)
    steady = closed["chunk_gap_steady_p50_ms"], closed["chunk_gap_steady_p99_ms"]
    assert closed["burst_admitted_s"] > 0 and (steady == (None, None) or steady[0] <= steady[1])
    online = next(r for r in rows if r["workload"] == "online")
    assert online["engine_steps"] > 0 and online["ingress_gap_p99_ms"] is not None
    assert online["load"] == 0.5 and online["rate_rps"] > 0 and online["errors"] == 0, online["first_error"]
    md = (tmp_path / "serve_vs_offline_cpu.md").read_text()
    assert "`python -m bench.serve_vs_offline --smoke" in md and "Ingress (OpenAIServer): 2 replica(s)" in md
    assert (tmp_path / "serve_vs_offline_cpu.png").is_file()


def test_loop_lag_from_two_replicas_histograms():
    # the ingress replicas' loop-lag histograms as /metrics serves them: the workload's observations of both
    # together, P99 in its bucket, the mean exact
    replicas = [APIMetrics("m", 0, spec_decode=False) for _ in range(2)]
    for metrics, before in zip(replicas, ([0.3] * 5, [])):
        for value in before:
            metrics.loop_lag.observe(value)
    scraped_before = dict(read_itl(m.render().decode(), LOOP_LAG) for m in replicas)
    assert len(scraped_before) == 2
    for metrics, during in zip(replicas, ([0.0002] * 90, [0.0002] * 8 + [0.04] * 2)):
        for value in during:
            metrics.loop_lag.observe(value)
    lag = loop_lag(scraped_before, dict(read_itl(m.render().decode(), LOOP_LAG) for m in replicas))
    assert 0 < lag["ingress_loop_lag_p50_ms"] <= 0.5
    assert 30 < lag["ingress_loop_lag_p99_ms"] <= 50                   # the two 40 ms ones; the 0.3 s ones were before
    assert lag["ingress_loop_lag_mean_ms"] == pytest.approx((98 * 0.2 + 2 * 40) / 100)
    assert loop_lag(scraped_before, None)["ingress_loop_lag_p99_ms"] is None
