"""`GcsStore`: a full torch.distributed store (set, get, add, compare_set, wait, check, delete_key, num_keys) over
Ray's GCS key-value store, under one key prefix per group (rendezvous.py: where a group meets). The draft channels'
two-rank gloo groups (the link, ray_collective) use set/get/wait; the target's tensor-parallel ranks build a gloo
group and, on GPUs, an NCCL group on it, which exchanges its unique id through it at its first collective and
signals and polls its watchdog's flags through it for as long as the group lives.

Atomic updates: the GCS has no compare-and-swap, only a put that fails when the key exists. Each store key is
therefore a log of versions `<key>@0`, `<key>@1`, ... each written once; an update reads the latest version and
creates the next one, retrying when another member created it first. Versions are dense (version n+1 is only
ever written by a member that read version n), so the latest is the last of a run of existing ones.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist
from ray.experimental import internal_kv

from .rendezvous import KV_NAMESPACE, Rendezvous, clear_prefix

POLL_S = 0.005
_PRESENT, _DELETED = b"=", b"-"   # a version holds a value (this byte, then the value) or marks the key deleted
_KEEP = object()                   # an update's "write nothing"


def _get(name: str) -> bytes | None:
    return internal_kv._internal_kv_get(name, namespace=KV_NAMESPACE)


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class GcsStore(dist.Store):
    """torch.distributed's store over Ray's GCS key-value store (one key prefix per group). Whoever hands it to a
    process group keeps a reference as long as the group lives: the group holds only its C++ side."""

    def __init__(self, prefix: str, timeout_s: float):
        super().__init__()
        self.prefix, self.timeout_s = prefix, timeout_s

    @classmethod
    def of(cls, group: Rendezvous) -> "GcsStore":
        """A member's store of `group` (nothing to connect to: every call goes to the GCS)."""
        return cls(group.prefix, group.timeout_s)

    # ---- versions ---------------------------------------------------------------------------------
    def _version(self, key: str, n: int) -> str:
        return f"{self.prefix}{key}@{n}"

    def _latest(self, key: str, known: tuple[int, bytes | None] = (-1, None)) -> tuple[int, bytes | None]:
        """(the latest version, its value or None: absent or deleted), reading on from a version `known`."""
        n, value = known
        while (stored := _get(self._version(key, n + 1))) is not None:
            n, value = n + 1, stored[1:] if stored[:1] == _PRESENT else None
        return n, value

    def _update(self, key: str, change: Callable[[bytes | None], bytes | None]) -> bytes | None:
        """Apply change(current value) atomically -> the value it left; change returns _KEEP to write nothing,
        None to delete."""
        latest = self._latest(key)
        while True:
            n, current = latest
            new = change(current)
            if new is _KEEP:
                return current
            stored = _DELETED if new is None else _PRESENT + new
            if self._create(self._version(key, n + 1), stored):
                return new
            latest = self._latest(key, latest)   # another member wrote first: read on and retry

    def _create(self, name: str, value: bytes) -> bool:
        """Write `name` unless it exists -> whether this call wrote it (atomic in the GCS)."""
        return not internal_kv._internal_kv_put(name, value, overwrite=False, namespace=KV_NAMESPACE)

    def _wait_for(self, keys, timeout_s: float) -> list[bytes]:
        """The keys' values, once each is set (timeout_s at most)."""
        deadline, values = time.monotonic() + timeout_s, []
        for key in keys:
            while (value := self._latest(key)[1]) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {key!r} in {self.prefix} within {timeout_s:.0f} s")
                time.sleep(POLL_S)
            values.append(value)
        return values

    # ---- torch.distributed.Store ------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        value = _as_bytes(value)
        self._update(key, lambda current: value)

    def get(self, key: str) -> bytes:
        """The value, once some member has set it (the store's timeout at most)."""
        return self._wait_for([key], self.timeout_s)[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._update(key, lambda current: str(int(current or 0) + amount).encode()))

    def compare_set(self, key: str, expected, desired) -> bytes:
        """As torch's stores: desired is written if the key holds expected, or is absent and expected is empty;
        -> the value the key holds after the call (expected, when absent and expected is not empty)."""
        expected, desired = _as_bytes(expected), _as_bytes(desired)

        def change(current):
            if current == expected or (current is None and not expected):
                return desired
            return _KEEP
        result = self._update(key, change)
        return expected if result is None else result

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        """Until every key is set: the store's timeout, or a shorter one given."""
        limit = self.timeout_s if timeout is None else min(self.timeout_s, timeout.total_seconds())
        self._wait_for(keys, limit)

    def check(self, keys) -> bool:
        return all(self._latest(key)[1] is not None for key in keys)

    def delete_key(self, key: str) -> bool:
        existed = []

        def change(current):
            existed.append(current is not None)
            return None if current is not None else _KEEP
        self._update(key, change)
        return existed[-1]

    def num_keys(self) -> int:
        names = {name.decode().removeprefix(self.prefix).rpartition("@")[0]
                 for name in internal_kv._internal_kv_list(self.prefix, namespace=KV_NAMESPACE)}
        return sum(self._latest(key)[1] is not None for key in names)

    # the names torch's C++ side calls these two by
    deleteKey = delete_key
    getNumKeys = num_keys

    def clear(self) -> None:
        """Delete every key of the group."""
        clear_prefix(self.prefix)
