"""Per-step Ray overhead of each draft channel: step wall time - max(t_draft, t_verify), psd mode.

    python -m bench.transport_overhead [--target random:tiny --draft random:tiny] [--steps 300]
    python -m bench.transport_overhead --target random:llama-8b --draft random:llama-1b \
        --transports collective,ray_collective

On a GPU machine pass `random:llama-8b` / `random:llama-1b`. Writes bench/results/transport_overhead.{parquet,md}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import ray

from bench.common import command_line, git_sha, write_results
from minedraft_ray import LLM, SamplingParams


def measure(args, transport: str) -> dict:
    overlap = {"auto": None, "on": True, "off": False}[args.verifier_overlap]
    llm = LLM(args.target, args.draft, mode="psd", k=args.k, max_batch=args.max_batch, transport=transport,
              torch_threads=1 if args.device == "cpu" else None, device=args.device, verifier_overlap=overlap,
              psd_high_load="psd", psd_low_load="psd")   # the channel is measured in psd's steps
    try:
        n = 2 * args.max_batch
        prompts = [[(7 * i + j) % 500 + 3 for j in range(32)] for i in range(n)]
        params = [SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True, seed=i) for i in range(n)]
        llm.generate(prompts, params)
        hist = [h for h in llm.history() if h.regime == "psd" and h.drafted and h.verified]
        hist = hist[len(hist) // 10: len(hist) - len(hist) // 10]   # steady state
        overhead = [h.step_ms - max(h.t_draft_ms, h.t_verify_ms) for h in hist]
        return {"transport": transport, "steps": len(hist), "step_ms": statistics.median(h.step_ms for h in hist),
                "t_draft_ms": statistics.median(h.t_draft_ms for h in hist),
                "t_verify_ms": statistics.median(h.t_verify_ms for h in hist),
                "ray_overhead_ms": statistics.median(overhead),
                "manager_host_ms": statistics.median(h.host_ms for h in hist), "max_batch": args.max_batch, "k": args.k,
                "verifier_overlap": llm.info()["verifier_overlap"],
                "target": args.target, "draft": args.draft}
    finally:
        llm.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="random:tiny")
    ap.add_argument("--draft", default="random:tiny")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64, help="tokens per request")
    ap.add_argument("--transports", default="object_store,collective")
    ap.add_argument("--verifier-overlap", choices=["auto", "on", "off"], default="on",
                    help="the threaded verifier (and drafter) for every channel, so they run alike")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the transports (interleaved)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not ray.is_initialized():
        gpus = None if args.device != "cpu" else 2
        ray.init(address="local", include_dashboard=False, num_gpus=gpus,
                 _temp_dir=tempfile.mkdtemp(prefix="r", dir="/tmp"))
    rows = [measure(args, t) for _ in range(args.rounds) for t in args.transports.split(",")]
    import torch
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    for r in rows:
        r.update(git_sha=git_sha(), device=device)
        print(r, flush=True)
    columns = ["transport", "steps", "step_ms", "t_draft_ms", "t_verify_ms", "ray_overhead_ms", "manager_host_ms",
               "max_batch", "k", "verifier_overlap",
               "target", "draft", "git_sha", "device"]
    name = "transport_overhead" + ("_gpu" if torch.cuda.is_available() else "_cpu")
    write_results(rows, args.out, name, columns, "Draft-channel overhead per psd step",
                  command_line("bench.transport_overhead"), device,
                  ["ray_overhead_ms = median over steady-state psd steps of step wall time - max(t_draft, t_verify)",
                   "manager_host_ms = the part of the step the manager spent in its own Python, not awaiting actors"])


if __name__ == "__main__":
    main()
