"""Where a torch.distributed group of actors meets.

- `GcsStore`: the store over Ray's GCS key-value store, for the draft channels' two-rank gloo groups (the link,
  ray_collective): nothing new listens, and only the cluster's processes (with the token Ray's auth asks for)
  reach it. Each group takes a key prefix of its own (`fresh_prefix`).
- `host_store` / `Rendezvous`: a TCPStore hosted by one process, its address handed to the members through Ray
  (as actor arguments), for the target's tensor-parallel ranks, whose NCCL group needs a full store. It listens
  on the given address only (the node's IP, 127.0.0.1 on a loopback-only instance): torch's TCPStore binds every
  interface by default, so the listening socket is bound here and handed over.
"""
from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from ray.experimental import internal_kv

KV_NAMESPACE = "minedraft_channel"


def fresh_prefix(kind: str) -> str:
    """A key prefix no other group uses (groups of other engines and replicas share the GCS)."""
    return f"{kind}/{uuid.uuid4().hex}/"


class GcsStore(dist.Store):
    """torch.distributed's rendezvous store over Ray's GCS key-value store (one key prefix per group)."""

    def __init__(self, prefix: str, timeout_s: float):
        super().__init__()
        self.prefix, self.timeout_s = prefix, timeout_s

    def set(self, key: str, value) -> None:
        internal_kv._internal_kv_put(self.prefix + key, bytes(value) if not isinstance(value, str) else value,
                                     namespace=KV_NAMESPACE)

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        while (value := internal_kv._internal_kv_get(self.prefix + key, namespace=KV_NAMESPACE)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {key!r} from the peer of {self.prefix} within {self.timeout_s:.0f} s")
            time.sleep(0.005)
        return value

    def wait(self, keys, timeout=None) -> None:
        for key in keys:
            self.get(key)

    def check(self, keys) -> bool:
        return all(internal_kv._internal_kv_exists(self.prefix + k, namespace=KV_NAMESPACE) for k in keys)

    def delete_key(self, key: str) -> bool:
        return bool(internal_kv._internal_kv_del(self.prefix + key, namespace=KV_NAMESPACE))

    def clear(self) -> None:
        internal_kv._internal_kv_del(self.prefix, del_by_prefix=True, namespace=KV_NAMESPACE)


@dataclass(frozen=True)
class Rendezvous:
    """The address members connect to, and the group's name within the store (a prefix of its keys)."""
    host: str
    port: int
    group: str
    timeout_s: float

    def join(self) -> dist.Store:
        """A member's connection to the store (blocks until it is reached, the timeout at most)."""
        store = dist.TCPStore(self.host, self.port, None, False, timeout=timedelta(seconds=self.timeout_s))
        return dist.PrefixStore(self.group, store)


def host_store(host: str, group: str, timeout_s: float) -> tuple[dist.TCPStore, Rendezvous]:
    """A store listening on host:<free port> -> (the store, which must live until every member has connected;
    the address to hand to the members)."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen()
    port = listener.getsockname()[1]
    store = dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                          master_listen_fd=listener.detach(), use_libuv=True)
    return store, Rendezvous(host, port, group, timeout_s)
