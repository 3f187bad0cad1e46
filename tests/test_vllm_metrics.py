"""/metrics' engine-wide vLLM counters (prefix-cache queries and hits, preemptions), fed from the engine's totals
at each scrape: a scrape reads one engine replica, so the counters are the sum of each replica's latest total,
never go down, and a replica whose engine restarted counts on from 0. No Ray: the engine's info is what
BatchManager.info returns (its keys), the registry is rendered and parsed as Prometheus parses it. The runtime
feeding these series from a real engine is tested in test_runtime_paging.py."""
from prometheus_client.parser import text_string_to_metric_families

from minedraft_ray.serve.vllm_metrics import APIMetrics

SERIES = {"prefix_cache_queries": "vllm:prefix_cache_queries_total",
          "prefix_cache_hits": "vllm:prefix_cache_hits_total", "preemptions": "vllm:num_preemptions_total"}


def scraped(metrics: APIMetrics) -> dict:
    return {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}


def info(replica: str, queries: int, hits: int, preemptions: int) -> dict:
    return {"running": 0, "queued": 0, "kv_cache": {}, "replica": replica, "prefix_cache_queries": queries,
            "prefix_cache_hits": hits, "preemptions": preemptions}


def test_engine_totals_are_summed_over_replicas_and_survive_a_restart():
    metrics = APIMetrics("m", num_spec_tokens=2)
    steps = [  # (info of the replica this scrape reached, the counters expected after it)
        (info("a", 100, 40, 2), (100, 40, 2)),
        (info("b", 30, 10, 0), (130, 50, 2)),
        (info("a", 150, 60, 3), (180, 70, 3)),
        (info("a", 150, 60, 3), (180, 70, 3)),    # nothing new: nothing counted twice
        (info("b", 20, 5, 1), (200, 75, 4)),      # b's engine restarted: its new totals count from 0
        (info("b", 25, 5, 1), (205, 75, 4)),
    ]
    for state, want in steps:
        metrics.set_engine_state(state)
        values = scraped(metrics)
        assert tuple(values[SERIES[key]] for key in ("prefix_cache_queries", "prefix_cache_hits",
                                                      "preemptions")) == want, (state, values)
        assert values["vllm:prompt_tokens_cached_total"] == values["vllm:prefix_cache_hits_total"]


def test_preemptions_per_request_from_final_stats():
    metrics = APIMetrics("m", num_spec_tokens=2)
    for preemptions in (0, 0, 1, 3):
        timer = metrics.request(prompt_tokens=5)
        timer.on_tokens(1)
        timer.on_finished("length", {"preemptions": preemptions})
    values = scraped(metrics)
    assert values["vllm:request_num_preemptions_count"] == 4 and values["vllm:request_num_preemptions_sum"] == 4
    buckets = {le: values_ for le, values_ in (
        (s.labels["le"], s.value) for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples if s.name == "vllm:request_num_preemptions_bucket")}
    assert buckets["1.0"] == 3 and buckets["2.0"] == 3 and buckets["3.0"] == 4 and buckets["+Inf"] == 4


def test_ttft_counts_from_the_requests_arrival():
    """The ingress passes the HTTP request's arrival: time queued for an admission slot is part of TTFT."""
    import time

    metrics = APIMetrics("m", num_spec_tokens=2)
    metrics.request(prompt_tokens=5, arrival=time.perf_counter() - 2.0).on_tokens(1)   # waited 2 s to be admitted
    values = scraped(metrics)
    assert values["vllm:time_to_first_token_seconds_count"] == 1
    assert values["vllm:time_to_first_token_seconds_sum"] >= 2.0
