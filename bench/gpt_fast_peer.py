"""A peer in the same call: gpt-fast (pytorch-labs/gpt-fast, pure PyTorch compiled with torch.compile) against
this engine's ModelRunner at the same shape (random weights: acceptance means nothing, step times do).

Steps timed on each side, at each batch size, with every slot holding `context` tokens:
- decode: one token per row (gpt-fast's `decode_one_token` path: the model compiled with mode="reduce-overhead",
  fullgraph; ours: the runner's CUDA graph of the batch bucket);
- verify: k + 1 tokens per row (gpt-fast's speculative verify runs the same compiled forward; ours: the graph
  of q = k + 1);
- prefill: one prompt of `prefill_tokens` (gpt-fast's prefill compiled with dynamic shapes, as its
  --compile_prefill; ours: the packed prefill).
gpt-fast's files are not part of this repository: fetch them into an ignored folder (default
third_party/gpt-fast, which .gitignore lists) and pass that folder to the GPU machine. Its compile warm-up runs
inside this command (`compile_s`).

    python -m bench.gpt_fast_peer                     # one H200: 8B shape, batches 1 and 32, k = 3
    python -m bench.gpt_fast_peer --smoke             # CPU: tiny shape, no compile, seconds
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.common import fmt, run_context, say, time_steps, write_results

NAME = "gpt_fast_peer"
COLUMNS = ["engine", "step", "batch", "tokens_per_row", "context", "ms", "ms_p90", "compile_s", "shape", "dtype",
           "git_sha", "command", "device"]
TABLE = ["engine", "step", "batch", "tokens_per_row", "context", "ms", "ms_p90", "compile_s", "shape", "dtype"]


def gpt_fast_model(path: Path, cfg, max_batch: int, max_seq: int, device, dtype):
    """gpt-fast's Transformer at our model's shape, random weights, caches for max_batch x max_seq (its
    attention reads the whole cache batch: a step's batch must be the caches' batch, `set_batch`)."""
    sys.path.insert(0, str(path))
    try:
        from model import ModelArgs, Transformer   # gpt-fast's model.py
    finally:
        sys.path.pop(0)
    args = ModelArgs(block_size=max_seq, vocab_size=cfg.vocab_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
                     dim=cfg.hidden_size, intermediate_size=cfg.intermediate_size, n_local_heads=cfg.num_kv_heads,
                     rope_base=cfg.rope_theta)
    with torch.device(device):
        model = Transformer(args)
        model.setup_caches(max_batch_size=max_batch, max_seq_length=max_seq)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model.to(device=device, dtype=dtype).eval()


def set_batch(model, batch: int, max_seq: int, device) -> None:
    """Fresh caches of exactly `batch` rows (setup_caches keeps larger ones, which attention would read)."""
    model.max_batch_size = -1
    with torch.device(device):
        model.setup_caches(max_batch_size=batch, max_seq_length=max_seq)
    model.to(device=device, dtype=model.output.weight.dtype)


def step_forward(model, x, input_pos):
    return model(x, input_pos)


def prefill_forward(model, x, input_pos):   # its own function: compiled with other options than the steps
    return model(x, input_pos)


def time_gpt_fast(args, cfg, device, dtype, emit) -> None:
    max_batch = max(args.batches)
    max_seq = args.context + args.prefill_tokens + args.k + 8
    model = gpt_fast_model(Path(args.gpt_fast), cfg, max_batch, max_seq, device, dtype)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)   # a shape per batch, q
    step = torch.compile(step_forward, mode="reduce-overhead", fullgraph=True) if args.compile else step_forward
    prefill = torch.compile(prefill_forward, fullgraph=True, dynamic=True) if args.compile else prefill_forward
    with torch.inference_mode():
        for batch in args.batches:
            set_batch(model, batch, max_seq, device)
            for name, q in (("decode", 1), ("verify", args.k + 1)):
                x = torch.randint(16, cfg.vocab_size, (batch, q), device=device)
                pos = torch.arange(args.context, args.context + q, device=device)
                t0 = time.perf_counter()
                for _ in range(3):   # compile (and its CUDA graph) before timing
                    step(model, x, pos)
                compile_s = time.perf_counter() - t0
                times = time_steps(lambda: step(model, x, pos), device, args.warmup, args.reps,
                                   f"gpt-fast {name} b={batch}")
                emit(row("gpt-fast", name, batch, q, args.context, times, compile_s))
        set_batch(model, 1, max_seq, device)
        x = torch.randint(16, cfg.vocab_size, (1, args.prefill_tokens), device=device)
        pos = torch.arange(args.prefill_tokens, device=device)
        t0 = time.perf_counter()
        for _ in range(2):
            prefill(model, x, pos)
        compile_s = time.perf_counter() - t0
        times = time_steps(lambda: prefill(model, x, pos), device, args.warmup, args.reps, "gpt-fast prefill")
        emit(row("gpt-fast", "prefill", 1, args.prefill_tokens, 0, times, compile_s))
    # the model and its caches go with this frame


def time_minedraft(args, target: str, device, dtype, emit) -> None:
    from minedraft_ray.engine.loader import load_model
    from minedraft_ray.engine.presets import resolve_model
    from minedraft_ray.engine.runner import ModelRunner

    model = load_model(resolve_model(target), device, dtype)
    max_batch = max(args.batches)
    runner = ModelRunner(model, device, max_batch, args.context + args.prefill_tokens + args.k + 8, max_batch,
                         cuda_graphs=args.compile)
    t0 = time.perf_counter()
    runner.capture_all((args.k + 1, 1))
    capture_s = time.perf_counter() - t0
    vocab = model.cfg.vocab_size
    for batch in args.batches:
        slots = list(range(batch))
        slot_t = torch.tensor(slots, device=device)
        for name, q in (("decode", 1), ("verify", args.k + 1)):
            ids = torch.randint(16, vocab, (batch, q), device=device)
            times = time_steps(lambda: runner.step(slot_t, ids), device, args.warmup, args.reps,
                               f"minedraft {name} b={batch}",
                               before=lambda: runner.set_lengths(slots, [args.context] * batch))
            emit(row("minedraft", name, batch, q, args.context, times, capture_s))
    prompt = torch.randint(16, vocab, (args.prefill_tokens,)).tolist()
    times = time_steps(lambda: runner.prefill([0], [prompt]), device, args.warmup, args.reps, "minedraft prefill")
    emit(row("minedraft", "prefill", 1, args.prefill_tokens, 0, times, capture_s))
    # the runner and its model go with this frame, before gpt-fast's model is built


def row(engine, step, batch, q, context, times, compile_s) -> dict:
    ts = sorted(times)
    return {"engine": engine, "step": step, "batch": batch, "tokens_per_row": q, "context": context,
            "ms": ts[len(ts) // 2], "ms_p90": ts[int(len(ts) * 0.9)], "compile_s": compile_s}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpt-fast", default="third_party/gpt-fast", help="folder holding gpt-fast's model.py")
    p.add_argument("--target", default="random:llama-8b", help="the shape both run (random weights)")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--context", type=int, default=512, help="tokens in every slot during decode and verify")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None, help="default bench/results; smoke: /tmp/gpt_fast_peer_smoke")
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny shape, no compile or graphs")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        args.target, args.batches, args.context, args.prefill_tokens = "random:tiny", [1, 4], 32, 32
        args.warmup, args.reps = 1, 3
    args.compile = not args.smoke
    if not Path(args.gpt_fast, "model.py").is_file():
        p.error(f"no gpt-fast model.py in {args.gpt_fast}: fetch pytorch-labs/gpt-fast there first")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    from minedraft_ray.engine.model import ModelConfig
    from minedraft_ray.engine.presets import resolve_model

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cfg = ModelConfig.from_pretrained(resolve_model(args.target))
    context = run_context(args.target, dtype, device, "bench.gpt_fast_peer", argv)
    notes = [f"shape {args.target} (random weights), {context['dtype']}; decode and verify with {args.context} "
             f"tokens in every slot, verify k + 1 = {args.k + 1} tokens per row; prefill one prompt of "
             f"{args.prefill_tokens} tokens",
             "gpt-fast: its model.py (pytorch-labs/gpt-fast), forward compiled as its generate.py does "
             "(decode/verify: mode reduce-overhead, fullgraph; prefill: dynamic); its positions are shared by "
             "the batch's rows; ours: the runner's CUDA graphs (decode, verify) and packed prefill",
             "ms: median of the timed steps; compile_s: gpt-fast's compile and first runs of that shape, ours the "
             "capture of every graph at start (one value for all rows)"]
    out = Path(args.out or ("/tmp/gpt_fast_peer_smoke" if args.smoke else "bench/results"))
    rows = []

    def emit(r: dict) -> None:   # written after every row: gpt-fast's compiles can outlast a device call
        rows.append({**context, **r})
        say(f"{r['engine']} {r['step']} b={r['batch']} q={r['tokens_per_row']}: {fmt(r['ms'])} ms "
            f"(compile/capture {fmt(r['compile_s'])} s)")
        write_results(rows, out, NAME, COLUMNS, "gpt-fast vs minedraft: step times at the same shape",
                      context["command"], context["device"], notes, TABLE)

    time_minedraft(args, args.target, device, dtype, emit)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    time_gpt_fast(args, cfg, device, dtype, emit)
    say(f"wrote {out / NAME}.{{parquet,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
