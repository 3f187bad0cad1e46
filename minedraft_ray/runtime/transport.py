"""The draft channel: how draft ids (and, for probabilistic drafting, draft probabilities) go from the
drafter actor to the verifier actor, and how a verify's tokens reach the draft round queued behind it.
The manager only ever holds references or keys; drafts never pass through it.

- `collective` (default where the workers compute on GPUs): drafter and verifier talk over a gloo link of
  their own (runtime/link.py), both ways: the drafter sends each round's drafts, and each verify sends its
  tokens to the draft round queued behind it, so neither direction of psd's chain (verify -> tokens -> draft
  -> drafts -> verify) waits for a Ray message (docs/transport.md). The manager still orders everything with
  Ray calls made ahead of time; they carry keys (LinkRound, LinkTokens) that tell each side the tag and shape
  of the message to wait for.
- `ray_collective`: the same keys and worker methods as `collective`, over `ray.util.collective` groups (NCCL
  between GPU actors, gloo on CPUs) instead of the hand-made link (runtime/ray_collective.py). Not a default
  until two GPUs have measured it against `collective` (docs/transport.md).
- `object_store` (default on CPUs): the drafter returns host lists; the verify task names that result as an
  argument, so Ray hands it over through the manager (the result's owner): drafter -> manager -> verifier,
  and a draft round names its verify's result the same way.

Measured and removed (docs/transport.md): Ray Direct Transport (RDT, NCCL/gloo collective groups; slower for
token-id payloads, and it kills the receiving verifier when the drafter dies), and `direct` (the drafter
calling the verifier itself; barely faster than through the manager, superseded by the link).
"""
from __future__ import annotations

import asyncio
import logging
import uuid

from .messages import ChannelSpec, DraftRound, LinkRound, LinkTokens, backend_for

log = logging.getLogger("minedraft.runtime")

CONCURRENCY_GROUP = "draft_channel"   # the actors' thread for opening and closing ray_collective ends, beside their tasks


class DraftChannel:
    name = "abstract"
    actor_options: dict = {}   # what the worker actors need for this channel (ray.remote's options)

    async def connect(self, drafter, verifier, device: str) -> None:
        """Called after both actors are up (and again after a drafter restart)."""

    async def disconnect(self) -> None:
        pass

    def drafter_gone(self, verifier) -> None:
        """The drafter of the current generation died or is being replaced: nothing of it will come."""

    def submit(self, drafter, verifier, round_: DraftRound, sources: list):
        """A draft round (sources: the results its rows take tokens from, after those over the link) -> (what the
        verify names as its drafts, device-ms ref for the manager)."""
        raise NotImplementedError

    def verify_drafts(self, drafts: list) -> tuple[list[LinkRound] | None, list]:
        """What a verify names as its drafts (`submit`'s) -> (the keys its message carries, its arguments)."""
        return None, drafts

    def discard(self, verifier, drafts) -> None:
        """A round no verify will name (its batch moved on)."""

    def without_drafts(self, verifier, drafts, task_ref, resubmit):
        """The round a verify names failed (the drafter died): -> the ref of that verify run without drafts."""
        raise NotImplementedError

    def tokens_to(self, seq: int, rows: int, k: int):
        """What a verify (task `seq`, `rows` rows) that a draft round will follow sends its tokens under, or None:
        the round then names the verify's result (Ray hands it over)."""
        return None

    def drop_tokens(self, drafter, tokens) -> None:
        """tokens_to's message that no draft round will take (the round had no rows after all)."""


class ObjectStoreChannel(DraftChannel):
    name = "object_store"

    def submit(self, drafter, verifier, round_, sources):
        return drafter.draft.remote(round_.to_wire(), *sources)

    def without_drafts(self, verifier, drafts, task_ref, resubmit):
        # a task whose argument failed never ran: submit it again (under its own number, its turn is still open)
        return resubmit()


class CollectiveChannel(DraftChannel):
    name = "collective"

    def __init__(self):
        self._next_key = 0
        self.generation = 0   # one link per drafter: a restarted drafter gets a new one

    async def connect(self, drafter, verifier, device: str) -> None:
        self.generation += 1
        prefix = await verifier.open_link.remote(self.generation)
        await drafter.join_link.remote(self.generation, prefix)

    def submit(self, drafter, verifier, round_, sources):
        key = LinkRound(self._next_key, round_.num_rows, round_.k, self.generation)
        self._next_key += 1
        return key, drafter.draft_over.remote(key.to_wire(), round_.to_wire(), *sources)

    def verify_drafts(self, drafts: list) -> tuple[list[LinkRound] | None, list]:
        return drafts, []   # the verifier takes them from the link

    def discard(self, verifier, drafts) -> None:
        verifier.drain_drafts.remote(drafts.to_wire())

    def without_drafts(self, verifier, drafts, task_ref, resubmit):
        # the verify waits on the link, which fails at once when the drafter dies or is replaced (a round that
        # failed on a live drafter makes the manager replace it)
        return task_ref

    def tokens_to(self, seq: int, rows: int, k: int):
        return LinkTokens(seq, rows, k + 1, self.generation)

    def drop_tokens(self, drafter, tokens) -> None:
        drafter.drain_tokens.remote(tokens.to_wire())


class RayCollectiveChannel(CollectiveChannel):
    """`collective`'s protocol over Ray's collective groups. Ray's NCCL transfers never fail on their own when the
    peer dies, so the manager's word that the drafter is gone (it learns that from Ray) closes the verifier's end:
    a verify waiting there runs without drafts at once."""
    name = "ray_collective"
    # the ends open and close in a thread of their own: the actor's tasks may be waiting on the channel then
    actor_options = {"concurrency_groups": {CONCURRENCY_GROUP: 1}}

    def __init__(self):
        super().__init__()
        self._prefix = f"minedraft-{uuid.uuid4().hex[:12]}"   # group names are global to the Ray cluster

    async def connect(self, drafter, verifier, device: str) -> None:
        self.generation += 1
        spec = ChannelSpec(f"{self._prefix}-g{self.generation}", self.generation, backend_for(device))
        await asyncio.gather(*(actor.open_channel_end.options(concurrency_group=CONCURRENCY_GROUP).remote(spec)
                               for actor in (verifier, drafter)))

    def drafter_gone(self, verifier) -> None:
        verifier.close_channel_end.options(concurrency_group=CONCURRENCY_GROUP).remote(self.generation,
                                                                                         "the drafter is gone")


CHANNELS = {c.name: c for c in (ObjectStoreChannel, CollectiveChannel, RayCollectiveChannel)}


def default_transport(on_gpu: bool) -> str:
    """The channel where `transport` is auto: the link on GPUs (the verifier idles less, docs/transport.md); the
    object store on CPUs, where the two actors and the link's threads share the cores."""
    return "collective" if on_gpu else "object_store"


def make_channel(name: str) -> DraftChannel:
    if name not in CHANNELS:
        raise ValueError(f"unknown transport {name!r}; expected one of {sorted(CHANNELS)}")
    return CHANNELS[name]()
