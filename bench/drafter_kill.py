"""The drafter-kill drill on real devices: the drafter actor is killed mid-run, in each mode that has one.

The embedded default pair (fp32) serves N greedy requests; after a few steps the drafter actor is killed.
It passes when every request completes with the target-only (`ar`, same devices) output token for token,
the engine served `ar` steps while the drafter was down, restarted the drafter, and speculates again
afterwards. tests/test_runtime.py runs the same drill on a CPU with fake GPUs; this is the GPU run.

    python -m bench.drafter_kill [--modes psd,sd_split] [--requests 16] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import ray

from bench.common import git_sha
from minedraft_ray.engine.sampling import SamplingParams
from minedraft_ray.runtime.llm import LLM, init_local_ray

PROMPTS = ["def fibonacci(n):", "import numpy as np\n\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):", "def quicksort(arr):", "# read a file line by line\n", "x = [1, 2, 3]\n",
           "def main():\n    args = "]


def wait_for(check, timeout_s: float) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def drill(mode: str, prompts: list[str], params: list[SamplingParams], reference: list[list[int]], common: dict,
          transport: str) -> dict:
    llm = LLM(mode=mode, k=3, transport=transport, **common)
    try:
        ref = llm.manager.generate_batch.remote([llm._encode(p) for p in prompts], params)
        started = wait_for(lambda: llm.info()["steps"] >= 5, 60)
        killed = ray.get(llm.manager.kill_drafter.remote())
        outs = ray.get(ref, timeout=300)
        info = llm.info()
        restarted = wait_for(lambda: llm.info()["drafter_alive"], 120)
        regimes = [h.regime for h in llm.history()]
        again = llm.generate(prompts[:4], params[:4])
        result = {
            "mode": mode, "transport": info["transport"], "killed_after_steps": started and killed,
            "completed": sum(o["finish_reason"] is not None for o in outs), "requests": len(outs),
            "equal_to_ar": sum(o["token_ids"] == r for o, r in zip(outs, reference)),
            "drafter_failures": info["drafter_failures"], "ar_steps_while_down": regimes.count("ar"),
            "draft_rounds_failed": info["draft_rounds_failed"],   # verifies whose drafts died with the drafter
            "restarted": restarted and llm.info()["drafter_restarts"] >= 1,
            "equal_after_restart": sum(o.token_ids == r for o, r in zip(again, reference[:4])),
            "accepted_after_restart": sum(o.stats["accepted"] for o in again),
        }
        result["passed"] = (result["killed_after_steps"] and result["completed"] == result["requests"]
                            and result["equal_to_ar"] == result["requests"] and result["drafter_failures"] >= 1
                            and result["ar_steps_while_down"] > 0 and result["restarted"]
                            and result["equal_after_restart"] == 4 and result["accepted_after_restart"] > 0)
        return result
    finally:
        llm.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="psd,sd_split")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", default=None)
    p.add_argument("--transport", default="auto", choices=["auto", "object_store", "collective", "ray_collective"])
    p.add_argument("--fake-gpus", action="store_true", help="CPU: 2 logical GPUs for the placement group")
    args = p.parse_args(argv)
    init_local_ray(**({"num_gpus": 2, "num_cpus": 4} if args.fake_gpus else {}))
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(args.requests)]
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens - 7 * (i % 5), ignore_eos=True)
              for i in range(args.requests)]
    # fp32, so that greedy argmax ties between a verify's and a decode's kernels cannot split the outputs
    common = {"max_batch": 8, "dtype": "float32"}
    t0 = time.time()
    ar = LLM(mode="ar", **common)
    try:
        reference = [o.token_ids for o in ar.generate(prompts, params)]
    finally:
        ar.shutdown()
    print(f"ar reference: {len(reference)} requests in {time.time() - t0:.1f} s (start-up included)", flush=True)
    results = []
    for mode in args.modes.split(","):   # each verdict printed as it comes: a run cut short still reports
        t0 = time.time()
        results.append({**drill(mode, prompts, params, reference, common, args.transport),
                        "seconds": round(time.time() - t0, 1)})
        print(json.dumps(results[-1]), flush=True)
    summary = {"git_sha": git_sha(), "results": results, "passed": all(r["passed"] for r in results)}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "drafter_kill.json").write_text(text)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
