"""PSD against standard speculative decoding and plain decoding on one machine with two GPUs.

Closed workload (as the paper's): 8 x 2m requests submitted at once, 128 output tokens each (ignore_eos),
random-token prompts of 128..256 tokens, one fixed seed per request (its index), so the synthetic acceptance
draws are the same in every mode. m in {64, 16}, synthetic acceptance alpha in {0.8, 0.6}, k from 1 until
the drafting time exceeds the verify time (at least up to 5). Baselines at their best k and at batch m, 2m
and 4m: `sd` (drafter and target on one GPU), `ar` (target only), `sd_split` (psd's placement without the
overlap). Single-GPU configurations run two at a time, one per GPU.

Part 2: the same closed workload and Poisson arrivals at 30/60/90 % of psd's closed-loop capacity, m = 64,
each mode at its best k: psd on both GPUs against sd_split on the same two GPUs (psd must not be slower at
low load: the P50/P99 <= 1.05x target) and against two data-parallel replicas of `sd` and of `ar` (requests
go to the replica with fewer in flight), and a model pair with real acceptance.

    python -m bench.psd_vs_sd --part 1      # closed workloads (fits one 9-minute command on 2 x H200)
    python -m bench.psd_vs_sd --part 2      # online, data-parallel baselines, real acceptance
    python -m bench.psd_vs_sd --smoke       # both parts on the CPU: tiny models, fake GPUs, seconds
    python -m bench.plot bench/results/psd_vs_sd.parquet

Each part stops starting configurations before --budget-s, runs fewer requests when its plan would not fit
(recorded in n_requests), and rewrites <out>/psd_vs_sd.{parquet,md} after every configuration. Rows of the
other part found in --prior files are kept, so the two parts merge into one result.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from bench.common import command_line, device_name, fmt, git_sha, markdown_table, progress, say

NAME = "psd_vs_sd"
COLUMNS = ["mode", "workload", "rate_rps", "m", "k", "alpha", "acceptance", "n_gpus", "tokens_per_s",
           "tokens_per_s_per_gpu", "makespan_per_req_s", "lat_mean_s", "lat_p50_s", "lat_p99_s", "ttft_mean_s",
           "ttft_p99_s", "t_draft_ms", "t_verify_ms", "step_ms", "verifier_busy", "ray_overhead_ms", "transport",
           "git_sha", "command", "device"]
# what ran, beyond the required columns: enough to tell scaled-down or partial configurations apart
EXTRA_COLUMNS = ["part", "status", "note", "alpha_group", "batch", "replicas", "in_flight", "n_requests", "completed",
                 "max_tokens", "prompt_len", "temperature", "load", "duration_s", "acceptance_rate",
                 "acceptance_length", "steady_steps", "prefill_share", "seq_share", "cadence_psd_ms", "cadence_seq_ms",
                 "ms_per_row_psd", "ms_per_row_seq",
                 "launch_gap_ms", "verifier_overlap", "psd_high_load", "build_s", "run_s", "models"]
STRINGS = {"mode", "workload", "acceptance", "transport", "git_sha", "command", "device", "status", "note",
           "prompt_len", "models", "verifier_overlap", "psd_high_load"}
INTS = {"m", "k", "n_gpus", "part", "batch", "replicas", "in_flight", "n_requests", "completed", "max_tokens",
        "steady_steps"}
TABLE_COLUMNS = ["part", "mode", "m", "batch", "k", "alpha", "n_gpus", "in_flight", "n_requests", "tokens_per_s",
                 "tokens_per_s_per_gpu", "makespan_per_req_s", "lat_p50_s", "lat_p99_s", "ttft_p99_s", "t_draft_ms",
                 "t_verify_ms", "step_ms", "verifier_busy", "ray_overhead_ms", "acceptance_length"]
ONLINE_TABLE_COLUMNS = ["mode", "load", "rate_rps", "k", "n_gpus", "n_requests", "completed", "tokens_per_s",
                        "lat_mean_s", "lat_p50_s", "lat_p99_s", "ttft_mean_s", "ttft_p99_s", "step_ms",
                        "verifier_busy", "ray_overhead_ms", "prefill_share", "seq_share", "cadence_psd_ms",
                        "cadence_seq_ms", "ms_per_row_psd", "ms_per_row_seq"]
GPUS_PER_REPLICA = {"psd": 2, "sd_split": 2, "sd": 1, "ar": 1}
MAIN_REGIME = {"psd": "psd", "sd_split": "seq", "sd": "sd", "ar": "ar"}
EDGE_FRACTION = 0.05  # steps dropped at each end of a run before steady-state statistics


# ---- settings ---------------------------------------------------------------------------------
@dataclass
class Setup:
    """Everything that differs between the GPU run and --smoke."""
    smoke: bool
    models: dict[str, tuple[str, str]]  # acceptance kind -> (target, draft)
    ms: list[int]
    alphas: list[float]
    k_min: int                 # the k sweep runs at least to this k ...
    k_max: int                 # ... and stops past it once drafting outlasts verifying, or here
    max_waves: int = 8         # closed workload: waves x 2m requests
    min_waves: int = 2         # fewer for everything planned: each group gets what fits it alone ...
    first_group_waves: int = 4  # ... the first at most this many, so the others get some time too
    max_tokens: int = 128
    prompt_len: tuple[int, int] = (128, 256)
    max_len: int = 512
    temperature: float = 1.0   # the paper's; real-acceptance rows are greedy (how the pair is evaluated)
    real_k: int = 4
    loads: tuple[float, ...] = (0.3, 0.6, 0.9)
    online_s: tuple[float, float] = (20.0, 60.0)   # shortest and longest arrival window
    build_prior_s: float = 20.0
    warm_prior_s: float = 5.0
    tokps_prior: dict = field(default_factory=lambda: {"psd": 8000.0, "sd": 5500.0, "sd_split": 4500.0, "ar": 5000.0})
    tokps_batch: int = 64      # batch the priors are for; others scale as (batch / this) ** 0.7
    margin_s: float = 25.0     # kept free at the end: writing, shutting down
    engine: dict = field(default_factory=dict)
    pairs: bool = True         # run two single-GPU configurations at once, one per GPU
    transport: str = "auto"
    batch_mults: tuple[int, ...] = (1, 2, 4)   # baseline batches, in units of m
    split_ablation: bool = True                # sd_split at psd's best k
    real_modes: tuple[str, ...] = ("psd", "sd")
    dp_modes: tuple[str, ...] = ("sd", "ar")   # part 2: two replicas of each against psd
    split_online: bool = True                  # part 2: sd_split (psd's GPUs, no overlap) online too: low load
    extras: bool = True                        # part 2: one sd replica online too, if time is left


def gpu_setup(args) -> Setup:
    from minedraft_ray.engine.presets import resolve_model

    for model in (args.target, args.draft):  # materialise random:<preset> folders once, before any actor races
        resolve_model(model)
    return Setup(smoke=False, models={"synthetic": (args.target, args.draft)},  # "real" is built by part 2
                 ms=[int(x) for x in args.ms.split(",")], alphas=[float(x) for x in args.alphas.split(",")],
                 k_min=min(5, args.k_max), k_max=args.k_max, batch_mults=tuple(int(x) for x in args.batch_mults.split(",")),
                 transport=args.transport, pairs=not args.no_pairs, temperature=args.temperature)


def smoke_setup(args, work: Path) -> Setup:
    from minedraft_ray.testing.tiny import make_noised_draft, make_tiny_model

    target = make_tiny_model(work / "target", "llama")
    draft = make_noised_draft(target, work / "draft", noise=0.02)
    return Setup(smoke=True, models={"synthetic": (str(target), str(draft)), "real": (str(target), str(draft))},
                 ms=[2], alphas=[0.8], k_min=1, k_max=1, max_waves=2, min_waves=1, max_tokens=8, prompt_len=(8, 24), max_len=64,
                 real_k=2, online_s=(0.5, 0.5), build_prior_s=6.0, warm_prior_s=1.0, batch_mults=(1,),
                 split_ablation=False, real_modes=("sd",), dp_modes=("sd",), extras=False,
                 tokps_prior={"psd": 100.0, "sd": 100.0, "sd_split": 100.0, "ar": 100.0}, tokps_batch=2,
                 margin_s=5.0, engine={"torch_threads": 1, "device": "cpu"}, transport=args.transport,
                 pairs=not args.no_pairs)


def real_pair(choice: str) -> tuple[str, str]:
    """The trained default pair when installed, else a noised copy of a small random model built here."""
    from minedraft_ray.config import default_draft, default_target

    if choice in ("auto", "assets") and Path(default_target(), "config.json").is_file() \
            and Path(default_draft(), "config.json").is_file():
        return default_target(), default_draft()
    if choice == "assets":
        raise FileNotFoundError(f"--real-pair assets: {default_target()} is not installed")
    from minedraft_ray.testing.tiny import make_noised_draft, make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="psdb-pair-"))
    target = make_tiny_model(root / "target", "llama", hidden=512, layers=4, heads=8, kv_heads=4)
    return str(target), str(make_noised_draft(target, root / "draft", noise=0.02))


# ---- engines ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One engine configuration; `replicas` > 1 = that many independent LLMs (data parallel)."""
    mode: str                  # psd | sd | sd_split | ar
    batch: int                 # max_batch of each replica
    k: int                     # 0 for ar
    alpha: float | None        # synthetic acceptance; None: what the models give
    replicas: int = 1
    acceptance: str = "synthetic"

    @property
    def label(self) -> str:
        return self.mode if self.replicas == 1 else f"{self.mode}_dp{self.replicas}"

    @property
    def n_gpus(self) -> int:
        return GPUS_PER_REPLICA[self.mode] * self.replicas

    @property
    def in_flight(self) -> int:
        return (2 if self.mode == "psd" else 1) * self.batch * self.replicas


def has_bench_hook() -> bool:
    """Whether the runtime offers the synthetic-acceptance workers (minedraft_ray.testing.workers)."""
    try:
        from minedraft_ray.testing.workers import synthetic_acceptance  # noqa: F401
    except ImportError:
        return False
    return True


class Engines:
    """The LLMs alive now. A configuration already up is reused; one that differs only in k and alpha is
    retuned in place when the runtime offers `LLM.reconfigure` (no new actors, models or graphs); the rest
    are shut down before anything new is built."""

    def __init__(self, setup: Setup, prompts: Callable[[str], Prompts]):
        from minedraft_ray.runtime import LLM

        self.setup, self.prompts = setup, prompts
        self.alive: dict[Spec, list] = {}
        self.synthetic = has_bench_hook()
        self.retunable = hasattr(LLM, "reconfigure")

    def acquire(self, specs: list[Spec]) -> tuple[dict[Spec, list], float, bool]:
        """-> ({spec: [LLM per replica]}, seconds spent getting them ready, whether any was built)."""
        t0 = time.perf_counter()
        ready = {s: self.alive.pop(s) for s in specs if s in self.alive}
        retune = []
        for spec in [s for s in specs if s not in ready and self.retunable]:
            match = next((a for a in self.alive if family(a) == family(spec)), None)
            if match is not None:
                ready[spec] = self.alive.pop(match)
                retune += [(spec, llm) for llm in ready[spec]]
        self.close()
        self.alive = ready
        todo = [s for s in specs if s not in ready for _ in range(s.replicas)]
        if todo or retune:
            with ThreadPoolExecutor(len(todo) + len(retune)) as pool:
                built = list(pool.map(self._build, todo))
                list(pool.map(lambda job: self._retune(*job), retune))
            for spec, llm in zip(todo, built):
                self.alive.setdefault(spec, []).append(llm)
        ready_s = time.perf_counter() - t0 if todo or retune else 0.0
        return {s: self.alive[s] for s in specs}, ready_s, bool(todo)

    def _settings(self, spec: Spec) -> dict:
        if spec.acceptance == "synthetic" and self.synthetic and spec.mode != "ar":
            from minedraft_ray.testing.workers import synthetic_acceptance
            return {"_workers": synthetic_acceptance(spec.alpha)}
        return {}

    def _build(self, spec: Spec):
        from minedraft_ray.runtime import LLM

        target, draft = self.setup.models[spec.acceptance]
        llm = LLM(target, None if spec.mode == "ar" else draft, mode=spec.mode, k=max(spec.k, 1),
                  max_batch=spec.batch, max_len=self.setup.max_len, transport=self.setup.transport,
                  max_queued=1_000_000, step_timeout_s=120.0, **self.setup.engine, **self._settings(spec))
        warm_up(llm, spec, self.setup, self.prompts(spec.acceptance))
        return llm

    def _retune(self, spec: Spec, llm) -> None:
        llm.reconfigure(k=max(spec.k, 1))
        if self._settings(spec):
            from minedraft_ray.testing.workers import set_synthetic_acceptance
            set_synthetic_acceptance(llm, spec.alpha)
        warm_up(llm, spec, self.setup, self.prompts(spec.acceptance))  # graphs for the new verify width

    def release(self, spec: Spec) -> None:
        for llm in self.alive.pop(spec, []):
            try:
                llm.shutdown()
            except Exception as e:  # a dead engine must not stop the benchmark
                say(f"shutdown of {spec.label} failed: {e!r}")

    def close(self) -> None:
        for spec in list(self.alive):
            self.release(spec)


def family(spec: Spec) -> tuple:
    """What needs new actors to change; k and alpha do not (with LLM.reconfigure)."""
    return spec.mode, spec.batch, spec.replicas, spec.acceptance


# ---- workloads ----------------------------------------------------------------------------------
class Prompts:
    """Request i gets the same prompt (and seed i) in every mode and part: random token ids, or windows of
    real text where acceptance is the models' own."""

    def __init__(self, setup: Setup, kind: str):
        self.lo, self.hi = setup.prompt_len
        target = setup.models[kind][0]
        self.vocab = min(vocab_size(target), 32000)
        self.text_ids = text_token_ids(target, self.hi * 400) if kind == "real" else None

    def __call__(self, i: int) -> list[int]:
        rng = random.Random(i)
        n = rng.randint(self.lo, self.hi)
        if self.text_ids is None:
            return [rng.randrange(16, self.vocab) for _ in range(n)]
        start = rng.randrange(len(self.text_ids) - n)
        return self.text_ids[start:start + n]


def vocab_size(target: str) -> int:
    from minedraft_ray.engine.model import ModelConfig
    from minedraft_ray.engine.presets import resolve_model

    return ModelConfig.from_pretrained(resolve_model(target)).vocab_size


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


def temperature_of(spec: Spec, setup: Setup) -> float:
    return 0.0 if spec.acceptance == "real" else setup.temperature


def warm_up(llm, spec: Spec, setup: Setup, prompts: Prompts) -> None:
    """Capture the CUDA graphs a run meets: a full batch of short requests finishing at different steps, so
    the batch shrinks through the smaller buckets too."""
    n = spec.in_flight // spec.replicas
    ids = range(10**6, 10**6 + n)  # seeds apart from the measured requests'
    llm.generate([prompts(i) for i in ids],
                 [sampling(i, max(2, setup.max_tokens * (1 + i % 4) // 16), temperature_of(spec, setup)) for i in ids])


def percentile(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def mean(values) -> float | None:
    return float(np.mean(values)) if len(values) else None


def steady_stats(histories: list[list], mode: str) -> dict:
    """Per-step medians over the steady state of each replica's run: the first and last 5 % of steps, steps
    of another regime (psd's sequential fallback) and steps that admitted requests (their prefill time is
    not in t_verify_ms) are left out. A psd run that was mostly sequential (its low-load regime, regime.py) is
    measured on those steps, as sd_split's are: its split steps, if any, are the exceptions then."""
    steps, busy = [], []
    # share of the verifier's wall time spent prefilling, over the whole run (online: the arrivals' cost)
    every = [r for history in histories for r in history]
    wall = sum(r.step_ms for r in every)
    prefill_share = sum(r.t_prefill_ms for r in every) / wall if wall else None
    # psd: share of verify steps run as one sequential batch (the low-load regime choice, regime.py)
    seq_share = sum(r.regime == "seq" for r in every) / len(every) if every and mode == "psd" else None
    # a request's period (ms between two verify ends of its batch) in each regime: what the choice compares
    regimes = {f"cadence_{regime}_ms": [r.cadence_ms for r in every if r.regime == regime and r.cadence_ms]
               for regime in ("psd", "seq")}
    # under a queue: the verifier's time per row in each regime, what psd_high_load=auto compares
    regimes |= {f"ms_per_row_{regime}": [r.ms_per_row for r in every if r.verified and r.regime == regime
                                         and r.extra.get("high_load") == regime] for regime in ("psd", "seq")}
    shares = {"prefill_share": prefill_share, "seq_share": seq_share,
              **{name: float(np.median(v)) if v else None for name, v in regimes.items()}}
    main = "seq" if seq_share is not None and seq_share > 0.5 else MAIN_REGIME[mode]
    for history in histories:
        cut = int(len(history) * EDGE_FRACTION)
        kept = [r for r in history[cut:len(history) - cut] if r.regime == main and not r.admitted]
        if kept:
            busy.append(sum(r.t_verify_ms for r in kept) / sum(r.step_ms for r in kept))
        steps += kept
    if not steps:
        return {"steady_steps": 0, **shares}
    sequential = main != "psd"  # sd, sd_split, psd's seq: draft then verify; ar: verify only
    critical = [r.t_draft_ms + r.t_verify_ms if sequential else max(r.t_draft_ms, r.t_verify_ms) for r in steps]
    return {"t_draft_ms": float(np.median([r.t_draft_ms for r in steps])) if mode != "ar" else None,
            "t_verify_ms": float(np.median([r.t_verify_ms for r in steps])),
            "step_ms": float(np.median([r.step_ms for r in steps])),
            "verifier_busy": float(np.mean(busy)),
            "ray_overhead_ms": float(np.median([r.step_ms - c for r, c in zip(steps, critical)])),
            "launch_gap_ms": float(np.median([r.launch_gap_ms for r in steps])),
            "steady_steps": len(steps), **shares}


def acceptance_stats(stats: list[dict]) -> dict:
    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    verify_steps = sum(s["verify_steps"] for s in stats)
    return {"acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_length": 1 + accepted / verify_steps if verify_steps else None}


def run_closed(llms: list, n: int, prompts: Prompts, max_tokens: int, temperature: float) -> dict:
    """n requests submitted at once, request i to replica i % replicas."""
    replicas = len(llms)
    starts = [len(llm.history()) for llm in llms]

    def one(r):
        ids = list(range(r, n, replicas))
        outs = llms[r].generate([prompts(i) for i in ids], [sampling(i, max_tokens, temperature) for i in ids])
        return outs, time.perf_counter()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(replicas) as pool:
        results = list(pool.map(one, range(replicas)))
    makespan = max(end for _, end in results) - t0
    outs = [o for out, _ in results for o in out]
    histories = [llm.history()[s:] for llm, s in zip(llms, starts)]
    tokens = sum(len(o.token_ids) for o in outs)
    lat = [o.stats["latency"] for o in outs]
    ttft = [o.stats["ttft"] for o in outs]
    return {"tokens_per_s": tokens / makespan, "makespan_per_req_s": makespan / n, "lat_mean_s": mean(lat),
            "lat_p50_s": percentile(lat, 50), "lat_p99_s": percentile(lat, 99), "ttft_mean_s": mean(ttft),
            "ttft_p99_s": percentile(ttft, 99), "n_requests": n, "completed": len(outs), "run_s": makespan,
            "_histories": histories, **acceptance_stats([o.stats for o in outs])}


def poisson_arrivals(rate: float, duration: float, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    times, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t > duration:
            return times or [duration / 2]   # at least one request (a short window at a low rate may have none)
        times.append(t)


async def run_online(llms: list, arrivals: list[float], prompts: Prompts, max_tokens: int, temperature: float,
                     tag: str, drain_s: float) -> dict:
    """Open loop: request i arrives at arrivals[i] and goes to the replica with the fewest in flight.
    TTFT and latency are seen by this client and counted from the scheduled arrival."""
    in_flight = [0] * len(llms)
    starts = [len(llm.history()) for llm in llms]
    bar = progress(None, f"{tag}", total=len(arrivals))
    t0 = time.perf_counter() + 0.05
    where: dict[str, int] = {}
    open_ids: set[str] = set()

    async def one(i: int, at: float):
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        r = int(np.argmin(in_flight))
        in_flight[r] += 1
        rid = f"{tag}-{i}"
        where[rid] = r
        open_ids.add(rid)
        first, tokens, stats = None, 0, None
        try:
            async for out in llms[r].stream(prompts(i), sampling(i, max_tokens, temperature), rid):
                if out.new_token_ids and first is None:
                    first = time.perf_counter()
                tokens += len(out.new_token_ids)
                if out.finished:
                    stats = out.stats
                    open_ids.discard(rid)
        finally:
            in_flight[r] -= 1
            bar.update()
        end = time.perf_counter()
        return first - (t0 + at), end - (t0 + at), tokens, end, stats

    tasks = [asyncio.ensure_future(one(i, at)) for i, at in enumerate(arrivals)]
    done, pending = await asyncio.wait(tasks, timeout=(arrivals[-1] if arrivals else 0) + drain_s)
    for task in pending:
        task.cancel()
    for rid in list(open_ids):  # still running after the drain: free the engine for the next run
        await asyncio.to_thread(llms[where[rid]].abort, rid)
    bar.close()
    results = [t.result() for t in done if not t.cancelled() and t.exception() is None]
    histories = [llm.history()[s:] for llm, s in zip(llms, starts)]
    span = max((r[3] for r in results), default=t0) - t0
    ttft, lat = [r[0] for r in results], [r[1] for r in results]
    tokens = sum(r[2] for r in results)
    errors = sum(1 for t in done if not t.cancelled() and t.exception() is not None)
    note = []
    if pending or errors:
        note.append(f"{len(pending)} unfinished after a {drain_s:.0f} s drain, {errors} failed: latencies cover "
                    "completed requests only (overload)")
    return {"tokens_per_s": tokens / span if span > 0 else None, "makespan_per_req_s": span / len(results)
            if results else None, "lat_mean_s": mean(lat), "lat_p50_s": percentile(lat, 50),
            "lat_p99_s": percentile(lat, 99), "ttft_mean_s": mean(ttft), "ttft_p99_s": percentile(ttft, 99),
            "n_requests": len(arrivals), "completed": len(results), "run_s": span, "_histories": histories,
            "_note": "; ".join(note), **acceptance_stats([r[4] for r in results if r[4]])}


# ---- time budget --------------------------------------------------------------------------------
class Budget:
    """Wall-clock deadline and running estimates of build, warm-up and throughput."""

    def __init__(self, setup: Setup, start: float, budget_s: float, engines: Engines):
        self.setup, self.engines = setup, engines
        self.deadline = start + budget_s
        self.build_s: dict[str, float] = {}
        self.retune_s = setup.warm_prior_s
        self.tokps: dict[tuple[str, int], float] = {}  # (mode, batch) -> tokens/s of one replica

    def left(self) -> float:
        """Seconds a configuration may still take."""
        return self.deadline - time.perf_counter() - self.setup.margin_s

    def hard_left(self) -> float:
        """Seconds until a running configuration is stopped: the margin, then half as much again."""
        return self.deadline + self.setup.margin_s / 2 - time.perf_counter()

    def learn(self, spec: Spec, ready_s: float, built: bool, tokens_per_s: float | None) -> None:
        if built:
            self.build_s[spec.mode] = max(ready_s, self.build_s.get(spec.mode, 0.0))
        elif ready_s:
            self.retune_s = ready_s
        if tokens_per_s:
            self.tokps[(spec.mode, spec.batch)] = tokens_per_s / spec.replicas

    def est_build(self, spec: Spec, families: set | None = None) -> float:
        """Seconds to get `spec` ready: 0 if up, a retune if its family is (`families`: the ones that will be)."""
        alive = list(self.engines.alive)
        if spec in alive:
            return 0.0
        if self.engines.retunable and family(spec) in ({family(a) for a in alive} if families is None else families):
            return self.retune_s
        return self.build_s.get(spec.mode, max(self.build_s.values(), default=self.setup.build_prior_s))

    def est_tokps(self, spec: Spec) -> float:
        same = [(b, v) for (mode, b), v in self.tokps.items() if mode == spec.mode]
        b, v = min(same, key=lambda bv: abs(math.log(bv[0] / spec.batch))) if same else \
            (self.setup.tokps_batch, self.setup.tokps_prior[spec.mode])
        return v * (spec.batch / b) ** 0.7 * spec.replicas

    def est_run(self, spec: Spec, n_requests: int) -> float:
        return n_requests * self.setup.max_tokens / self.est_tokps(spec)

    def est_job(self, spec: Spec, n_requests: int) -> float:
        return self.est_build(spec) + self.est_run(spec, n_requests)

    def fit_waves(self, pending: list[tuple[Spec, int]], reserve_s: float = 0.0, share: float = 1.0) -> int:
        """Waves (of 2m requests each) that let every pending (spec, m) job finish in time; single-GPU jobs
        count `share` of their time (they run two at a time)."""
        weight = lambda s: share if s.n_gpus == 1 else 1.0
        families = {family(a) for a in self.engines.alive}
        fixed = 0.0
        for s, _ in pending:
            fixed += weight(s) * self.est_build(s, families)
            families.add(family(s))
        per_wave = sum(weight(s) * self.est_run(s, 2 * m) for s, m in pending)
        if per_wave <= 0:
            return self.setup.max_waves
        return int(min(self.setup.max_waves, max(1, (self.left() - reserve_s - fixed) // per_wave)))

    def affordable_waves(self, spec: Spec, m: int, waves: int) -> int:
        """The most waves up to `waves` that end before the deadline; 0: not even one."""
        while waves >= 1 and self.est_job(spec, waves * 2 * m) > self.left():
            waves //= 2
        return waves


# ---- results ------------------------------------------------------------------------------------
def row_config(row: dict) -> tuple:
    """What a row measured: rows with equal configurations replace one another (a rerun, a merge)."""
    return tuple(row.get(c) for c in ("mode", "workload", "m", "batch", "k", "replicas", "alpha_group", "load",
                                      "acceptance"))


class Results:
    def __init__(self, out_dir: Path, priors: list[Path], parts: set[int], context: dict, resume: bool = False):
        self.out_dir, self.context = out_dir, context
        self.rows: list[dict] = []
        self.earlier: list[dict] = []   # prior rows of the parts run again: not written again, but looked up
        seen = set()
        for path in priors:
            if path.is_file() and path.resolve() not in seen:
                seen.add(path.resolve())
                import pyarrow.parquet as pq

                for r in pq.read_table(path).to_pylist():
                    if r.get("device") != context["device"]:
                        continue
                    if r.get("part") not in parts or (resume and r.get("status") == "ok"):
                        self.rows.append(r)
                    elif r.get("status") == "ok":
                        self.earlier.append(r)
        self.prior_count = len(self.rows)

    def add(self, row: dict) -> dict:
        row = {**self.context, **{k: v for k, v in row.items() if not k.startswith("_")}}
        self.rows.append(row)
        self.save()
        return row

    def find(self, earlier: bool = False, **where) -> list[dict]:
        """Rows of this run and the kept prior ones; with earlier=True also the prior rows of the parts run
        again (e.g. part 2's closed psd row, for the arrival rates of a part 2 that runs only online), where
        this run has no row of the same configuration."""
        def match(rows):
            return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in where.items())]
        rows = match(self.rows)
        if earlier:
            have = {row_config(r) for r in rows}
            rows += [r for r in match(self.earlier) if row_config(r) not in have]
        return rows

    def best_k(self, mode: str, m: int, alpha_group: float | None, default: int) -> int:
        """k of the highest closed-workload throughput of `mode` at batch m (one replica), else `default`."""
        rows = self.find(mode=mode, m=m, batch=m, replicas=1, workload="closed", alpha_group=alpha_group,
                         earlier=True)
        return max(rows, key=lambda r: r["tokens_per_s"])["k"] if rows else default

    def save(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.out_dir.mkdir(parents=True, exist_ok=True)
        columns = COLUMNS + EXTRA_COLUMNS
        schema = pa.schema([(c, pa.string() if c in STRINGS else pa.int64() if c in INTS else pa.float64())
                            for c in columns])
        table = pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in self.rows], schema=schema)
        pq.write_table(table, self.out_dir / f"{NAME}.parquet")
        (self.out_dir / f"{NAME}.md").write_text(report(self.rows))


# ---- the two parts ------------------------------------------------------------------------------
def crossover_k(rows: dict[int, dict], k_max: int) -> int:
    """The k where a line through the measured draft times meets one through the verify times, in 3..k_max."""
    ks = sorted(rows)
    draft = np.polyfit(ks, [rows[k]["t_draft_ms"] for k in ks], 1)
    verify = np.polyfit(ks, [rows[k]["t_verify_ms"] for k in ks], 1)
    slope = draft[0] - verify[0]
    k = (verify[1] - draft[1]) / slope if slope > 0 else k_max
    return int(min(k_max, max(3, round(k))))


@dataclass
class Job:
    """A closed-workload configuration of part 1; `resolve` decides it once earlier results are in."""
    group: tuple[int, float]          # (m, alpha) it is compared within
    tier: int                         # 0: what the targets need; 1: the rest, if time is left
    estimate: Spec                    # for the budget before resolve can run
    resolve: Callable[[], Spec | None]
    barrier: bool = False             # resolves from results of the jobs before it: never starts alongside them


class Bench:
    def __init__(self, setup: Setup, args, results: Results):
        self.setup, self.args, self.results = setup, args, results
        self._prompts: dict[str, Prompts] = {}
        self.engines = Engines(setup, self.prompts)
        self.budget: Budget | None = None
        self.part = 0

    def prompts(self, kind: str) -> Prompts:
        if kind not in self._prompts:
            self._prompts[kind] = Prompts(self.setup, kind)
        return self._prompts[kind]

    # -- rows
    def record(self, spec: Spec, m: int, workload: str, metrics: dict | None = None, status: str = "ok",
               note: str = "", **extra) -> dict:
        metrics = dict(metrics or {})
        steady = steady_stats(metrics.pop("_histories"), spec.mode) if "_histories" in metrics else {}
        notes = [note, metrics.pop("_note", "")]
        real = spec.acceptance == "real" or not self.engines.synthetic
        if spec.acceptance == "synthetic" and real and spec.mode != "ar":
            notes.append(f"runtime has no _bench hook: acceptance is the models', not alpha={spec.alpha}")
        target, draft = self.setup.models[spec.acceptance]
        tokps = metrics.get("tokens_per_s")
        row = {"mode": spec.label, "workload": workload, "m": m, "k": spec.k, "batch": spec.batch,
               "replicas": spec.replicas, "in_flight": spec.in_flight, "n_gpus": spec.n_gpus,
               "alpha": None if spec.mode == "ar" else metrics.get("acceptance_rate") if real else spec.alpha,
               "alpha_group": spec.alpha if spec.acceptance == "synthetic" else None,
               "acceptance": None if spec.mode == "ar" else "real" if real else "synthetic",
               "tokens_per_s_per_gpu": tokps / spec.n_gpus if tokps else None, "status": status,
               "note": "; ".join(n for n in notes if n), "part": self.part, "max_tokens": self.setup.max_tokens,
               "prompt_len": "{}..{}".format(*self.setup.prompt_len), "temperature": temperature_of(spec, self.setup),
               "models": target if spec.mode == "ar" else f"{target} + {draft}", **metrics, **steady, **extra}
        row = self.results.add(row)
        what = f"{spec.label} {workload} m={m} b={spec.batch} k={spec.k} alpha={spec.alpha}" + \
            (f" {extra['rate_rps']:.2f} req/s" if extra.get("rate_rps") else "")
        if status == "ok":
            say(f"[{self.budget.left() + self.setup.margin_s:4.0f} s left] {what}: {fmt(tokps)} tok/s, step "
                f"{fmt(row.get('step_ms'))} ms (draft {fmt(row.get('t_draft_ms'))}, verify "
                f"{fmt(row.get('t_verify_ms'))}), busy {fmt(row.get('verifier_busy'))}, overhead "
                f"{fmt(row.get('ray_overhead_ms'))} ms, p99 {fmt(row.get('lat_p99_s'))} s, "
                f"{row.get('n_requests')} requests")
        else:
            say(f"{status}: {what}: {row['note']}")
        return row

    def closed(self, specs: list[Spec], m: int, waves: list[int], note: str = "") -> list[dict]:
        """Build (or reuse) the engines and run the closed workload on each spec at once."""
        try:
            llms, ready_s, built = self.engines.acquire(specs)
        except Exception as e:
            self.engines.close()
            return [self.record(s, m, "closed", status="failed", note=f"build: {e!r}"[:500]) for s in specs]

        def one(spec, w):
            return run_closed(llms[spec], w * 2 * m, self.prompts(spec.acceptance), self.setup.max_tokens,
                              temperature_of(spec, self.setup))

        pool = ThreadPoolExecutor(len(specs))
        futures = [pool.submit(one, s, w) for s, w in zip(specs, waves)]
        rows = []
        for spec, w, future in zip(specs, waves, futures):
            try:  # past the hard limit the engine is shut down, which ends its run
                metrics = future.result(timeout=max(1.0, self.budget.hard_left()))
            except Exception as e:
                self.engines.release(spec)
                why = "hard time limit" if isinstance(e, TimeoutError) else f"run: {e!r}"[:500]
                rows.append(self.record(spec, m, "closed", status="failed", note=why))
                continue
            self.budget.learn(spec, ready_s, built, metrics["tokens_per_s"])
            scaled = f"scaled to {w} x 2m requests to fit the time budget" if w < self.setup.max_waves else ""
            rows.append(self.record(spec, m, "closed", metrics, note="; ".join(n for n in (note, scaled) if n),
                                    build_s=ready_s or None))
        pool.shutdown(wait=True)
        return rows

    # -- part 1: closed workloads
    def plan_part1(self) -> list[Job]:
        setup, res = self.setup, self.results
        jobs = []
        for index, (m, a) in enumerate(self.groups()):
            tier = 0 if index == 0 else 1
            ks = range(1, setup.k_max + 1)
            jobs += [Job((m, a), tier, Spec("psd", m, k, a), lambda m=m, a=a: self._psd_next(m, a)) for k in ks]
            jobs += [Job((m, a), tier, Spec("sd", m, k, a), lambda i=i, m=m, a=a: self._sd_sweep(m, a, i))
                     for i, k in enumerate(ks)]
            # baselines at batch m, 2m, 4m and their best k; ar does not depend on alpha: once per m
            batches = [x * m for x in setup.batch_mults]
            ar = [Job((m, a), tier, Spec("ar", b, 0, None), lambda b=b: Spec("ar", b, 0, None))
                  for b in batches] if a == setup.alphas[0] else []
            # sd at b = m is its k sweep above; a list without m (--batch-mults 4) still gets its other batches
            sd = [Job((m, a), tier, Spec("sd", b, setup.real_k, a),
                      lambda b=b, m=m, a=a: Spec("sd", b, res.best_k("sd", m, a, setup.real_k), a), barrier=True)
                  for b in batches if b != m]
            jobs += ar[:1]  # pairs with the sweep's last sd run; each sd job below needs the whole sweep
            for i, job in enumerate(sd):
                jobs += [job] + ar[i + 1:i + 2]
            if index == 0 and setup.split_ablation:  # psd's placement without the overlap: what it buys
                jobs.append(Job((m, a), tier, Spec("sd_split", m, setup.real_k, a), barrier=True,
                                resolve=lambda m=m, a=a: Spec("sd_split", m, res.best_k("psd", m, a, setup.real_k), a)))
        return jobs

    def groups(self) -> list[tuple[int, float]]:
        """(m, alpha) in priority order: the targets' configuration, the other m at the same alpha, the rest."""
        a0 = self.setup.alphas[0]
        return [(m, a0) for m in self.setup.ms] + [(m, a) for a in self.setup.alphas[1:] for m in self.setup.ms]

    def _psd_rows(self, m: int, a: float, ok: bool) -> list[dict]:
        rows = [r for r in self.results.rows if r.get("part") == 1 and r["mode"] == "psd" and r["m"] == m
                and r["batch"] == m and r.get("alpha_group") == a and r["workload"] == "closed"]
        return [r for r in rows if r["status"] == "ok"] if ok else rows

    def _psd_next(self, m: int, a: float) -> Spec | None:
        """psd's k sweep: k = 1, 2, then the k where drafting is predicted to take as long as verifying
        (the one the targets need, so it runs early), then the rest upwards to the first k >= k_min whose
        drafting outlasts its verifying, or k_max."""
        tried = {r["k"] for r in self._psd_rows(m, a, ok=False)}
        if self.args.psd_ks:  # an explicit sweep (e.g. the k values an earlier run did not reach)
            k = next((k for k in map(int, self.args.psd_ks.split(",")) if k not in tried), None)
            return None if k is None else Spec("psd", m, k, a)
        ok = {r["k"]: r for r in self._psd_rows(m, a, ok=True) if r.get("t_draft_ms") and r.get("t_verify_ms")}
        order = [1, 2] + ([crossover_k(ok, self.setup.k_max)] if len(ok) >= 2 else [])
        crossed = [k for k, r in ok.items() if k >= self.setup.k_min and r["t_draft_ms"] > r["t_verify_ms"]]
        order += list(range(3, min(crossed, default=self.setup.k_max) + 1))
        k = next((k for k in order if k not in tried and k <= self.setup.k_max), None)
        if k is None or (k > 2 and len(ok) < 2):
            return None
        return Spec("psd", m, k, a)

    def _sd_sweep(self, m: int, a: float, i: int) -> Spec | None:
        """sd runs the k values psd ran, in the same order."""
        ks = [r["k"] for r in self._psd_rows(m, a, ok=True)]
        if self.args.sd_ks:  # an explicit sweep (e.g. the k values around psd's best, when time is short)
            ks = [int(x) for x in self.args.sd_ks.split(",")]
        return Spec("sd", m, ks[i], a) if i < len(ks) else None

    def part1(self) -> None:
        setup, budget = self.setup, self.budget
        jobs = self.plan_part1()
        group_waves: dict[tuple, int] = {}
        if self.args.part1_modes:   # a subset: e.g. psd alone after a change to psd only
            jobs = [j for j in jobs if j.estimate.mode in self.args.part1_modes.split(",")]
        bar = progress(None, "part 1 configurations", total=len(jobs))
        while jobs:
            job = jobs.pop(0)
            bar.update()
            spec = job.resolve()
            if spec is None:
                continue
            batch = [(job, spec)]
            if setup.pairs and spec.n_gpus == 1:  # a partner for the other GPU
                while jobs and jobs[0].tier == job.tier and not jobs[0].barrier:
                    other = jobs[0].resolve()  # None now stays None: the results it waits for came earlier
                    if other is not None and (other.n_gpus != 1 or jobs[0].group[0] != job.group[0]):
                        break
                    partner = jobs.pop(0)
                    bar.update()
                    if other is not None:
                        batch.append((partner, other))
                        break
            for j, _ in batch:
                if j.group not in group_waves:
                    group_waves[j.group] = self._group_waves(j, jobs)
            run = []
            for j, s in batch:
                w = budget.affordable_waves(s, j.group[0], group_waves[j.group])
                if w:
                    run.append((s, w))
                else:
                    self.record(s, j.group[0], "closed", status="skipped", note="time budget")
            if run:
                self.closed([s for s, _ in run], job.group[0], [w for _, w in run])
        bar.close()

    def _group_waves(self, job: Job, jobs: list[Job]) -> int:
        """Waves for every configuration of a group, decided at its first: as many as let the whole plan run;
        if that is fewer than min_waves, what fits this group alone (the first group at most
        first_group_waves) and later groups get what is left."""
        setup, share = self.setup, 0.5 if self.setup.pairs else 1.0
        pending = [job] + jobs
        everything = self.budget.fit_waves([(x.estimate, x.group[0]) for x in pending], share=share)
        if everything >= setup.min_waves:
            return everything
        alone = self.budget.fit_waves([(x.estimate, x.group[0]) for x in pending if x.group == job.group], share=share)
        return min(alone, max(setup.first_group_waves, everything)) if job.tier == 0 else alone

    # -- part 2: online, data-parallel baselines, real acceptance
    def part2(self) -> None:
        setup, budget, res, args = self.setup, self.budget, self.results, self.args
        if "real" not in setup.models:
            setup.models["real"] = real_pair(args.real_pair)
        m, a = setup.ms[0], setup.alphas[0]
        k_psd = args.k_psd or res.best_k("psd", m, a, setup.real_k)
        k_sd = args.k_sd or res.best_k("sd", m, a, setup.real_k)
        say(f"part 2: m={m}, alpha={a}, psd k={k_psd}, sd k={k_sd}; real pair {setup.models['real']}")
        psd = Spec("psd", m, k_psd, a)
        dp = {"sd": Spec("sd", m, k_sd, a, replicas=2), "ar": Spec("ar", m, 0, None, replicas=2)}
        real = [Spec(mode, m, setup.real_k, None, acceptance="real") for mode in setup.real_modes]
        # sd_split first: psd must not be slower than it at low load (the regime switch's condition)
        split = [Spec("sd_split", m, k_psd, a)] if setup.split_online else []
        online = [psd] + split + [dp[mode] for mode in setup.dp_modes]
        if args.part2_modes:   # a subset: e.g. psd alone after a change to psd only
            keep = set(args.part2_modes.split(","))
            online = [s for s in online if s.label in keep]
            real = [s for s in real if "real" in keep]
        runs = len(online) * len(setup.loads)
        drain_est = 1.0 if setup.smoke else 4.0
        waves = budget.fit_waves([(s, m) for s in online + real], reserve_s=runs * (setup.online_s[0] + drain_est))

        # psd's closed run, also the capacity the arrival rates are relative to: not for the real rows alone, nor
        # for baselines whose rates are given (--capacity) or follow from an earlier psd row
        closed_psd = res.find(mode="psd", m=m, batch=m, k=k_psd, alpha_group=a, workload="closed", earlier=True)
        if (psd in online and not args.online_only) or (online and not args.capacity and not closed_psd):
            closed_psd = [r for r in self.closed([psd], m, [waves]) if r.get("status") == "ok"] + closed_psd
        capacity = closed_psd[0]["n_requests"] / closed_psd[0]["run_s"] if closed_psd else None
        if args.capacity:   # the arrival rates of an earlier run (its baselines' rows stay comparable)
            say(f"online: arrival rates relative to {args.capacity} req/s, not this psd's {fmt(capacity)} req/s")
            capacity = args.capacity
        rest = sum(budget.est_job(s, waves * 2 * m) for s in online[1:] + real)
        duration = (budget.left() - rest) / max(runs, 1) - drain_est   # runs = 0: the real rows alone
        duration = args.online_s or min(setup.online_s[1], max(setup.online_s[0], duration))
        rates = [load * capacity for load in setup.loads] if capacity else []
        if online:
            say(f"online: psd closed-loop capacity {fmt(capacity)} req/s -> {[round(r, 2) for r in rates]} req/s, "
                f"{duration:.1f} s of arrivals each")
        for spec in online:
            if spec is not psd and not args.online_only:  # the baselines on the closed workload psd just ran
                w = budget.affordable_waves(spec, m, waves)
                if w:
                    self.closed([spec], m, [w])
                else:
                    self.record(spec, m, "closed", status="skipped", note="time budget")
            self.online(spec, m, rates, duration)
        for spec in real:
            w = budget.affordable_waves(spec, m, waves)
            if w:
                self.closed([spec], m, [w])
            else:
                self.record(spec, m, "closed", status="skipped", note="time budget")
        # beyond the plan: one sd replica against the same arrivals (the paper's SD, on one GPU)
        single = Spec("sd", m, k_sd, a)
        if setup.extras and not args.part2_modes and rates and budget.left() > budget.est_build(single) + len(rates) * (duration + drain_est):
            self.online(single, m, rates, duration)

    def online(self, spec: Spec, m: int, rates: list[float], duration: float) -> None:
        setup, budget = self.setup, self.budget
        drain = 10.0 if setup.smoke else min(30.0, max(5.0, duration / 2))
        if not rates:
            for load in setup.loads:
                self.record(spec, m, "online", status="skipped", note="no psd closed-loop capacity to scale the "
                            "arrival rates by", load=load)
        for load, rate in zip(setup.loads, rates):
            if budget.left() < budget.est_build(spec) + duration + drain / 2:
                self.record(spec, m, "online", status="skipped", note="time budget", rate_rps=rate, load=load)
                continue
            try:
                llms, ready_s, built = self.engines.acquire([spec])
                arrivals = poisson_arrivals(rate, duration, seed=round(load * 1000))
                metrics = asyncio.run(run_online(llms[spec], arrivals, self.prompts(spec.acceptance),
                                                 setup.max_tokens, temperature_of(spec, setup),
                                                 f"{spec.label} {load:.0%}", drain))
            except Exception as e:
                self.engines.release(spec)
                self.record(spec, m, "online", status="failed", note=f"{e!r}"[:500], rate_rps=rate, load=load)
                continue
            self.budget.learn(spec, ready_s, built, None)
            self.record(spec, m, "online", metrics, rate_rps=rate, load=load, duration_s=duration,
                        build_s=ready_s or None)


# ---- report -------------------------------------------------------------------------------------
def _ok(rows, **where):
    return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in where.items())]


def _best(rows, key="tokens_per_s"):
    rows = [r for r in rows if r.get(key) is not None]
    return max(rows, key=lambda r: r[key]) if rows else None


def _where(r) -> str:
    return f"{r['mode']} b={r['batch']} k={r['k']}"


def target_rows(rows: list[dict]) -> list[dict]:
    psd = _ok(rows, mode="psd", workload="closed", acceptance="synthetic")
    out = []
    hidden = [r for r in psd if None not in (r.get("t_draft_ms"), r.get("t_verify_ms"), r.get("verifier_busy"))
              and r["t_draft_ms"] <= r["t_verify_ms"]]
    low = [r for r in hidden if r["verifier_busy"] < 0.9]
    worst = min(hidden, key=lambda r: r["verifier_busy"], default=None)
    out.append({"target": "psd verifier_busy >= 0.9 where t_draft <= t_verify",
                "value": "no rows" if worst is None else f"min {worst['verifier_busy']:.3f} (m={worst['m']} "
                f"alpha={worst['alpha']} k={worst['k']}); {len(low)} of {len(hidden)} rows below",
                "met": None if worst is None else not low})
    ratios = []
    for m, a in sorted({(r["m"], r["alpha_group"]) for r in psd}, reverse=True):
        cands = [r for r in psd if r["m"] == m and r["alpha_group"] == a and r.get("t_draft_ms") and r.get("t_verify_ms")
                 and r["batch"] == m]
        if not cands:
            continue
        p = min(cands, key=lambda r: abs(math.log(r["t_draft_ms"] / r["t_verify_ms"])))
        sd = _ok(rows, mode="sd", workload="closed", m=m, batch=m, k=p["k"], alpha_group=a)
        if sd:
            ratios.append((m, a, p, p["tokens_per_s"] / sd[-1]["tokens_per_s"]))
    # "t_draft ~ t_verify": the k closest to balance, within 25 %; a group whose k sweep never gets there
    # (verify grows with k too) is shown but not judged
    balanced = [x for m, a, p, x in ratios if abs(math.log(p["t_draft_ms"] / p["t_verify_ms"])) <= math.log(1.25)]
    out.append({"target": "psd / sd tokens/s >= 1.5 at equal m where t_draft ~ t_verify (within 25 %)",
                "value": "; ".join(f"m={m} alpha={a} k={p['k']} (draft/verify {p['t_draft_ms'] / p['t_verify_ms']:.2f}"
                                   f"{'' if abs(math.log(p['t_draft_ms'] / p['t_verify_ms'])) <= math.log(1.25) else ', not balanced: not judged'})"
                                   f": {x:.2f}x" for m, a, p, x in ratios) or "no rows",
                "met": None if not balanced else all(x >= 1.5 for x in balanced)})
    timed = _ok(rows, workload="online")
    pairs = [(p, b) for p in _ok(timed, mode="psd") for b in _ok(timed, mode="sd_split", load=p["load"], k=p["k"])]
    slow = [(p, b, q) for p, b in pairs for q in ("lat_p50_s", "lat_p99_s")
            if None not in (p.get(q), b.get(q)) and p[q] > 1.05 * b[q]]
    out.append({"target": "online: psd P50/P99 latency <= 1.05x sd_split's at every load",
                "value": "no rows" if not pairs else "; ".join(
                    f"k={p['k']} {p['load']:.0%}: P50 {p['lat_p50_s'] / b['lat_p50_s']:.2f}x, "
                    f"P99 {p['lat_p99_s'] / b['lat_p99_s']:.2f}x"
                    for p, b in pairs if b.get("lat_p50_s") and b.get("lat_p99_s")),
                "met": None if not pairs else not slow})
    over = [r for r in psd if r.get("ray_overhead_ms") is not None]
    top = max(over, key=lambda r: r["ray_overhead_ms"], default=None)
    out.append({"target": "psd ray_overhead <= 1 ms",
                "value": "no rows" if top is None else f"max {top['ray_overhead_ms']:.2f} ms (m={top['m']} k={top['k']}), "
                f"median over rows {np.median([r['ray_overhead_ms'] for r in over]):.2f} ms",
                "met": None if top is None else top["ray_overhead_ms"] <= 1.0})
    for row in out:
        row["met"] = {True: "yes", False: "**no**", None: "not measured"}[row["met"]]
    return out


def comparisons(rows: list[dict]) -> list[dict]:
    """psd at its best k against each baseline at its best batch and k, per load; higher is better for
    tokens/s, lower for latencies."""
    out = []
    closed = [r for r in rows if r.get("workload") == "closed" and r.get("acceptance") != "real"]
    for m, a in sorted({(r["m"], r["alpha_group"]) for r in _ok(closed, mode="psd")}, reverse=True):
        psd = _best(_ok(closed, mode="psd", m=m, alpha_group=a))
        base = {"sd (b=m)": _best(_ok(closed, mode="sd", m=m, batch=m, alpha_group=a)),
                "sd (best b)": _best(_ok(closed, mode="sd", m=m, alpha_group=a)),
                "sd_split": _best(_ok(closed, mode="sd_split", m=m, alpha_group=a)),
                "sd_dp2": _best(_ok(closed, mode="sd_dp2", m=m, alpha_group=a)),
                "ar (best b)": _best(_ok(closed, mode="ar", m=m)),
                "ar_dp2": _best(_ok(closed, mode="ar_dp2", m=m))}
        for name, b in base.items():
            if b is None:
                continue
            for metric, higher in (("tokens_per_s", True), ("tokens_per_s_per_gpu", True), ("lat_p99_s", False)):
                if metric == "lat_p99_s" and psd.get("n_requests") != b.get("n_requests"):
                    continue   # a closed run's tail latency grows with its request count: compare equal runs
                out.append(_compare(f"closed m={m} alpha={a}", psd, name, b, metric, higher))
    timed = _ok(rows, workload="online")
    for load in sorted({r["load"] for r in timed}):
        psd = _ok(timed, mode="psd", load=load)
        for b in [r for r in timed if r["load"] == load and r["mode"] != "psd"]:
            if psd:
                for metric in ("lat_mean_s", "lat_p99_s", "ttft_p99_s"):
                    out.append(_compare(f"online {load:.0%} ({psd[-1]['rate_rps']:.1f} req/s)", psd[-1], b["mode"], b,
                                        metric, False))
    return [c for c in out if c is not None]


def _compare(load, psd, name, base, metric, higher):
    p, b = psd.get(metric), base.get(metric)
    if p is None or b is None or b == 0:
        return None
    loses = p < b if higher else p > b
    return {"load": load, "baseline": f"{name}: {_where(base)}", "metric": metric, "psd": p, "base": b,
            "psd/base": p / b, "psd k": psd["k"], "psd loses": "**yes**" if loses else "no"}


def online_rows(rows: list[dict]) -> list[dict]:
    return sorted(_ok(rows, workload="online"), key=lambda r: (r["load"], r["mode"]))


def report(rows: list[dict]) -> str:
    ok = [r for r in rows if r.get("status") == "ok"]
    lines = ["# PSD vs standard SD on two GPUs", "",
             "Closed workload: 8 x 2m requests submitted at once (fewer where `n_requests` says so), 128 output "
             "tokens each (ignore_eos), random-token prompts, request i seeded with i so synthetic acceptance "
             "draws match across modes. Online: Poisson arrivals at a fraction (`load`) of psd's closed-loop "
             "capacity at m=64; data-parallel replicas (`_dp2`) get each request on the one with fewer in flight. "
             "`m` is the group a row is compared in, `batch` its max_batch per replica; psd holds 2 x batch "
             "requests (`in_flight`). Single-GPU rows of part 1 ran two at a time, one per GPU.", "",
             "Definitions: `t_draft_ms` / `t_verify_ms`: median device time (CUDA events) of one draft phase "
             "(k steps) and one verify step; `step_ms`: median manager wall time per step; `verifier_busy`: verify "
             "device time / step wall time; `ray_overhead_ms`: median of step wall time - max(t_draft, t_verify) "
             "(psd) or - (t_draft + t_verify) (sequential modes). All four over the steady state: the first and "
             "last 5 % of steps, fallback steps and steps that admitted requests (prefill, not in t_verify) "
             "dropped. `tokens_per_s`: output tokens / wall time of the whole run, prefill included; "
             "`makespan_per_req_s`: that time / requests (the paper's E2EL). Latencies: closed from the engine's "
             "request stats, online from the client (scheduled arrival to first token / last token).", "",
             "## Commands", ""]
    for part, command, sha, device in sorted({(r.get("part"), r.get("command"), r.get("git_sha"), r.get("device"))
                                              for r in rows}, key=lambda x: (x[0] or 0, x[1] or "")):
        lines.append(f"- part {part}: `{command}` (git {sha}, {device})")
    lines += ["", "## Targets", "", markdown_table(target_rows(rows), ["target", "value", "met"]), ""]
    comp = comparisons(rows)
    lost = [c for c in comp if c["psd loses"] != "no"]
    lines += ["## Where psd loses", ""]
    lines += [f"- {c['load']}, {c['metric']}: psd {fmt(c['psd'])} vs {c['baseline']} {fmt(c['base'])}"
              for c in lost] or ["- nowhere among the comparisons below"]
    lines += ["", "## psd against each baseline (psd at its best k, baselines at their best batch and k)", "",
              markdown_table(comp, ["load", "metric", "psd k", "psd", "baseline", "base", "psd/base", "psd loses"]), ""]
    key = lambda r: (-(r.get("alpha_group") or 0), -r["m"], r["mode"], r["batch"], r["k"])
    closed = sorted([r for r in ok if r["workload"] == "closed" and r.get("acceptance") != "real"], key=key)
    setups = sorted({(r["models"], r["prompt_len"], r["max_tokens"], r["temperature"]) for r in closed + online_rows(ok)
                     if r.get("acceptance") == "synthetic"})
    lines += ["## Closed workload, synthetic acceptance", ""]
    lines += [f"Models {mdl}; prompts of {pl} random tokens; {mt} output tokens; temperature {t}." for mdl, pl, mt, t
              in setups] + ["", markdown_table(closed, TABLE_COLUMNS), ""]
    lines += ["## Online (Poisson arrivals)", "", markdown_table(online_rows(ok), ONLINE_TABLE_COLUMNS), ""]
    real = sorted(_ok(rows, workload="closed", acceptance="real"), key=key)
    models = sorted({r["models"] for r in real})
    lines += ["## Real acceptance", "", f"Models: {', '.join(models) or '-'}; greedy; `alpha` is the measured "
              "acceptance rate (accepted / drafted).", "", markdown_table(real, TABLE_COLUMNS), ""]
    notes = [r for r in rows if r.get("note") or r.get("status") != "ok"]
    if notes:
        lines += ["## Skipped, failed, scaled or partial configurations", ""]
        lines += [f"- part {r.get('part')} {r['status']}: {r['mode']} {r['workload']} m={r['m']} b={r['batch']} "
                  f"k={r['k']} alpha={r.get('alpha_group')}" + (f" rate={fmt(r.get('rate_rps'))}" if r.get("rate_rps")
                  else "") + f": {r.get('note')}" for r in notes]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["1", "2", "all"], default=None, help="default: all with --smoke, else 1")
    p.add_argument("--out", default=None,
                   help="folder of psd_vs_sd.{parquet,md,png} (default bench/results; smoke: /tmp/psd_vs_sd_smoke)")
    p.add_argument("--prior", action="append", default=None,
                   help="earlier results whose rows of the other part (same device) are kept; default: the "
                        "--out file and bench/results/psd_vs_sd.parquet")
    p.add_argument("--budget-s", type=float, default=None,
                   help="per part: no configuration starts that would end later (default 460; smoke 600)")
    p.add_argument("--target", default="random:llama-8b")
    p.add_argument("--draft", default="random:llama-1b")
    p.add_argument("--real-pair", choices=["auto", "assets", "tiny"], default="auto",
                   help="real acceptance: the trained pair under minedraft_ray/assets, or a noised tiny copy")
    p.add_argument("--k-psd", type=int, default=None, help="part 2: psd's k (default: best of part 1)")
    p.add_argument("--k-sd", type=int, default=None, help="part 2: sd's k (default: best of part 1)")
    p.add_argument("--transport", choices=["auto", "object_store", "collective"], default="auto",
                   help="the draft channel (auto: the engine's default, collective on GPUs)")
    p.add_argument("--verifier-overlap", choices=["auto", "on", "off"], default="auto",
                   help="every engine's verifier_overlap (the verifier launching its next step ahead; auto: on a GPU)")
    p.add_argument("--psd-high-load", choices=["auto", "psd", "seq"], default="auto",
                   help="psd's choice when more requests want to run than one batch holds (EngineConfig.psd_high_load)")
    p.add_argument("--part1-modes", default=None, help="part 1: only these of psd,sd,ar,sd_split (default: all)")
    p.add_argument("--part2-modes", default=None,
                   help="part 2: only these of psd,sd_split,sd_dp2,ar_dp2,real (default: all)")
    p.add_argument("--capacity", type=float, default=None,
                   help="part 2: the closed-loop capacity (req/s) the arrival rates are relative to (default: "
                   "psd's in this run)")
    p.add_argument("--online-only", action="store_true",
                   help="part 2: the online runs alone, at the arrival rates --capacity gives (no closed runs)")
    p.add_argument("--loads", default=None, help="part 2: the online loads, as fractions of the closed-loop "
                   "capacity (default: 0.3,0.6,0.9)")
    p.add_argument("--online-s", type=float, default=None,
                   help="part 2: seconds of arrivals per load (default: what the budget allows, 20-60)")
    p.add_argument("--no-pairs", action="store_true", help="run single-GPU configurations one at a time")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny models, fake GPUs: checks the script")
    p.add_argument("--ms", default="64,16", help="per-verify batches m to run, in priority order")
    p.add_argument("--alphas", default="0.8,0.6", help="synthetic acceptance rates, in priority order")
    p.add_argument("--k-max", type=int, default=8, help="largest k of the sweeps")
    p.add_argument("--psd-ks", default=None, help="psd's k sweep, in this order (default: 1, 2, the predicted "
                   "balance, then upwards until drafting outlasts verifying)")
    p.add_argument("--sd-ks", default=None, help="sd's k sweep (default: the k values psd ran)")
    p.add_argument("--resume", action="store_true",
                   help="keep the finished rows of the same part from --prior and run only what is missing")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of synthetic rows")
    p.add_argument("--batch-mults", default="1,2,4", help="baseline batches as multiples of m")
    args = p.parse_args(argv)
    if args.online_only and not args.capacity:
        p.error("--online-only needs --capacity (the arrival rates come from it, not from a closed run)")
    start = time.perf_counter()  # the first part's budget counts from here: Ray and model setup included
    parts = [1, 2] if (args.part or ("all" if args.smoke else "1")) == "all" else [int(args.part)]
    budget_s = args.budget_s or (600.0 if args.smoke else 460.0)

    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    work = Path(tempfile.mkdtemp(prefix="psdb-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    setup = smoke_setup(args, work) if args.smoke else gpu_setup(args)
    if args.verifier_overlap != "auto":
        setup.engine["verifier_overlap"] = args.verifier_overlap == "on"
    setup.engine["psd_high_load"] = args.psd_high_load
    if args.loads:
        setup.loads = tuple(float(x) for x in args.loads.split(","))
    out = Path(args.out or ("/tmp/psd_vs_sd_smoke" if args.smoke else "bench/results"))
    priors = [Path(x) for x in args.prior] if args.prior else [out / f"{NAME}.parquet",
                                                               Path("bench/results") / f"{NAME}.parquet"]
    from minedraft_ray.runtime.transport import default_transport
    context = {"git_sha": git_sha(), "command": command_line("bench.psd_vs_sd"), "device": machine_name(args.smoke),
               # auto: the engine's defaults where the workers run (the smoke runs on the CPU)
               "transport": setup.transport if setup.transport != "auto" else default_transport(on_gpu=not args.smoke),
               "verifier_overlap": args.verifier_overlap if args.verifier_overlap != "auto"
               else "off" if args.smoke else "on", "psd_high_load": args.psd_high_load}
    results = Results(out, priors, set(parts), context, resume=args.resume)
    say(f"{context['device']}; git {context['git_sha']}; parts {parts}; {results.prior_count} rows from earlier "
        f"parts; budget {budget_s:.0f} s per part; synthetic acceptance hook: {has_bench_hook()}")
    own_ray = not ray.is_initialized()
    if own_ray:
        extra = {"num_cpus": 4, "num_gpus": 2} if args.smoke else {}
        ray.init(address="local", include_dashboard=False, _temp_dir=str(work / "ray"), log_to_driver=False, **extra)
    bench = Bench(setup, args, results)
    try:
        for part in parts:
            bench.part, bench.budget = part, Budget(setup, start if part == parts[0] else time.perf_counter(),
                                                    budget_s, bench.engines)
            bench.part1() if part == 1 else bench.part2()
    finally:
        bench.engines.close()
        results.save()
        if own_ray:
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    md = out / f"{NAME}.md"
    try:
        from bench.plot import plot_psd_vs_sd

        plot_psd_vs_sd(out / f"{NAME}.parquet", out / f"{NAME}.png")
        say(f"wrote {md}, {md.with_suffix('.parquet')} and {md.with_suffix('.png')}")
    except ImportError:  # no matplotlib on the GPU machine: plot later with python -m bench.plot
        say(f"wrote {md} and {md.with_suffix('.parquet')} (plot: python -m bench.plot {md.with_suffix('.parquet')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
