"""Prefill of a few short prompts, as a server admits them per step: graphed (ModelRunner.prefill) vs eager.

Random bf16 weights at Llama-3.1-8B shape. For each (prompts, length) the call is timed on the host
(wall clock from the call to its logits on the device being ready) and on the device (CUDA events
around it): an eager forward launches ~10 kernels per layer from Python, so its wall time can be
several times its device work; a graph replay launches once.

    python -m bench.prefill_speed [--out DIR] [--model 8b] [--smoke]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.common import command_line, device_name, git_sha, markdown_table, say, synchronize, write_results
from bench.engine_speed import build_engine, hf_config
from minedraft_ray.engine.model import ModelConfig

COLUMNS = ["model", "prompts", "length", "path", "wall_ms", "device_ms", "tokens_per_s"]


def time_prefill(runner, prompts, graphed: bool, reps: int) -> tuple[float, float]:
    """Median (wall ms, device ms) of one prefill of `prompts` into slots 0..n-1."""
    slots = list(range(len(prompts)))
    cuda = runner.device.type == "cuda"

    def call():
        if graphed:
            return runner.prefill(slots, prompts)
        runner.set_lengths(slots, [0] * len(slots))
        return runner.extend(slots, prompts)

    for _ in range(3):
        call()
    synchronize(runner.device)
    walls, devices = [], []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        call()
        if cuda:
            end.record()
            end.synchronize()
            devices.append(start.elapsed_time(end))
        walls.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(walls), statistics.median(devices) if devices else float("nan")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--model", default="8b")
    p.add_argument("--shapes", default="1x64,1x192,2x192,4x192,1x512", help="PROMPTSxLENGTH,...")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    name = "tiny" if args.smoke else args.model
    shapes = [(1, 8), (2, 12)] if args.smoke else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    cfg = ModelConfig.from_hf_dict(hf_config(name))
    runner = build_engine(cfg, device, num_slots=4, max_len=64 if args.smoke else 1024)
    runner.capture_all(())  # the prefill graphs, as the workers capture them at start
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, length in shapes:
        prompts = [torch.randint(cfg.vocab_size, (length,), generator=gen).tolist() for _ in range(n)]
        for graphed in (False, True):
            wall, dev = time_prefill(runner, prompts, graphed, 2 if args.smoke else args.reps)
            rows.append({"model": name, "prompts": n, "length": length, "path": "graph" if graphed else "eager",
                         "wall_ms": round(wall, 3), "device_ms": round(dev, 3),
                         "tokens_per_s": round(n * length / wall * 1e3)})
            say(markdown_table(rows[-1:], COLUMNS).splitlines()[-1])
    for row in rows:
        row["git_sha"] = git_sha()
    write_results(rows, args.out or "/tmp/prefill_speed", "prefill_speed", COLUMNS + ["git_sha"],
                  "Prefill: graphed vs eager", command_line("bench.prefill_speed", argv), device_name(device),
                  ["wall_ms: host clock from the call to its logits being ready; device_ms: CUDA events around the "
                   "call (an eager forward's device span includes the gaps while the host launches)"])

if __name__ == "__main__":
    sys.exit(main())
