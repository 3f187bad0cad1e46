"""Paged KV cache (issue 25): concurrency, prefix caching and decode step against the static layout.

    python -m bench.paged_kv [--parts concurrency,prefix,decode] [--out bench/results] [--smoke]

Random bf16 weights at Llama-3.1-8B shape (`random:llama-8b`), mode `ar`, one GPU:
- concurrency: the long-tailed workload (prompts lognormal median 300 / P99 3000, outputs median 150 / P99
  1000, greedy, no EOS) at max_len 8192 and gpu_memory_utilization 0.9, all submitted at once to a paged
  Engine: the most requests resident at once (`peak_running`) against the slots a static cache (every slot
  holding max_len + headroom) gets from the same KV memory (`slots_static`).
- prefix: a shared 1000-token system prompt + 100 distinct tokens per request, with and without prefix
  caching: TTFT of one request at a time (after two warm-up requests that put the system prompt in the cache)
  and output tokens/s of a batch of them together; the tokens must be the same with and without the cache.
- decode: ModelRunner.step (CUDA graph) at batch 64, context 512, q = 1 and 5: blocks of 16 scattered over the
  pool (allocated round-robin across the rows) against the static layout (each slot's blocks in order, so its
  positions are contiguous in memory, as before paging). Both read the block table; the step before paging
  is bench.engine_speed at the parent commit, to be run in the same call for the 1.03x target.
ratio: paged / static (concurrency, decode) or cached / uncached (TTFT, tokens/s).
--smoke: the `random:tiny` model on the CPU with small numbers, to check the script.
The GPU machine gets the tree without .git: pass GIT_SHA=<sha> in the environment to record it.
"""
from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time

import numpy as np
import torch

from bench.common import command_line, device_name, git_sha, markdown_table, say, versions, write_results
from bench.engine_speed import time_engine
from bench.prefill_speed import longtail_lengths
from minedraft_ray.engine.engine import Engine
from minedraft_ray.engine.kv_cache import HEADROOM
from minedraft_ray.engine.loader import load_model
from minedraft_ray.engine.presets import resolve_model
from minedraft_ray.engine.runner import ModelRunner
from minedraft_ray.engine.sampling import SamplingParams

COLUMNS = ["part", "variant", "requests", "max_len", "peak_running", "slots_static", "preemptions", "ttft_ms",
           "tokens_per_s", "hit_rate", "same_tokens", "batch", "q", "context", "step_ms", "ratio", "git_sha",
           "command", "device"]
TABLE_COLUMNS = ["part", "variant", "requests", "peak_running", "slots_static", "preemptions", "ttft_ms",
                 "tokens_per_s", "hit_rate", "same_tokens", "batch", "q", "step_ms", "ratio"]


def concurrency(model: str, device, settings: dict) -> list[dict]:
    n, max_len = settings["requests"], settings["max_len"]
    prompts = longtail_lengths(n, 300, 3000, max_len // 2, seed=0)
    outputs = longtail_lengths(n, 150, 1000, max_len // 2, seed=1)
    engine = Engine(model, mode="ar", device=device, max_len=max_len, max_batch=settings["max_batch"],
                    gpu_memory_utilization=settings["utilization"])
    vocab = engine.verifier.runner.vocab
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, vocab, p).tolist() for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outputs]
    start = time.perf_counter()
    outs = engine.generate(ids, params)
    wall = time.perf_counter() - start
    stats = engine.cache_stats()
    cache = engine.verifier.runner.cache
    # the same KV memory laid out as before: every slot max_len + HEADROOM tokens
    slots_static = (cache.num_blocks - 1) * cache.block_size // (max_len + HEADROOM)
    tokens = sum(len(o.token_ids) for o in outs)
    return [dict(part="concurrency", variant="paged", requests=n, max_len=max_len, peak_running=engine.peak_running,
                 slots_static=slots_static, preemptions=stats["preemptions"], tokens_per_s=tokens / wall,
                 ratio=engine.peak_running / max(slots_static, 1))]


def prefix(model: str, device, settings: dict) -> list[dict]:
    rows, results = [], {}
    rng = np.random.default_rng(0)
    for caching in (False, True):
        engine = Engine(model, mode="ar", device=device, max_len=settings["prefix_max_len"],
                        max_batch=settings["prefix_batch"], gpu_memory_utilization=settings["utilization"],
                        prefix_caching=caching)
        vocab = engine.verifier.runner.vocab
        rng = np.random.default_rng(0)  # the same prompts in both runs
        system = rng.integers(0, vocab, settings["system"]).tolist()
        suffixes = [rng.integers(0, vocab, settings["suffix"]).tolist() for _ in range(2 + settings["ttft_requests"]
                                                                                      + settings["batch_requests"])]
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ttfts = []
        for i, suffix in enumerate(suffixes[:2 + settings["ttft_requests"]]):
            out = engine.generate([system + suffix], one)[0]
            if i >= 2:  # two warm-ups: graphs, compilation, and the system prompt into the cache
                ttfts.append(out.stats["ttft"] * 1e3)
        batch = [system + s for s in suffixes[2 + settings["ttft_requests"]:]]
        params = SamplingParams(temperature=0.0, max_tokens=settings["max_tokens"], ignore_eos=True)
        start = time.perf_counter()
        outs = engine.generate(batch, params)
        wall = time.perf_counter() - start
        results[caching] = [o.token_ids for o in outs]
        stats = engine.cache_stats()["target"]
        rows.append(dict(part="prefix", variant="cached" if caching else "uncached", requests=len(batch),
                         max_len=engine.max_len, ttft_ms=statistics.median(ttfts),
                         tokens_per_s=sum(len(o.token_ids) for o in outs) / wall, hit_rate=stats["hit_rate"]))
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        row["same_tokens"] = results[True] == results[False]
    rows[0]["ratio"], rows[1]["ratio"] = 1.0, rows[1]["ttft_ms"] / rows[0]["ttft_ms"]
    rows.append(dict(part="prefix tokens/s", variant="cached", requests=rows[1]["requests"],
                     tokens_per_s=rows[1]["tokens_per_s"], ratio=rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]))
    return rows


def decode(model: str, device, settings: dict) -> list[dict]:
    batch, context, max_len = settings["decode_batch"], settings["context"], settings["decode_max_len"]
    rows, step_ms = [], {}
    net = load_model(resolve_model(model), device)
    for variant in ("static", "paged"):
        if variant == "static":  # every slot's blocks in order from the start: its positions contiguous in memory
            runner = ModelRunner(net, device, num_slots=batch, max_len=max_len, max_batch=batch)
        else:
            per_row = math.ceil((context + 8) / 16)
            runner = ModelRunner(net, device, num_slots=batch, max_len=max_len, max_batch=batch, block_size=16,
                                 num_blocks=batch * per_row + 1)
            for i in range(1, per_row + 1):  # round-robin: neighbouring blocks belong to different rows
                runner.reserve(list(range(batch)), [i * 16] * batch)
        for q in (1, 5):
            ms = time_engine(runner, [context] * batch, q, settings["warmup"], settings["reps"],
                             f"{variant} B={batch} q={q}")
            step_ms[(variant, q)] = ms
            rows.append(dict(part="decode", variant=variant, batch=batch, q=q, context=context, max_len=max_len,
                             step_ms=ms))
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        row["ratio"] = step_ms[(row["variant"], row["q"])] / step_ms[("static", row["q"])]
    return rows


PARTS = {"concurrency": concurrency, "prefix": prefix, "decode": decode}
GPU = dict(model="random:llama-8b", requests=1500, max_len=8192, max_batch=1024, utilization=0.9,
           prefix_max_len=2048, prefix_batch=64, system=1000, suffix=100, ttft_requests=20, batch_requests=256,
           max_tokens=64, decode_batch=64, context=512, decode_max_len=4096, warmup=10, reps=100)
SMOKE = dict(model="random:tiny", requests=12, max_len=256, max_batch=8, utilization=0.9, prefix_max_len=256,
             prefix_batch=4, system=40, suffix=5, ttft_requests=1, batch_requests=4, max_tokens=4, decode_batch=4,
             context=24, decode_max_len=64, warmup=1, reps=3)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--out", default=None, help="results folder (default bench/results; smoke: /tmp/paged_kv_smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, small numbers: checks the script")
    args = p.parse_args(argv)
    settings = SMOKE if args.smoke else GPU
    device = torch.device("cpu" if args.smoke else "cuda")
    out_dir = args.out or ("/tmp/paged_kv_smoke" if args.smoke else "bench/results")
    sha, command, device_str = git_sha(), command_line("bench.paged_kv"), device_name(device)
    print(f"{device_str}; {versions()}; git {sha}", flush=True)
    rows = []
    for part in args.parts.split(","):
        new = PARTS[part](settings["model"], device, settings)
        for row in new:
            row.update(git_sha=sha, command=command, device=device_str)
        say(markdown_table(new, TABLE_COLUMNS))
        rows += new
        write(rows, out_dir, command, device_str, settings)   # each part's rows kept should a later one fail
        gc.collect()   # the part's engine (graphs, pool) sits in reference cycles: free it before the next sizes its pool
        if device.type == "cuda":
            torch.cuda.empty_cache()


def write(rows: list[dict], out_dir, command: str, device_str: str, settings: dict) -> None:
    notes = [versions(), f"model {settings['model']}, mode ar, bf16 on CUDA (fp32 on the CPU)",
             f"concurrency: {settings['requests']} long-tailed requests at max_len {settings['max_len']}, "
             f"max_batch {settings['max_batch']}, gpu_memory_utilization {settings['utilization']}; slots_static = "
             "the paged pool's tokens / (max_len + headroom)",
             f"prefix: system prompt {settings['system']} tokens + {settings['suffix']}-token suffixes; ttft_ms: "
             "median "
             f"of {settings['ttft_requests']} single requests; tokens/s: {settings['batch_requests']} requests of "
             f"{settings['max_tokens']} tokens, max_batch {settings['prefix_batch']}",
             f"decode: median of {settings['reps']} steps after {settings['warmup']} warm-up (bench.engine_speed's "
             "time_engine: step + greedy sample)"]
    path = write_results(rows, out_dir, "paged_kv", COLUMNS, "Paged KV cache", command, device_str, notes,
                         TABLE_COLUMNS)
    print(f"\nwrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
