"""A channel end in an actor of its own, for the tests of runtime/ray_collective.py: the actor holds one end as a
worker does (its `link`), and exposes its interface as Ray calls."""
from __future__ import annotations

import os
import time

import torch

from ..runtime.ray_collective import ChannelEnd, close_end

TIMEOUT_S = 20.0


class End:
    """An actor holding one channel end, as a worker does."""

    def __init__(self):
        self.link = None

    def open(self, spec, rank, timeout_s=TIMEOUT_S):
        """This actor's end of `spec`'s channel; an earlier end is closed first, as a worker's is
        (runtime/ray_collective.py's open_end)."""
        old, self.link = self.link, None
        if old is not None:
            old.close(f"replaced by {spec.name} generation {spec.generation}")
        self.link = ChannelEnd.open(spec, rank, timeout_s)

    def close_channel_end(self, generation, reason):   # as the verifier's (RayCollectiveChannel.drafter_gone)
        close_end(self, generation, reason)

    def send(self, values, tag):
        self.link.send(torch.tensor(values, dtype=torch.int64), tag)

    def recv(self, shape, tag):
        t0 = time.perf_counter()
        try:
            return self.link.recv(shape, torch.int64, tag).tolist(), time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - the test reads what failed, and when
            return repr(e), time.perf_counter() - t0

    def drain(self, shape, tag):
        self.link.drain(shape, torch.int64, tag)

    def in_flight(self):
        return self.link.in_flight

    def default_group_initialized(self):
        import torch.distributed as dist
        return dist.is_initialized()

    def use_default_group(self) -> int:
        """Another torch.distributed user of this process (a tensor-parallel group, say) takes the default group
        (one rank, an in-process store) -> its all-reduce of 1."""
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        one = torch.ones(1)
        dist.all_reduce(one)
        return int(one.item())

    def wildcard_listeners(self):
        return wildcard_listeners()


def tcp_listeners() -> list[tuple[str, int]]:
    """(address, port) of this process's listening TCP sockets; the address as /proc/net writes it (hex)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                (address, port), state, inode = fields[1].split(":"), fields[3], fields[9]
                if state == "0A" and inode in inodes:
                    found.append((address, int(port, 16)))
    return found


def wildcard_listeners() -> list[tuple[str, int]]:
    """TCP sockets of this process listening on 0.0.0.0 or ::."""
    return [(address, port) for address, port in tcp_listeners() if set(address) == {"0"}]


def ray_worker_port() -> int:
    """The port of this Ray worker's own gRPC server (every Ray worker process listens on one)."""
    import ray
    from ray.core.generated.common_pb2 import Address

    ref = ray.put(None)   # an object this worker owns: its owner address is the worker's
    return Address.FromString(ray._private.worker.global_worker.core_worker.get_owner_address(ref)).port
