"""The draft channel: how draft ids (and, for probabilistic drafting, draft probabilities) go
from the drafter actor to the verifier actor. The manager only ever holds references and waits on
a tiny timing object; the tensors never pass through it.

- `object_store`: the drafter returns host tensors; the verifier receives them as a task argument
  (small objects are inlined into the task, so this is one hop).
- `rdt`: Ray Direct Transport. The tensors stay on the drafter's device and move over a collective
  group: NCCL between GPUs, gloo on a CPU (which exercises the same code path in CI).
"""
from __future__ import annotations

import asyncio
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


class RDTChannel(DraftChannel):
    name = "rdt"
    actor_options = {"enable_tensor_transport": True}

    def __init__(self):
        self.group = None
        self.backend = None

    async def connect(self, drafter, verifier, device: str) -> None:
        from ray.experimental.collective import create_collective_group
        await self.disconnect()
        self.backend = "nccl" if device.startswith("cuda") else "gloo"
        await asyncio.to_thread(ray.get, drafter.set_keep_on_device.remote(True))
        self.group = await asyncio.to_thread(create_collective_group, [drafter, verifier],
                                             "nccl" if self.backend == "nccl" else "torch_gloo")

    async def disconnect(self) -> None:
        if self.group is not None:
            from ray.experimental.collective import destroy_collective_group
            group, self.group = self.group, None
            try:
                await asyncio.to_thread(destroy_collective_group, group)
            except Exception as e:  # a dead member: the group is gone with it
                log.info("collective group teardown: %s", e)

    def submit(self, drafter, args):
        drafts = drafter.draft_tensors.options(tensor_transport=self.backend).remote(*args)
        return drafts, drafter.last_draft_ms.remote()


def make_channel(name: str) -> DraftChannel:
    if name == "object_store":
        return ObjectStoreChannel()
    if name == "rdt":
        return RDTChannel()
    raise ValueError(f"unknown transport {name!r}; expected 'object_store' or 'rdt'")
