"""Rendezvous for torch.distributed groups between Ray actors through Ray's GCS key-value store.

torch's TCPStore would do, but its server listens on every interface whatever host it is given; the GCS is
already there, reachable only by the cluster's processes (with the token Ray's auth asks for), and nothing new
listens. Each group takes a key prefix of its own.
"""
from __future__ import annotations

import time
import uuid

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
