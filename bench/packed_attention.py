"""The packed prefill kernel on one chunk deep in a long prompt: its tiles, stages and key splits, the kernel it
replaced (a copy of an earlier commit's file, --baseline) and torch's flash SDPA as the ceiling, all in one call.

Llama-3.1-8B attention (32 query heads over 8 KV heads, head dim 128), bf16: one slot whose prompt holds `start`
tokens in the paged cache (blocks of the default size, scattered over the pool) and a chunk of `chunk` tokens
continuing it, as a chunked prefill runs one. Each variant gets 5 warm-up and 30 timed calls (CUDA events,
median); a 512 MB write before each call evicts L2, as the rest of a model step does between two layers' attention.
TFLOP/s counts the causal work (4 x head dim x query heads x keys each query sees); SDPA's row runs its flash
kernel over contiguous K/V without the causal mask (its mask is aligned top-left, a chunk's is bottom-right), so it
does more work than the chunk needs and its TFLOP/s counts that work. Every variant's output is checked against a
float32 reference.

    python -m bench.packed_attention [--baseline FILE] [--out DIR] [--smoke]

Writes DIR/packed_attention.{parquet,md,png} (default bench/results).
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import command_line, device_name, git_sha, markdown_table, time_steps, triton_device, versions

FULL = dict(heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, chunks=(64, 128, 256, 512),
            starts=(0, 1024, 2816), warmup=5, reps=30)
SMOKE = dict(heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, chunks=(8,), starts=(0, 24), warmup=1, reps=2)
FLUSH_BYTES = 512 << 20
MAX_ERR = 2e-2  # bf16 outputs of ~0.1 against a float32 reference
COLUMNS = ["kernel", "chunk", "start", "block_m", "block_n", "num_warps", "num_stages", "splits", "us", "tflops",
           "max_err", "status", "git_sha", "command", "device"]


def load_baseline(path: str):
    """An earlier copy of attention_packed_triton.py as a module (its relative import made absolute): its kernel and
    its own launch rules."""
    source = Path(path).read_text().replace("from .attention_triton import",
                                            "from minedraft_ray.engine.attention_triton import")
    spec = importlib.util.spec_from_loader("baseline_packed", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, path, "exec"), module.__dict__)  # noqa: S102 - a file of this repository's history
    return module


def make_chunk(shape: dict, chunk: int, start: int, device: torch.device):
    """q [chunk, Hq, D], a paged pool holding the slot's start + chunk keys, its block table, slots, positions."""
    from minedraft_ray.engine.kv_blocks import DEFAULT_BLOCK_SIZE

    torch.manual_seed(start * 7 + chunk)
    blocks = -(-(start + chunk) // DEFAULT_BLOCK_SIZE)
    pool = (4 * blocks + 1, DEFAULT_BLOCK_SIZE, shape["kv_heads"], shape["head_dim"])
    k_pool = torch.randn(pool, dtype=shape["dtype"], device=device)
    v_pool = torch.randn(pool, dtype=shape["dtype"], device=device)
    table = (torch.randperm(4 * blocks)[:blocks] + 1).view(1, blocks).to(device)
    q = torch.randn(chunk, shape["heads"], shape["head_dim"], dtype=shape["dtype"], device=device)
    slots = torch.zeros(chunk, dtype=torch.int64, device=device)
    positions = torch.arange(start, start + chunk, device=device)
    return q, k_pool, v_pool, table, slots, positions


def reference(args, scale: float) -> torch.Tensor:
    """The engine's torch path (attention.attend_packed_reference) in float32."""
    from minedraft_ray.engine.attention import attend_packed_reference

    return attend_packed_reference(*(t.float() if t.is_floating_point() else t for t in args), scale)


def causal_flop(shape: dict, chunk: int, start: int) -> float:
    keys = chunk * start + chunk * (chunk + 1) / 2  # keys summed over the chunk's queries
    return 4 * shape["head_dim"] * shape["heads"] * keys


def variants(smoke: bool):
    """(block_m, block_n, num_warps, num_stages, splits or None for the launch's own) of the current kernel."""
    if smoke:
        return [(16, 16, 4, 2, None), (16, 16, 4, 2, 2)]
    tiles = [(64, 64, 4), (64, 64, 8), (128, 64, 8), (128, 128, 8), (64, 32, 4)]
    return [(m, n, w, s, splits) for (m, n, w), s, splits in itertools.product(tiles, (2, 3), (None, 1, 2, 4))]


def own_launch(module, shape: dict, chunk: int, max_keys: int, device: torch.device) -> tuple:
    """(block_m, block_n, num_warps, num_stages, splits) a kernel module's own rules pick for the chunk."""
    from minedraft_ray.engine.attention_triton import num_sms

    groups, kv_heads = shape["heads"] // shape["kv_heads"], shape["kv_heads"]
    m, n, w = module.launch_shape(chunk, groups, kv_heads, shape["head_dim"], shape["dtype"], num_sms(device))
    return m, n, w, 2, module.prefill_splits(chunk, groups, kv_heads, m, n, max_keys, num_sms(device))


def sweep(shape: dict, device: torch.device, baseline, smoke: bool) -> list[dict]:
    import minedraft_ray.engine.attention_packed_triton as current
    from minedraft_ray.engine.attention_triton import num_sms

    flush = torch.empty(FLUSH_BYTES if device.type == "cuda" else 1, dtype=torch.uint8, device=device)
    scale = shape["head_dim"] ** -0.5
    groups, kv_heads = shape["heads"] // shape["kv_heads"], shape["kv_heads"]
    rows = []
    for chunk, start in itertools.product(shape["chunks"], shape["starts"]):
        args = make_chunk(shape, chunk, start, device)
        truth = reference(args, scale)
        max_keys = args[3].shape[1] * args[1].shape[1]
        runs = [("current, default", current, dict(), own_launch(current, shape, chunk, max_keys, device))]
        runs += [("current", current, dict(block_m=m, block_n=n, num_warps=w, num_stages=s, num_splits=splits),
                  (m, n, w, s, splits)) for m, n, w, s, splits in variants(smoke)]
        if baseline is not None:
            runs.append(("baseline, default", baseline, dict(), own_launch(baseline, shape, chunk, max_keys, device)))
        for name, module, kw, (m, n, w, s, splits) in runs:
            kernel = module.attend_packed_triton
            splits = splits or current.prefill_splits(chunk, groups, kv_heads, m, n, max_keys, num_sms(device))
            row = dict(kernel=name, chunk=chunk, start=start, block_m=m, block_n=n, num_warps=w, num_stages=s,
                       splits=splits)
            rows.append(row)
            try:  # a variant may not compile (shared memory) or launch: report it and go on
                call = (lambda k=kernel, kw=kw: k(*args, scale, **kw))
                out = call().float()
                times = time_steps(call, device, shape["warmup"], shape["reps"], None, before=flush.zero_)
            except Exception as exc:  # noqa: BLE001
                row["status"] = f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:80]}"
                continue
            row["us"] = statistics.median(times) * 1e3
            row["tflops"] = causal_flop(shape, chunk, start) / (row["us"] * 1e-6) / 1e12
            row["max_err"] = float((out - truth).abs().max())
            row["status"] = "ok" if row["max_err"] < MAX_ERR else "wrong output"
        if device.type == "cuda":
            rows.append(sdpa_row(shape, args, chunk, start, device, flush))
    return rows


def sdpa_row(shape: dict, args, chunk: int, start: int, device: torch.device, flush) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k_pool, v_pool, table, _, _ = args
    live = start + chunk
    group = shape["heads"] // shape["kv_heads"]
    k = k_pool[table[0]].flatten(0, 1)[:live].repeat_interleave(group, 1).transpose(0, 1)[None].contiguous()
    v = v_pool[table[0]].flatten(0, 1)[:live].repeat_interleave(group, 1).transpose(0, 1)[None].contiguous()
    qh = q.transpose(0, 1)[None].contiguous()
    row = dict(kernel="torch SDPA flash (no mask)", chunk=chunk, start=start)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            times = time_steps(lambda: torch.nn.functional.scaled_dot_product_attention(qh, k, v), device,
                               shape["warmup"], shape["reps"], None, before=flush.zero_)
    except Exception as exc:  # noqa: BLE001
        row["status"] = f"failed: {type(exc).__name__}"
        return row
    row["us"] = statistics.median(times) * 1e3
    row["tflops"] = 4 * shape["head_dim"] * shape["heads"] * chunk * live / (row["us"] * 1e-6) / 1e12
    row["status"] = "ok"
    return row


def summary(rows: list[dict]) -> list[dict]:
    """Per chunk and start: the current kernel's default launch, its best variant, the baseline's default, SDPA."""
    out = []
    for (chunk, start), group in itertools.groupby(rows, key=lambda r: (r["chunk"], r["start"])):
        ok = [r for r in group if r.get("status") == "ok"]
        pick = {r["kernel"]: r for r in ok if r["kernel"] != "current"}
        best = min((r for r in ok if r["kernel"] == "current"), key=lambda r: r["us"], default=None)
        line = dict(chunk=chunk, start=start)
        for label, r in [("baseline_us", pick.get("baseline, default")), ("default_us", pick.get("current, default")),
                         ("best_us", best), ("sdpa_us", pick.get("torch SDPA flash (no mask)"))]:
            line[label] = None if r is None else round(r["us"], 1)
        line["default_tflops"] = None if "current, default" not in pick else round(pick["current, default"]["tflops"])
        line["best"] = None if best is None else (f"{best['block_m']}x{best['block_n']} w{best['num_warps']} "
                                                 f"s{best['num_stages']} splits {best['splits']}")
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=None, help="an earlier attention_packed_triton.py to time beside")
    p.add_argument("--out", default=None, help="default bench/results; smoke: /tmp/packed_attention_smoke")
    p.add_argument("--chunks", default=None, help="chunk tokens, comma separated (default 64,128,256,512)")
    p.add_argument("--starts", default=None, help="prompt tokens before the chunk (default 0,1024,2816)")
    p.add_argument("--smoke", action="store_true", help="tiny shape, 2 variants, Triton interpreter on the CPU")
    args = p.parse_args(argv)
    device = triton_device(p, args.smoke)
    import pyarrow as pa
    import pyarrow.parquet as pq

    shape = dict(SMOKE if args.smoke else FULL)
    for name in ("chunks", "starts"):
        if getattr(args, name):
            shape[name] = tuple(int(x) for x in getattr(args, name).split(","))
    out = Path(args.out or ("/tmp/packed_attention_smoke" if args.smoke else "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    baseline = load_baseline(args.baseline) if args.baseline else None
    rows = sweep(shape, device, baseline, args.smoke)
    run = dict(git_sha=git_sha(), command=command_line("bench.packed_attention", argv), device=device_name(device))
    table = pa.Table.from_pylist([{c: {**r, **run}.get(c) for c in COLUMNS} for r in rows])
    pq.write_table(table, out / "packed_attention.parquet")
    try:
        from bench.plot import PLOTS
        PLOTS["packed_attention"](out / "packed_attention.parquet", out / "packed_attention.png")
    except ImportError:   # no matplotlib: python -m bench.plot later
        pass
    lines = summary(rows)
    failed = [r for r in rows if r.get("status") != "ok"]
    md = ["# Packed prefill attention: one chunk deep in a prompt", "",
          markdown_table(lines, list(lines[0])), "",
          f"Command: `{command_line('bench.packed_attention', argv)}`", "", f"Git: {git_sha()}", "",
          f"Device: {device_name(device)}", "",
          f"- {shape['heads']} query heads over {shape['kv_heads']} KV heads, head dim {shape['head_dim']}, "
          f"{str(shape['dtype']).replace('torch.', '')}; one layer's attention of a chunk continuing one prompt at "
          f"`start` (paged cache, blocks scattered); us: median of {shape['reps']} calls, L2 evicted before each",
          "- default: the current kernel at the launch's own tiles and splits; best: its fastest variant of "
          f"{len(variants(args.smoke))} (tiles, warps, stages, splits); baseline: --baseline "
          f"({args.baseline}) at its own launch; SDPA: torch's flash kernel over all start + chunk keys for every "
          "query (no mask: more work than the chunk's, see the module docstring)",
          f"- default_tflops: causal FLOPs / the default's time; variants failed or wrong: {len(failed)}"
          + "".join(f"\n  - {r['kernel']} {r.get('block_m')}x{r.get('block_n')} w{r.get('num_warps')} "
                    f"s{r.get('num_stages')} at {r['chunk']}@{r['start']}: {r.get('status')}" for r in failed[:10]),
          f"- {versions()}; {time.monotonic() - t0:.0f} s"]
    (out / "packed_attention.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {out}/packed_attention.{{parquet,md,png}}")
    # a variant may fail to compile on a GPU (shared memory); the launch's own must run, and nothing may be wrong
    default_ok = all(r.get("status") == "ok" for r in rows if r["kernel"] == "current, default")
    return 0 if default_ok and not any(r.get("status") == "wrong output" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
