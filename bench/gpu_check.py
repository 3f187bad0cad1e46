"""GPU sanity check (not a benchmark): greedy sd == ar on CUDA with CUDA graphs, then the Ray
runtime's modes on real GPUs. Prints one line per check; exits non-zero on a mismatch.

    python -m bench.gpu_check
"""
import os
import sys
import tempfile
import time

import torch


def main() -> int:
    from minedraft_ray.engine.engine import Engine
    from minedraft_ray.engine.sampling import SamplingParams
    from minedraft_ray.testing.tiny import make_noised_draft, make_tiny_model

    tmp = tempfile.mkdtemp()
    target = make_tiny_model(os.path.join(tmp, "t"), "llama", hidden=128, layers=4, heads=4, kv_heads=2)
    draft = make_noised_draft(target, os.path.join(tmp, "d"), noise=0.02)
    prompts = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n", "a", "class Foo:"] * 3
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ok = True
    ref = Engine(target, mode="ar", max_batch=8, device="cpu").generate(prompts, greedy)
    for mode, k in (("ar", 1), ("sd", 1), ("sd", 4)):
        t0 = time.time()
        eng = Engine(target, draft if mode == "sd" else None, mode=mode, k=k, max_batch=8, device="cuda",
                     dtype=torch.float32)
        outs = eng.generate(prompts, greedy)
        same = sum(o.token_ids == r.token_ids for o, r in zip(outs, ref))
        ok &= same == len(prompts)
        acc = sum(o.stats["accepted"] for o in outs) / max(sum(o.stats["drafted"] for o in outs), 1)
        print(f"engine cuda fp32 {mode} k={k}: {same}/{len(prompts)} equal to cpu ar, acceptance {acc:.2f}, "
              f"{time.time() - t0:.1f}s", flush=True)

    import ray
    from minedraft_ray import LLM
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(address="local", include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="r", dir="/tmp"))
    for mode in ("ar", "sd", "sd_split", "psd"):
        t0 = time.time()
        llm = LLM(str(target), None if mode == "ar" else str(draft), mode=mode, k=3, max_batch=4, dtype="float32")
        outs = llm.generate(prompts, greedy)
        same = sum(o.token_ids == r.token_ids for o, r in zip(outs, ref))
        ok &= same == len(prompts)
        print(f"runtime {mode}: {same}/{len(prompts)} equal, workers {llm.worker_info}, "
              f"{time.time() - t0:.1f}s", flush=True)
        llm.shutdown()
    ray.shutdown()
    print("GPU CHECK", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
