"""CPU of the calling process per Serve handle call, the way the ingress submits a request (issue 22): a streaming
call whose first item is awaited and whose stream then ends, with Serve's router on its own thread (default) or on the
caller's loop; a unary Serve call; a plain Ray actor call; and one Serve call carrying 64 requests (per request).

    python -m bench.serve_call_cost          # CPU, ~2 min; prints the per-call CPU-ms of each kind (3 rounds)

The caller's CPU (getrusage of this process: its loop, Serve's router thread and Ray's core worker threads), not
wall time. Numbers of a run: docs/ingress-cpu.md.
"""
import asyncio
import resource
import shutil
import tempfile

from minedraft_ray.ray_local import lock_down

lock_down()   # before Ray's import: a private, locked-down instance
import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.handle import DeploymentHandle  # noqa: E402

from minedraft_ray.runtime.llm import init_local_ray  # noqa: E402


@serve.deployment(max_ongoing_requests=2000, max_queued_requests=2000)
class Echo:
    async def generate(self, ids, rid):
        yield rid
        await asyncio.sleep(0.05)
    async def unary(self, ids, rid):
        return rid
    async def many(self, reqs):
        return [r[1] for r in reqs]

@ray.remote(num_cpus=0)
class Plain:
    async def unary(self, ids, rid):
        return rid

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

async def timed(fn, n, conc=256):
    sem = asyncio.Semaphore(conc)
    async def one(i):
        async with sem:
            await fn(i)
    c = cpu()
    await asyncio.gather(*(one(i) for i in range(n)))
    return (cpu() - c) / n * 1e3

async def main():
    sep = DeploymentHandle("Echo", "ab")
    sep._init()
    onl = DeploymentHandle("Echo", "ab")
    onl._init(_run_router_in_separate_loop=False)
    plain = Plain.remote()
    ids = list(range(20))
    async def stream(h):
        g = h.options(method_name="generate", stream=True)
        async def f(i):
            gen = g.remote(ids, str(i))
            async for _ in gen:
                pass
        return f
    def unary(h):
        u = h.options(method_name="unary")
        async def f(i):
            await u.remote(ids, str(i))
        return f
    async def pl(i):
        await plain.unary.remote(ids, str(i))
    many = onl.options(method_name="many")
    async def batch(i):   # one call for 64 requests: cost per request
        await many.remote([(ids, f"{i}-{j}") for j in range(64)])
    cases = {"stream_sep": await stream(sep), "stream_onloop": await stream(onl), "unary_sep": unary(sep),
             "unary_onloop": unary(onl), "plain_actor": pl}
    for f in cases.values():
        await timed(f, 200)
    res = {k: [] for k in list(cases) + ["batch64_onloop"]}
    for _ in range(3):
        for k, f in cases.items():
            res[k].append(await timed(f, 1000))
        res["batch64_onloop"].append(await timed(batch, 30, 8) / 64)
        print({k: round(v[-1], 3) for k, v in res.items()}, flush=True)
    for k, v in res.items():
        print(f"{k}: mean {sum(v)/len(v):.3f} min {min(v):.3f} ms CPU per request")

if __name__ == "__main__":
    temp_dir = tempfile.mkdtemp(prefix="r", dir="/tmp")
    init_local_ray(num_gpus=0, _temp_dir=temp_dir, log_to_driver=False)
    serve.run(Echo.bind(), name="ab", route_prefix=None)
    try:
        asyncio.run(main())
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
