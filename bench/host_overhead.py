"""psd's per-step host overhead on a CPU, this tree against another (its parent), in alternating runs.

    python -m bench.host_overhead --parent-tree /tmp/parent --parent-sha bd2b7ee --runs 10

The host overhead of a step is the manager's own time in it: from the verifier's result arriving to the next
tasks submitted and the step recorded (commit, schedule, submit: StepRecord.host_ms, measured alike in both
trees). The change prefills whole prompts by default, as the parent (which predates chunked prefill) does: both
trees then run the same steps (16 rows each at max_batch 16). Under the change's chunked default the burst's
prompts join over several fused steps, so its batches fill late and drain late: more steps, fewer rows in some,
a prompt chunk in others (`--prefill-chunk-tokens -1` measures that). Each run is a fresh process (its own local Ray, two logical GPUs, the psd regime forced) generating a
fixed greedy workload; runs alternate between the two trees so that load on a shared machine falls on both.
One run needs only the public API both trees have (LLM, SamplingParams, history), so this file runs against
any tree: `--one` measures the tree on PYTHONPATH and prints one JSON row.

Writes bench/results/host_overhead_cpu.{parquet,md,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NAME = "host_overhead_cpu"
COLUMNS = ["tree", "run", "git_sha", "prefill_chunk_tokens", "host_ms_median", "manager_cpu_ms_per_step",
           "manager_cpu_us_per_token", "host_ms_mean", "host_ms_p90", "steps",
           "step_ms_median",
           "wall_s", "pinned", "load_before", "max_batch", "k", "max_tokens", "target", "draft", "device"]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> set[int]:
    """Every live process below `root` (this run's Ray: its GCS, raylet and workers are the driver's)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


def pin_manager(manager_pid: int) -> bool:
    """The manager's threads alone on the last core, every other process of this run (driver, Ray's own, the
    workers) on the rest: the host time measured is the manager's own, not its wait for a core the verifier
    holds. Affinity is per thread, so each thread of each process is pinned."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return False
    for pid in descendants(os.getpid()) | {os.getpid()}:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), {cores[-1]} if pid == manager_pid else set(cores[:-1]))
            except (OSError, ValueError):   # a thread that ended meanwhile
                pass
    return True


def measure_one(args) -> dict:
    """One run in this process, with the minedraft_ray on sys.path."""
    import ray

    from minedraft_ray import LLM, SamplingParams
    from minedraft_ray.runtime.llm import init_local_ray

    init_local_ray(num_gpus=2, _temp_dir=tempfile.mkdtemp(prefix="r", dir="/tmp"))
    # below 0: the config's default (the parent, which has no such setting, always runs so)
    chunking = {} if args.prefill_chunk_tokens < 0 else {"prefill_chunk_tokens": args.prefill_chunk_tokens}
    llm = LLM(args.target, args.draft, mode="psd", k=args.k, max_batch=args.max_batch, transport="object_store",
              torch_threads=1, device="cpu", psd_low_load="psd", psd_high_load="psd", **chunking)
    try:
        n = 2 * args.max_batch
        prompts = [[(7 * i + j) % 500 + 3 for j in range(32)] for i in range(n)]
        params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, seed=i)
                  for i in range(n)]
        llm.generate(prompts[:4], params[:4])   # warm-up: first calls, allocations
        pid = ray.get(llm.manager.__ray_call__.remote(lambda actor: os.getpid()))
        pinned = args.pin and pin_manager(pid)
        skip = len(llm.history())
        t0, cpu0 = time.perf_counter(), process_cpu_s(pid)
        for _ in range(args.repeats):
            llm.generate(prompts, params)
        wall, cpu = time.perf_counter() - t0, process_cpu_s(pid) - cpu0
        everything = llm.history()[skip:]
        hist = [h for h in everything if h.regime == "psd" and h.drafted and h.verified]
        host = sorted(h.host_ms for h in hist)
        tokens = args.repeats * n * args.max_tokens   # ignore_eos: every request runs to max_tokens
        return {"steps": len(hist), "manager_cpu_ms_per_step": cpu * 1e3 / len(everything),
                "manager_cpu_us_per_token": cpu * 1e6 / tokens,
                "host_ms_median": statistics.median(host),
                "host_ms_mean": statistics.fmean(host), "host_ms_p90": host[int(0.9 * (len(host) - 1))],
                "step_ms_median": statistics.median(h.step_ms for h in hist), "wall_s": wall,
                "max_batch": args.max_batch, "k": args.k, "max_tokens": args.max_tokens, "target": args.target,
                "draft": args.draft, "device": f"cpu ({os.cpu_count()} cores)", "pinned": pinned}
    finally:
        llm.shutdown()


def run_tree(tree: Path, args, chunk_tokens: int | None = None) -> dict:
    """One run of the tree at `tree` in a fresh process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--max-batch", str(args.max_batch),
           "--k", str(args.k), "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
           "--target", args.target, "--draft", args.draft] + ([] if args.pin else ["--no-pin"])
    cmd += ["--prefill-chunk-tokens", str(-1 if chunk_tokens is None else chunk_tokens)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"run in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", action="store_true", help="one run of the tree on PYTHONPATH; print a JSON row")
    ap.add_argument("--parent-tree", type=Path, help="a checkout of the tree to compare against")
    ap.add_argument("--parent-sha", default="parent")
    ap.add_argument("--runs", type=int, default=10, help="runs per tree, alternating")
    ap.add_argument("--target", default="random:tiny")
    ap.add_argument("--draft", default="random:tiny")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="workload passes per run")
    ap.add_argument("--prefill-chunk-tokens", type=int, default=0,
                    help="the change's per-step prefill budget (default 0: whole prompts, as the parent, which "
                         "predates chunked prefill, always plans them, so both trees run the same steps; -1: the "
                         "config's default)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave the manager's process to the OS scheduler (default: alone on the last core, "
                         "everything else of the run on the others)")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(args)), flush=True)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.common import command_line, git_sha, write_results

    here = Path(__file__).resolve().parents[1]
    trees = [("change", here, git_sha())]
    if args.parent_tree is not None:
        trees.insert(0, ("parent", args.parent_tree.resolve(), args.parent_sha))
    rows = []
    for run in range(args.runs):
        # alternate which tree goes first, so neither always runs right after the other's shutdown
        for name, tree, sha in (trees if run % 2 == 0 else trees[::-1]):
            load = os.getloadavg()[0]
            chunk_tokens = args.prefill_chunk_tokens if name == "change" and args.prefill_chunk_tokens >= 0 else None
            row = {"tree": name, "run": run, "git_sha": sha, "load_before": load, "prefill_chunk_tokens": chunk_tokens,
                   **run_tree(tree, args, chunk_tokens)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = []
    for name, _, sha in trees:
        mine = [r["host_ms_median"] for r in rows if r["tree"] == name]
        summary.append(f"{name} ({sha}): median over runs of the per-run median host_ms = "
                       f"{statistics.median(mine):.3f} ms (runs: {', '.join(f'{x:.3f}' for x in mine)})")
    for name, _, sha in trees:
        mine = [r["manager_cpu_ms_per_step"] for r in rows if r["tree"] == name]
        per_token = [r["manager_cpu_us_per_token"] for r in rows if r["tree"] == name]
        summary.append(f"{name} ({sha}): median over runs of the manager process's CPU ms per step = "
                       f"{statistics.median(mine):.3f} ms, per generated token = {statistics.median(per_token):.1f} us")
    if len(trees) == 2:
        for column in ("host_ms_median", "manager_cpu_ms_per_step", "manager_cpu_us_per_token"):
            p = statistics.median(r[column] for r in rows if r["tree"] == "parent")
            c = statistics.median(r[column] for r in rows if r["tree"] == "change")
            summary.append(f"{column}: change / parent = {c / p:.3f}")
    for line in summary:
        print(line)
    device = rows[0]["device"]
    notes = [*summary,
             "host_ms: StepRecord.host_ms of steady psd steps (drafted, verified): the manager's time from the "
             "verifier's result arriving to the next tasks submitted and the step recorded",
             f"workload: {2 * args.max_batch} requests x {args.max_tokens} greedy tokens (ignore_eos), psd forced "
             f"(psd_low_load = psd_high_load = psd), object_store channel, torch_threads 1, {args.repeats} passes "
             "per run after a warm-up; each run a fresh process and local Ray (2 logical GPUs); runs alternate "
             "between the trees; the change's prefill budget: "
             + ("whole prompts, as the parent's (prefill_chunk_tokens 0)" if args.prefill_chunk_tokens == 0 else
                "the config's default" if args.prefill_chunk_tokens < 0 else
                f"{args.prefill_chunk_tokens} tokens a step"),
             "manager_cpu_ms_per_step: CPU time (user + system, all threads: Ray's serialization and IO threads "
             "included) of the manager actor's process over the measured passes / every step recorded; CPU time "
             "moves less than wall time with the machine's load; per generated token: the same CPU over the tokens "
             "both trees generate alike (the parent records two more steps a pass: its new requests' first verify "
             "carries no drafts)",
             "load_before: the 1-minute load average before the run (other sessions share the cores)",
             "pinned: the manager's threads alone on the last core and every other process of the run (driver, "
             "Ray's, the workers) on the others, so host_ms is the manager's own time, not its waits for a core "
             "the verifier or drafter holds; pinned or not, one tree's runs spread by +-15 % on a 2-core machine, so "
             "only the medians of several alternating runs compare"]
    if args.note:
        notes.append(args.note)
    write_results(rows, args.out, NAME, COLUMNS, "psd's per-step host overhead on a CPU, change against parent",
                  command_line("bench.host_overhead"), device, notes)


if __name__ == "__main__":
    main()
