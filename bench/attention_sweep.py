"""A tuner, not a benchmark: time attend_triton's launch configs (attention_triton.LaunchConfig) at the
Llama-3.1-8B attention shape, to pick MINEDRAFT_ATTN_CONFIG for a GPU; it keeps no result in bench/results.

Hq=32, Hkv=8, D=128, bf16, 128 slots of max_len 4096; batch 64 at context 512, one decode (q=1) and one
verify (q=5) call shape. Every config of a small grid gets 10 warm-up and 50 timed calls (CUDA events,
median); a 512 MB write before each call evicts L2, as the rest of a model step would. TB/s counts the
live K+V bytes a call must read. Each config's output is checked against the default config's.

    python -m bench.attention_sweep [--out DIR] [--budget-s 45] [--smoke]

Prints a table per q sorted by time and writes DIR/attention_sweep.json: the best config per q
(use it as MINEDRAFT_ATTN_CONFIG='<json>') and every row. Compiling dominates the run time: each q gets
its share of --budget-s, and configs left when it runs out are listed as skipped (Triton's disk cache
makes a rerun fast).
--smoke: a tiny fp32 shape and 2 configs in Triton's interpreter on the CPU, to check the script.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import device_name, git_sha, markdown_table, time_steps, triton_device

FULL = dict(heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, slots=128, max_len=4096, batch=64,
            context=512, qlens=(1, 5), warmup=10, reps=50)
SMOKE = dict(heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, slots=4, max_len=32, batch=2,
             context=8, qlens=(1, 5), warmup=1, reps=2)
FLUSH_BYTES = 512 << 20  # > L2 (50 MB on an H200), and long enough to write that the next launch queues behind it
COLUMNS = ["q", "config", "splits", "us", "tbps", "max_err", "status"]
MAX_ERR = 1e-2  # vs the default config's output: bf16 rounding and split order stay far below; outputs are ~0.1


def grid(smoke: bool):
    """LaunchConfigs to time, the default first. Full grid: 36 configs of 12 kernel variants (compiled once
    for one split and once for several, per q)."""
    from minedraft_ray.engine.attention_triton import LaunchConfig

    if smoke:
        return [LaunchConfig(BLOCK_N=16), LaunchConfig(BLOCK_N=32, TARGET_WAVES=8)]
    # shared memory per program ~ 2 tiles x BLOCK_N x 128 x 2 B x stages: keep BLOCK_N * stages <= 384
    tiles = [(32, 3), (32, 4), (64, 2), (64, 3), (128, 2), (128, 3)]
    # at batch 64 there are 512 stage-1 programs: waves 2, 4, 8 give 1, 2, 3 key splits on 132 SMs
    configs = [LaunchConfig(BLOCK_N=n, num_stages=s, num_warps=w, TARGET_WAVES=waves)
               for (n, s), w, waves in itertools.product(tiles, (4, 8), (2, 4, 8))]
    default = LaunchConfig()
    return [default] + [c for c in configs if c != dataclasses.replace(default, num_warps=4)]


def short(config) -> str:
    return json.dumps({k: v for k, v in dataclasses.asdict(config).items() if k != "MAX_SPLITS"})


def make_inputs(shape: dict, qlen: int, device: torch.device):
    """Paged cache (blocks of the default size, each slot's scattered over the pool), queries, slots (a random
    half of them, out of order) and positions at the shape's context."""
    from minedraft_ray.engine.kv_blocks import DEFAULT_BLOCK_SIZE, HEADROOM

    torch.manual_seed(qlen)
    per_slot = -(-(shape["max_len"] + HEADROOM) // DEFAULT_BLOCK_SIZE)
    cache_shape = (shape["slots"] * per_slot + 1, DEFAULT_BLOCK_SIZE, shape["kv_heads"], shape["head_dim"])
    k_cache = torch.randn(cache_shape, dtype=shape["dtype"], device=device)
    v_cache = torch.randn(cache_shape, dtype=shape["dtype"], device=device)
    tables = (torch.randperm(shape["slots"] * per_slot) + 1).view(shape["slots"], per_slot).to(device)
    q = torch.randn(shape["batch"], qlen, shape["heads"], shape["head_dim"], dtype=shape["dtype"], device=device)
    slots = torch.randperm(shape["slots"])[:shape["batch"]].to(device)
    positions = shape["context"] + torch.arange(qlen, device=device).expand(shape["batch"], qlen).contiguous()
    live_bytes = 2 * shape["batch"] * (shape["context"] + qlen) * shape["kv_heads"] * shape["head_dim"] \
        * k_cache.element_size()
    return (q, k_cache, v_cache, tables, slots, positions), live_bytes


def sweep(shape: dict, configs: list, device: torch.device, budget_s: float) -> list[dict]:
    from minedraft_ray.engine.attention_triton import attend_triton, launch_shape

    start, qlens = time.monotonic(), shape["qlens"]
    flush = torch.empty(FLUSH_BYTES if device.type == "cuda" else 1, dtype=torch.uint8, device=device)
    scale = shape["head_dim"] ** -0.5
    rows = []
    for j, qlen in enumerate(qlens):
        deadline = start + budget_s * (j + 1) / len(qlens)  # time one q leaves unused goes to the next
        args, live_bytes = make_inputs(shape, qlen, device)
        cache_rows = args[3].shape[1] * args[1].shape[1]  # positions a slot holds
        reference = None
        for config in configs:
            row = dict(q=qlen, config=short(config),
                       splits=launch_shape(shape["batch"], qlen, shape["heads"], shape["kv_heads"], cache_rows,
                                           shape["head_dim"], device, config)[2])
            rows.append(row)
            if time.monotonic() > deadline:
                row["status"] = "skipped (budget)"
                continue
            try:  # a config may not compile (shared memory) or launch; report it and go on
                out = attend_triton(*args, scale, config=config).float()
                times = time_steps(lambda: attend_triton(*args, scale, config=config), device,
                                   shape["warmup"], shape["reps"], None, before=flush.zero_)
            except Exception as exc:  # noqa: BLE001
                row["status"] = f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:80]}"
                continue
            reference = out if reference is None else reference
            row["us"] = statistics.median(times) * 1e3
            row["tbps"] = live_bytes / (row["us"] * 1e-6) / 1e12
            row["max_err"] = float((out - reference).abs().max())
            row["status"] = "ok" if row["max_err"] < MAX_ERR else "wrong output"
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/attention_sweep", help="folder of attention_sweep.json")
    p.add_argument("--budget-s", type=float, default=45.0, help="stop starting new configs after this many seconds")
    p.add_argument("--smoke", action="store_true", help="tiny shape, 2 configs, Triton interpreter on the CPU")
    args = p.parse_args(argv)

    device = triton_device(p, args.smoke)
    import triton

    shape = SMOKE if args.smoke else FULL
    print(f"{device_name(device)}; torch {torch.__version__}, triton {triton.__version__}; git {git_sha()}",
          flush=True)
    t0 = time.monotonic()
    configs = grid(args.smoke)
    rows = sweep(shape, configs, device, args.budget_s)

    best = {}
    for qlen in shape["qlens"]:
        mine = [r for r in rows if r["q"] == qlen]  # the default config first
        ranked = sorted(mine, key=lambda r: r.get("us", float("inf")))
        print(f"\n## q={qlen}, batch {shape['batch']}, context {shape['context']}\n")
        print(markdown_table(ranked, COLUMNS))
        ok = [r for r in ranked if r["status"] == "ok"]
        if ok:
            top = ok[0]
            best[str(qlen)] = {"config": json.loads(top["config"]), "us": top["us"], "tbps": top["tbps"],
                               "default_us": mine[0].get("us")}
            print(f"\nbest q={qlen}: MINEDRAFT_ATTN_CONFIG='{top['config']}' {top['us']:.1f} us, "
                  f"{top['tbps']:.2f} TB/s (default config: {mine[0].get('us', float('nan')):.1f} us)")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "attention_sweep.json"
    shape_out = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in shape.items()}
    path.write_text(json.dumps({"device": device_name(device), "git_sha": git_sha(), "shape": shape_out,
                                "best": best, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {path} ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
