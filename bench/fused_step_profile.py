"""A fused step against a decode step: what a prompt chunk riding in the launch costs, and where the time goes.

At the 8B shape (random weights, bf16, graphs on), rows of one token each (ar) on slots whose contexts follow the
real-traffic prompts (lognormal, median 300, P99 3000 tokens, seed 0), time
- decode: ModelRunner.step of the rows (chunk_tokens 0);
- fused: ModelRunner.step_with_chunks of the same rows and one prompt chunk of C tokens continuing a prompt at
  each of --chunk-starts (its first chunk, the middle and the end of a long prompt: the chunk attends its earlier
  tokens too), under each graph bucket set of --bucket-sets (`fine`: the runner's PACKED_GRAPH_TOKENS; `pow2`: the
  doubling token counts it had before, 16..1024), so a launch's padding is timed against its real size in one call;
for every batch in --batches and C in --chunks; over_decode = fused / decode of the same rows, the factor by which
a running request's gap grows while the chunk rides (issue 24's target: at most 2).
- rows_attention: the rows' attention of one layer alone, three ways on the same tensors: `decode` (a decode step's
  kernel, attention_triton), `rows` (the packed kernel's rows mode, what a fused launch runs for them) and
  `blocks16` (the packed kernel in 16-row blocks without a key split: what fused launches ran before rows mode);
- chunk_attention: one layer's attention of the chunk alone, `split` (the launch's key splits, as fused steps run
  it) against `direct` (one split per block);
- plan_*: the rows' attention programs and the longest program's key tiles (64 keys each) per layout, from the
  launch shapes alone (no device): a program walks its tiles in turn, so the longest one bounds the kernel;
- kernels: per-kernel device time (torch.profiler, graph replays included) of one decode step and of fused steps
  at --profile-batch rows, for every chunk of --kernel-chunks at every start of --chunk-starts: in the md, one
  table of the kernels (rows) by step (columns), so what a small chunk adds to a decode step (its fixed cost)
  and what grows with the chunk or with its start are read side by side.
gemm_tflop: the launch's linear-layer FLOPs (tokens after graph padding x 2 x weights); with ms it gives the rate.

    python -m bench.fused_step_profile                 # one H200, about two minutes
    python -m bench.fused_step_profile --smoke         # CPU: tiny shape, fp32, seconds
    python -m bench.fused_step_profile --batches 32 --chunks 0,224,256,352,480 --chunk-starts 1024 \
        --bucket-sets fine,pow2 --kernel-chunks ''     # launches between buckets: fine vs doubling buckets
The GPU machine gets the tree without .git: pass GIT_SHA=<sha> in the environment to record it.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from bench.common import (markdown_table, run_context, say, synchronize, time_steps, versions, write_results)
from minedraft_ray.engine.loader import load_model
from minedraft_ray.engine.presets import resolve_model
from minedraft_ray.engine.runner import PACKED_GRAPH_TOKENS, ModelRunner, token_bucket

NAME = "fused_step_profile"
COLUMNS = ["part", "variant", "buckets", "batch", "chunk_tokens", "launch_tokens", "graph_tokens", "ms", "ms_p90",
           "over_decode", "gemm_tflop", "programs", "splits", "longest_tiles", "mean_context", "chunk_start", "kernel", "calls",
           "us", "share", "shape", "dtype", "prefill_waves", "git_sha", "command", "device"]
TABLE = ["part", "variant", "buckets", "batch", "chunk_tokens", "chunk_start", "launch_tokens", "graph_tokens", "ms",
         "over_decode", "gemm_tflop", "programs", "splits", "longest_tiles"]
BLOCK_N = 64   # the key tile both layouts walk
# graph token buckets of packed launches: the runner's, and the doubling ones it had before finer steps above 256
BUCKET_SETS = {"fine": PACKED_GRAPH_TOKENS, "pow2": (16, 32, 64, 128, 256, 512, 1024)}


def contexts(batch: int, max_context: int, seed: int = 0) -> list[int]:
    """Each row's cache length: a real-traffic prompt (lognormal, median 300, P99 3000) plus some of its output."""
    rng = np.random.default_rng(seed)
    sigma = math.log(3000 / 300) / 2.3263
    prompts = np.exp(rng.normal(math.log(300), sigma, batch))
    return [int(min(max(p, 1) + o, max_context)) for p, o in zip(prompts, rng.integers(0, 256, batch))]


def gemm_tflop(cfg, tokens: int) -> float:
    """Linear-layer FLOPs of a launch of `tokens` tokens (the lm_head left out: a fused launch runs it on its rows
    and the chunks' last tokens only)."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = H * (cfg.num_heads + 2 * cfg.num_kv_heads) * D + cfg.num_heads * D * H + 3 * H * I
    return 2 * tokens * cfg.num_layers * per_layer / 1e12


def graph_tokens(runner: ModelRunner, tokens: int) -> int:
    """The token count a packed launch runs at: its graph bucket, or itself when eager."""
    return token_bucket(tokens, runner.packed_buckets) or tokens


def use_buckets(runner: ModelRunner, name: str) -> None:
    """Packed launches of `runner` take the graph buckets of BUCKET_SETS[name] from now on (graphs are keyed by
    their token count, so the sets share the ones they have in common); a runner without packed graphs (a CPU's)
    stays without."""
    if runner.packed_buckets:
        runner.packed_buckets = [n for n in BUCKET_SETS[name] if n <= runner.max_prefill_tokens]


def rows_plan(lengths: list[int], groups: int, kv_heads: int, head_dim: int, max_keys: int, sm_count: int,
              layout: str) -> tuple[int, int]:
    """(programs, key tiles of the longest program) of the rows' attention, one token per row: `rows` as
    attend_packed_triton's rows mode launches it, `blocks16` as 16-row blocks with no key split."""
    from minedraft_ray.engine.attention_packed_triton import rows_launch_shape

    if layout == "rows":
        _, rows, block_n, splits, _ = rows_launch_shape(len(lengths), 1, groups, kv_heads, head_dim, max_keys,
                                                        sm_count)
    else:
        rows, block_n, splits = 16, BLOCK_N, 1
    longest = 0
    for first in range(0, len(lengths) * groups, rows):
        slots = sorted({r // groups for r in range(first, min(first + rows, len(lengths) * groups))})
        for split in range(splits):
            tiles = 0
            for s in slots:   # one pass per slot, in turn, over this split's piece of its keys
                live = lengths[s] + 1
                piece = -(-(-(-live // splits)) // block_n) * block_n
                start, end = split * piece, min(split * piece + piece, live)
                tiles += max(0, -(-(end - start) // block_n))
            longest = max(longest, tiles)
    return -(-len(lengths) * groups // rows) * kv_heads * splits, longest


@torch.inference_mode()
def time_steps_of(runner: ModelRunner, batch: int, chunks: list[int], chunk_starts: list[int], reps: int,
                  warmup: int, emit, bucket_sets: list[str]) -> None:
    """The decode step of `batch` rows, then a fused step per chunk start, chunk size (0 in `chunks`: the decode
    step) and graph bucket set (on a CPU, without graphs, the sets change nothing)."""
    device, cfg = runner.device, runner.cfg
    lengths = contexts(batch, runner.max_len - 8)
    slots = torch.arange(batch, device=device)
    ids = torch.randint(16, cfg.vocab_size, (batch, 1), device=device)
    chunk_slot = batch   # the rows' slots are 0..batch-1
    prompt = torch.randint(16, cfg.vocab_size, (max(chunk_starts) + max(chunks),)).tolist()
    runner.set_lengths(list(range(batch)), lengths)
    common = {"batch": batch, "mean_context": statistics.fmean(lengths)}

    def reset():
        runner.set_lengths(list(range(batch)), lengths)

    decode_ms = None
    steps = [(None, 0, None)] + [(start, c, name) for start in chunk_starts for c in chunks if c
                                 for name in bucket_sets]
    for start, chunk, buckets in steps:
        if chunk == 0:
            step = lambda: runner.step(slots, ids)   # noqa: E731
        else:
            use_buckets(runner, buckets)
            tokens = prompt[start:start + chunk]
            step = lambda: runner.step_with_chunks(slots, ids, [chunk_slot], [start], [tokens])   # noqa: E731
        times = sorted(time_steps(step, device, warmup, reps, f"b={batch} chunk={chunk}@{start} {buckets or ''}",
                                  before=reset))
        ms = times[len(times) // 2]
        decode_ms = ms if chunk == 0 else decode_ms
        launch = batch + chunk
        padded = graph_tokens(runner, launch) if chunk else launch
        emit({**common, "part": "step", "variant": "decode" if chunk == 0 else "fused", "buckets": buckets,
              "chunk_tokens": chunk, "chunk_start": start, "launch_tokens": launch, "graph_tokens": padded, "ms": ms,
              "ms_p90": times[int(len(times) * 0.9)], "over_decode": ms / decode_ms,
              "gemm_tflop": gemm_tflop(cfg, padded)})
    use_buckets(runner, "fine")


@torch.inference_mode()
def time_rows_attention(runner: ModelRunner, batch: int, reps: int, warmup: int, emit) -> None:
    """One layer's attention of `batch` one-token rows, by the decode kernel and by the packed kernel's two row
    layouts (GPU only: the kernels are Triton's), and the device-free plan of each packed layout."""
    device, cfg, cache = runner.device, runner.cfg, runner.cache
    lengths = contexts(batch, runner.max_len - 8)
    groups, kv_heads = cfg.num_heads // cfg.num_kv_heads, runner.model.num_kv_heads
    max_keys = cache.block_tables.shape[1] * cache.block_size
    from minedraft_ray.engine.attention_triton import num_sms
    common = {"part": "rows_attention", "batch": batch, "mean_context": statistics.fmean(lengths)}
    for layout in ("rows", "blocks16"):
        programs, longest = rows_plan(lengths, groups, kv_heads, cfg.head_dim, max_keys, num_sms(device), layout)
        emit({**common, "part": f"plan_{layout}", "variant": layout, "programs": programs, "longest_tiles": longest})
    if device.type != "cuda":
        return
    from minedraft_ray.engine.attention_packed_triton import attend_packed_triton
    from minedraft_ray.engine.attention_triton import attend_triton

    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=cache.k[0].dtype, device=device)
    slots = torch.arange(batch, device=device)
    positions = torch.tensor(lengths, device=device)
    k, v, tables, scale = cache.k[0], cache.v[0], cache.block_tables, cfg.head_dim ** -0.5
    variants = {
        "decode": lambda: attend_triton(q[:, None], k, v, tables, slots, positions[:, None], scale),
        "rows": lambda: attend_packed_triton(q, k, v, tables, slots, positions, scale, row_width=1),
        "blocks16": lambda: attend_packed_triton(q, k, v, tables, slots, positions, scale, block_m=16, block_n=64,
                                                 num_warps=8),
    }
    for name, run in variants.items():
        times = sorted(time_steps(run, device, warmup, reps, f"rows attention {name} b={batch}"))
        emit({**common, "variant": name, "ms": times[len(times) // 2], "ms_p90": times[int(len(times) * 0.9)]})


@torch.inference_mode()
def time_chunk_attention(runner: ModelRunner, chunks: list[int], chunk_starts: list[int], reps: int, warmup: int,
                         emit) -> None:
    """One layer's attention of a prompt chunk alone (prefill blocks), at every chunk size and start: `split` (the
    launch's own key splits, prefill_splits) and `direct` (one split: each block walks its whole prefix), plus each
    launch's programs and splits (GPU timing only: the kernel is Triton's)."""
    device, cfg, cache = runner.device, runner.cfg, runner.cache
    from minedraft_ray.engine.attention_packed_triton import attend_packed_triton, launch_shape, prefill_splits
    from minedraft_ray.engine.attention_triton import num_sms

    groups, kv_heads = cfg.num_heads // cfg.num_kv_heads, runner.model.num_kv_heads
    max_keys = cache.block_tables.shape[1] * cache.block_size
    k, v, tables, scale = cache.k[0], cache.v[0], cache.block_tables, cfg.head_dim ** -0.5
    for start in chunk_starts:
        for chunk in (c for c in chunks if c):
            block_m, block_n, _ = launch_shape(chunk, groups, kv_heads, cfg.head_dim, k.dtype, num_sms(device))
            splits = prefill_splits(chunk, groups, kv_heads, block_m, block_n, max_keys, num_sms(device))
            common = {"part": "chunk_attention", "chunk_tokens": chunk, "chunk_start": start, "launch_tokens": chunk,
                      "programs": -(-chunk * groups // block_m) * kv_heads, "splits": splits}
            if device.type != "cuda":
                emit({**common, "variant": "plan"})
                continue
            q = torch.randn(chunk, cfg.num_heads, cfg.head_dim, dtype=k.dtype, device=device)
            slots = torch.zeros(chunk, dtype=torch.int64, device=device)
            positions = torch.arange(start, start + chunk, device=device)
            variants = {"split": lambda: attend_packed_triton(q, k, v, tables, slots, positions, scale),
                        "direct": lambda: attend_packed_triton(q, k, v, tables, slots, positions, scale,
                                                               num_splits=1)}
            for name, run in variants.items():
                times = sorted(time_steps(run, device, warmup, reps, f"chunk attention {name} {chunk}@{start}"))
                emit({**common, "variant": name, "ms": times[len(times) // 2],
                      "ms_p90": times[int(len(times) * 0.9)]})


def step_name(chunk: int, start: int | None) -> str:
    """A profiled step's column in the kernel table: `decode`, or `fused C@S` (a C-token chunk from position S)."""
    return "decode" if chunk == 0 else f"fused {chunk}@{start}"


@torch.inference_mode()
def kernel_tables(runner: ModelRunner, batch: int, steps_of: list[tuple[int, int | None]], steps: int
                  ) -> dict[tuple[int, int | None], list[dict]]:
    """Per-kernel device time of each step in `steps_of` ((chunk tokens, chunk start); chunk 0: the decode step),
    the mean over `steps` of each -> (chunk, start) -> its kernels, largest first."""
    from torch.profiler import ProfilerActivity, profile

    device, cfg = runner.device, runner.cfg
    lengths = contexts(batch, runner.max_len - 8)
    slots = torch.arange(batch, device=device)
    ids = torch.randint(16, cfg.vocab_size, (batch, 1), device=device)
    prompt = torch.randint(16, cfg.vocab_size, (max(c + (s or 0) for c, s in steps_of),)).tolist()

    def call_of(chunk: int, start: int | None):
        if chunk == 0:
            return lambda: runner.step(slots, ids)
        return lambda: runner.step_with_chunks(slots, ids, [batch], [start], [prompt[start:start + chunk]])

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    tables = {}
    for key in steps_of:
        call = call_of(*key)
        runner.set_lengths(list(range(batch)), lengths)
        call()   # its graph is captured (and compiled) outside the profile
        synchronize(device)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                runner.set_lengths(list(range(batch)), lengths)
                call()
            synchronize(device)
        rows = []
        for event in prof.key_averages():   # on a GPU its kernels (graph replays' too), on a CPU its ops
            on_device = event.device_type == torch.autograd.DeviceType.CUDA
            us = (event.self_device_time_total if on_device else event.self_cpu_time_total) / steps
            if us > 0 and on_device == (device.type == "cuda"):
                rows.append({"step": step_name(*key), "kernel": event.key[:90], "calls": event.count / steps,
                             "us": us})
        total = sum(r["us"] for r in rows) or 1.0
        rows = sorted(rows, key=lambda r: -r["us"])
        tables[key] = [{**r, "share": r["us"] / total} for r in rows]
    return tables


def kernel_pivot(tables: dict[tuple[int, int | None], list[dict]], top: int) -> tuple[list[dict], list[str]]:
    """The kernels (rows: the `top` largest in any step, then the total of all) by step (columns, us per step)
    -> (rows, columns)."""
    names = [step_name(*key) for key in tables]
    us = {(step_name(*key), r["kernel"]): r["us"] for key, table in tables.items() for r in table}
    largest = {}
    for (_, kernel), value in us.items():
        largest[kernel] = max(largest.get(kernel, 0.0), value)
    kernels = sorted(largest, key=lambda k: -largest[k])[:top]
    rows = [{"kernel": k, **{n: us.get((n, k)) for n in names}} for k in kernels]
    rows.append({"kernel": "total (all kernels)", **{n: sum(r["us"] for r in tables[key])
                                                      for n, key in zip(names, tables)}})
    return rows, ["kernel"] + names


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="random:llama-8b", help="the shape (random weights)")
    p.add_argument("--batches", default="16,32,64")
    p.add_argument("--chunks", default="0,64,128,256,512", help="chunk tokens per fused step (0: the decode step)")
    p.add_argument("--chunk-starts", default="0,1024,2816", help="prompt tokens the chunk's slot already holds: "
                   "a prompt's first chunk, its middle, near its end")
    p.add_argument("--kernel-chunks", default="64,128,512", help="chunk tokens of the profiled fused steps (each "
                   "at every chunk start; '': no kernel tables)")
    p.add_argument("--bucket-sets", default="fine", help="graph bucket sets the fused steps are timed under, of "
                   f"{', '.join(BUCKET_SETS)} (fine: the runner's; pow2: the doubling ones before it)")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--profile-batch", type=int, default=32)
    p.add_argument("--profile-steps", type=int, default=5, help="profiled steps per kernel table (their mean)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="default bench/results; smoke: /tmp/fused_step_profile_smoke")
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny shape, fp32")
    args = p.parse_args(argv)
    if args.smoke:
        args.target, args.batches, args.chunks, args.chunk_starts = "random:tiny", "2,4", "0,8,16", "0,24"
        args.max_len, args.profile_batch, args.warmup, args.reps, args.kernel_chunks = 128, 4, 1, 3, "8,16"
        args.profile_steps = 1   # on a CPU every op is an event: parsing five steps' took a quarter of the smoke's CPU
    args.batches = [int(b) for b in args.batches.split(",")]
    args.chunks = sorted({int(c) for c in args.chunks.split(",")} | {0})
    args.chunk_starts = [int(c) for c in args.chunk_starts.split(",")]
    args.kernel_chunks = [int(c) for c in args.kernel_chunks.split(",") if c]
    args.bucket_sets = args.bucket_sets.split(",")
    if not args.bucket_sets or any(b not in BUCKET_SETS for b in args.bucket_sets):
        p.error(f"--bucket-sets: a list of {', '.join(BUCKET_SETS)}")
    if max(args.chunk_starts) + max(args.chunks + args.kernel_chunks) > args.max_len - 8:
        p.error("the latest chunk start plus the largest chunk must fit --max-len (less a verify's room)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = load_model(resolve_model(args.target), device, dtype)
    slots = max(args.batches) + 1   # the rows' slots and the chunk's
    runner = ModelRunner(model, device, num_slots=slots, max_len=args.max_len, max_batch=max(args.batches),
                         cuda_graphs=True)
    from minedraft_ray.engine.attention_triton import CONFIG

    # the packed kernel's key splits (MINEDRAFT_ATTN_CONFIG): runs at other settings are told apart by it
    context = {**run_context(args.target, dtype, device, "bench.fused_step_profile", argv),
               "prefill_waves": CONFIG.PREFILL_WAVES}
    out = Path(args.out or ("/tmp/fused_step_profile_smoke" if args.smoke else "bench/results"))
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append({**context, **row})
        say(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                     if v is not None))

    for batch in args.batches:
        time_steps_of(runner, batch, args.chunks, args.chunk_starts, args.reps, args.warmup, emit, args.bucket_sets)
        time_rows_attention(runner, batch, args.reps, args.warmup, emit)
    time_chunk_attention(runner, args.chunks, args.chunk_starts, args.reps, args.warmup, emit)
    profiled = [(0, None)] + [(c, start) for c in args.kernel_chunks for start in args.chunk_starts]
    kernels = kernel_tables(runner, args.profile_batch, profiled, steps=args.profile_steps) if args.kernel_chunks \
        else {}
    sets = "; ".join(f"{name}: {', '.join(map(str, BUCKET_SETS[name]))}" for name in args.bucket_sets)
    notes = [f"{args.target} (random weights), {context['dtype']}, graphs on (packed token buckets, `buckets`: "
             f"{sets}); rows of one token (ar) on slots whose contexts are "
             "real-traffic prompts (lognormal median 300, P99 3000, seed 0) plus 0..255 output tokens; the chunk "
             f"continues a prompt at {', '.join(map(str, args.chunk_starts))} tokens (chunk_start)",
             "ms: median of the timed steps (CUDA events); over_decode: fused ms / decode ms at the same rows",
             "rows_attention: one layer's attention of the rows alone; plan_*: programs and the longest program's "
             "64-key tiles from the launch shapes (no device)",
             "chunk_attention: one layer's attention of a chunk alone (prefill blocks) at each chunk_start: `split` "
             "with the launch's key splits (splits), `direct` without (each block walks its whole prefix)",
             f"packed kernel's PREFILL_WAVES {CONFIG.PREFILL_WAVES} (MINEDRAFT_ATTN_CONFIG; prefill_splits)",
             versions()]
    path = write_results(rows, out, NAME, COLUMNS, "Fused step vs decode step: the chunk's cost and its kernels",
                         context["command"], context["device"], notes, TABLE)
    # the kernels go into the parquet with the rest, and into tables of their own in the md
    kernel_rows = [{**context, "part": "kernels", "variant": "decode" if chunk == 0 else "fused",
                    "batch": args.profile_batch, "chunk_tokens": chunk, "chunk_start": start, **r}
                   for (chunk, start), table in kernels.items() for r in table]
    pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in rows + kernel_rows]),
                   out / f"{NAME}.parquet")
    if kernels:
        pivot, pivot_columns = kernel_pivot(kernels, top=30)
        section = (f"\n## Kernels per step (b={args.profile_batch}, us per step, mean of 5 steps; fused C@S: a chunk "
                   "of C tokens from prompt position S)\n\n" + markdown_table(pivot, pivot_columns) + "\n")
        path.write_text(path.read_text() + section)
    say(f"wrote {out / NAME}.{{parquet,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
