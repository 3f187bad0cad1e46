"""What the container of a draft costs on its Ray hop: one actor returns draft ids ([rows, k] int64) as a
torch tensor, a numpy array or nested lists, and another actor takes them by reference (through the owner,
as the draft channel does); the median round trip per container.

    python -m bench.payload_hop [--rows 64] [--k 3] [--trips 400]

Writes bench/results/payload_hop_{cpu,gpu}.{parquet,md} (the host does this work: the GPU is not involved).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import ray
import torch

from bench.common import command_line, git_sha, write_results

CONTAINERS = {"torch": lambda t: t, "numpy": lambda t: t.numpy(), "list": lambda t: t.tolist()}


@ray.remote
class Drafter:
    def draft(self, rows: int, k: int, container: str):
        return {"ids": CONTAINERS[container](torch.randint(0, 128_000, (rows, k))), "probs": None}, 0.0


@ray.remote
class Verifier:
    def verify(self, drafts: dict) -> int:
        return len(drafts["ids"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--trips", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the containers (interleaved)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(address="local", include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="r", dir="/tmp"))
    drafter, verifier = Drafter.remote(), Verifier.remote()
    times = {c: [] for c in CONTAINERS}
    for _ in range(args.rounds):
        for container in CONTAINERS:
            for trip in range(args.trips):
                t0 = time.perf_counter()
                drafts, _ = drafter.draft.options(num_returns=2).remote(args.rows, args.k, container)
                assert ray.get(verifier.verify.remote(drafts)) == args.rows
                if trip >= args.trips // 10:   # the first tenth warms the path
                    times[container].append((time.perf_counter() - t0) * 1e3)
    gpu = torch.cuda.is_available()
    device = f"{os.cpu_count()}-core host of {torch.cuda.get_device_name(0)}" if gpu else f"cpu ({os.cpu_count()} cores)"
    rows = [{"container": c, "rows": args.rows, "k": args.k, "trips": len(t), "median_ms": statistics.median(t),
             "p90_ms": statistics.quantiles(t, n=10)[-1], "git_sha": git_sha(), "device": device}
            for c, t in times.items()]
    for r in rows:
        print(r, flush=True)
    write_results(rows, args.out, "payload_hop_" + ("gpu" if gpu else "cpu"),
                  ["container", "rows", "k", "trips", "median_ms", "p90_ms", "git_sha", "device"],
                  "Draft payload on its Ray hop: drafter -> owner -> verifier", command_line("bench.payload_hop"), device,
                  ["round trip: the draft task's submission to the verifier task's result, both actors on this host",
                   "the draft channel returns lists (ids) and numpy (probabilistic drafts' q) since this measurement"])
    ray.shutdown()


if __name__ == "__main__":
    main()
