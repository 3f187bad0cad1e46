"""PSD against standard speculative decoding and plain decoding: one engine configuration per command.

A command builds one configuration (mode, batch, replicas, acceptance) and runs it at each k and alpha given,
on the closed workload (the paper's: 2m x waves requests submitted at once, 128 output tokens each,
ignore_eos, random-token prompts of 128..256 tokens, request i seeded with i, so the synthetic acceptance
draws are the same in every mode) and, with --loads, on Poisson arrivals at those fractions of a closed-loop
capacity. Its rows merge into <out>/psd_vs_sd.parquet by configuration (a rerun replaces a row); the grid of
bench/results/psd_vs_sd.md is several such commands, e.g. on a machine with two GPUs:

    python -m bench.psd_vs_sd --mode psd --m 64 --ks 1,2,3,4,5 --alphas 0.8,0.6
    python -m bench.psd_vs_sd --mode sd --m 64 --batch 256 --ks 2 --alphas 0.8
    python -m bench.psd_vs_sd --mode ar --m 64 --batch 256 --replicas 2
    python -m bench.psd_vs_sd --mode psd --m 64 --ks 3 --loads 0.3,0.6,0.9 --capacity 51.9 --online-only
    python -m bench.psd_vs_sd --mode sd --m 64 --ks 4 --acceptance real
    python -m bench.psd_vs_sd --mode psd --m 2 --ks 1 --smoke      # CPU: tiny models, 2 fake GPUs, seconds

A device call's file merges into the results with `python -m bench.merge_rows RUN.parquet`.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import (command_line, device_name, fmt, git_sha, markdown_table, merge_by_config, progress,
                          say)

NAME = "psd_vs_sd"
COLUMNS = ["mode", "workload", "rate_rps", "m", "k", "tp", "alpha", "acceptance", "n_gpus", "tokens_per_s",
           "tokens_per_s_per_gpu", "makespan_per_req_s", "lat_mean_s", "lat_p50_s", "lat_p99_s", "ttft_mean_s",
           "ttft_p99_s", "t_draft_ms", "t_verify_ms", "step_ms", "verifier_busy", "ray_overhead_ms", "transport",
           "git_sha", "command", "device",
           "part", "status", "note", "alpha_group", "batch", "replicas", "in_flight", "n_requests", "completed",
           "max_tokens", "prompt_len", "temperature", "load", "duration_s", "acceptance_rate", "acceptance_length",
           "steady_steps", "prefill_share", "seq_share", "cadence_psd_ms", "cadence_seq_ms", "ms_per_row_psd",
           "ms_per_row_seq", "launch_gap_ms", "verifier_overlap", "psd_high_load", "build_s", "run_s", "models"]
STRINGS = {"mode", "workload", "acceptance", "transport", "git_sha", "command", "device", "status", "note",
           "prompt_len", "models", "verifier_overlap", "psd_high_load"}
INTS = {"m", "k", "tp", "n_gpus", "part", "batch", "replicas", "in_flight", "n_requests", "completed", "max_tokens",
        "steady_steps"}
# what a row measured: rows of equal configuration replace one another
CONFIG = ("mode", "workload", "m", "batch", "k", "tp", "replicas", "alpha_group", "load", "acceptance", "transport")
TABLE = ["mode", "m", "batch", "k", "tp", "alpha", "n_gpus", "in_flight", "n_requests", "tokens_per_s",
         "tokens_per_s_per_gpu", "lat_p50_s", "lat_p99_s", "t_draft_ms", "t_verify_ms", "step_ms", "verifier_busy",
         "ray_overhead_ms", "acceptance_length", "transport", "git_sha"]
ONLINE_TABLE = ["mode", "load", "rate_rps", "k", "tp", "n_gpus", "n_requests", "completed", "tokens_per_s", "lat_p50_s",
                "lat_p99_s", "ttft_p99_s", "step_ms", "verifier_busy", "seq_share", "transport", "git_sha"]
DRAFTER_GPUS = {"psd": 1, "sd_split": 1, "sd": 0, "ar": 0}   # GPUs of a replica besides the target's tp
SEQUENTIAL = {"psd": "psd", "sd_split": "seq", "sd": "sd", "ar": "ar"}   # the regime a mode's steps run in
EDGE_FRACTION = 0.05  # steps dropped at each end of a run before steady-state statistics


@dataclass(frozen=True)
class Spec:
    """One engine configuration; `replicas` > 1: that many independent LLMs (data parallel)."""
    mode: str                  # psd | sd | sd_split | ar
    batch: int                 # max_batch of each replica
    k: int                     # 0 for ar
    alpha: float | None        # synthetic acceptance; None: what the models give
    replicas: int = 1
    acceptance: str = "synthetic"
    tp: int = 1                # the target's tensor-parallel size

    @property
    def label(self) -> str:
        return self.mode if self.replicas == 1 else f"{self.mode}_dp{self.replicas}"

    @property
    def n_gpus(self) -> int:
        return (self.tp + DRAFTER_GPUS[self.mode]) * self.replicas

    @property
    def in_flight(self) -> int:
        return (2 if self.mode == "psd" else 1) * self.batch * self.replicas


@dataclass(frozen=True)
class Workload:
    max_tokens: int = 128
    prompt_len: tuple[int, int] = (128, 256)
    max_len: int = 512
    temperature: float = 0.0   # real-acceptance rows are greedy whatever this says


# ---- prompts ------------------------------------------------------------------------------------
class Prompts:
    """Request i gets the same prompt (and seed i) in every mode: random token ids, or windows of real text
    where acceptance is the models' own."""

    def __init__(self, target: str, prompt_len: tuple[int, int], real_text: bool):
        from minedraft_ray.engine.model import ModelConfig
        from minedraft_ray.engine.presets import resolve_model

        self.lo, self.hi = prompt_len
        self.vocab = min(ModelConfig.from_pretrained(resolve_model(target)).vocab_size, 32000)
        self.text_ids = text_token_ids(target, self.hi * 400) if real_text else None

    def __call__(self, i: int) -> list[int]:
        rng = random.Random(i)
        n = rng.randint(self.lo, self.hi)
        if self.text_ids is None:
            return [rng.randrange(16, self.vocab) for _ in range(n)]
        start = rng.randrange(len(self.text_ids) - n)
        return self.text_ids[start:start + n]


def text_token_ids(target: str, n: int) -> list[int]:
    """Python standard library source, tokenized by the target's tokenizer: prompts with real structure."""
    from minedraft_ray.engine.loader import load_tokenizer
    from minedraft_ray.engine.presets import resolve_model

    tok = load_tokenizer(resolve_model(target))
    ids: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        ids += tok.encode(path.read_text(errors="ignore"), add_special_tokens=False)
        if len(ids) >= n:
            break
    return ids


def sampling(i: int, max_tokens: int, temperature: float):
    from minedraft_ray.engine.sampling import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i)


# ---- statistics ---------------------------------------------------------------------------------
def steady_stats(histories: list[list], mode: str) -> dict:
    """Per-step medians over the steady state of each replica's run: the first and last 5 % of steps, steps
    of another regime and steps that admitted requests (their prefill is not in t_verify_ms) are left out. A
    psd run that was mostly sequential (its low-load regime) is measured on those steps, as sd_split's are."""
    every = [r for history in histories for r in history]
    wall = sum(r.step_ms for r in every)
    seq_share = sum(r.regime == "seq" for r in every) / len(every) if every and mode == "psd" else None
    medians = {f"cadence_{g}_ms": [r.cadence_ms for r in every if r.regime == g and r.cadence_ms] for g in ("psd", "seq")}
    medians |= {f"ms_per_row_{g}": [r.ms_per_row for r in every if r.verified and r.regime == g
                                    and r.extra.get("high_load") == g] for g in ("psd", "seq")}
    shares = {"prefill_share": sum(r.t_prefill_ms for r in every) / wall if wall else None, "seq_share": seq_share,
              **{name: float(np.median(v)) if v else None for name, v in medians.items()}}
    main = "seq" if seq_share is not None and seq_share > 0.5 else SEQUENTIAL[mode]
    steps, busy = [], []
    for history in histories:
        cut = int(len(history) * EDGE_FRACTION)
        kept = [r for r in history[cut:len(history) - cut] if r.regime == main and not r.admitted]
        if kept:
            busy.append(sum(r.t_verify_ms for r in kept) / sum(r.step_ms for r in kept))
        steps += kept
    if not steps:
        return {"steady_steps": 0, **shares}
    # psd's split overlaps drafting with verifying; every other regime runs them one after the other
    critical = [max(r.t_draft_ms, r.t_verify_ms) if main == "psd" else r.t_draft_ms + r.t_verify_ms for r in steps]
    return {"t_draft_ms": float(np.median([r.t_draft_ms for r in steps])) if mode != "ar" else None,
            "t_verify_ms": float(np.median([r.t_verify_ms for r in steps])),
            "step_ms": float(np.median([r.step_ms for r in steps])), "verifier_busy": float(np.mean(busy)),
            "ray_overhead_ms": float(np.median([r.step_ms - c for r, c in zip(steps, critical)])),
            "launch_gap_ms": float(np.median([r.launch_gap_ms for r in steps])), "steady_steps": len(steps), **shares}


def acceptance_stats(stats: list[dict]) -> dict:
    drafted, accepted = sum(s["drafted"] for s in stats), sum(s["accepted"] for s in stats)
    verify_steps = sum(s["verify_steps"] for s in stats)
    return {"acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_length": 1 + accepted / verify_steps if verify_steps else None}


def latency_stats(lat: list[float], ttft: list[float]) -> dict:
    pct = lambda v, q: float(np.percentile(v, q)) if v else None
    return {"lat_mean_s": float(np.mean(lat)) if lat else None, "lat_p50_s": pct(lat, 50), "lat_p99_s": pct(lat, 99),
            "ttft_mean_s": float(np.mean(ttft)) if ttft else None, "ttft_p99_s": pct(ttft, 99)}


# ---- workloads ----------------------------------------------------------------------------------
def run_closed(llms: list, n: int, prompts: Prompts, work: Workload) -> dict:
    """n requests submitted at once, request i to replica i % replicas."""
    starts = [len(llm.history()) for llm in llms]

    def one(r):
        ids = list(range(r, n, len(llms)))
        outs = llms[r].generate([prompts(i) for i in ids], [sampling(i, work.max_tokens, work.temperature) for i in ids])
        return outs, time.perf_counter()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(llms)) as pool:
        results = list(pool.map(one, range(len(llms))))
    makespan = max(end for _, end in results) - t0
    outs = [o for out, _ in results for o in out]
    return {"tokens_per_s": sum(len(o.token_ids) for o in outs) / makespan, "makespan_per_req_s": makespan / n,
            **latency_stats([o.stats["latency"] for o in outs], [o.stats["ttft"] for o in outs]),
            "n_requests": n, "completed": len(outs), "run_s": makespan,
            "_histories": [llm.history()[s:] for llm, s in zip(llms, starts)],
            **acceptance_stats([o.stats for o in outs])}


def poisson_arrivals(rate: float, duration: float, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    times, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t > duration:
            return times or [duration / 2]   # at least one request (a short window at a low rate may have none)
        times.append(t)


async def run_online(llms: list, arrivals: list[float], prompts: Prompts, work: Workload, tag: str,
                     drain_s: float) -> dict:
    """Open loop: request i arrives at arrivals[i] and goes to the replica with the fewest in flight. TTFT and
    latency are seen by this client and counted from the scheduled arrival."""
    in_flight, starts = [0] * len(llms), [len(llm.history()) for llm in llms]
    bar = progress(None, tag, total=len(arrivals))
    t0 = time.perf_counter() + 0.05
    open_ids: dict[str, int] = {}   # request id -> replica, until it finishes

    async def one(i: int, at: float):
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        r = int(np.argmin(in_flight))
        in_flight[r] += 1
        rid = f"{tag}-{i}"
        open_ids[rid] = r
        first, tokens, stats = None, 0, None
        try:
            async for out in llms[r].stream(prompts(i), sampling(i, work.max_tokens, work.temperature), rid):
                if out.new_token_ids and first is None:
                    first = time.perf_counter()
                tokens += len(out.new_token_ids)
                if out.finished:
                    stats = out.stats
                    open_ids.pop(rid, None)
        finally:
            in_flight[r] -= 1
            bar.update()
        end = time.perf_counter()
        return first - (t0 + at), end - (t0 + at), tokens, end, stats

    tasks = [asyncio.ensure_future(one(i, at)) for i, at in enumerate(arrivals)]
    done, pending = await asyncio.wait(tasks, timeout=arrivals[-1] + drain_s)
    for task in pending:
        task.cancel()
    for rid, r in list(open_ids.items()):  # still running after the drain: free the engine for the next run
        await asyncio.to_thread(llms[r].abort, rid)
    bar.close()
    results = [t.result() for t in done if not t.cancelled() and t.exception() is None]
    errors = sum(1 for t in done if not t.cancelled() and t.exception() is not None)
    span = max((r[3] for r in results), default=t0) - t0
    note = (f"{len(pending)} unfinished after a {drain_s:.0f} s drain, {errors} failed: latencies cover completed "
            "requests only (overload)") if pending or errors else ""
    return {"tokens_per_s": sum(r[2] for r in results) / span if span > 0 else None,
            "makespan_per_req_s": span / len(results) if results else None,
            **latency_stats([r[1] for r in results], [r[0] for r in results]),
            "n_requests": len(arrivals), "completed": len(results), "run_s": span, "note": note,
            "_histories": [llm.history()[s:] for llm, s in zip(llms, starts)],
            **acceptance_stats([r[4] for r in results if r[4]])}


# ---- engines ------------------------------------------------------------------------------------
def build(spec: Spec, target: str, draft: str, work: Workload, engine: dict) -> list:
    """The spec's LLMs (one per replica), built side by side."""
    from minedraft_ray.runtime import LLM

    def one(_):
        return LLM(target, None if spec.mode == "ar" else draft, mode=spec.mode, k=max(spec.k, 1),
                   max_batch=spec.batch, max_len=work.max_len, max_queued=1_000_000, step_timeout_s=120.0,
                   tp=spec.tp, **engine, **bench_hook(spec))

    with ThreadPoolExecutor(spec.replicas) as pool:
        return list(pool.map(one, range(spec.replicas)))


def synthetic(spec: Spec) -> bool:
    return spec.acceptance == "synthetic" and spec.mode != "ar"


def bench_hook(spec: Spec) -> dict:
    """Synthetic acceptance: the benchmark-only verifier workers accept each draft with probability alpha."""
    from minedraft_ray.testing.workers import synthetic_acceptance

    return {"_workers": synthetic_acceptance(spec.alpha)} if synthetic(spec) else {}


def warm_up(llms: list, spec: Spec, prompts: Prompts, work: Workload) -> None:
    """Capture the CUDA graphs a run meets: a full batch of short requests finishing at different steps, so the
    batch shrinks through the smaller buckets too; seeds apart from the measured requests'."""
    ids = range(10**6, 10**6 + spec.in_flight // spec.replicas)
    with ThreadPoolExecutor(len(llms)) as pool:
        list(pool.map(lambda llm: llm.generate(
            [prompts(i) for i in ids],
            [sampling(i, max(2, work.max_tokens * (1 + i % 4) // 16), work.temperature) for i in ids]), llms))


def shutdown(llms: list) -> None:
    for llm in llms:
        try:
            llm.shutdown()
        except Exception as e:  # a dead engine must not lose the rows measured so far
            say(f"shutdown failed: {e!r}")


# ---- rows and files -----------------------------------------------------------------------------
def make_row(spec: Spec, m: int, workload: str, metrics: dict, work: Workload, models: str, context: dict,
             **extra) -> dict:
    metrics = dict(metrics)
    steady = steady_stats(metrics.pop("_histories"), spec.mode)
    tokps = metrics.get("tokens_per_s")
    return {**context, "mode": spec.label, "workload": workload, "m": m, "k": spec.k, "tp": spec.tp,
            "batch": spec.batch,
            "replicas": spec.replicas, "in_flight": spec.in_flight, "n_gpus": spec.n_gpus,
            "alpha": None if spec.mode == "ar" else spec.alpha if synthetic(spec) else metrics.get("acceptance_rate"),
            "alpha_group": spec.alpha if spec.acceptance == "synthetic" else None,
            "acceptance": None if spec.mode == "ar" else spec.acceptance, "status": "ok",
            "tokens_per_s_per_gpu": tokps / spec.n_gpus if tokps else None, "max_tokens": work.max_tokens,
            "prompt_len": "{}..{}".format(*work.prompt_len), "temperature": work.temperature, "models": models,
            **metrics, **steady, **extra}


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    return merge_by_config(old, new, CONFIG)


def read_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist() if path.is_file() else []
    return [{**r, "tp": r.get("tp") or 1} for r in rows]   # rows from before the column ran the target at tp 1


def write(out: Path, rows: list[dict]) -> Path:
    """<out>/psd_vs_sd.{parquet,md}; the parquet has every column of COLUMNS (and any others the rows have)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    columns = COLUMNS + sorted({c for r in rows for c in r} - set(COLUMNS))
    kind = lambda c: pa.string() if c in STRINGS else pa.int64() if c in INTS else pa.float64()
    schema = pa.schema([(c, kind(c)) for c in columns])
    pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows], schema=schema),
                   out / f"{NAME}.parquet")
    (out / f"{NAME}.md").write_text(report(rows))
    return out / f"{NAME}.parquet"


def report(rows: list[dict]) -> str:
    key = lambda r: (-(r.get("alpha_group") or 0), -r["m"], r["mode"], r["batch"], r["k"], r.get("load") or 0)
    ok = sorted((r for r in rows if r.get("status", "ok") == "ok"), key=key)
    closed = [r for r in ok if r["workload"] == "closed" and r.get("acceptance") != "real"]
    lines = ["# PSD vs standard SD and plain decoding", "",
             "Closed workload: 2m x waves requests submitted at once (`n_requests`), `max_tokens` output tokens "
             "each (ignore_eos), random-token prompts, request i seeded with i, so synthetic acceptance draws "
             "match across modes. Online: Poisson arrivals at `rate_rps` (`load` x a closed-loop capacity); "
             "data-parallel replicas (`_dp2`) get each request on the one with fewer in flight. `m` is the group "
             "a row is compared in, `batch` its max_batch per replica; psd holds 2 x batch (`in_flight`).", "",
             "`t_draft_ms` / `t_verify_ms`: median device time of one draft phase (k steps) and one verify step; "
             "`step_ms`: median verifier cycle; `verifier_busy`: verify time / step time; `ray_overhead_ms`: "
             "median step - max(draft, verify) (psd's split) or - (draft + verify) (sequential). All over the "
             "steady state (first and last 5 % of steps, other-regime steps and steps that admitted requests "
             "left out). `tokens_per_s`: output tokens / wall time of the whole run, prefill included.", "",
             "Each row stays, with the commit that measured it (`git_sha`), until a run of the same configuration "
             "replaces it. Rows of a GPU machine are not re-run with each commit: the runtime's defaults may have "
             "changed since (docs/design.md).", ""]
    by_device: dict[str, set] = {}
    for r in rows:
        by_device.setdefault(r.get("device") or "unknown", set()).add(r.get("git_sha"))
    lines += [f"- {device}: rows of git {', '.join(sorted(shas))}" for device, shas in sorted(by_device.items())]
    lines += ["", "## Commands", "", "Each ran the script as it was at its commit (`git show <sha>:bench/psd_vs_sd.py`).", ""]
    for command, sha, device in sorted({(r.get("command"), r.get("git_sha"), r.get("device")) for r in rows},
                                       key=lambda x: (x[1] or "", x[0] or "")):
        lines.append(f"- `{command}` (git {sha}, {device})")
    online = [r for r in ok if r["workload"] == "online"]
    real = [r for r in ok if r["workload"] == "closed" and r.get("acceptance") == "real"]
    for title, table, columns in (("Closed workload, synthetic acceptance", closed, TABLE),
                                  ("Online (Poisson arrivals)", online, ONLINE_TABLE),
                                  ("Real acceptance (greedy; `alpha` is the measured acceptance rate)", real, TABLE)):
        lines += ["", f"## {title}", "", markdown_table(table, columns)] if table else []
    notes = [r for r in ok if r.get("note")]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {r['mode']} {r['workload']} m={r['m']} b={r['batch']} k={r['k']} "
                                          f"alpha={r.get('alpha_group')}: {r['note']}" for r in notes]
    return "\n".join(lines).rstrip() + "\n"


# ---- main ---------------------------------------------------------------------------------------
def machine_name(smoke: bool) -> str:
    if smoke:
        return device_name(__import__("torch").device("cpu")) + ", 2 fake GPUs"
    try:  # nvidia-smi: the driver process never initialises CUDA (it would take memory on GPU 0)
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, check=True).stdout.split("\n")
        names = [n.strip() for n in names if n.strip()]
        return f"{len(names)} x {names[0]}" if names else "no GPU"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def model_pair(args, work_dir: Path) -> tuple[str, str]:
    """--smoke: a tiny llama and a noised copy; real acceptance: the trained default pair when installed."""
    from minedraft_ray.config import default_draft, default_target
    from minedraft_ray.engine.presets import resolve_model

    if args.acceptance == "real" and not args.smoke and Path(default_target(), "config.json").is_file():
        return default_target(), default_draft()
    if args.smoke or args.acceptance == "real":
        from minedraft_ray.testing.tiny import make_noised_draft, make_tiny_model

        target = make_tiny_model(work_dir / "target", "llama", **({} if args.smoke else
                                                                  dict(hidden=512, layers=4, heads=8, kv_heads=4)))
        return str(target), str(make_noised_draft(target, work_dir / "draft", noise=0.02))
    for model in (args.target, args.draft):  # materialise random:<preset> folders once, before the actors race
        resolve_model(model)
    return args.target, args.draft


TRANSPORTS = ("auto", "object_store", "collective", "ray_collective")


def parse(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=sorted(DRAFTER_GPUS), required=True)
    p.add_argument("--tp", type=int, default=1, help="the target's tensor-parallel size (GPUs of its ranks)")
    p.add_argument("--m", type=int, required=True, help="the group's per-verify batch: closed runs have 2m x waves requests")
    p.add_argument("--batch", type=int, default=None, help="max_batch per replica (default m)")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas of the mode")
    p.add_argument("--ks", default="4", help="draft lengths, one row each (ar: ignored)")
    p.add_argument("--alphas", default="0.8", help="synthetic acceptance rates, one row each")
    p.add_argument("--acceptance", choices=["synthetic", "real"], default="synthetic",
                   help="real: the models' own acceptance (the trained default pair, else a noised small model)")
    p.add_argument("--waves", type=int, default=8, help="closed workload: waves x 2m requests")
    p.add_argument("--loads", default=None, help="online runs at these fractions of --capacity (or of this run's "
                   "closed-loop capacity)")
    p.add_argument("--capacity", type=float, default=None, help="closed-loop capacity (req/s) the loads scale")
    p.add_argument("--online-s", type=float, default=60.0, help="seconds of arrivals per load")
    p.add_argument("--online-only", action="store_true", help="no closed runs (needs --capacity)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of synthetic rows")
    p.add_argument("--target", default="random:llama-8b")
    p.add_argument("--draft", default="random:llama-1b")
    p.add_argument("--transport", default="auto", help="draft channel(s), comma-separated, of " + ", ".join(TRANSPORTS)
                   + "; several run the whole grid once each (a fresh engine per channel)")
    p.add_argument("--verifier-overlap", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--psd-high-load", choices=["auto", "psd", "seq"], default="auto")
    p.add_argument("--out", default=None, help="folder of psd_vs_sd.{parquet,md,png} (default bench/results; "
                   "smoke: /tmp/psd_vs_sd_smoke); rows of other configurations found there are kept")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny models, 2 fake GPUs: checks the script")
    args = p.parse_args(argv)
    if args.online_only and not (args.loads and args.capacity):
        p.error("--online-only needs --loads and --capacity")
    if unknown := set(args.transport.split(",")) - set(TRANSPORTS):
        p.error(f"unknown --transport {sorted(unknown)}; expected of {TRANSPORTS}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    import ray

    from minedraft_ray.runtime.transport import default_transport

    work_dir = Path(tempfile.mkdtemp(prefix="psdb-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    work = Workload(max_tokens=8, prompt_len=(8, 24), max_len=64, temperature=args.temperature) if args.smoke \
        else Workload(max_tokens=args.max_tokens, temperature=args.temperature)
    engine = {"transport": args.transport, "psd_high_load": args.psd_high_load}
    if args.verifier_overlap != "auto":
        engine["verifier_overlap"] = args.verifier_overlap == "on"
    if args.smoke:
        engine |= {"torch_threads": 1, "device": "cpu"}
    out = Path(args.out or ("/tmp/psd_vs_sd_smoke" if args.smoke else "bench/results"))
    context = {"git_sha": git_sha(), "command": command_line("bench.psd_vs_sd", argv), "device": machine_name(args.smoke),
               "verifier_overlap": args.verifier_overlap if args.verifier_overlap != "auto"
               else "off" if args.smoke else "on", "psd_high_load": args.psd_high_load}
    rows = read_rows(out / f"{NAME}.parquet")
    own_ray = not ray.is_initialized()
    if own_ray:
        extra = {"num_cpus": 4, "num_gpus": max(2, Spec(args.mode, 1, 0, None, args.replicas, tp=args.tp).n_gpus)} \
            if args.smoke else {}
        ray.init(address="local", include_dashboard=False, _temp_dir=str(work_dir / "ray"), log_to_driver=False, **extra)
    llms = []
    try:
        target, draft = model_pair(args, work_dir)
        real = args.acceptance == "real"
        work = Workload(work.max_tokens, work.prompt_len, work.max_len, 0.0) if real else work
        prompts = Prompts(target, work.prompt_len, real_text=real)
        models = target if args.mode == "ar" else f"{target} + {draft}"
        ks = [0] if args.mode == "ar" else [int(x) for x in args.ks.split(",")]
        alphas = [None] if real or args.mode == "ar" else [float(x) for x in args.alphas.split(",")]
        batch = args.batch or args.m
        for transport in args.transport.split(","):
            shutdown(llms)   # a fresh engine for each channel
            llms = []
            engine["transport"] = transport
            context["transport"] = transport if transport != "auto" else default_transport(on_gpu=not args.smoke)
            for alpha in alphas:
                for k in ks:
                    spec = Spec(args.mode, batch, k, alpha, args.replicas, args.acceptance, args.tp)
                    t0 = time.perf_counter()
                    if llms and hasattr(llms[0], "reconfigure"):  # same actors, models and graphs: a new k and alpha
                        for llm in llms:
                            llm.reconfigure(k=max(k, 1))
                            if synthetic(spec):
                                from minedraft_ray.testing.workers import set_synthetic_acceptance
                                set_synthetic_acceptance(llm, spec.alpha)
                    else:
                        shutdown(llms)
                        llms = build(spec, target, draft, work, engine)
                    warm_up(llms, spec, prompts, work)
                    ready = {"build_s": time.perf_counter() - t0}
                    new = []
                    if not args.online_only:
                        metrics = run_closed(llms, args.waves * 2 * args.m, prompts, work)
                        new.append(make_row(spec, args.m, "closed", metrics, work, models, context, **ready))
                    if args.loads:
                        capacity = args.capacity or new[0]["n_requests"] / new[0]["run_s"]
                        for load in (float(x) for x in args.loads.split(",")):
                            arrivals = poisson_arrivals(load * capacity, args.online_s, seed=round(load * 1000))
                            drain = 10.0 if args.smoke else min(30.0, max(5.0, args.online_s / 2))
                            metrics = asyncio.run(run_online(llms, arrivals, prompts, work, f"{spec.label} {load:.0%}",
                                                             drain))
                            new.append(make_row(spec, args.m, "online", metrics, work, models, context,
                                                rate_rps=load * capacity, load=load, duration_s=args.online_s, **ready))
                    for row in new:
                        say(f"{row['mode']} {row['transport']} {row['workload']} m={row['m']} b={row['batch']} "
                            f"k={row['k']} "
                            f"alpha={row['alpha']} load={row.get('load')}: {fmt(row['tokens_per_s'])} tok/s, step "
                            f"{fmt(row.get('step_ms'))} ms, busy {fmt(row.get('verifier_busy'))}, overhead "
                            f"{fmt(row.get('ray_overhead_ms'))} ms, p99 {fmt(row.get('lat_p99_s'))} s")
                    rows = merge(rows, new)
                    write(out, rows)  # after every configuration: a device call cut short keeps what it measured
    finally:
        shutdown(llms)
        if own_ray:
            ray.shutdown()
        shutil.rmtree(work_dir, ignore_errors=True)
    try:
        from bench.plot import plot_psd_vs_sd

        plot_psd_vs_sd(out / f"{NAME}.parquet", out / f"{NAME}.png")
    except ImportError:  # no matplotlib on the GPU machine: plot later with python -m bench.plot
        pass
    say(f"wrote {out / NAME}.{{parquet,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
