"""Prefill speed at Llama-3.1-8B shape (random bf16 weights), three workloads:

- graphs: a few short prompts, as a server admits them per step: the padded path graphed vs eager, and the
  packed path (graphed per token-count bucket). Timed on the host (wall clock from the call to its logits
  being ready) and on the device (CUDA events around it): an eager forward launches ~10 kernels per layer
  from Python, so its wall time can be several times its device work; a graph replay launches once.
- longtail: long-tailed prompt lengths (lognormal, median and P99 given, cut at the context, fixed seed),
  prefilled in calls of --batch prompts, packed vs padded in the same process: prompt tokens/s and the ratio.
- check: packed vs padded vs one prompt at a time vs chunked (--chunk tokens per launch), the logits of each
  prompt's last token, fp32 and bf16; max abs diff relative to the logits' scale. Fails (exit 1) past the
  tolerance, so the Triton kernels are verified on the GPU too.

    python -m bench.prefill_speed [--workload graphs|longtail|check] [--out DIR] [--smoke]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np
import torch

from bench.common import command_line, device_name, git_sha, markdown_table, say, synchronize, write_results
from minedraft_ray.engine.loader import load_model
from minedraft_ray.engine.presets import resolve_model
from minedraft_ray.engine.runner import ModelRunner

COLUMNS = ["model", "prompts", "length", "path", "wall_ms", "device_ms", "tokens_per_s"]
LONGTAIL_COLUMNS = ["model", "prompts", "batch", "tokens", "median", "p99", "max_len", "seed", "path", "wall_ms",
                    "device_ms", "tokens_per_s", "speedup_over_padded"]
Z99 = 2.3263478740408408  # the standard normal's 99th percentile
# relative max abs diff of last-token logits allowed by `check` (bf16: other GEMM shapes round differently
# over 32 layers; fp32: reduction order only)
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


def longtail_lengths(n: int, median: float, p99: float, max_len: int, seed: int) -> list[int]:
    """n lognormal prompt lengths with this median and 99th percentile, cut to 1..max_len."""
    sigma = math.log(p99 / median) / Z99
    draws = np.random.default_rng(seed).lognormal(math.log(median), sigma, n)
    return np.clip(np.round(draws), 1, max_len).astype(int).tolist()


def build_runner(model_spec: str, device: torch.device, num_slots: int, max_len: int,
                 dtype: torch.dtype | None = None, **kw) -> ModelRunner:
    model = load_model(resolve_model(model_spec), device, dtype)
    return ModelRunner(model, device, num_slots=num_slots, max_len=max_len, max_batch=num_slots, **kw)


def timed(call, device: torch.device, reps: int, warmup: int = 2) -> tuple[float, float]:
    """Median (wall ms, device ms) of call()."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        call()
    synchronize(device)
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


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]


# ---- workloads -------------------------------------------------------------------------------------
def run_graphs(args, device, name) -> None:
    shapes = [(1, 8), (2, 12)] if args.smoke else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    runner = build_runner(name, device, num_slots=4, max_len=64 if args.smoke else 1024)
    runner.capture_all(())  # the packed graphs, as the workers capture them at start
    runner.packed_prefill = False
    runner.capture_all(())  # and the padded ones
    rows = []
    for n, length in shapes:
        prompts = random_prompts([length] * n, runner.cfg.vocab_size)
        slots = list(range(n))

        def eager():
            runner.set_lengths(slots, [0] * n)
            return runner.extend(slots, prompts, packed=False)

        calls = {"eager": eager, "graph": lambda: runner.prefill(slots, prompts, packed=False),
                 "packed": lambda: runner.prefill(slots, prompts, packed=True)}
        for path, call in calls.items():
            wall, dev = timed(call, device, 2 if args.smoke else args.reps, warmup=3)
            rows.append({"model": name, "prompts": n, "length": length, "path": path, "wall_ms": round(wall, 3),
                         "device_ms": round(dev, 3), "tokens_per_s": round(n * length / wall * 1e3)})
            say(markdown_table(rows[-1:], COLUMNS).splitlines()[-1])
    for row in rows:
        row["git_sha"] = git_sha()
    write_results(rows, args.out or "/tmp/prefill_speed", "prefill_speed", COLUMNS + ["git_sha"],
                  "Prefill of a few short prompts: padded eager, padded graphed, packed",
                  command_line("bench.prefill_speed", args.argv), device_name(device),
                  ["wall_ms: host clock from the call to its logits being ready; device_ms: CUDA events around the "
                   "call (an eager forward's device span includes the gaps while the host launches)",
                   "packed: no padding, graphed per token-count bucket up to the largest bucket"])


def run_longtail(args, device, name) -> None:
    lengths = longtail_lengths(args.prompts, args.median, args.p99, args.max_len, args.seed)
    runner = build_runner(name, device, num_slots=args.batch, max_len=args.max_len)
    runner.capture_all(())
    prompts = random_prompts(lengths, runner.cfg.vocab_size, args.seed)
    calls = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    say(f"{len(lengths)} prompts, {sum(lengths)} tokens, median {int(np.median(lengths))}, "
        f"P99 {int(np.percentile(lengths, 99))}, max {max(lengths)}; {len(calls)} calls of <= {args.batch}")

    def prefill_all(packed: bool):
        def call():
            for group in calls:
                runner.prefill(list(range(len(group))), group, packed=packed)
        return call

    rows = []
    for path in ("padded", "packed"):
        wall, dev = timed(prefill_all(path == "packed"), device, args.reps, warmup=1)
        rows.append({"model": name, "prompts": len(lengths), "batch": args.batch, "tokens": sum(lengths),
                     "median": args.median, "p99": args.p99, "max_len": args.max_len, "seed": args.seed,
                     "path": path, "wall_ms": round(wall, 3), "device_ms": round(dev, 3),
                     "tokens_per_s": round(sum(lengths) / wall * 1e3)})
    for row in rows:
        row["speedup_over_padded"] = round(row["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
        row["git_sha"] = git_sha()
        say(markdown_table([row], LONGTAIL_COLUMNS).splitlines()[-1])
    write_results(rows, args.out or "/tmp/prefill_speed", "prefill_longtail", LONGTAIL_COLUMNS + ["git_sha"],
                  "Prefill of long-tailed prompts: packed vs padded (same process)",
                  command_line("bench.prefill_speed", args.argv), device_name(device),
                  [f"lengths: lognormal, median {args.median}, P99 {args.p99}, cut to 1..{args.max_len}, "
                   f"seed {args.seed}; prompts prefilled in calls of {args.batch} in drawn order",
                   "tokens_per_s: real prompt tokens per wall second over all calls (median of the reps)"])


def run_check(args, device, name) -> bool:
    lengths = longtail_lengths(args.prompts, args.median, args.p99, args.max_len, args.seed)[:args.batch]
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        runner = build_runner(name, device, num_slots=len(lengths), max_len=args.max_len, dtype=dtype)
        chunked = ModelRunner(runner.model, device, num_slots=len(lengths), max_len=args.max_len,
                              max_batch=len(lengths), max_prefill_tokens=args.chunk)
        prompts = random_prompts(lengths, runner.cfg.vocab_size, args.seed)
        slots = list(range(len(prompts)))
        padded = runner.prefill(slots, prompts, packed=False).clone()
        results = {"packed": runner.prefill(slots, prompts, packed=True).clone(),
                   "one_at_a_time": torch.cat([runner.prefill([s], [p], packed=True).clone()
                                               for s, p in zip(slots, prompts)]),
                   f"chunked_{args.chunk}": chunked.prefill(slots, prompts).clone()}
        scale = padded.abs().max().item()
        for what, logits in results.items():
            diff = (logits - padded).abs().max().item()
            same_argmax = (logits.argmax(-1) == padded.argmax(-1)).float().mean().item()
            passed = diff <= CHECK_TOLERANCE[dtype] * scale and math.isfinite(diff)
            ok &= passed
            say(f"{str(dtype):15} {what:14} vs padded: max abs diff {diff:.3e} (logits up to {scale:.3g}; "
                f"tolerance {CHECK_TOLERANCE[dtype] * scale:.3e}), same argmax {same_argmax:.3f} "
                f"{'ok' if passed else 'FAIL'}")
        del runner, chunked, padded, results
        torch.cuda.empty_cache() if device.type == "cuda" else None
    say(f"lengths {lengths}: {'all ok' if ok else 'FAILED'}")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=("graphs", "longtail", "check"), default="graphs")
    p.add_argument("--out", default=None)
    p.add_argument("--model", default="random:llama-8b")
    p.add_argument("--shapes", default="1x64,1x192,2x192,4x192,1x512", help="graphs: PROMPTSxLENGTH,...")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=128, help="longtail/check: prompts drawn")
    p.add_argument("--batch", type=int, default=16, help="longtail: prompts per prefill call; check: prompts")
    p.add_argument("--median", type=float, default=300)
    p.add_argument("--p99", type=float, default=3000)
    p.add_argument("--max-len", type=int, default=4096, help="the context: lengths are cut to it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=384, help="check: tokens per launch of the chunked runner")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, small workload")
    args = p.parse_args(argv)
    args.argv = argv
    device = torch.device("cpu" if args.smoke else "cuda")
    name = "random:tiny" if args.smoke else args.model
    if args.smoke:
        args.prompts, args.batch, args.median, args.p99, args.max_len = 12, 4, 10, 60, 64
        args.reps, args.chunk = min(args.reps, 2), 7
    if args.workload == "graphs":
        run_graphs(args, device, name)
    elif args.workload == "longtail":
        run_longtail(args, device, name)
    elif not run_check(args, device, name):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
