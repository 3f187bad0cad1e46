"""What a draft's trip to the verifier costs on the host: one actor drafts ([rows, k] int64 ids, as a torch
tensor, a numpy array or nested lists) and the verifier takes them either by reference through the owner
(`owner`: what the draft channel does, the manager submitted both tasks) or from a call the drafter makes
itself (`direct`: the drafter submits the verify, one actor-to-actor message), or over the gloo link of the
collective draft channel (`link`: the verifier waits on it, the drafter sends a torch tensor), or over the ends of
the ray_collective channel (`ray_collective`: Ray's collective groups, NCCL with --device cuda, gloo on CPUs).
Measured: the drafter's task end to the verifier's task start (wall clocks of one host), and the whole round trip
seen by the driver.
With --probs-widths, probabilistic drafting's q [rows, k, width] float32 travels with the ids too, through the
owner (numpy) and the link: width = the vocabulary is dense q, 2 x top_k is q packed as top_k (prob, id) pairs
(engine/rejection.py draft_sample_packed).

    python -m bench.payload_hop [--rows 64] [--k 3] [--trips 400] [--probs-widths 128256,128 --probs-trips 20]
    python -m bench.payload_hop --device cuda --routes link,ray_collective   # two GPUs: gloo link vs NCCL

With --device cuda each actor holds a GPU and the drafts start and end in GPU memory, as in the engine: the link
route copies them to the host and back (as `collective` does), ray_collective moves them GPU to GPU (NCCL).
Otherwise the host does this work. --smoke: a few trips of every route on the CPU (the tests run it).
Writes bench/results/payload_hop_{cpu,gpu}.{parquet,md}.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time

import ray
import torch

from bench.common import command_line, git_sha, write_results
from minedraft_ray.runtime.gcs_store import GcsStore
from minedraft_ray.runtime.link import PeerLink
from minedraft_ray.runtime.messages import ChannelSpec, backend_for
from minedraft_ray.runtime.ray_collective import ChannelEnd
from minedraft_ray.runtime.rendezvous import fresh_prefix

LINK_TAGS = itertools.count()   # one tag per message over the link
CONTAINERS = {"torch": lambda t: t, "numpy": lambda t: t.numpy(), "list": lambda t: t.tolist()}


ROUTES = ("owner", "direct", "link", "ray_collective")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class _Ends:
    """Both channels' ends in one actor: the gloo link (`link`) and the ray_collective channel (`channel`)."""

    def open_channel(self, spec: ChannelSpec, rank: int) -> None:
        self.channel = ChannelEnd.open(spec, rank, 30.0)

    def _end(self, route: str):
        return self.link if route == "link" else self.channel


@ray.remote
class Verifier(_Ends):
    def verify(self, drafts: dict) -> tuple[int, float]:
        return len(drafts["ids"]), time.time()   # the task's start: what the drafter's end is compared with

    def open_link(self) -> str:
        prefix = fresh_prefix("hop")
        self.link = PeerLink.listen(0, ray.util.get_node_ip_address(), GcsStore(prefix, 30.0), 30.0)
        return prefix

    def verify_over_link(self, rows: int, k: int, tag: int, width: int = 0, route: str = "link") -> tuple[int, float]:
        end = self._end(route)
        ids = end.recv((rows, k), torch.int64, 2 * tag).to(_device())   # over the link they arrive on the host
        if width:
            end.recv((rows, k, width), torch.float32, 2 * tag + 1).to(_device())
        if ids.is_cuda:
            torch.cuda.current_stream().synchronize()
        return len(ids), time.time()   # the drafts' arrival, on the verifier's device


@ray.remote
class Drafter(_Ends):
    def __init__(self, verifier=None):
        self.verifier = verifier

    def draft(self, rows: int, k: int, container: str, width: int = 0):
        drafts = {"ids": CONTAINERS[container](torch.randint(0, 128_000, (rows, k))),
                  "probs": CONTAINERS[container](torch.rand(rows, k, width)) if width else None}
        return drafts, time.time()

    def join_link(self, prefix: str) -> None:
        self.link = PeerLink.join(0, ray.util.get_node_ip_address(), GcsStore(prefix, 30.0), 30.0)

    def draft_over_link(self, rows: int, k: int, tag: int, width: int = 0, route: str = "link") -> float:
        end_ = self._end(route)
        ids = torch.randint(0, 128_000, (rows, k), device=_device())
        probs = torch.rand(rows, k, width, device=_device()) if width else None
        if ids.is_cuda:
            torch.cuda.current_stream().synchronize()
        end = time.time()
        if not end_.on_device:   # the drafter's copy to the host (workers.DrafterWorker._draft)
            ids, probs = ids.cpu(), (probs.cpu() if probs is not None else None)
        end_.send(ids, 2 * tag)
        if width:
            end_.send(probs, 2 * tag + 1)
        return end

    def draft_and_send(self, rows: int, k: int, container: str):
        drafts = {"ids": CONTAINERS[container](torch.randint(0, 128_000, (rows, k))), "probs": None}
        end = time.time()
        return self.verifier.verify.remote(drafts), end


def trip(drafter, verifier, route: str, rows: int, k: int, container: str, width: int = 0) -> tuple[float, float]:
    """-> (drafter end -> verifier start, driver round trip), in ms."""
    t0 = time.perf_counter()
    if route in ("link", "ray_collective"):   # the verify waits first, as a verify queued behind another does
        tag = next(LINK_TAGS)
        verify_ref = verifier.verify_over_link.remote(rows, k, tag, width, route)
        time.sleep(0.002)
        end = ray.get(drafter.draft_over_link.remote(rows, k, tag, width, route))
        verify = ray.get(verify_ref)
    elif route == "owner":
        drafts, end_ref = drafter.draft.options(num_returns=2).remote(rows, k, container, width)
        verify = ray.get(verifier.verify.remote(drafts))
        end = ray.get(end_ref)
    else:
        ref, end = ray.get(drafter.draft_and_send.remote(rows, k, container))
        verify = ray.get(ref)
    assert verify[0] == rows
    return (verify[1] - end) * 1e3, (time.perf_counter() - t0) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--trips", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the configurations (interleaved)")
    ap.add_argument("--probs-widths", default="", help="q's widths to send with the ids (owner/numpy and link), "
                    "e.g. 128256,128: dense at Llama-3's vocabulary, and packed top-64 pairs")
    ap.add_argument("--probs-trips", type=int, default=20, help="trips per round with q (dense q is ~100 MB)")
    ap.add_argument("--routes", default=",".join(ROUTES), help=f"of {', '.join(ROUTES)}")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the drafts start and end (cuda: each actor holds a GPU; needs two)")
    ap.add_argument("--smoke", action="store_true", help="a few trips per route on the CPU")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    if args.smoke:
        args.trips, args.probs_trips, args.rounds, args.rows, args.device = 20, 10, 1, 8, "cpu"
        args.probs_widths = args.probs_widths or "16"
    routes = args.routes.split(",")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(address="local", include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="r", dir="/tmp"))
    gpus = {"num_gpus": 1} if args.device == "cuda" else {}
    verifier = Verifier.options(**gpus).remote()
    drafter = Drafter.options(**gpus).remote(verifier)
    ray.get(drafter.join_link.remote(ray.get(verifier.open_link.remote())))
    if "ray_collective" in routes:
        spec = ChannelSpec(f"payload-hop-{os.getpid()}-{time.time_ns()}", 1, backend_for(args.device))
        ray.get([verifier.open_channel.remote(spec, ChannelEnd.VERIFIER),
                 drafter.open_channel.remote(spec, ChannelEnd.DRAFTER)])
    widths = [int(w) for w in args.probs_widths.split(",") if w]
    configs = [(route, c, 0) for route in ("owner", "direct") if route in routes for c in CONTAINERS]
    configs += [(route, "torch", 0) for route in ("link", "ray_collective") if route in routes]
    configs += [(route, c, w) for w in widths for route, c in (("owner", "numpy"), ("link", "torch"),
                                                               ("ray_collective", "torch")) if route in routes]
    hops, rounds = {c: [] for c in configs}, {c: [] for c in configs}
    for _ in range(args.rounds):
        for config in configs:
            trips = args.probs_trips if config[2] else args.trips
            for i in range(trips):
                hop, rt = trip(drafter, verifier, config[0], args.rows, args.k, config[1], config[2])
                if i >= trips // 10:   # the first tenth warms the path
                    hops[config].append(hop)
                    rounds[config].append(rt)
    gpu = torch.cuda.is_available() and not args.smoke
    device = f"{os.cpu_count()}-core host of {torch.cuda.get_device_name(0)}" if gpu else f"cpu ({os.cpu_count()} cores)"
    rows = [{"route": route, "container": c, "probs_width": w, "rows": args.rows, "k": args.k, "drafts_on": args.device,
             "trips": len(hops[route, c, w]), "hop_ms": statistics.median(hops[route, c, w]),
             "hop_p90_ms": statistics.quantiles(hops[route, c, w], n=10)[-1],
             "round_trip_ms": statistics.median(rounds[route, c, w]), "git_sha": git_sha(), "device": device}
            for route, c, w in configs]
    for r in rows:
        print(r, flush=True)
    write_results(rows, args.out, "payload_hop_" + ("gpu" if gpu else "cpu"),
                  ["route", "container", "probs_width", "rows", "k", "drafts_on", "trips", "hop_ms", "hop_p90_ms",
                   "round_trip_ms",
                   "git_sha", "device"],
                  "A draft's trip to the verifier", command_line("bench.payload_hop"), device,
                  ["hop_ms: median from the end of the drafter's task (link: its send) to the start of the verifier's "
                   "(link: its receive's end), one host's clock",
                   "round_trip_ms: the driver's view (submission to the verify result), other hops included; for link "
                   "it includes a 2 ms pause before the send",
                   "owner: the verify takes the drafts by reference from the task's submitter (the object_store "
                   "channel); direct: the drafter submits the verify itself; link: the collective channel's gloo link, "
                   "the verify already waiting on it; ray_collective: that channel's ends (NCCL on GPUs, gloo on "
                   "CPUs), the verify already waiting",
                   "drafts_on: where the drafts start and end; cuda: the link's hop includes the copies to the host "
                   "and back, ray_collective's none",
                   "probs_width: q's last dimension when probabilistic drafting's q travels with the ids (0: ids "
                   "only); the vocabulary is dense q, 2 x top_k the packed top_k (prob, id) pairs"])
    for actor in (verifier, drafter):
        ray.kill(actor)
    if own_ray:
        ray.shutdown()


if __name__ == "__main__":
    main()
