"""Paged KV cache (issue 25): concurrency, prefix caching, decode step and attention tiles.

    python -m bench.paged_kv [--parts concurrency,prefix,decode,tiles] [--out bench/results] [--smoke]

Random bf16 weights at Llama-3.1-8B shape (`random:llama-8b`), mode `ar`, one GPU:
- concurrency: real_traffic's long-tailed workload (its generator: prompts lognormal median 300 / P99 3000,
  outputs uniform 64..512) at max_len 8192 and gpu_memory_utilization 0.9. A paged Engine is built (its pool
  sized from the device's free memory) and its requests are admitted in order into the pool until it refuses
  one: `paged, whole sequence` holds each request's prompt + output (they all run to their end without
  preemption), `paged, at admission` what admission holds (prompt + first step; preemption makes room as they
  grow). `static`: the slots of max_len + headroom the same KV memory gives (`kv_tokens`). Seconds: the model
  is built, nothing runs. `concurrency_run` (not in the default parts; minutes) runs the whole workload to its
  end and reports the most requests running at once (`peak_running`) and the preemptions.
- prefix: a shared 1000-token system prompt + 100 distinct tokens per request, with and without prefix
  caching: TTFT of one request at a time (after two warm-up requests that put the system prompt in the cache)
  and output tokens/s of a batch of them together; the tokens must be the same with and without the cache.
- decode: ModelRunner.step (CUDA graph) at batch 64, context 512, q = 1 and 5: blocks of 16 scattered over the
  pool (allocated round-robin across the rows) against the static layout (each slot's blocks in order, so its
  positions are contiguous in memory, as before paging). Both read the block table; the step before paging
  is bench.engine_speed at the parent commit, to be run in the same call for the 1.03x target.
- tiles: the packed attention kernel (one layer's call) for requests x suffix new tokens over 1000 cached
  tokens each, at each tile shape (BLOCK_M x BLOCK_N / warps); `chosen`: the tile its launch_shape picks.
ratio: paged / static (concurrency, decode), cached / uncached (TTFT, tokens/s), or time / the 128x64 tile's.
--smoke: the `random:tiny` model on the CPU with small numbers, to check the script (tiles: the torch
reference path, as the CPU has no kernel).
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

from bench.common import command_line, device_name, git_sha, markdown_table, say, time_steps, versions, write_results
from bench.engine_speed import time_engine
from bench.real_traffic import Requests, Workload
from minedraft_ray.engine.engine import Engine
from minedraft_ray.engine.kv_blocks import HEADROOM, BlocksExhaustedError
from minedraft_ray.engine.loader import load_model
from minedraft_ray.engine.presets import resolve_model
from minedraft_ray.engine.runner import ModelRunner
from minedraft_ray.engine.sampling import SamplingParams

COLUMNS = ["part", "variant", "requests", "max_len", "kv_tokens", "mean_tokens", "peak_running", "slots_static",
           "preemptions", "ttft_ms", "tokens_per_s", "hit_rate", "same_tokens", "batch", "q", "tokens", "context",
           "chosen", "step_ms", "ratio", "build_s", "git_sha", "command", "device"]
TABLE_COLUMNS = ["part", "variant", "requests", "mean_tokens", "peak_running", "slots_static", "preemptions",
                 "ttft_ms", "tokens_per_s", "hit_rate", "same_tokens", "batch", "q", "tokens", "context", "chosen",
                 "step_ms", "ratio"]


def concurrency(model: str, device, settings: dict) -> list[dict]:
    """The most requests of real_traffic's workload resident at once: a paged Engine built at max_len and
    gpu_memory_utilization (its pool sized from the device's free memory), requests admitted in order into its
    block pool until the pool refuses one, each holding its whole sequence (prompt + output + the step's draft
    room: it runs to its end without preemption) or what admission holds (prompt + its first step: preemption
    makes room as they grow). The static layout gets the same KV memory as slots of max_len + HEADROOM."""
    max_len = settings["max_len"]
    work = Workload(**settings["workload"], max_len=max_len)
    start = time.perf_counter()
    engine = Engine(model, mode="ar", device=device, max_len=max_len, max_batch=settings["max_batch"],
                    num_slots=settings["concurrency_slots"], gpu_memory_utilization=settings["utilization"],
                    num_blocks=settings["concurrency_blocks"], cuda_graphs=False)
    build_s = time.perf_counter() - start
    runner, step = engine.verifier.runner, engine.k   # the engine reserves k positions past a step's length
    kv_tokens = runner.cache.capacity_tokens
    slots_static = kv_tokens // (max_len + HEADROOM)
    requests = Requests(work, runner.vocab)
    lengths = [(len(prompt), params.max_tokens)
               for prompt, params in map(requests, range(settings["concurrency_slots"]))]
    rows = [dict(part="concurrency", variant="static", requests=slots_static, max_len=max_len, kv_tokens=kv_tokens,
                 slots_static=slots_static, ratio=1.0)]
    for variant, need in (("paged, whole sequence", lambda p, o: p + o + step),
                          ("paged, at admission", lambda p, o: p + 1 + step)):
        resident = 0
        try:
            for slot, (p, o) in enumerate(lengths):
                runner.reserve([slot], [need(p, o)])
                resident += 1
        except BlocksExhaustedError:
            pass
        if resident == len(lengths):
            raise RuntimeError(f"all {resident} requests fit: raise concurrency_slots to find the pool's limit")
        held = sum(need(p, o) for p, o in lengths[:resident])
        for slot in range(resident):
            runner.release(slot)
        rows.append(dict(part="concurrency", variant=variant, requests=resident, max_len=max_len, kv_tokens=kv_tokens,
                         mean_tokens=held / resident, slots_static=slots_static, ratio=resident / max(slots_static, 1),
                         build_s=build_s))
    return rows


def concurrency_run(model: str, device, settings: dict) -> list[dict]:
    """The whole workload submitted at once to the paged Engine and run to the end: the most requests running
    at once (`peak_running`, with preemption), against the static slots of the same KV memory."""
    n, max_len = settings["requests"], settings["max_len"]
    work = Workload(**settings["workload"], max_len=max_len)
    engine = Engine(model, mode="ar", device=device, max_len=max_len, max_batch=settings["max_batch"],
                    gpu_memory_utilization=settings["utilization"])
    requests = Requests(work, engine.verifier.runner.vocab)
    ids, params = zip(*map(requests, range(n)))
    start = time.perf_counter()
    outs = engine.generate(list(ids), list(params))
    wall = time.perf_counter() - start
    stats = engine.cache_stats()
    kv_tokens = engine.verifier.runner.cache.capacity_tokens
    slots_static = kv_tokens // (max_len + HEADROOM)
    tokens = sum(len(o.token_ids) for o in outs)
    return [dict(part="concurrency run", variant="paged", requests=n, max_len=max_len, kv_tokens=kv_tokens,
                 peak_running=engine.peak_running, slots_static=slots_static, preemptions=stats["preemptions"],
                 tokens_per_s=tokens / wall, ratio=engine.peak_running / max(slots_static, 1))]


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


TILES = [(128, 64, 8), (64, 64, 8), (64, 64, 4), (32, 64, 4)]   # (BLOCK_M, BLOCK_N, num_warps)


def tile_name(shape: tuple[int, int, int]) -> str:
    return f"{shape[0]}x{shape[1]}/{shape[2]}w"


def tiles(model: str, device, settings: dict) -> list[dict]:
    """The packed attention kernel at 8B heads (32 query over 8 KV heads, 128 wide, bf16, blocks of 16) for
    launches of `requests` x `suffix` new tokens, each request over `context` cached tokens (the prefix-cache
    case: a suffix after a cached system prompt), at each tile shape; `chosen`: the tile `launch_shape` picks.
    ratio: time / the 128x64 tile's. The CPU (--smoke) has no kernel: the torch reference path, once per case."""
    from minedraft_ray.engine.attention import attend_packed
    from minedraft_ray.engine.attention_packed_triton import launch_shape
    from minedraft_ray.engine.attention_triton import num_sms

    hq, hkv, d, bs, context = 32, 8, 128, 16, settings["tile_context"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for n_requests, suffix in settings["tile_cases"]:
        T, per_request = n_requests * suffix, context + suffix
        blocks = -(-per_request // bs)
        k_pool = torch.randn(n_requests * blocks + 1, bs, hkv, d, generator=gen, device=device, dtype=dtype)
        v_pool = torch.randn(n_requests * blocks + 1, bs, hkv, d, generator=gen, device=device, dtype=dtype)
        tables = (torch.arange(n_requests * blocks, device=device) + 1).view(n_requests, blocks)
        q = torch.randn(T, hq, d, generator=gen, device=device, dtype=dtype)
        slots = torch.arange(n_requests, device=device).repeat_interleave(suffix)
        positions = (context + torch.arange(suffix, device=device)).repeat(n_requests)
        case = dict(part="tiles", requests=n_requests, tokens=T, context=context,
                    chosen=tile_name(launch_shape(T, hq // hkv, hkv, d, torch.bfloat16, num_sms(device))))
        if device.type != "cuda":
            args = (q, k_pool, v_pool, tables, slots, positions, d ** -0.5)
            ms = statistics.median(time_steps(lambda: attend_packed(*args), device, 0, 1, None))
            rows.append(dict(case, variant="reference", step_ms=ms))
            continue
        from minedraft_ray.engine.attention_packed_triton import attend_packed_triton

        times = {}
        for shape in TILES:
            m, n, w = shape

            def call():
                attend_packed_triton(q, k_pool, v_pool, tables, slots, positions, d ** -0.5, block_m=m, block_n=n,
                                     num_warps=w)
            times[shape] = statistics.median(time_steps(call, device, settings["warmup"], settings["reps"], None))
            rows.append(dict(case, variant=tile_name(shape), step_ms=times[shape]))
        for row in rows[-len(TILES):]:
            row["ratio"] = row["step_ms"] / times[TILES[0]]
    return rows


PARTS = {"concurrency": concurrency, "prefix": prefix, "decode": decode, "tiles": tiles,
         "concurrency_run": concurrency_run}
DEFAULT_PARTS = "concurrency,prefix,decode,tiles"   # concurrency_run: the whole workload to its end (minutes)
GPU = dict(model="random:llama-8b", requests=1500, max_len=8192, max_batch=1024, utilization=0.9,
           workload={}, concurrency_slots=4096, concurrency_blocks=None,
           prefix_max_len=2048, prefix_batch=64, system=1000, suffix=100, ttft_requests=20, batch_requests=256,
           max_tokens=64, decode_batch=64, context=512, decode_max_len=4096, warmup=10, reps=100,
           tile_context=1000, tile_cases=[(1, 100), (1, 256), (1, 512), (1, 1024), (1, 2048), (8, 100), (32, 100)])
SMOKE = dict(model="random:tiny", requests=12, max_len=256, max_batch=8, utilization=0.9,
             workload=dict(prompt_median=30, prompt_p99=150, out_min=8, out_max=32), concurrency_slots=64,
             concurrency_blocks=200, prefix_max_len=256,
             prefix_batch=4, system=40, suffix=5, ttft_requests=1, batch_requests=4, max_tokens=4, decode_batch=4,
             context=24, decode_max_len=64, warmup=1, reps=3, tile_context=40, tile_cases=[(1, 10), (2, 10)])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=DEFAULT_PARTS, help=f"of {', '.join(PARTS)}")
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
    work = Workload(**settings["workload"], max_len=settings["max_len"])
    notes = [versions(), f"model {settings['model']}, mode ar, bf16 on CUDA (fp32 on the CPU)",
             f"concurrency: real_traffic's workload, {work.describe()}"
             f", max_batch {settings['max_batch']}, gpu_memory_utilization {settings['utilization']}; "
             "slots_static = the paged pool's tokens (kv_tokens) / (max_len + headroom); mean_tokens: what each "
             f"resident request holds; concurrency_run: {settings['requests']} of its requests run to the end",
             f"prefix: system prompt {settings['system']} tokens + {settings['suffix']}-token suffixes; ttft_ms: "
             "median "
             f"of {settings['ttft_requests']} single requests; tokens/s: {settings['batch_requests']} requests of "
             f"{settings['max_tokens']} tokens, max_batch {settings['prefix_batch']}",
             f"decode: median of {settings['reps']} steps after {settings['warmup']} warm-up (bench.engine_speed's "
             "time_engine: step + greedy sample)",
             f"tiles: 8B heads (32 q / 8 kv, 128 wide), blocks of 16, {settings['tile_context']} cached tokens per "
             f"request; step_ms: median of {settings['reps']} calls after {settings['warmup']} warm-up"]
    path = write_results(rows, out_dir, "paged_kv", COLUMNS, "Paged KV cache", command, device_str, notes,
                         TABLE_COLUMNS)
    print(f"\nwrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
