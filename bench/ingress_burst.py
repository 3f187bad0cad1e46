"""Running streams' chunk gaps while a burst of new requests is admitted beside them (issue 22), on one Serve app.

    python -m bench.ingress_burst                                   # CPU: the default target, ar, 8 + 256 requests
    python -m bench.ingress_burst --running 64 --burst 192 --max-tokens 512 --device cuda --target random:llama-8b
    python -m bench.ingress_burst --ingress-http direct      # the ingress replica serves HTTP itself (no Serve proxy)

`--running` streaming completions (`--max-tokens` each, `ignore_eos`) fill the engine's batch; `--burst-at` seconds
later `--burst` more are sent at once (4 tokens each: they queue behind the running ones, as the 192 queued beside 64
running of the closed serve benchmark do). Printed: the running streams' chunk gaps before the burst and in the
`--window` seconds from its start (client side, exact), the burst's TTFT, and the ingress's event-loop lag in both
windows (`minedraft_api_event_loop_lag_seconds`, one ingress replica: with several, each scrape reaches one of them).
Profile the ingress meanwhile with `py-spy record --gil --threads --pid <OpenAIServer replica pid>` (the pid from
`ps -eo pid,args | grep OpenAIServer`). One row per run, merged by `--label` into <out>/ingress_burst.* (on a CPU:
ingress_burst_cpu.*); a diagnosis of earlier CPU runs: docs/ingress-burst.md.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import command_line, git_sha, merge_by_config, write_results
from bench.serve_vs_offline import (LOOP_LAG, Shard, Trace, deploy, direct_ingress_environ, loop_lag, make_prompts,
                                   percentile, read_itl,
                                   run_shard)

NAME = "ingress_burst"   # on a CPU: ingress_burst_cpu
COLUMNS = ["label", "device", "target", "running", "burst", "max_tokens", "ingress_replicas", "ingress_http",
           "gap_before_p50_ms",
           "gap_before_p99_ms", "gap_during_p50_ms", "gap_during_p99_ms", "gap_during_max_ms", "gaps_during",
           "loop_lag_before_mean_ms", "loop_lag_during_mean_ms", "loop_lag_during_p99_ms", "burst_ttft_p50_ms",
           "burst_ttft_p99_ms", "errors", "load_before", "git_sha", "command"]
TABLE_COLUMNS = ["label", "running", "burst", "ingress_replicas", "ingress_http", "gap_before_p50_ms", "gap_before_p99_ms",
                 "gap_during_p50_ms", "gap_during_p99_ms", "loop_lag_during_mean_ms", "loop_lag_during_p99_ms",
                 "burst_ttft_p50_ms", "errors", "load_before"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=8, help="streams running when the burst comes (= max_batch)")
    ap.add_argument("--burst", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=300, help="tokens of each running stream")
    ap.add_argument("--burst-at", type=float, default=3.0)
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("--ingress-replicas", type=int, default=1)
    ap.add_argument("--ingress-http", default="proxy", choices=["proxy", "direct"],
                    help="through Serve's proxy, or at each ingress replica (direct ingress)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target", default=None, help="default: the default target")
    ap.add_argument("--label", default=None, help="names this run's row (default: the git sha and ingress replicas)")
    ap.add_argument("--smoke", action="store_true", help="a few short streams (CI)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    if args.smoke:
        args.running, args.burst, args.max_tokens, args.burst_at, args.window = 2, 16, 60, 1.0, 1.0
    load_before = os.getloadavg()[0]

    from minedraft_ray.ray_local import lock_down

    lock_down()
    import ray

    from minedraft_ray.runtime.llm import init_local_ray

    temp_dir = tempfile.mkdtemp(prefix="r", dir="/tmp")
    if args.ingress_http == "direct":   # Ray's processes read it at start
        os.environ.update(direct_ingress_environ())
    init_local_ray(num_gpus=None if args.device == "cuda" else 2, _temp_dir=temp_dir, log_to_driver=False)
    settings = {"mode": "ar", "draft": None, "max_batch": args.running, "max_len": 24 + args.max_tokens + 16,
                "max_queued": max(args.burst, 64), "device": args.device, "stream_interval_ms": 20.0,
                "ingress_replicas": args.ingress_replicas, "ingress_http": args.ingress_http}
    if args.device == "cpu":
        settings["torch_threads"] = 1
    if args.target:
        settings["target"] = args.target
    pool = mp.get_context("spawn").Pool(2)
    try:
        urls = deploy(settings)
        from minedraft_ray.config import EngineConfig

        model = EngineConfig.model_validate(settings).served_model_name
        prompts = make_prompts(args.running + args.burst, 8, 24, 512)
        pool.map(run_shard, [Shard(urls, model, prompts[:args.running], [0.0] * args.running, 4, time.time() + 0.5)])

        def scrape():
            with urllib.request.urlopen(urls[0] + "/metrics", timeout=60) as r:
                return read_itl(r.read().decode(), LOOP_LAG)[1]

        start = time.time() + 1.0
        running = pool.map_async(run_shard, [Shard(urls, model, prompts[:args.running], [0.0] * args.running,
                                                   args.max_tokens, start)])
        burst = pool.map_async(run_shard, [Shard(urls, model, prompts[args.running:], [args.burst_at] * args.burst, 4,
                                                 start)])
        burst_t = start + args.burst_at
        snapshots = []
        for t in (burst_t - 1.5, burst_t, burst_t + args.window):
            time.sleep(max(0.0, t - time.time()))
            snapshots.append(scrape())
        streams = [Trace(**t) for part in running.get() for t in part]
        admitted = [Trace(**t) for part in burst.get() for t in part]
    finally:
        pool.close()
        pool.join()
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    gaps = [(a, (b - a) * 1e3) for t in streams for a, b in zip(t.chunks, t.chunks[1:])]
    before = [g for a, g in gaps if a + g / 1e3 < burst_t]
    during = [g for a, g in gaps if a + g / 1e3 >= burst_t and a < burst_t + args.window]
    errors = [t.error for t in streams + admitted if t.error]
    ttft = [(t.chunks[0] - t.sent) * 1e3 for t in admitted if t.chunks]

    # one ingress replica: each scrape's histogram (None: no probe yet) under one key
    before_burst, at_burst, after_window = ({0: s} if s is not None else None for s in snapshots)
    lag_before = loop_lag(before_burst, at_burst)["ingress_loop_lag_mean_ms"]
    lag_during = loop_lag(at_burst, after_window)
    lag_during, lag_during_p99 = lag_during["ingress_loop_lag_mean_ms"], lag_during["ingress_loop_lag_p99_ms"]
    row = {"label": args.label or f"{git_sha()} x{args.ingress_replicas} {args.ingress_http}", "device": args.device,
           "target": args.target or "default", "running": args.running, "burst": args.burst,
           "max_tokens": args.max_tokens, "ingress_replicas": args.ingress_replicas, "ingress_http": args.ingress_http,
           "gap_before_p50_ms": percentile(before, 50), "gap_before_p99_ms": percentile(before, 99),
           "gap_during_p50_ms": percentile(during, 50), "gap_during_p99_ms": percentile(during, 99),
           "gap_during_max_ms": max(during, default=None), "gaps_during": len(during),
           "loop_lag_before_mean_ms": lag_before, "loop_lag_during_mean_ms": lag_during,
           "loop_lag_during_p99_ms": lag_during_p99, "burst_ttft_p50_ms": percentile(ttft, 50),
           "burst_ttft_p99_ms": percentile(ttft, 99), "errors": len(errors), "load_before": load_before,
           "git_sha": git_sha(), "command": command_line("bench.ingress_burst", argv)}
    print({k: row[k] for k in TABLE_COLUMNS} | ({"first_error": errors[0]} if errors else {}))
    name = NAME if args.device == "cuda" else f"{NAME}_cpu"
    old = Path(args.out) / f"{name}.parquet"
    rows = [row]
    if old.exists():
        import pyarrow.parquet as pq

        rows = merge_by_config(pq.read_table(old).to_pylist(), rows, ("label",))
    write_results(rows, args.out, name, COLUMNS, "Running streams' chunk gaps while a burst is admitted beside them",
                  row["command"], args.device, table_columns=TABLE_COLUMNS, notes=[
                      f"{r['label']}: {r['running']} streaming completions of {r['max_tokens']} tokens running "
                      f"(max_batch = running, ar), then {r['burst']} more sent at once (4 tokens each, queued behind "
                      f"them); gaps of the running streams' chunks (client side) before the burst and in the "
                      f"window from its start; ingress event-loop lag (5 ms probe) in the same window; "
                      f"load_before: the 1-minute load average at the start" for r in rows[-1:]])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
