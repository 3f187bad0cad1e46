"""The draft channel: how draft ids (and, for probabilistic drafting, draft probabilities) go
from the drafter actor to the verifier actor. The manager only ever holds references and waits on
a tiny timing object; the tensors never pass through it.

- `object_store`: the drafter returns host tensors; the verifier receives them as a task argument
  (small objects are inlined into the task, so this is one hop).

Ray Direct Transport (RDT, NCCL/gloo collective groups) was implemented and measured behind this
interface and removed: slower for token-id payloads, it fails the drafter-kill test (RDT kills the
receiving verifier) and it stalled a verify step under CPU load (docs/transport.md).
"""
from __future__ import annotations

import logging

import ray

from .workers import DrafterWorker, SpecWorker, VerifierWorker

log = logging.getLogger("minedraft.runtime")


class DraftChannel:
    name = "abstract"
    actor_options: dict = {}

    def actor_classes(self):
        """(VerifierActor, DrafterActor, SpecActor) remote classes suited to this channel."""
        opts = {"max_restarts": 0, **self.actor_options}
        return ray.remote(**opts)(VerifierWorker), ray.remote(**opts)(DrafterWorker), ray.remote(**opts)(SpecWorker)

    async def connect(self, drafter, verifier, device: str) -> None:
        """Called after both actors are up (and again after a drafter restart)."""

    async def disconnect(self) -> None:
        pass

    def submit(self, drafter, args: tuple):
        """-> (drafts ref for the verifier, device-ms ref for the manager)."""
        raise NotImplementedError


class ObjectStoreChannel(DraftChannel):
    name = "object_store"

    def submit(self, drafter, args):
        return drafter.draft.options(num_returns=2).remote(*args)


def make_channel(name: str) -> DraftChannel:
    if name == "object_store":
        return ObjectStoreChannel()
    raise ValueError(f"unknown transport {name!r}; expected 'object_store'")
