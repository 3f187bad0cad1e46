"""Speed-up of sd and psd over ar for the embedded default pair (greedy, held-in-package prompts).

    python -m bench.default_pair_speed [--requests 16] [--max-tokens 96]

On a CPU the rows are informational (one torch thread per actor); on a GPU machine the same command
measures the real thing. Writes bench/results/default_pair_speed_{cpu,gpu}.{parquet,md}.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import ray
import torch

from bench.common import command_line, git_sha, write_results
from minedraft_ray import LLM, SamplingParams
from minedraft_ray.config import EngineConfig

PROMPTS = ["def fibonacci(n):", "import numpy as np\n\n\ndef ", "class Config:\n    \"\"\"", "for i in range(",
           "def read_json(path):\n    ", "import os\nimport sys\n\n", "    def __init__(self, name):\n",
           "# Parse the command line\nparser = argparse.ArgumentParser("]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--dtype", default="auto", help="float32: greedy outputs comparable token for token")
    ap.add_argument("--modes", default="ar,sd,sd_split,psd", help="ar first: the others are compared with it")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if modes[0] != "ar":
        ap.error("--modes must start with ar (the reference)")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    gpu = torch.cuda.is_available()
    ray.init(address="local", include_dashboard=False, num_gpus=None if gpu else 2,
             _temp_dir=tempfile.mkdtemp(prefix="r", dir="/tmp"))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, base, reference = [], None, None
    for mode in modes:
        cfg = EngineConfig(mode=mode, k=args.k, max_batch=args.max_batch, torch_threads=None if gpu else 1,
                           dtype=args.dtype, **({"draft": None} if mode == "ar" else {}))
        llm = LLM(config=cfg)
        try:
            # warm-up at the run's load: every request (short), so psd's first regime measurements (runtime/regime.py)
            # and every batch size the run meets happen here, not in the timed run
            llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=4 + 4 * (i % 4), ignore_eos=True)
                                   for i in range(len(prompts))])
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
        finally:
            llm.shutdown()
        tokens = sum(len(o.token_ids) for o in outs)
        drafted = sum(o.stats["drafted"] for o in outs)
        steps = sum(o.stats["verify_steps"] for o in outs)
        row = {"mode": mode, "k": 0 if mode == "ar" else args.k, "max_batch": args.max_batch,
               "requests": args.requests, "tokens_per_s": tokens / wall,
               "acceptance_rate": sum(o.stats["accepted"] for o in outs) / drafted if drafted else None,
               "acceptance_length": 1 + sum(o.stats["accepted"] for o in outs) / steps if steps else None}
        reference = reference or [o.token_ids for o in outs]
        # greedy: the same tokens as ar, request by request (exact in float32; bf16 may differ by rounding)
        row["equal_to_ar"] = sum(o.token_ids == t for o, t in zip(outs, reference)) / len(outs)
        base = base or row["tokens_per_s"]
        row["speedup_vs_ar"] = row["tokens_per_s"] / base
        print(row, flush=True)
        rows.append(row)
    device = torch.cuda.get_device_name(0) if gpu else f"cpu ({os.cpu_count()} cores, 1 torch thread per actor)"
    for r in rows:
        r.update(git_sha=git_sha(), device=device, dtype=args.dtype)
    columns = ["mode", "k", "max_batch", "requests", "tokens_per_s", "speedup_vs_ar", "acceptance_rate",
               "acceptance_length", "equal_to_ar", "dtype", "git_sha", "device"]
    write_results(rows, args.out, "default_pair_speed_" + ("gpu" if gpu else "cpu"),
                  columns, "Default pair: sd and psd against ar", command_line("bench.default_pair_speed"), device,
                  ["greedy; prompts are code openings; CPU rows are informational (the GPU run is the real one)"])
    ray.shutdown()


if __name__ == "__main__":
    main()
