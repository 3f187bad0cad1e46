"""Time the projection GEMMs of a Llama-3.1-8B-shaped step under the ways PyTorch can run them.

A decode step at batch 64 is weight-read bound: its five projections (qkv, o, gate_up, down, lm_head)
are skinny GEMMs (M = 64 tokens, or 320 for a k=4 verify) whose time is the weight bytes over the
bandwidth cuBLAS reaches. Each variant below runs 32 calls over 32 different weight copies inside one
CUDA graph, as the model's layers do (so L2 holds none of them and launch gaps are a graph's), and
reports the median per call over the replays, with the TB/s of the weight bytes read:

  linear            F.linear(x, W), W [N, K] as nn.Linear stores it (the engine today)
  linear_cublas     the same with torch.backends.cuda.preferred_blas_library("cublas")
  matmul_t          x @ Wt with Wt = W.t().contiguous() [K, N] (the other operand layout)
  matmul_t_cublas   both
  inductor          torch.compile(F.linear, mode="max-autotune-no-cudagraphs"): Triton templates vs ATen

    python -m bench.gemm_sweep [--out DIR] [--ms 64,128,320] [--no-inductor] [--smoke]

Writes DIR/gemm_sweep.{parquet,md,png}. --smoke: tiny shapes on the CPU (wall clock, no graph).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import command_line, device_name, git_sha, say, write_results

# (name, N out features, K in features) of Llama-3.1-8B
SHAPES_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
             ("lm_head", 128256, 4096)]
SHAPES_SMOKE = [("qkv", 96, 64), ("down", 64, 128)]
COLUMNS = ["m", "gemm", "variant", "us", "tbps", "vs_linear"]


def _blas(lib: str | None):
    if lib is not None and hasattr(torch.backends.cuda, "preferred_blas_library"):
        torch.backends.cuda.preferred_blas_library(lib)


def time_variant(fn, x, weights, device, replays: int) -> float:
    """Median microseconds per call of fn(x, w) over len(weights) calls per graph replay."""
    calls = len(weights)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for w in weights:
            fn(x, w)
        return (time.perf_counter() - t0) / calls * 1e6
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(x, w)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--ms", default="64,128,320",
                   help="token counts M (64 / 128: decode at batch 64 / 128; 320: a q=5 verify at batch 64)")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--copies", type=int, default=32, help="weight copies per graph (the model's layer count)")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes = SHAPES_SMOKE if args.smoke else SHAPES_8B
    copies = 2 if args.smoke else args.copies
    default_lib = torch.backends.cuda.preferred_blas_library() if device.type == "cuda" else None

    def linear(x, w):
        return F.linear(x, w)

    def matmul_t(x, wt):
        return x @ wt

    inductor = None if args.no_inductor or args.smoke else torch.compile(
        linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    variants = [("linear", linear, False, None), ("linear_cublas", linear, False, "cublas"),
                ("matmul_t", matmul_t, True, None), ("matmul_t_cublas", matmul_t, True, "cublas")]
    if inductor is not None:
        variants.append(("inductor", inductor, False, None))

    rows = []
    for m in [int(v) for v in args.ms.split(",")]:
        for name, n, k in shapes:
            x = torch.randn(m, k, device=device, dtype=dtype)
            # lm_head is one matrix per step; a graph of 32 copies would be 33 GB: 4 copies still exceed L2
            count = min(copies, 4) if name == "lm_head" else copies
            weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(count)]
            ref = F.linear(x, weights[0]).float()
            base = None
            for vname, fn, transposed, lib in variants:
                ws = [w.t().contiguous() for w in weights] if transposed else weights
                _blas(lib)
                try:
                    err = (fn(x, ws[0]).float() - ref).abs().max().item()
                    us = time_variant(fn, x, ws, device, args.replays)
                    status = "ok" if err < 0.05 else f"max_err {err:.3g}"
                except Exception as e:  # a variant that cannot run here is a row, not a crash
                    us, status = float("nan"), f"{type(e).__name__}: {e}"[:120]
                finally:
                    _blas(default_lib)
                del ws
                base = us if vname == "linear" else base
                tbps = n * k * x.element_size() / (us * 1e-6) / 1e12 if us == us else float("nan")
                rows.append({"m": m, "gemm": name, "n": n, "k": k, "variant": vname, "us": round(us, 2),
                             "tbps": round(tbps, 3), "vs_linear": round(us / base, 3), "status": status})
                say(f"M={m} {name:8s} {vname:16s} {us:8.2f} us {tbps:5.2f} TB/s {status}")
            del weights
            if device.type == "cuda":
                torch.cuda.empty_cache()

    for row in rows:
        row["git_sha"] = git_sha()
    write_results(rows, args.out or "/tmp/gemm_sweep", "gemm_sweep", COLUMNS + ["status", "git_sha"],
                  "GEMM variants at the Llama-3.1-8B projection shapes", command_line("bench.gemm_sweep", argv),
                  device_name(device), [f"default BLAS library {default_lib}; {copies} weight copies per CUDA graph "
                                        f"(lm_head 4); median of {args.replays} replays; TB/s = weight bytes / time"])

if __name__ == "__main__":
    main()
