"""Real traffic on one GPU: long-tailed prompt lengths, chunked + packed prefill against the padded, unchunked
engine, in `ar` and `sd`, in one call.

Workload: prompt lengths lognormal (median and P99 given, seeded), cut at the context minus the output;
output lengths uniform in [out_min, out_max] (ignore_eos); random token ids; request i seeded with i, so
both engines see the same requests. `sd` on random weights runs the synthetic acceptance of
minedraft_ray.testing.workers (alpha), so its steps are the size real acceptance would give.

Engines per mode, built one after the other: `padded` (packed_prefill off, prefill_chunk_tokens 0: each
prefill pads its prompts to the longest and runs whole), `chunked` (packed prefill, prompts cut into chunks of
the per-step budget, each chunk a launch of its own in front of the step's verify: fused_prefill off) and
`fused` (the same chunks inside the verify's launch while requests decode, the budget bounding the whole
launch: fused_prefill on, the engine's default); `chunked_arrival` and `fused_arrival` are those with the budget
handed out first come, first served (prefill_order arrival; the others: the fewest prompt tokens left first).
- closed: every request submitted at once. `prefill_tokens_per_s`: prompt tokens / prefill device time (every
  prefill task's, the chunks' included; none for `fused` where chunks rode verifies, whose device time holds
  both: `fused_prefills` counts those); `tokens_per_s`: output tokens / wall time; `verify_ms_p50`: a plain
  verify's device time, `fused_verify_ms_p50` a verify's that carried chunks (`fused_tokens_p50` of them).
- online: Poisson arrivals at 30/60/90 % of the padded engine's closed capacity (the same absolute rates for
  both engines). TTFT P50/P99 counted from the scheduled arrival; `gap_p99_ms`: P99 of the time between a
  request's consecutive outputs (streamed one per step: stream_interval_ms 0); `gap_long_p99_ms`: that P99 over
  the gaps that overlap a long prompt's prefill (arrival to first token of a prompt of >= long_tokens),
  `gap_quiet_p50_ms`: the median over the gaps that overlap none, and `long_over_quiet` their ratio, pooled
  over the loads (`n_long`: long prompts that arrived).
- online_long (--long-prompts N): one more online run at --long-load, its Poisson arrivals plus N prompts drawn
  from the lognormal's tail above long_tokens at evenly spaced times (`added_long`), so the gap ratio rests on N
  long prompts' windows, not on the one or two the plain runs hold.

    python -m bench.real_traffic                      # one H200: 8B / 1B random weights, about 8 minutes
    python -m bench.real_traffic --long-prompts 8     # and a run with 8 long prompts for the gap ratio
    python -m bench.real_traffic --smoke              # CPU: tiny models, 2 fake GPUs, seconds
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import command_line, fmt, git_sha, merge_by_config, say, write_results
from bench.psd_vs_sd import machine_name, poisson_arrivals
from bench.prefill_speed import Z99

NAME = "real_traffic"
COLUMNS = ["mode", "engine", "workload", "load", "rate_rps", "n_requests", "added_long", "completed", "prompt_tokens",
           "prefill_tokens_per_s", "prefill_ms", "tokens_per_s", "run_s", "ttft_p50_ms", "ttft_p99_ms", "gap_p50_ms",
           "gap_p99_ms", "n_long", "gap_long_p99_ms", "gap_quiet_p50_ms", "long_over_quiet", "prefill_tasks",
           "fused_prefills", "verify_ms_p50", "fused_verify_ms_p50", "fused_tokens_p50", "prefill_chunk_tokens",
           "packed_prefill", "fused_prefill", "prefill_order", "chunk_gap_ratio", "max_batch", "k", "alpha", "build_s",
           "git_sha", "command", "device"]
TABLE = ["mode", "engine", "workload", "load", "rate_rps", "completed", "prefill_tokens_per_s", "tokens_per_s",
         "ttft_p50_ms", "ttft_p99_ms", "gap_p99_ms", "n_long", "gap_long_p99_ms", "gap_quiet_p50_ms",
         "long_over_quiet", "prefill_tasks", "fused_prefills"]


@dataclass(frozen=True)
class Workload:
    prompt_median: int = 300
    prompt_p99: int = 3000
    out_min: int = 64
    out_max: int = 512
    max_len: int = 4096
    long_tokens: int = 2000
    seed: int = 0

    @property
    def sigma(self) -> float:
        """The lognormal's sigma whose P99 / median is prompt_p99 / prompt_median (z of the 99th percentile)."""
        return float(np.log(self.prompt_p99 / self.prompt_median) / Z99)

    def describe(self) -> str:
        return (f"prompt lengths lognormal(mu=ln {self.prompt_median}, sigma={self.sigma:.3f}) tokens (median "
                f"{self.prompt_median}, P99 {self.prompt_p99}), cut to [1, max_len - output] with max_len "
                f"{self.max_len}; outputs uniform {self.out_min}..{self.out_max}; seed {self.seed}; long prompts: "
                f">= {self.long_tokens} tokens")


TAIL_IDS = 10**7   # request ids from here on draw their prompt length from the lognormal's tail (online_long)


class Requests:
    """Request i: the same prompt (random ids), output length and seed in every engine. From TAIL_IDS on, the
    prompt's length is drawn from the lognormal above long_tokens (its inverse CDF over the tail's share)."""

    def __init__(self, work: Workload, vocab: int):
        self.work, self.vocab = work, vocab

    def __call__(self, i: int):
        from minedraft_ray.engine.sampling import SamplingParams

        w = self.work
        rng = np.random.default_rng([w.seed, i])
        out = int(rng.integers(w.out_min, w.out_max + 1))
        z = rng.normal()
        if i >= TAIL_IDS:
            normal = statistics.NormalDist()
            tail_from = normal.cdf(np.log(w.long_tokens / w.prompt_median) / w.sigma)
            z = normal.inv_cdf(tail_from + (1 - tail_from) * normal.cdf(z))
        n = int(np.clip(round(np.exp(np.log(w.prompt_median) + w.sigma * z)), 1, w.max_len - out))
        prompt = rng.integers(16, self.vocab, n).tolist()
        return prompt, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True, seed=i)


def percentile(values, q):
    return float(np.percentile(values, q)) if len(values) else None


# ---- workloads ----------------------------------------------------------------------------------
def run_closed(llm, requests: Requests, ids: range) -> dict:
    start, before = len(llm.history()), llm.info()
    reqs = [requests(i) for i in ids]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], [s for _, s in reqs])
    run_s = time.perf_counter() - t0
    steps = llm.history()[start:]
    prefill_ms = sum(r.t_prefill_ms for r in steps)
    # a fused step's device time (verify rows and chunk in one launch) against a plain verify's
    fused_steps = [r for r in steps if "fused_prefill_tokens" in r.extra]
    plain_steps = [r for r in steps if "fused_prefill_tokens" not in r.extra]
    prompt_tokens = sum(len(p) for p, _ in reqs)
    after = llm.info()
    fused = after["fused_prefills"] - before["fused_prefills"]
    # fused chunks' device time is inside their verifies': prefill time alone is not measured then
    separate = prefill_ms and not fused
    return {"n_requests": len(reqs), "completed": len(outs), "prompt_tokens": prompt_tokens, "run_s": run_s,
            "prefill_ms": prefill_ms, "prefill_tokens_per_s": prompt_tokens / prefill_ms * 1e3 if separate else None,
            "tokens_per_s": sum(len(o.token_ids) for o in outs) / run_s,
            "prefill_tasks": after["prefill_tasks"] - before["prefill_tasks"], "fused_prefills": fused,
            "verify_ms_p50": percentile([r.t_verify_ms for r in plain_steps], 50),
            "fused_verify_ms_p50": percentile([r.t_verify_ms for r in fused_steps], 50),
            "fused_tokens_p50": percentile([r.extra["fused_prefill_tokens"] for r in fused_steps], 50)}


@dataclass
class Trace:
    arrival: float                  # scheduled, on the client's clock
    prompt_len: int
    outputs: list[float]            # times of the outputs that carried tokens


async def run_online(llm, requests: Requests, ids: list[int], arrivals: list[float], tag: str,
                     drain_s: float) -> list[Trace]:
    t0 = time.perf_counter() + 0.05
    open_ids: set[str] = set()

    async def one(i: int, at: float) -> Trace:
        prompt, params = requests(i)
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        trace, rid = Trace(t0 + at, len(prompt), []), f"{tag}-{i}"
        open_ids.add(rid)
        async for out in llm.stream(prompt, params, rid):
            if out.new_token_ids:
                trace.outputs.append(time.perf_counter())
        open_ids.discard(rid)
        return trace

    tasks = [asyncio.ensure_future(one(i, at)) for i, at in zip(ids, arrivals)]
    done, pending = await asyncio.wait(tasks, timeout=arrivals[-1] + drain_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for rid in open_ids:   # still running after the drain: free the engine for the next load
        await asyncio.to_thread(llm.abort, rid)
    return [t.result() for t in done if not t.cancelled() and t.exception() is None]


def online_stats(traces: list[Trace], long_tokens: int) -> dict:
    ttft = [(t.outputs[0] - t.arrival) * 1e3 for t in traces if t.outputs]
    gaps = [(a, b) for t in traces for a, b in zip(t.outputs, t.outputs[1:])]
    out = {"completed": len(traces), "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
           "gap_p50_ms": percentile([(b - a) * 1e3 for a, b in gaps], 50),
           "gap_p99_ms": percentile([(b - a) * 1e3 for a, b in gaps], 99)}
    out.update(long_prompt_gaps(traces, long_tokens))
    return out


def long_prompt_gaps(traces: list[Trace], long_tokens: int) -> dict:
    """Gaps between a request's consecutive outputs that overlap a long prompt's prefill (its arrival to its
    first output; requests of their own), against those that overlap none."""
    windows = [(t.arrival, t.outputs[0]) for t in traces if t.prompt_len >= long_tokens and t.outputs]
    long, quiet = [], []
    for t in traces:
        for a, b in zip(t.outputs, t.outputs[1:]):
            (long if any(a < end and b > start for start, end in windows) else quiet).append((b - a) * 1e3)
    p99, p50 = percentile(long, 99), percentile(quiet, 50)
    return {"n_long": len(windows), "gap_long_p99_ms": p99, "gap_quiet_p50_ms": p50,
            "long_over_quiet": p99 / p50 if p99 is not None and p50 else None}


def step_trace(records, mode: str, engine: str, workload: str, context: dict) -> list[dict]:
    """--steps: a run's verifier cycles, to tell what made its long gaps (a chunk's launch, or something else)."""
    return [{"mode": mode, "engine": engine, "workload": workload, "step": i, "t_emit": r.t_emit,
             "git_sha": context["git_sha"], "command": context["command"], "device": context["device"],
             "step_ms": r.step_ms, "t_verify_ms": r.t_verify_ms, "t_prefill_ms": r.t_prefill_ms, "rows": r.verified,
             "prefill_tokens": r.prefill_tokens, "prefill_launches": len(r.prefill_launches),
             "launch_tokens": max((launch.tokens for launch in r.prefill_launches), default=0),
             "prior_keys": sum(launch.prior_keys for launch in r.prefill_launches),
             "chunk_limit": r.chunk_limit, "chunk_key_ms": r.chunk_key_ms,
             "chunk_margin": r.chunk_margin, "host_ms": r.host_ms,
             "launch_gap_ms": r.launch_gap_ms}
            for i, r in enumerate(records)]


def long_arrivals(count: int, seconds: float) -> list[float]:
    """When online_long's added long prompts arrive: evenly spaced over the run, none at its edges."""
    return [(j + 0.5) * seconds / count for j in range(count)]


def run_online_long(llm, requests: Requests, args, capacity: float, work: Workload, first_id: int,
                    tag: str) -> dict:
    """online_long: Poisson arrivals at --long-load plus --long-prompts prompts from the tail (ids from
    TAIL_IDS), merged in time."""
    arrivals = poisson_arrivals(args.long_load * capacity, args.online_s, seed=round(args.long_load * 1000) + 1)
    timed = sorted([(at, first_id + n) for n, at in enumerate(arrivals)] +
                   [(at, TAIL_IDS + n) for n, at in enumerate(long_arrivals(args.long_prompts, args.online_s))])
    drain = 10.0 if args.smoke else min(30.0, max(5.0, args.online_s))
    traces = asyncio.run(run_online(llm, requests, [i for _, i in timed], [at for at, _ in timed], tag, drain))
    return {"workload": "online_long", "load": args.long_load, "rate_rps": args.long_load * capacity,
            "n_requests": len(timed), "added_long": args.long_prompts, **online_stats(traces, work.long_tokens)}


# ---- engines ------------------------------------------------------------------------------------
ENGINES = {"fused": {"packed_prefill": True, "fused_prefill": True},
           "chunked": {"packed_prefill": True, "fused_prefill": False},
           "fused_arrival": {"packed_prefill": True, "fused_prefill": True, "prefill_order": "arrival"},
           "chunked_arrival": {"packed_prefill": True, "fused_prefill": False, "prefill_order": "arrival"},
           "padded": {"packed_prefill": False, "prefill_chunk_tokens": 0, "fused_prefill": False}}


@dataclass(frozen=True)
class EngineSpec:
    """An --engines entry: `fused`, `fused:256` (that engine at its own prefill_chunk_tokens), `fused:512@2`
    (chunks sized from step times within that budget, chunk_gap_ratio 2) or `fused:512@2/typical` (that ratio of
    chunk_gap_reference typical)."""
    kind: str
    chunk: int | None = None
    gap_ratio: float | None = None
    gap_reference: str | None = None

    @classmethod
    def parse(cls, spec: str) -> EngineSpec:
        head, _, adaptive = spec.partition("@")
        kind, _, chunk = head.partition(":")
        ratio, slash, reference = adaptive.partition("/")
        if (kind not in ENGINES or ((chunk or ratio) and kind == "padded") or (slash and not ratio)
                or reference not in (("recent", "typical") if slash else ("",))):
            raise ValueError(f"unknown engine {spec!r}: one of {', '.join(ENGINES)}, chunked/fused optionally "
                             f":TOKENS and @GAP_RATIO[/recent|/typical]")
        return cls(kind, int(chunk) if chunk else None, float(ratio) if ratio else None, reference or None)


def build(mode: str, engine: str, args, target: str, draft: str, work: Workload, extra: dict):
    from minedraft_ray.runtime import LLM
    from minedraft_ray.testing.workers import synthetic_acceptance

    spec = EngineSpec.parse(engine)
    settings = dict(ENGINES[spec.kind])
    chunk = spec.chunk if spec.chunk is not None else args.chunk
    if spec.kind != "padded" and chunk is not None:
        settings["prefill_chunk_tokens"] = chunk
    if spec.gap_ratio is not None:
        settings["chunk_gap_ratio"] = spec.gap_ratio
    if spec.gap_reference is not None:
        settings["chunk_gap_reference"] = spec.gap_reference
    hook = {"_workers": synthetic_acceptance(args.alpha)} if mode == "sd" else {}
    return LLM(target, draft if mode == "sd" else None, mode=mode, k=args.k, max_batch=args.max_batch,
               max_len=work.max_len, max_queued=1_000_000, stream_interval_ms=0.0, **settings, **extra, **hook)


def model_pair(args, work_dir: Path) -> tuple[str, str]:
    from minedraft_ray.engine.presets import resolve_model

    if args.smoke:
        from minedraft_ray.testing.tiny import make_noised_draft, make_tiny_model

        target = make_tiny_model(work_dir / "target", "llama")
        return str(target), str(make_noised_draft(target, work_dir / "draft", noise=0.02))
    for model in (args.target, args.draft):   # materialise random:<preset> folders once, before the actors race
        resolve_model(model)
    return args.target, args.draft


def vocab_of(target: str) -> int:
    from minedraft_ray.engine.model import ModelConfig
    from minedraft_ray.engine.presets import resolve_model

    return min(ModelConfig.from_pretrained(resolve_model(target)).vocab_size, 32000)


# ---- main ---------------------------------------------------------------------------------------
def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="ar,sd")
    p.add_argument("--engines", default="padded,chunked,fused", help="padded (the unchunked engine) first: its "
                   "closed capacity sets the online rates of all; chunked/fused take :TOKENS for their own budget "
                   "(e.g. fused:256,fused:512) and @RATIO for chunks sized from step times (chunk_gap_ratio, e.g. "
                   "fused:512@2), /typical after it for chunk_gap_reference typical (fused:512@2/typical)")
    p.add_argument("--target", default="random:llama-8b")
    p.add_argument("--draft", default="random:llama-1b")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--alpha", type=float, default=0.8, help="sd's synthetic acceptance (random weights)")
    p.add_argument("--chunk", type=int, default=None, help="the chunked and fused engines' prefill_chunk_tokens "
                   "(default: the engine's default for the device)")
    p.add_argument("--n-closed", type=int, default=96, help="requests of the closed workload")
    p.add_argument("--loads", default="0.3,0.6,0.9")
    p.add_argument("--online-s", type=float, default=15.0, help="seconds of arrivals per load")
    p.add_argument("--long-prompts", type=int, default=0, help="add an online run (online_long) at --long-load "
                   "holding this many prompts from the lognormal's tail above the long length, evenly spaced "
                   "(0: none)")
    p.add_argument("--long-load", type=float, default=0.6, help="online_long's load (x the padded capacity)")
    p.add_argument("--prompt-median", type=int, default=300)
    p.add_argument("--prompt-p99", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder of real_traffic.{parquet,md,png} (default bench/results; "
                   "smoke: /tmp/real_traffic_smoke)")
    p.add_argument("--steps", action="store_true", help="also write the engine's steps in online_long (cycle, "
                   "chunk and launch tokens, the adaptive limit) to real_traffic_steps.parquet")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny models, 2 fake GPUs, a small workload")
    p.add_argument("--merge", nargs="+", default=None, metavar="PARQUET",
                   help="run nothing: merge these runs' real_traffic.parquet into --out's (a row replaces the one of "
                   "the same mode, engine, workload and load; later files win) and write its md and plot again, the "
                   "workload described by the other flags (give the runs' own)")
    return p.parse_args(argv)


MERGE_KEY = ("mode", "engine", "workload", "load")


def merge_runs(out: Path, runs: list[Path], args) -> list[dict]:
    """--merge: the results' rows with the runs' merged in, written."""
    import pyarrow.parquet as pq

    results = out / f"{NAME}.parquet"
    rows = pq.read_table(results).to_pylist() if results.exists() else []
    steps_path = out / f"{NAME}_steps.parquet"
    steps = pq.read_table(steps_path).to_pylist() if steps_path.exists() else []
    for run in runs:
        rows = merge_by_config(rows, pq.read_table(run).to_pylist(), MERGE_KEY)
        if (run.parent / steps_path.name).exists():   # its --steps: replace those of the same mode and engine
            new = pq.read_table(run.parent / steps_path.name).to_pylist()
            replaced = {(r["mode"], r["engine"]) for r in new}
            steps = [r for r in steps if (r["mode"], r["engine"]) not in replaced] + new
    # one setting per mode: a CPU smoke run, another batch or k would otherwise replace rows it cannot compare with
    for mode in {r["mode"] for r in rows}:
        settings = {(r["device"], r["max_batch"], r["k"], r["alpha"]) for r in rows if r["mode"] == mode}
        if len(settings) > 1:
            raise SystemExit(f"{mode}: rows of different device, max_batch, k or alpha would mix: {sorted(settings)}")
    if steps:
        write_steps(out, steps)
    write(out, rows, Workload(args.prompt_median, args.prompt_p99, seed=args.seed), args, steps)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.merge:
        out = Path(args.out or "bench/results")
        say(f"{out / NAME}.parquet: {len(merge_runs(out, [Path(m) for m in args.merge], args))} rows")
        return 0
    import ray

    if args.smoke:
        work = Workload(prompt_median=24, prompt_p99=200, out_min=4, out_max=16, max_len=256, long_tokens=60,
                        seed=args.seed)
        extra = {"device": "cpu", "torch_threads": 1}
    else:
        work = Workload(args.prompt_median, args.prompt_p99, seed=args.seed)
        extra = {}
    out = Path(args.out or ("/tmp/real_traffic_smoke" if args.smoke else "bench/results"))
    context = {"git_sha": git_sha(), "command": command_line("bench.real_traffic", argv),
               "device": machine_name(args.smoke)}
    work_dir = Path(tempfile.mkdtemp(prefix="rtb-", dir="/tmp"))   # short: Ray's socket paths have a length limit
    own_ray = not ray.is_initialized()
    if own_ray:
        more = {"num_cpus": 4, "num_gpus": 2} if args.smoke else {}
        ray.init(address="local", include_dashboard=False, _temp_dir=str(work_dir / "ray"), log_to_driver=False,
                 **more)
    rows, step_rows, loads = [], [], [float(x) for x in args.loads.split(",") if x]
    try:
        target, draft = model_pair(args, work_dir)
        requests = Requests(work, vocab_of(target))
        for mode in args.modes.split(","):
            capacity = None   # the padded engine's closed requests/s: both engines' online rates
            for engine in args.engines.split(","):
                t0 = time.perf_counter()
                llm = build(mode, engine, args, target, draft, work, extra)
                try:
                    llm.generate(*map(list, zip(*[requests(10**6 + i) for i in range(4)])))   # warm-up
                    base = {**context, "mode": mode, "engine": engine, "max_batch": args.max_batch,
                            "k": args.k if mode == "sd" else None, "alpha": args.alpha if mode == "sd" else None,
                            "prefill_chunk_tokens": llm.info()["prefill_chunk_tokens"],
                            "packed_prefill": ENGINES[EngineSpec.parse(engine).kind]["packed_prefill"],
                            "chunk_gap_ratio": llm.info()["chunk_gap_ratio"],
                            "fused_prefill": llm.info()["fused_prefill"],
                            "prefill_order": llm.info()["prefill_order"],
                            "build_s": time.perf_counter() - t0}
                    closed = {**base, "workload": "closed", **run_closed(llm, requests, range(args.n_closed))}
                    rows.append(closed)
                    say(f"{mode} {engine} closed: {fmt(closed['prefill_tokens_per_s'])} prompt tok/s in prefill, "
                        f"{fmt(closed['tokens_per_s'])} tok/s")
                    capacity = capacity or closed["n_requests"] / closed["run_s"]
                    traces_all, next_id = [], 10**5
                    for load in loads:
                        arrivals = poisson_arrivals(load * capacity, args.online_s, seed=round(load * 1000))
                        ids = list(range(next_id, next_id + len(arrivals)))
                        next_id += len(arrivals)
                        drain = 10.0 if args.smoke else min(30.0, max(5.0, args.online_s))
                        traces = asyncio.run(run_online(llm, requests, ids, arrivals, f"{mode}-{engine}-{load}",
                                                        drain))
                        traces_all += traces
                        row = {**base, "workload": "online", "load": load, "rate_rps": load * capacity,
                               "n_requests": len(arrivals), **online_stats(traces, work.long_tokens)}
                        rows.append(row)
                        say(f"{mode} {engine} {load:.0%}: TTFT P50/P99 {fmt(row['ttft_p50_ms'])}/"
                            f"{fmt(row['ttft_p99_ms'])} ms, gap P99 {fmt(row['gap_p99_ms'])} ms")
                    if loads:   # the long-prompt gaps pooled over the loads (long prompts are rare)
                        rows.append({**base, "workload": "online_pooled", "n_requests": len(traces_all),
                                     **online_stats(traces_all, work.long_tokens)})
                    if args.long_prompts:
                        first_step = len(llm.history())
                        rows.append({**base, **run_online_long(llm, requests, args, capacity, work, next_id,
                                                               f"{mode}-{engine}-long")})
                        if args.steps:
                            step_rows += step_trace(llm.history()[first_step:], mode, engine, "online_long",
                                                    context)
                        say(f"{mode} {engine} with {args.long_prompts} long prompts: gap ratio "
                            f"{fmt(rows[-1]['long_over_quiet'])} over {rows[-1]['n_long']}")
                finally:
                    llm.shutdown()
                # after every engine: a device call cut short keeps what it measured
                if step_rows:
                    write_steps(out, step_rows)
                write(out, rows, work, args, step_rows)
    finally:
        if own_ray:
            ray.shutdown()
        shutil.rmtree(work_dir, ignore_errors=True)
    say(f"wrote {out / NAME}.{{parquet,md,png}}")
    return 0


def write(out: Path, rows: list[dict], work: Workload, args, steps: list[dict] = ()) -> Path:
    """steps: the rows' --steps, described in the notes too."""
    from minedraft_ray.runtime.chunk_budget import TYPICAL_CYCLES

    notes = [work.describe(),
             f"max_batch {args.max_batch}; sd: k={args.k}, synthetic acceptance alpha={args.alpha}; "
             f"{args.n_closed} closed requests; online {args.online_s:g} s of Poisson arrivals per load at "
             f"{args.loads} x the padded engine's closed capacity",
             "chunked: packed prefill, prompts cut at prefill_chunk_tokens per step, each chunk its own launch; "
             "fused: the same budget bounding one launch of the verify and the chunk while requests decode; padded: "
             "packed_prefill off, prefill_chunk_tokens 0 (whole prompts, padded to the longest)",
             "prefill_tokens_per_s: prompt tokens / prefill device time; gaps: between a request's consecutive "
             "outputs (one per step); gap_long_p99_ms / gap_quiet_p50_ms: gaps overlapping a long prompt's "
             "arrival-to-first-token window, or none; online_pooled: all loads together",
             "@RATIO (e.g. fused:512@2): chunk_gap_ratio, the chunk sized from the engine's step times so that a "
             "step with one takes at most RATIO x one without (the recent ones' moving average), within the budget; "
             f"@RATIO/typical: x the shorter of that and the median step without one over the last "
             f"{TYPICAL_CYCLES} (chunk_gap_reference typical)",
             "prefill_order: who takes the step's prefill budget first (shortest: the fewest prompt tokens left, a "
             "prompt overtaken by its own length first; arrival: first come, first served)"]
    if args.long_prompts:
        notes.append(f"online_long: {args.online_s:g} s of Poisson arrivals at {args.long_load} x the padded "
                     f"engine's closed capacity (seed {round(args.long_load * 1000) + 1}) plus {args.long_prompts} "
                     f"prompts drawn from the same lognormal above {work.long_tokens} tokens (inverse CDF over the "
                     f"tail, request ids from {TAIL_IDS}), arriving at (j + 0.5) x {args.online_s:g} s / "
                     f"{args.long_prompts}")
    commands = dict.fromkeys((r["command"], r["git_sha"]) for r in rows)
    if len(commands) > 1:   # merged runs
        notes.append("Rows from: " + "; ".join(f"`{c}` at {sha}" for c, sha in commands))
    notes += ratios(rows) + step_notes(steps)
    return write_results(rows, out, NAME, COLUMNS, "Real traffic: chunked + packed prefill (separate or fused "
                         "launches) vs the padded engine",
                         rows[0]["command"] if rows else "", rows[0]["device"] if rows else "", notes, TABLE)


def write_steps(out: Path, steps: list[dict]) -> None:
    """real_traffic_steps.{parquet,md,png}: every cycle in the parquet, their summary in the md."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = out / f"{NAME}_steps.parquet"
    pq.write_table(pa.Table.from_pylist(steps), path)
    runs = dict.fromkeys((r["command"], r["git_sha"], r["device"]) for r in steps)
    md = ["# Real traffic: the engine's verifier cycles in online_long (--steps)", ""]
    md += [f"- {line}" for line in step_notes(steps)]
    md += ["", "Command: " + "; ".join(f"`{c}`" for c, _, _ in runs), "",
           "Git: " + ", ".join(dict.fromkeys(sha for _, sha, _ in runs)), "",
           "Device: " + ", ".join(dict.fromkeys(d for _, _, d in runs)), "",
           "- step_ms: the verifier's cycle (the end of its previous verify to the end of this one); launch_tokens: "
           "the largest launch that carried prompt tokens in it (a fused one's with its verify's tokens); prior_keys: "
           "its launches' chunks' tokens x their starts (the keys before their own that they read: a chunk's depth); "
           "chunk_limit: the adaptive chunk's launch tokens for the steps after it (chunk_gap_ratio), at depth 0; "
           "chunk_key_ms: what it priced a prior key at; chunk_margin: what its predicted cycles were scaled by (the "
           "90th percentile of what its recent predictions missed by)"]
    path.with_suffix(".md").write_text("\n".join(md) + "\n")
    try:
        from bench.plot import PLOTS

        PLOTS[path.stem](path, path.with_suffix(".png"))
    except ImportError:   # no matplotlib (the GPU machine): python -m bench.plot later
        pass


def step_notes(steps: list[dict]) -> list[str]:
    """--steps (real_traffic_steps.parquet): online_long's verifier cycles with a prompt chunk against those
    without, and by the class of the launch that carried the chunk (runtime/chunk_budget.py's classes)."""
    from minedraft_ray.engine.launch_buckets import token_bucket
    from minedraft_ray.runtime.chunk_budget import LAUNCH_CLASSES

    lines = []
    for mode, engine in dict.fromkeys((r["mode"], r["engine"]) for r in steps):
        mine = [r for r in steps if (r["mode"], r["engine"]) == (mode, engine)]
        chunk = [r["step_ms"] for r in mine if r["prefill_tokens"]]
        plain = [r["step_ms"] for r in mine if not r["prefill_tokens"]]
        if not chunk or not plain:
            continue
        line = (f"{mode} {engine}, online_long's cycles (steps parquet): {len(chunk)} with a prompt chunk, P50/P99 "
                f"{fmt(percentile(chunk, 50))}/{fmt(percentile(chunk, 99))} ms, against {len(plain)} without, "
                f"P50/P99 {fmt(percentile(plain, 50))}/{fmt(percentile(plain, 99))} ms")
        classes: dict[int, list[float]] = {}
        for r in mine:
            if r["prefill_launches"] == 1 and r["launch_tokens"] <= LAUNCH_CLASSES[-1]:
                classes.setdefault(token_bucket(r["launch_tokens"], LAUNCH_CLASSES), []).append(r["step_ms"])
        if classes and any(r["chunk_limit"] is not None for r in mine):   # adaptive: what each class it ran cost
            line += "; by launch class (tokens: cycles, P50/P99 ms) " + ", ".join(
                f"{c}: {len(ms)}, {fmt(percentile(ms, 50))}/{fmt(percentile(ms, 99))}"
                for c, ms in sorted(classes.items()))
        lines.append(line)
    return lines


def ratios(rows: list[dict]) -> list[str]:
    """The issue's targets, where both engines have rows: prefill tok/s ratio, TTFT P99 at 60 %, the gap ratio."""
    lines = []
    for mode in sorted({r["mode"] for r in rows}):
        pick = lambda engine, workload, load=None: next(
            (r for r in rows if r["mode"] == mode and r["engine"] == engine and r["workload"] == workload
             and (load is None or r.get("load") == load)), None)
        padded = pick("padded", "closed")
        for engine in dict.fromkeys(r["engine"] for r in rows if r["mode"] == mode and r["engine"] != "padded"):
            closed = pick(engine, "closed")
            if closed and padded and closed["prefill_tokens_per_s"] and padded["prefill_tokens_per_s"]:
                lines.append(f"{mode}: prefill prompt tokens/s {engine} / padded = "
                             f"{closed['prefill_tokens_per_s'] / padded['prefill_tokens_per_s']:.2f} (target >= 1.25)")
            if closed and padded and closed["tokens_per_s"] and padded["tokens_per_s"]:
                lines.append(f"{mode}: closed tok/s {engine} / padded = "
                             f"{closed['tokens_per_s'] / padded['tokens_per_s']:.2f}")
            c60, p60 = pick(engine, "online", 0.6), pick("padded", "online", 0.6)
            if c60 and p60 and c60["ttft_p99_ms"] and p60["ttft_p99_ms"]:
                lines.append(f"{mode}: TTFT P99 at 60 % load {engine} {fmt(c60['ttft_p99_ms'])} ms vs padded "
                             f"{fmt(p60['ttft_p99_ms'])} ms (target: {engine} <= padded)")
            for workload in ("online_long", "online_pooled"):
                row = pick(engine, workload)
                if row:
                    lines.append(f"{mode}: {engine}, gap P99 while long prompts prefill / median gap without = "
                                 f"{fmt(row['long_over_quiet'])} over {row['n_long']} long prompts ({workload}; "
                                 f"target <= 2)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
