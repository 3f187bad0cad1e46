"""Chunked prefill against whole prompts on the CPU, phase by phase: where a chunk budget could cost time.

    python -m bench.chunked_prefill_cpu                 # every mode, both workloads, 5 alternating passes
    python -m bench.chunked_prefill_cpu --smoke         # sd only, 1 pass (tests/test_bench_scripts.py)

One engine per mode (the tests' tiny Llama pair, built here; one torch thread, 2 logical GPUs), and the
budgets alternate in place on it (`reconfigure`), pass after pass, so that load on a shared machine falls
on every budget alike. Per pass: the wall time of `generate`, the steps, the verifier's tasks (verifies and
prefill tasks) and the drafter's tasks (rounds and prefills) -- each one Ray call from the manager -- and the
device time of verifies, prefills and draft rounds and the manager's host time per step (StepRecord).

Workloads:
- `tests`: the runtime tests' ten prompts and lengths (tests/runtime_common.py), max_batch 3: the greedy tests'
  generate call. Every prompt fits a 256-token budget, and so do the prompts admitted together.
- `over`: 24 prompts of 48..160 random tokens, 24 output tokens each, max_batch 8: the prompts admitted together
  exceed the budget, so chunking cuts them (the cost of bounded stalls).

Writes bench/results/chunked_prefill_cpu.{parquet,md}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

NAME = "chunked_prefill_cpu"
COLUMNS = ["mode", "workload", "budget", "pass", "wall_s", "steps", "verifier_tasks", "prefill_tasks",
           "drafter_tasks", "ray_calls_per_step", "cpu_s", "verify_ms", "prefill_ms", "draft_ms", "host_ms", "load",
           "max_batch", "k", "git_sha"]
SUMMARY = ["mode", "workload", "budget", "passes", "wall_s_median", "cpu_s", "steps", "prefill_tasks", "ray_calls_per_step",
           "verify_ms", "prefill_ms", "draft_ms", "host_ms", "load_median"]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def tiny_pair(root: Path) -> tuple[str, str]:
    """The tests' tiny Llama target and its noised drafter (tests/conftest.py)."""
    from minedraft_ray.testing.tiny import make_noised_draft, make_tiny_model

    target = make_tiny_model(root / "target", "llama", rope_scaling=LLAMA3_ROPE)
    return str(target), str(make_noised_draft(target, root / "draft", noise=0.02))


def workloads(tokenizer) -> dict:
    import numpy as np

    from minedraft_ray.engine.sampling import SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from runtime_common import LENGTHS, PROMPTS

    def greedy(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    rng = np.random.default_rng(0)
    over = [rng.integers(16, 500, int(rng.integers(48, 161))).tolist() for _ in range(24)]
    return {"tests": (3, [tokenizer.encode(p) for p in PROMPTS], [greedy(n) for n in LENGTHS]),
            "over": (8, over, [greedy(24)] * len(over))}


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_pids(llm) -> list[int]:
    """The processes of the manager, the verifier and (psd, sd_split) the drafter."""
    import ray

    def pids(actor):
        m = actor.manager
        workers = [w for w in (m.verifier, m.drafter) if w is not None]
        return [os.getpid()] + ray.get([w.__ray_call__.remote(lambda _: os.getpid()) for w in workers])
    return ray.get(llm.manager.__ray_call__.remote(pids))


def counts(llm, pids: list[int]) -> dict:
    """The manager's task counters (verifier tasks numbered, drafter tasks numbered, prefill tasks) and the CPU
    seconds the engine's processes have used."""
    import ray

    def read(actor):
        m = actor.manager
        return {"verifier_tasks": m.sched.tasks_numbered, "drafter_tasks": m.actors.drafter_seq,
                "prefill_tasks": m.counters["prefill_tasks"]}
    return {**ray.get(llm.manager.__ray_call__.remote(read)), "cpu_s": sum(process_cpu_s(p) for p in pids)}


def reconfigure_when_idle(llm, budget: int, timeout_s: float = 30.0) -> None:
    """sd and ar keep a step queued behind a request's last one: the engine is idle once it has run."""
    import ray

    deadline = time.time() + timeout_s
    while True:
        try:
            return llm.reconfigure(prefill_chunk_tokens=budget)
        except ray.exceptions.RayTaskError as e:
            if "idle" not in str(e) or time.time() > deadline:
                raise
            time.sleep(0.02)


def measure(llm, pids: list[int], prompts, params, budget: int) -> dict:
    reconfigure_when_idle(llm, budget)
    before, start = counts(llm, pids), len(llm.history())
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    steps = llm.history()[start:]
    after = counts(llm, pids)
    d = {key: after[key] - before[key] for key in after}
    return {"wall_s": wall, "steps": len(steps), **d,
            "ray_calls_per_step": (d["verifier_tasks"] + d["drafter_tasks"]) / len(steps),
            "verify_ms": sum(h.t_verify_ms for h in steps), "prefill_ms": sum(h.t_prefill_ms for h in steps),
            "draft_ms": sum(h.t_draft_ms for h in steps), "host_ms": sum(h.host_ms for h in steps), "load": load}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="ar,sd,sd_split,psd")
    ap.add_argument("--budgets", default="0,256", help="prefill_chunk_tokens per pass, alternating (0: whole)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="sd, one pass: that the bench runs")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if args.smoke:
        args.modes, args.passes = "sd", 1
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.common import command_line, git_sha, markdown_table, write_results
    from minedraft_ray import LLM
    from minedraft_ray.engine.loader import load_tokenizer
    from minedraft_ray.runtime.llm import init_local_ray

    root = Path(tempfile.mkdtemp(prefix="chunked-cpu-"))
    target, draft = tiny_pair(root)
    work = workloads(load_tokenizer(Path(target)))
    budgets = [int(b) for b in args.budgets.split(",")]
    init_local_ray(num_cpus=4, num_gpus=2, _temp_dir=tempfile.mkdtemp(prefix="r", dir="/tmp"), log_to_driver=False)
    rows, sha = [], git_sha()
    for mode in args.modes.split(","):
        for name, (max_batch, prompts, params) in work.items():
            llm = LLM(target, None if mode == "ar" else draft, mode=mode, k=args.k, max_batch=max_batch,
                      torch_threads=1, device="cpu", transport="object_store",
                      **({"psd_high_load": "psd"} if mode == "psd" else {}))
            try:
                llm.generate(prompts[:2], params[:2])   # warm-up: first calls, allocations
                pids = engine_pids(llm)
                for p in range(args.passes):
                    # alternate which budget goes first, so neither always follows the other
                    for budget in (budgets if p % 2 == 0 else budgets[::-1]):
                        row = {"mode": mode, "workload": name, "budget": budget, "pass": p,
                               **measure(llm, pids, prompts, params, budget), "max_batch": max_batch, "k": args.k,
                               "git_sha": sha}
                        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
                        rows.append(row)
            finally:
                llm.shutdown()
    summary = []
    for mode in args.modes.split(","):
        for name in work:
            for budget in budgets:
                mine = [r for r in rows if (r["mode"], r["workload"], r["budget"]) == (mode, name, budget)]
                med = {c: statistics.median(r[c] for r in mine) for c in
                       ("wall_s", "cpu_s", "steps", "prefill_tasks", "ray_calls_per_step", "verify_ms", "prefill_ms",
                        "draft_ms", "host_ms", "load")}
                summary.append({"mode": mode, "workload": name, "budget": budget, "passes": len(mine),
                                "wall_s_median": med.pop("wall_s"), "load_median": med.pop("load"), **med})
    notes = ["budget: prefill_chunk_tokens (0: whole prompts); ray_calls_per_step: verifier + drafter tasks "
             "(each one Ray call from the manager) / verify steps; cpu_s: CPU seconds (user + system, every thread) "
             "the manager's, the verifier's and the drafter's processes used in the pass, which moves less with "
             "the machine's load than wall_s; verify_ms, prefill_ms, draft_ms: device "
             "time summed over the pass; host_ms: the manager's time per step (commit, schedule, submit) summed",
             f"workloads: tests = the runtime tests' ten prompts (max_batch 3), over = 24 prompts of 48..160 "
             f"tokens x 24 greedy tokens (max_batch 8); k {args.k}, object_store channel, torch_threads 1, "
             "psd with psd_high_load = psd; budgets alternate in place on one engine per mode and workload",
             "load: the 1-minute load average before the pass (other sessions share the 2 cores)"]
    if args.note:
        notes.append(args.note)
    path = write_results(rows, args.out, NAME, COLUMNS, "Chunked prefill against whole prompts on the CPU",
                         command_line("bench.chunked_prefill_cpu"), f"cpu ({os.cpu_count()} cores)", notes)
    path.write_text(path.read_text() + "\n## Medians over the passes (each column on its own)\n\n"
                    + markdown_table(summary, SUMMARY) + "\n")
    print(markdown_table(summary, SUMMARY))


if __name__ == "__main__":
    main()
