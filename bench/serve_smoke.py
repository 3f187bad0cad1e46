"""Smoke run of a Serve YAML: `serve run` it on a private Ray, stream N chat completions through the
official openai client at once, print what came back, shut it down.

    python -m bench.serve_smoke [--config deployments/minedraft-gpu.yaml] [--requests 8] [--max-tokens 64]

The GPU run (random 8B/1B-shaped weights, psd on two H200s) writes its log and a JSON summary to --out.
On a CPU, `--config deployments/minedraft.yaml` runs the same thing on the embedded default pair.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.common import git_sha

PROMPTS = ["Write a Python function that reverses a list.", "Explain speculative decoding in one paragraph.",
           "def quicksort(arr):", "List three uses of a hash map.", "What does a KV cache store?",
           "Translate 'good morning' into French.", "import numpy as np\n\n", "Summarise the CAP theorem."]


def serve_command(config: Path) -> list[str]:
    # the `serve` console script may not be on PATH (wheels installed with --target): call its entry point
    return [sys.executable, "-c", "import sys; from ray.serve.scripts import cli; sys.exit(cli())", "run", str(config)]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    import urllib.request
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {proc.returncode} before the API came up")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"the API did not come up within {timeout:.0f} s")


def engine_info(url: str) -> dict | None:
    import urllib.request
    request = urllib.request.Request(url + "/v1/minedraft/info", headers={
        "Authorization": f"Bearer {os.environ.get('MINEDRAFT_API_KEY', 'none')}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())
    except OSError as e:
        print(f"/v1/minedraft/info: {e}", flush=True)
        return None


async def stream_all(url: str, model: str, n: int, max_tokens: int) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key=os.environ.get("MINEDRAFT_API_KEY", "none"), timeout=600)

    async def one(i: int) -> dict:
        t0 = time.monotonic()
        ttft, pieces, finish, usage = None, [], None, None
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        arrivals = []
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
            for choice in chunk.choices:
                if choice.delta.content:
                    arrivals.append(time.monotonic() - t0)
                    ttft = ttft if ttft is not None else arrivals[-1]
                    pieces.append(choice.delta.content)
                finish = choice.finish_reason or finish
        gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:]))
        return dict(request=i, ttft_s=ttft, latency_s=time.monotonic() - t0, chunks=len(pieces),
                    chars=sum(map(len, pieces)), finish_reason=finish, usage=usage,
                    median_gap_s=gaps[len(gaps) // 2] if gaps else None)

    return await asyncio.gather(*(one(i) for i in range(n)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="deployments/minedraft-gpu.yaml")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=None, help="override http_options.port")
    ap.add_argument("--ready-timeout-s", type=float, default=420)
    ap.add_argument("--out", default="/tmp/serve_smoke")
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load(Path(args.config).read_text())
    if args.port:
        config["http_options"]["port"] = args.port
    config_path = out / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    http = config["http_options"]
    url = f"http://{http['host']}:{http['port']}"
    app_args = config["applications"][0]["args"]
    model = app_args.get("model_name") or "minedraft-default"

    log = open(out / "serve_smoke_server.log", "w")
    proc = subprocess.Popen(serve_command(config_path), stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "RAY_ADDRESS": "local"}, start_new_session=True)
    summary = dict(config=args.config, args=app_args, git_sha=git_sha(), requests=args.requests,
                   max_tokens=args.max_tokens)
    try:
        summary["ready_s"] = wait_ready(url, proc, args.ready_timeout_s)
        print(f"API up at {url} after {summary['ready_s']:.0f} s", flush=True)
        t0 = time.monotonic()
        results = asyncio.run(stream_all(url, model, args.requests, args.max_tokens))
        summary["wall_s"] = time.monotonic() - t0
        summary["results"] = results
        for r in results:
            usage = r["usage"] or {}
            ttft = "none" if r["ttft_s"] is None else f"{r['ttft_s']:.3f} s"
            gap = "none" if r["median_gap_s"] is None else f"{r['median_gap_s'] * 1e3:.1f} ms"
            print(f"request {r['request']}: ttft {ttft}, median gap {gap}, latency {r['latency_s']:.2f} s, "
                  f"{r['chunks']} chunks, {usage.get('completion_tokens')} tokens, finish={r['finish_reason']}",
                  flush=True)
        tokens = sum((r["usage"] or {}).get("completion_tokens", 0) for r in results)
        summary["tokens_per_s"] = tokens / summary["wall_s"]
        print(f"{args.requests} streams, {tokens} tokens in {summary['wall_s']:.2f} s "
              f"({summary['tokens_per_s']:.0f} tokens/s)", flush=True)
        info = engine_info(url)   # the engine's own view: step times, regimes
        summary["engine"] = info
        if info:
            print(f"engine: {json.dumps(info.get('recent_steps'))}", flush=True)
        ok = all(r["finish_reason"] == "length" and (r["usage"] or {}).get("completion_tokens") == args.max_tokens
                 for r in results)
        summary["ok"] = ok
        return 0 if ok else 1
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        (out / "serve_smoke.json").write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(main())
