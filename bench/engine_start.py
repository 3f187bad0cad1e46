"""What one engine start costs on a CPU: CPU seconds per process and wall, from `LLM(...)` until its first
generate returns, with the tests' tiny pair (tests/conftest.py's tiny llama and its noised draft).

    python -m bench.engine_start --runs 3            # psd, sd and ar, three fresh processes each
    python -m bench.engine_start --one --mode psd    # one run in this process, one JSON row

Each run is a fresh process with its own local Ray (6 CPUs, 8 logical GPUs, as the tests' cluster), started before
the measured window, like the suite's session cluster; the driver has imported torch and transformers before it
(it built the tiny pair), as a test process has. CPU time is read from /proc (user + system, all threads) for every
process descending from the driver: before the start and after the first generate. The worker actors usually take
a process Ray started earlier (an idle pooled worker that had imported Ray), so their CPU is counted from their
process's start (`*_total`); what the window adds is `*_window`. Bytecode is cached, as under `make test` (a first,
unrecorded run writes it).

Prints a JSON row per run and the medians per mode (`--out`: the same into a file). docs/engine-start.md
holds a before/after comparison made by alternating `--one` runs of two trees.
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

TICK = os.sysconf("SC_CLK_TCK")
ROLES = ("driver", "manager", "verifier", "drafter", "raylet", "gcs", "others")


def proc_stat(pid: int) -> tuple[float, int, int]:
    """(CPU seconds so far, all threads; parent pid; start time in ticks since boot)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK, int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, tuple[float, str, int]]:
    """pid -> (CPU s, command line, start ticks) of `root` and every process below it."""
    parent, info = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            cpu, ppid, start = proc_stat(pid)
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parent[pid], info[pid] = ppid, (cpu, cmd, start)
    mine = {root}
    changed = True
    while changed:
        changed = False
        for pid, ppid in parent.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                changed = True
    return {pid: info[pid] for pid in mine if pid in info}


def measure_one(args) -> dict:
    from minedraft_ray.ray_local import lock_down
    lock_down()   # before Ray's import, as the tests' conftest does
    import ray

    from minedraft_ray.ray_local import start_local_ray
    from minedraft_ray.runtime.llm import LLM
    from minedraft_ray.engine.sampling_params import SamplingParams
    from minedraft_ray.testing.tiny import make_noised_draft, make_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="mdstart-", dir="/tmp"))
    target = make_tiny_model(folder / "target", "llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    draft = make_noised_draft(target, folder / "draft", noise=0.02)
    start_local_ray(num_cpus=6, num_gpus=8, _temp_dir=str(folder / "r"), log_to_driver=False)
    time.sleep(args.settle_s)   # Ray's own start (pool workers, dashboard) out of the window
    settings = {"ar": {"mode": "ar"}, "sd": {"mode": "sd", "k": 3, "max_batch": 3},
                "psd": {"mode": "psd", "k": 3, "max_batch": 3, "psd_low_load": "psd", "psd_high_load": "psd"}}
    me = os.getpid()
    before = descendants(me)
    t0 = time.perf_counter()
    llm = LLM(str(target), None if args.mode == "ar" else str(draft), torch_threads=1, **settings[args.mode])
    t_started = time.perf_counter()
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    wall = time.perf_counter() - t0
    after = descendants(me)
    assert len(out[0].token_ids) == 8
    pids = {"driver": me, "manager": ray.get(llm.manager.__ray_call__.remote(lambda actor: os.getpid())),
            "verifier": llm.worker_info["verifier"]["pid"],
            "drafter": (llm.worker_info.get("drafter") or {}).get("pid")}
    for pid, (_, cmd, _) in after.items():
        if "raylet" in cmd.split(" ")[0]:
            pids["raylet"] = pid
        elif "gcs_server" in cmd.split(" ")[0]:
            pids["gcs"] = pid
    tree = ray.get(llm.manager.__ray_call__.remote(lambda actor: str(Path(sys.modules["minedraft_ray"].__file__).parents[1])))
    row = {"mode": args.mode, "tree": tree, "wall_s": wall, "start_wall_s": t_started - t0, "load_before": os.getloadavg()[0]}
    named = {pid for pid in pids.values() if pid is not None}
    for role, pid in pids.items():
        if pid is None:
            continue
        total = after[pid][0]
        row[f"{role}_window"] = total - before.get(pid, (0.0,))[0]
        row[f"{role}_total"] = total
    others = {pid: after[pid][0] - before.get(pid, (0.0,))[0] for pid in after if pid not in named}
    row["others_window"] = sum(others.values())
    row["others_detail"] = {after[pid][1][:60]: round(cpu, 2) for pid, cpu in others.items() if cpu >= 0.05}
    row["all_window"] = sum(after[pid][0] - before.get(pid, (0.0,))[0] for pid in after)
    llm.shutdown()
    ray.shutdown()
    return row


def run_fresh(mode: str, args) -> dict:
    cmd = [sys.executable, "-m", "bench.engine_start", "--one", "--mode", mode, "--settle-s", str(args.settle_s)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)   # as `make test` and an installed server run: bytecode cached
    out = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", action="store_true")
    ap.add_argument("--mode", default="psd", choices=("ar", "sd", "psd"))
    ap.add_argument("--modes", default="psd,sd,ar")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--settle-s", type=float, default=5.0, help="wait after Ray's start, before the window")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure_one(args)), flush=True)
        return
    rows = []
    run_fresh(args.modes.split(",")[0], args)   # writes the bytecode of what the processes import (not recorded)
    for run in range(args.runs):
        for mode in args.modes.split(","):
            row = {"run": run, **run_fresh(mode, args)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    lines = []
    for mode in args.modes.split(","):
        mine = [r for r in rows if r["mode"] == mode]
        cols = ["wall_s", "all_window"] + [f"{r}_window" for r in ROLES] + [f"{r}_total" for r in ROLES[:4]]
        parts = [f"{c} {statistics.median(r[c] for r in mine if c in r):.2f}" for c in cols
                 if any(c in r for r in mine)]
        lines.append(f"{mode} (median of {len(mine)}): " + ", ".join(parts))
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(json.dumps(r) for r in rows) + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
