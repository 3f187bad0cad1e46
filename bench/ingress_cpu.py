"""The ingress replica's CPU time per admitted request and per streamed chunk (issue 22), on one Serve app.

    python -m bench.ingress_cpu                                   # CPU: ar, the default target, 3 bursts of 256
    python -m bench.ingress_cpu --burst 512 --max-tokens 16 --runs 3 --ingress-http direct
    python -m bench.ingress_cpu --pyspy /tmp/pyspy/bin/py-spy     # + a raw py-spy profile of one more burst

Each run sends `--burst` streaming /v1/completions (prompt token ids, `--max-tokens` each, ignore_eos) at once and
reads the OpenAIServer replica's CPU time (utime + stime of its process, /proc) every few ms meanwhile: CPU time, not
wall time, so other work on the host does not count. Split at the moment every request has its first chunk
(admission: parse, submit, first chunk of each) and after it (streaming: the remaining chunks), per request and per
chunk; a run at `--max-tokens 1` beside one at N gives the per-chunk cost from the difference too.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from bench.serve_vs_offline import Shard, Trace, direct_ingress_environ, free_port, make_prompts, run_shard

APP = "ingress-cpu"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK   # utime, stime


def ingress_pid(app: str) -> int:
    """The OpenAIServer replica of `app` (its worker process renames itself after the actor)."""
    out = subprocess.run(["pgrep", "-f", f"ServeReplica:{app}:OpenAIServer"], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split()]
    if len(pids) != 1:
        raise RuntimeError(f"{len(pids)} ingress processes of {app}: {pids}")
    return pids[0]


class CPUSampler:
    """(wall time, CPU-s) of one process every `period_s`, on a thread."""

    def __init__(self, pid: int, period_s: float = 0.005):
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            self.samples.append((time.time(), cpu_s(self.pid)))
            time.sleep(self.period_s)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()
        self.samples.append((time.time(), cpu_s(self.pid)))

    def at(self, t: float) -> float:
        """CPU-s at wall time t (the last sample at or before it)."""
        last = self.samples[0][1]
        for when, cpu in self.samples:
            if when > t:
                break
            last = cpu
        return last


@dataclass
class Burst:
    requests: int
    chunks: int              # SSE chunks with text or a finish, as the clients counted them
    admission_cpu_s: float   # from the send until every request has its first chunk
    streaming_cpu_s: float   # from then until the last request's end
    admission_s: float
    errors: int

    @property
    def per_request_ms(self) -> float:
        return self.admission_cpu_s / self.requests * 1e3

    @property
    def per_chunk_ms(self) -> float:
        later = self.chunks - self.requests   # the chunks after each request's first
        return self.streaming_cpu_s / later * 1e3 if later > 0 else float("nan")

    @property
    def total_ms_per_request(self) -> float:
        return (self.admission_cpu_s + self.streaming_cpu_s) / self.requests * 1e3


def burst(pool, pid: int, urls: list[str], model: str, prompts: list[list[int]], max_tokens: int,
          procs: int) -> Burst:
    start = time.time() + 1.0
    sampler = CPUSampler(pid)
    shards = [Shard(urls, model, prompts[i::procs], [0.0] * len(prompts[i::procs]), max_tokens, start, 120.0)
              for i in range(procs)]
    traces = [Trace(**t) for part in pool.map(run_shard, shards) for t in part]
    time.sleep(0.3)   # the ingress finishes its last requests' bookkeeping
    sampler.finish()
    ok = [t for t in traces if t.error is None and t.chunks]
    admitted = max(t.chunks[0] for t in ok)
    c0, c1, c2 = sampler.at(start - 0.05), sampler.at(admitted), sampler.samples[-1][1]
    return Burst(len(ok), sum(len(t.chunks) for t in ok), c1 - c0, c2 - c1, admitted - start,
                 len(traces) - len(ok))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst", type=int, default=256)
    ap.add_argument("--max-tokens", default="1,16", help="comma-separated: one set of runs each")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ingress-http", default="direct", choices=["proxy", "direct"])
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--pyspy", default=None, help="py-spy binary: record one more burst (raw, 100 Hz)")
    ap.add_argument("--pyspy-out", default="/tmp/ingress_cpu.pyspy.txt")
    ap.add_argument("--pyspy-gil", action="store_true", help="sample only the thread holding the GIL")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.max_tokens.split(",")]

    from minedraft_ray.ray_local import lock_down

    lock_down()
    import ray
    from ray import serve

    from minedraft_ray.config import EngineConfig
    from minedraft_ray.runtime.llm import init_local_ray
    from minedraft_ray.serve.app import build_app_with_key
    from minedraft_ray.serve.ingress_http import ingress_urls

    temp_dir = tempfile.mkdtemp(prefix="r", dir="/tmp")
    if args.ingress_http == "direct":
        os.environ.update(direct_ingress_environ())
    init_local_ray(num_gpus=2, _temp_dir=temp_dir, log_to_driver=False)
    app = f"{APP}-{os.getpid()}"
    settings = {"mode": "ar", "draft": None, "max_batch": args.max_batch, "max_len": 24 + max(lengths) + 16,
                "max_queued": max(args.burst, 64), "device": "cpu", "torch_threads": 1,
                "stream_interval_ms": 20.0, "ingress_replicas": 1, "ingress_http": args.ingress_http}
    pool = mp.get_context("spawn").Pool(args.client_procs)
    results: dict[int, list[Burst]] = {n: [] for n in lengths}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        serve.run(build_app_with_key(settings, None), name=app, route_prefix="/")
        urls = ingress_urls(app, 1)
        model = EngineConfig.model_validate(settings).served_model_name
        pid = ingress_pid(app)
        prompts = make_prompts(args.burst, 8, 24, 512)
        burst(pool, pid, urls, model, prompts, 4, args.client_procs)   # warm-up: imports, caches, connections
        for run in range(args.runs):
            for n in lengths:
                b = burst(pool, pid, urls, model, prompts, n, args.client_procs)
                results[n].append(b)
                print(f"max_tokens={n} run {run}: {b.requests} ok ({b.errors} errors), {b.chunks} chunks; admission "
                      f"{b.admission_cpu_s:.2f} CPU-s in {b.admission_s:.2f} s = {b.per_request_ms:.2f} ms/request;"
                      f" streaming {b.streaming_cpu_s:.2f} CPU-s = {b.per_chunk_ms:.3f} ms/chunk; total "
                      f"{b.total_ms_per_request:.2f} ms/request", flush=True)
        if args.pyspy:
            spy = subprocess.Popen([args.pyspy, "record", "--nonblocking", "-r", "100", "-f", "raw", "-o",
                                    args.pyspy_out, "-p", str(pid)] + (["--gil"] if args.pyspy_gil else []), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            burst(pool, pid, urls, model, prompts, lengths[-1], args.client_procs)
            spy.send_signal(2)
            spy.wait(60)
            print(f"py-spy profile: {args.pyspy_out}")
    finally:
        pool.close()
        pool.join()
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    for n, runs in results.items():
        mean = lambda f: sum(map(f, runs)) / len(runs)   # noqa: E731
        print(f"max_tokens={n}: admission {mean(lambda b: b.per_request_ms):.2f} ms CPU/request, streaming "
              f"{mean(lambda b: b.per_chunk_ms):.3f} ms CPU/chunk, total {mean(lambda b: b.total_ms_per_request):.2f}"
              f" ms CPU/request ({len(runs)} runs: "
              + ", ".join(f"{b.per_request_ms:.2f}/{b.per_chunk_ms:.3f}/{b.total_ms_per_request:.2f}" for b in runs)
              + ")")
    if len(lengths) >= 2:
        lo, hi = lengths[0], lengths[-1]
        cpu = lambda n: sum(b.admission_cpu_s + b.streaming_cpu_s for b in results[n]) / len(results[n])   # noqa
        chunks = lambda n: sum(b.chunks for b in results[n]) / len(results[n])   # noqa: E731
        per_chunk = (cpu(hi) - cpu(lo)) / (chunks(hi) - chunks(lo)) * 1e3
        per_request = cpu(lo) / args.burst * 1e3 - per_chunk * chunks(lo) / args.burst
        print(f"difference of max_tokens {lo} and {hi}: {per_chunk:.3f} ms CPU/chunk, {per_request:.2f} ms CPU/request"
              " beyond its chunks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
