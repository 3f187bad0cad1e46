"""The draft channel: how draft ids (and, for probabilistic drafting, draft probabilities) go
from the drafter actor to the verifier actor. The manager only ever holds references and waits on
a tiny timing object; the drafts never pass through it.

- `object_store` (default): the drafter returns host lists; the verify task names that result as an
  argument, so Ray hands it over through the manager (the result's owner): drafter -> manager -> verifier.
- `direct`: the drafter pushes its drafts to the verifier itself (`VerifierWorker.put_drafts`), and the
  verify, already delivered, takes them by key from the verifier's mailbox in its turn: one message on
  the chain instead of two (0.70 against 1.00 ms per hop on the 2x H200 host, bench/results/payload_hop_gpu.md).
  The verify waits in a thread of its own, so this channel needs the threaded verifier (verifier_overlap).
- `collective`: drafter and verifier talk over a gloo link of their own (runtime/link.py), both ways: the
  drafter sends each round's drafts, and each verify sends its tokens to the draft round queued behind it, so
  neither direction of psd's chain (verify -> tokens -> draft -> drafts -> verify) waits for a Ray message.
  The manager still orders everything with Ray calls made ahead of time; they carry keys (LinkRound,
  LinkTokens) that tell each side the tag and shape of the message to wait for.

Ray Direct Transport (RDT, NCCL/gloo collective groups) was implemented and measured behind this
interface and removed: slower for token-id payloads, it fails the drafter-kill test (RDT kills the
receiving verifier) and it stalled a verify step under CPU load (docs/transport.md).
"""
from __future__ import annotations

import logging

import ray

from .workers import DraftKey, DrafterWorker, LinkRound, LinkTokens, SpecWorker, VerifierWorker

log = logging.getLogger("minedraft.runtime")


class DraftChannel:
    name = "abstract"
    actor_options: dict = {}
    needs_threaded_verifier = False

    def actor_classes(self):
        """(VerifierActor, DrafterActor, SpecActor) remote classes suited to this channel."""
        opts = {"max_restarts": 0, **self.actor_options}
        return ray.remote(**opts)(VerifierWorker), ray.remote(**opts)(DrafterWorker), ray.remote(**opts)(SpecWorker)

    async def connect(self, drafter, verifier, device: str) -> None:
        """Called after both actors are up (and again after a drafter restart)."""

    async def disconnect(self) -> None:
        pass

    def submit(self, drafter, verifier, args: tuple):
        """-> (what the verify names as its drafts, device-ms ref for the manager)."""
        raise NotImplementedError

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

    def submit(self, drafter, verifier, args):
        return drafter.draft.options(num_returns=2).remote(*args)

    def without_drafts(self, verifier, drafts, task_ref, resubmit):
        # a task whose argument failed never ran: submit it again (under its own number, its turn is still open)
        return resubmit()


class DirectChannel(DraftChannel):
    name = "direct"
    needs_threaded_verifier = True

    def __init__(self):
        self._next_key = 0

    async def connect(self, drafter, verifier, device: str) -> None:
        await drafter.set_peer.remote(verifier)

    def submit(self, drafter, verifier, args):
        key, self._next_key = self._next_key, self._next_key + 1
        return DraftKey(key), drafter.draft_to.remote(key, *args)

    def discard(self, verifier, drafts) -> None:
        verifier.drop_drafts.remote(drafts.key, False)

    def without_drafts(self, verifier, drafts, task_ref, resubmit):
        # the verify is on the verifier already, waiting for these drafts: it runs without them
        verifier.drop_drafts.remote(drafts.key, True)
        return task_ref


class CollectiveChannel(DraftChannel):
    name = "collective"

    def __init__(self):
        self._next_key = 0
        self.generation = 0   # one link per drafter: a restarted drafter gets a new one

    async def connect(self, drafter, verifier, device: str) -> None:
        self.generation += 1
        host, port = await verifier.open_link.remote(self.generation)
        await drafter.join_link.remote(self.generation, host, port)

    def submit(self, drafter, verifier, args):
        rows, k = args[1], args[2]
        key, self._next_key = LinkRound(self._next_key, len(rows), k, self.generation), self._next_key + 1
        return key, drafter.draft_over.remote(key, *args)

    def discard(self, verifier, drafts) -> None:
        verifier.drain_drafts.remote(drafts)

    def without_drafts(self, verifier, drafts, task_ref, resubmit):
        # the verify waits on the link, which fails at once when the drafter dies or is replaced (a round that
        # failed on a live drafter makes the manager replace it)
        return task_ref

    def tokens_to(self, seq: int, rows: int, k: int):
        return LinkTokens(seq, rows, k + 1, self.generation)

    def drop_tokens(self, drafter, tokens) -> None:
        drafter.drain_tokens.remote(tokens)


CHANNELS = {c.name: c for c in (ObjectStoreChannel, DirectChannel, CollectiveChannel)}


def make_channel(name: str) -> DraftChannel:
    if name not in CHANNELS:
        raise ValueError(f"unknown transport {name!r}; expected one of {sorted(CHANNELS)}")
    return CHANNELS[name]()
