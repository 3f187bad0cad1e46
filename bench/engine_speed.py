"""Speed of one engine step (ModelRunner.step + greedy sample) against transformers and the HBM floor.

Random bf16 weights at Llama-3.1-8B / Llama-3.2-1B shapes, KV slots preallocated to max_len 4096;
decode (q=1) and verify (q=5) steps at batch 1/16/64/128 with 512 live tokens per row, plus a batch
with live lengths uniform in 128..1024. KV content does not change timing, so lengths are set directly.

    python -m bench.engine_speed [--models 8b,1b] [--batches 1,16,64,128] [--no-transformers] [--smoke]

floor_ms = (bytes of the linear layers and lm_head + live KV bytes the step reads) / 4.8 TB/s.
The GPU machine gets the tree without .git: pass GIT_SHA=<sha> in the environment to record it.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
from pathlib import Path

import torch

from bench.common import (command_line, device_name, git_sha, markdown_table, progress, say, synchronize,
                          time_steps, versions, write_results)
from minedraft_ray.engine.model import ModelConfig, Transformer
from minedraft_ray.engine.runner import ModelRunner
from minedraft_ray.engine.sampling import SamplingBatch, SamplingParams, sample

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# Hugging Face config.json dicts: ModelConfig.from_hf_dict and transformers' LlamaConfig read the same one
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
               max_position_embeddings=131072, rope_parameters={**LLAMA3_ROPE, "factor": 8.0}),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
               max_position_embeddings=131072, rope_parameters={**LLAMA3_ROPE, "factor": 32.0}),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False,
                 max_position_embeddings=256, rope_parameters={**LLAMA3_ROPE, "factor": 8.0,
                                                               "original_max_position_embeddings": 64}),
}
COMMON = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
              bos_token_id=128000, eos_token_id=128001, dtype="bfloat16")
COLUMNS = ["model", "batch", "q", "context", "max_len", "ms", "ms_transformers", "floor_ms", "gbps", "git_sha",
           "command", "device", "lengths", "transformers_config"]
TABLE_COLUMNS = ["model", "batch", "q", "context", "lengths", "ms", "ms_transformers", "floor_ms", "gbps"]
TRANSFORMERS_CONFIG = (
    "LlamaForCausalLM eager, bf16, sdpa, StaticCache(max_cache_len = longest live + q; not prefilled, "
    "zero KV), shorter rows left-padded by attention_mask, greedy argmax")


def hf_config(name: str) -> dict:
    return {**COMMON, **SHAPES[name]}


def step_bytes(cfg: ModelConfig, lengths: list[int], q: int) -> int:
    """Bytes a step must move at least: every linear weight and the lm_head once, and the live K/V."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv, o = H * (cfg.num_heads + 2 * cfg.num_kv_heads) * D, cfg.num_heads * D * H
    linear = cfg.num_layers * (qkv + o + 2 * H * I + I * H) + cfg.vocab_size * H
    elem = torch.tensor([], dtype=cfg.dtype).element_size()
    kv = sum(n + q for n in lengths) * cfg.num_layers * 2 * cfg.num_kv_heads * D * elem
    return linear * elem + kv


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- this engine ------------------------------------------------------------------------------
def build_engine(cfg: ModelConfig, device: torch.device, num_slots: int, max_len: int) -> ModelRunner:
    with torch.device(device):
        # default inits keep activations finite: N(0, 1) embeddings, U(+-1/sqrt(fan_in)) linears, unit norms
        model = Transformer(cfg).eval()
    return ModelRunner(model, device, num_slots=num_slots, max_len=max_len, max_batch=num_slots, cuda_graphs=True)


@torch.inference_mode()
def time_engine(runner: ModelRunner, lengths: list[int], q: int, warmup: int, reps: int, desc: str) -> float:
    device, B = runner.device, len(lengths)
    slots = torch.arange(B, device=device)
    live = torch.tensor(lengths, device=device)
    input_ids = torch.randint(runner.cfg.vocab_size, (B, q), device=device)
    positions = live[:, None] + torch.arange(q, device=device)  # [B, q] output positions (unused when greedy)
    batch = SamplingBatch.build([SamplingParams(temperature=0.0)] * B, device, seeds=[0] * B)

    def reset_lengths():  # step advances the lengths; put them back so every step sees the same context
        runner.cache.lengths[slots] = live

    def step():
        return sample(runner.step(slots, input_ids), batch, positions)  # [B, q]

    reset_lengths()
    assert torch.isfinite(runner.step(slots, input_ids)).all(), "random weights overflowed"
    return statistics.median(time_steps(step, device, warmup, reps, desc, before=reset_lengths))


def profile_engine(runner: ModelRunner, batch: int, context: int, q: int, path) -> None:
    """Kernel time table of one model's step (torch.profiler over graph replays), to see where the floor gap is."""
    from torch.profiler import ProfilerActivity, profile

    lengths = [context] * batch
    time_engine(runner, lengths, q, warmup=3, reps=3, desc="profile warm-up")  # captures the graph
    slots, live = torch.arange(batch, device=runner.device), torch.tensor(lengths, device=runner.device)
    input_ids = torch.randint(runner.cfg.vocab_size, (batch, q), device=runner.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            runner.cache.lengths[slots] = live
            runner.step(slots, input_ids)
        synchronize(runner.device)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    path.write_text(f"B={batch} q={q} context={context}, 10 steps\n\n{table}\n")
    print(table, flush=True)


# ---- transformers -----------------------------------------------------------------------------
def build_transformers(name: str, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**hf_config(name))
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


@torch.inference_mode()
def time_transformers(model, lengths: list[int], q: int, warmup: int, reps: int, desc: str) -> float:
    from transformers import StaticCache

    device, B, longest = model.device, len(lengths), max(lengths)
    cache = StaticCache(config=model.config, max_cache_len=longest + q)
    input_ids = torch.randint(model.config.vocab_size, (B, q), device=device)
    cache_position = torch.arange(longest, longest + q, device=device)
    mask = None
    if min(lengths) != longest:  # shorter rows are left-padded, the usual transformers batch
        pad = torch.tensor([longest - n for n in lengths], device=device)
        mask = (torch.arange(longest + q, device=device)[None, :] >= pad[:, None]).long()  # [B, longest + q]

    def step():
        out = model(input_ids=input_ids, attention_mask=mask, past_key_values=cache, cache_position=cache_position,
                    use_cache=True)
        return out.logits.argmax(-1)  # [B, q]

    return statistics.median(time_steps(step, device, warmup, reps, desc))


# ---- driver -----------------------------------------------------------------------------------
def plan(batches: list[int], context: int, mixed_batch: int, mixed_range: tuple[int, int]) -> list[tuple[str, list[int], int]]:
    """(label, live lengths per row, q) for every row of the table."""
    rows = [(str(context), [context] * B, q) for B in batches for q in (1, 5)]
    rng = random.Random(0)
    mixed = [rng.randint(*mixed_range) for _ in range(mixed_batch)]
    rows += [(f"uniform {mixed_range[0]}..{mixed_range[1]}", mixed, q) for q in (1, 5)]
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="results folder (default bench/results; smoke: /tmp/engine_speed_smoke)")
    p.add_argument("--models", default="8b,1b")
    p.add_argument("--batches", default="1,16,64,128")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--profile", default=None, metavar="MODEL:B:Q",
                   help="also write a kernel time table of that step to OUT/engine_profile_MODEL_B_Q.txt")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few repetitions: checks the script")
    args = p.parse_args(argv)

    if args.smoke:
        device, models, max_len, context, mixed_range = torch.device("cpu"), ["tiny"], 64, 16, (8, 32)
        batches = [1, 4]
        warmup, reps, hf_warmup, hf_reps = 1, 3, 1, 2
    else:
        device, models, max_len, context, mixed_range = torch.device("cuda"), args.models.split(","), 4096, 512, (128, 1024)
        batches = [int(b) for b in args.batches.split(",")]
        warmup, reps, hf_warmup, hf_reps = 10, 100, 3, 20
    out_dir = args.out or ("/tmp/engine_speed_smoke" if args.smoke else "bench/results")
    num_slots = max(batches)
    rows_plan = plan(batches, context, min(64, num_slots), mixed_range)
    sha, command, device_str = git_sha(), command_line("bench.engine_speed"), device_name(device)
    print(f"{device_str}; {versions()}; git {sha}", flush=True)

    results = []
    for name in models:
        cfg = ModelConfig.from_hf_dict(hf_config(name))
        runner = build_engine(cfg, device, num_slots, max_len)
        model_rows = []
        say(f"\n## {name}: engine\n\n" + markdown_table([], TABLE_COLUMNS))
        for label, lengths, q in progress(rows_plan, f"{name} engine"):
            nbytes = step_bytes(cfg, lengths, q)
            floor_ms = nbytes / HBM_BYTES_PER_S * 1e3
            ms = time_engine(runner, lengths, q, warmup, reps, f"{name} B={len(lengths)} q={q}")
            row = dict(model=name, batch=len(lengths), q=q, context=round(sum(lengths) / len(lengths)), lengths=label,
                       max_len=max_len, ms=ms, ms_transformers=None, floor_ms=floor_ms, gbps=nbytes / ms / 1e6,
                       git_sha=sha, command=command, device=device_str,
                       transformers_config=None if args.no_transformers else TRANSFORMERS_CONFIG)
            model_rows.append(row)
            say(markdown_table([row], TABLE_COLUMNS).splitlines()[-1])
        if args.profile and args.profile.split(":")[0] == name:
            _, pb, pq = args.profile.split(":")
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            profile_engine(runner, int(pb), context, int(pq), Path(out_dir) / f"engine_profile_{name}_{pb}_{pq}.txt")
        del runner
        release_memory()

        if not args.no_transformers:
            hf = build_transformers(name, device)
            say(f"\n## {name}: transformers ({TRANSFORMERS_CONFIG})")
            for row, (_, lengths, q) in progress(list(zip(model_rows, rows_plan)), f"{name} transformers"):
                row["ms_transformers"] = time_transformers(hf, lengths, q, hf_warmup, hf_reps,
                                                           f"{name} hf B={len(lengths)} q={q}")
                release_memory()  # the row's StaticCache
                say(f"B={row['batch']} q={q} lengths={row['lengths']}: {row['ms_transformers']:.2f} ms")
            del hf
            release_memory()
        results += model_rows

    synchronize(device)
    print("\n" + markdown_table(results, TABLE_COLUMNS), flush=True)
    on_gpu = device.type == "cuda"
    notes = [versions(),
             f"ms: median of {reps} steps after {warmup} warm-up: runner.step "
             + ("(CUDA graph per batch and q, Triton attention)" if on_gpu else "(eager, torch reference attention)")
             + " + greedy sample; " + ("CUDA events around each step" if on_gpu else "wall clock"),
             f"floor_ms: (linear + lm_head weight bytes + live KV bytes) / {HBM_BYTES_PER_S / 1e12:.1f} TB/s; "
             "gbps: those bytes / ms",
             f"random weights, bf16, {num_slots} slots of max_len {max_len}; context = mean live length per row"]
    if not args.no_transformers:
        notes.insert(2, f"ms_transformers: median of {hf_reps} steps after {hf_warmup} warm-up; {TRANSFORMERS_CONFIG}")
    path = write_results(results, out_dir, "engine_speed", COLUMNS, "Engine step speed", command, device_str,
                         notes, TABLE_COLUMNS)
    print(f"\nwrote {path} and {path.with_suffix('.parquet')}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
