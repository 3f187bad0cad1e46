"""bench/serve_vs_offline.py in its --smoke form on the CPU (the default pair, the session's Ray cluster, two ingress
replicas): both paths run, the files are written, and the closed row carries both tok/s and their ratio. The
statistics are checked without Ray."""
import pyarrow.parquet as pq
import pytest

from bench.serve_vs_offline import COLUMNS, Trace, main, merge, percentile, trace_stats


def test_trace_stats():
    traces = [Trace(0.0, [0.1, 0.15, 0.35], tokens=6), Trace(0.0, [0.2, 0.3], tokens=4), Trace(0.0, error="HTTP 429")]
    stats = trace_stats(traces, start=0.0)
    assert stats["completed"] == 2 and stats["errors"] == 1 and stats["first_error"] == "HTTP 429"
    assert stats["http_tokens_per_s"] == pytest.approx(10 / 0.35)
    assert stats["ttft_p50_ms"] == pytest.approx(100) and stats["ttft_p99_ms"] == pytest.approx(200)
    assert sorted([stats["chunk_gap_p50_ms"], stats["chunk_gap_p99_ms"]]) == pytest.approx([100, 200])
    assert percentile([], 50) is None and percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_merge_replaces_a_configuration():
    row = {"mode": "ar", "tp": 1, "max_batch": 4, "workload": "closed", "http_tokens_per_s": 1.0}
    other = {**row, "mode": "sd"}
    assert merge([row, other], [{**row, "http_tokens_per_s": 2.0}]) == [{**row, "http_tokens_per_s": 2.0}, other]
    # a row from before the tp column ran at tp 1; another tp is another configuration
    old = {k: v for k, v in row.items() if k != "tp"}
    assert merge([old], [{**row, "http_tokens_per_s": 3.0}, {**row, "tp": 2}]) == [
        {**row, "http_tokens_per_s": 3.0}, {**row, "tp": 2}]


def test_smoke(ray_cluster, tmp_path):
    # two ingress replicas: both subscribe to the engine replica's mailbox, each gets only its own requests' outputs
    assert main(["--smoke", "--n-requests", "6", "--max-tokens", "12", "--loads", "0.5", "--online-s", "0.5",
                 "--ingress-replicas", "2", "--out", str(tmp_path)]) == 0
    assert list(pq.read_schema(tmp_path / "serve_vs_offline_cpu.parquet").names) == COLUMNS
    rows = pq.read_table(tmp_path / "serve_vs_offline_cpu.parquet").to_pylist()
    closed = next(r for r in rows if r["workload"] == "closed")
    assert closed["completed"] == 6 and closed["errors"] == 0, closed["first_error"]
    assert closed["ingress_replicas"] == 2
    assert closed["http_tokens_per_s"] > 0 and closed["offline_tokens_per_s"] > 0
    assert closed["http_over_offline"] == pytest.approx(closed["http_tokens_per_s"] / closed["offline_tokens_per_s"])
    assert closed["ttft_p50_ms"] <= closed["ttft_p99_ms"] and closed["chunk_gap_p50_ms"] <= closed["chunk_gap_p99_ms"]
    # the offline engine's own TTFT of the burst (its queueing included) and step, to read the HTTP ones against
    assert 0 < closed["offline_ttft_p50_ms"] <= closed["offline_ttft_p99_ms"] and closed["offline_engine_step_ms"] > 0
    online = next(r for r in rows if r["workload"] == "online")
    assert online["load"] == 0.5 and online["rate_rps"] > 0 and online["errors"] == 0, online["first_error"]
    md = (tmp_path / "serve_vs_offline_cpu.md").read_text()
    assert "`python -m bench.serve_vs_offline --smoke" in md and "Ingress (OpenAIServer): 2 replica(s)" in md
    assert (tmp_path / "serve_vs_offline_cpu.png").is_file()
