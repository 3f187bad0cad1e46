"""Where a torch.distributed group of actors meets: a key prefix in Ray's GCS key-value store, so nothing new
listens, and only the cluster's processes (with the token Ray's auth asks for) reach it. `Rendezvous` is a group's
prefix and timeout, handed to its members (as actor arguments); its owner clears the keys when the group ends. The
members' store over it is gcs_store.GcsStore. No torch here: the manager's process makes and clears the rendezvous of
its target's ranks.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from ray.experimental import internal_kv

KV_NAMESPACE = "minedraft_channel"


def fresh_prefix(kind: str) -> str:
    """A key prefix no other group uses (groups of other engines and replicas share the GCS)."""
    return f"{kind}/{uuid.uuid4().hex}/"


def clear_prefix(prefix: str) -> None:
    """Delete every key of the group under `prefix`."""
    internal_kv._internal_kv_del(prefix, del_by_prefix=True, namespace=KV_NAMESPACE)


@dataclass(frozen=True)
class Rendezvous:
    """Where a group meets: its key prefix in the GCS, and how long a member waits for the others there."""
    prefix: str
    timeout_s: float

    @classmethod
    def fresh(cls, kind: str, timeout_s: float) -> "Rendezvous":
        return cls(fresh_prefix(kind), timeout_s)

    def close(self) -> None:
        """The group ended: its keys go."""
        clear_prefix(self.prefix)
