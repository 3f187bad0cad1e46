"""The messages between the manager and its worker actors (workers.py), without torch: the manager's process
builds and reads them and imports no torch.

Every worker task takes one message (besides the ObjectRefs whose values Ray hands over) and returns one result.
Each crosses Ray in its wire form, `to_wire()`: lists of ints, floats, bools, strings and None only, which Ray
serializes with msgpack. A dataclass or a tuple takes Ray's cloudpickle fallback instead, several times slower,
and each step sends a few messages. The receiving side decodes with `from_wire` first thing, so the manager and
the workers both work with the dataclasses (tests/test_messages.py: every message round-trips, msgpack only).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

from ..engine.kv_blocks import TableEdits


def _wire(message) -> list | None:
    return None if message is None else message.to_wire()


def _wire_list(messages: list | None) -> list | None:
    return None if messages is None else [m.to_wire() for m in messages]


@dataclass(frozen=True)
class LinkRound:
    """A verify's drafts under the collective channel: ids [rows, k] int64 (then probs [rows, k, W] float32,
    packed by draft_sample_packed, under probabilistic drafting) that the drafter sends over the link of
    `generation` as message 2 * key (and 2 * key + 1)."""
    key: int
    rows: int
    k: int
    generation: int

    def to_wire(self) -> list:
        return [self.key, self.rows, self.k, self.generation]

    @classmethod
    def from_wire(cls, wire: list) -> "LinkRound":
        return cls(*wire)


@dataclass(frozen=True)
class LinkTokens:
    """A verify's emitted tokens [rows, width] int64 (-1 past the emitted ones) that the verifier sends to
    the drafter over the link of `generation` as message `seq`, for the draft round submitted behind it."""
    seq: int
    rows: int
    width: int
    generation: int

    def to_wire(self) -> list:
        return [self.seq, self.rows, self.width, self.generation]

    @classmethod
    def from_wire(cls, wire: list) -> "LinkTokens":
        return cls(*wire)


@dataclass(frozen=True)
class SamplingRow:
    """A request's sampling settings, as the verifier keeps them per slot."""
    temperature: float
    top_p: float
    top_k: int
    seed: int

    @classmethod
    def of(cls, request) -> "SamplingRow":
        p = request.params
        return cls(p.temperature, p.top_p, p.top_k, request.seed)

    def to_wire(self) -> list:
        return [self.temperature, self.top_p, self.top_k, self.seed]

    @classmethod
    def from_wire(cls, wire: list) -> "SamplingRow":
        return cls(*wire)


GREEDY_ROW = SamplingRow(0.0, 1.0, 0, 0)   # for rows whose sample is not used (a chunk before a prompt's end)


@dataclass(frozen=True)
class SlotResume:
    """A preempted request's slot state, which a verify reads: its last two tokens and the output position of
    its next token (its prefill recomputed the K/V of every token but the last)."""
    prev_token: int
    last_token: int
    position: int

    def to_wire(self) -> list:
        return [self.prev_token, self.last_token, self.position]

    @classmethod
    def from_wire(cls, wire: list) -> "SlotResume":
        return cls(*wire)


@dataclass(frozen=True)
class PrefillRow:
    """One row of a prefill task: tokens [start, start + len(tokens)) of a prompt into `slot`, which holds the
    tokens before them. The row that ends its prompt carries the request's sampling settings: its first token
    is sampled and its slot state starts; a chunk before the end only fills KV. A resumed request's prefill
    (`resume`) holds every token but its last, and its slot state is set from `resume`, nothing sampled."""
    slot: int
    start: int
    tokens: list[int]
    sampling: SamplingRow | None = None
    resume: SlotResume | None = None

    @property
    def starts_request(self) -> bool:
        """It ends a new request's prompt: the request's first token is sampled here."""
        return self.sampling is not None and self.resume is None

    def to_wire(self) -> list:
        return [self.slot, self.start, self.tokens, _wire(self.sampling), _wire(self.resume)]

    @classmethod
    def from_wire(cls, wire: list) -> "PrefillRow":
        slot, start, tokens, sampling, resume = wire
        return cls(slot, start, tokens, None if sampling is None else SamplingRow.from_wire(sampling),
                   None if resume is None else SlotResume.from_wire(resume))


def _edits_wire(edits: TableEdits | None) -> list | None:
    return None if edits is None else [edits.rows, edits.cols, edits.ids]


def _edits_of(wire: list | None) -> TableEdits | None:
    return None if wire is None else TableEdits(*wire)


@dataclass(frozen=True)
class KVEdits:
    """The block-table changes a task carries, per model, applied in its turn before its device work: those the
    scheduler made since this worker's previous task (runtime/scheduler.py hands out the blocks)."""
    target: TableEdits | None = None
    draft: TableEdits | None = None

    def to_wire(self) -> list:
        return [_edits_wire(self.target), _edits_wire(self.draft)]

    @classmethod
    def from_wire(cls, wire: list) -> "KVEdits":
        return cls(_edits_of(wire[0]), _edits_of(wire[1]))


def _kv_edits_of(wire: list | None) -> KVEdits | None:
    return None if wire is None else KVEdits.from_wire(wire)


def _rows_of(wire: list | None) -> list[PrefillRow] | None:
    return None if wire is None else [PrefillRow.from_wire(row) for row in wire]


@dataclass(frozen=True)
class PrefillTask:
    """A prefill task `seq`: prompt chunks into their slots, on the verifier (a first token sampled where a chunk
    ends its prompt, logprobs of num_logprobs) or on the drafter (KV only), with the worker's block-table
    changes since its previous task."""
    seq: int
    rows: list[PrefillRow]
    num_logprobs: int = 0
    tables: KVEdits | None = None

    def to_wire(self) -> list:
        return [self.seq, _wire_list(self.rows), self.num_logprobs, _wire(self.tables)]

    @classmethod
    def from_wire(cls, wire: list) -> "PrefillTask":
        seq, rows, num_logprobs, tables = wire
        return cls(seq, _rows_of(rows), num_logprobs, _kv_edits_of(tables))


@dataclass(frozen=True)
class VerifyTask:
    """A verify, the verifier's task `seq`, of `slots` (their last tokens and positions are in its slot state).
    draft_index[b]: row b's row in its draft rounds' rows, concatenated in order, or -1 for a row without drafts;
    None: no row has any. The rounds are the task's arguments (the object store: Ray hands their drafts over) or,
    under a collective channel, `rounds`: the keys their drafts come over the link under. tokens_to: where the
    collective channel sends its tokens for the round drafted behind it. chunks: prompt chunks of other slots
    riding in its launch (fused), whose rows follow the verify's in the result."""
    seq: int
    slots: list[int]
    num_logprobs: int = 0
    draft_index: list[int] | None = None
    rounds: list[LinkRound] | None = None
    tokens_to: LinkTokens | None = None
    tables: KVEdits | None = None
    chunks: list[PrefillRow] | None = None

    def to_wire(self) -> list:
        return [self.seq, self.slots, self.num_logprobs, self.draft_index, _wire_list(self.rounds),
                _wire(self.tokens_to), _wire(self.tables), _wire_list(self.chunks)]

    @classmethod
    def from_wire(cls, wire: list) -> "VerifyTask":
        seq, slots, num_logprobs, draft_index, rounds, tokens_to, tables, chunks = wire
        return cls(seq, slots, num_logprobs, draft_index,
                   None if rounds is None else [LinkRound.from_wire(r) for r in rounds],
                   None if tokens_to is None else LinkTokens.from_wire(tokens_to), _kv_edits_of(tables),
                   _rows_of(chunks))


@dataclass(frozen=True)
class SpecStep:
    """An `sd` step, the spec worker's task `seq`: k drafts for every slot from its slot state, then their verify
    (chunks: prompt chunks riding in the target's launch, as in a VerifyTask)."""
    seq: int
    slots: list[int]
    k: int
    num_logprobs: int = 0
    tables: KVEdits | None = None
    chunks: list[PrefillRow] | None = None

    def to_wire(self) -> list:
        return [self.seq, self.slots, self.k, self.num_logprobs, _wire(self.tables), _wire_list(self.chunks)]

    @classmethod
    def from_wire(cls, wire: list) -> "SpecStep":
        seq, slots, k, num_logprobs, tables, chunks = wire
        return cls(seq, slots, k, num_logprobs, _kv_edits_of(tables), _rows_of(chunks))


@dataclass(frozen=True)
class DraftRound:
    """A drafter task: k drafts for each of its rows. It is laid out column by column (one list per field, entry
    i for row i): its wire form is then a few flat lists, and a round is sent every step.

    Row i's sequence past the valid[i] tokens its drafter slot slots[i] holds is tails[i] (its committed tokens)
    followed by the tokens it takes: takes[i] lists (source, row) pairs naming a row of a verifier result the
    round takes (a prefill's first token, a verify's emitted tokens), in order. Source 0 comes over the link under
    `tokens_over_link` when that is set (a collective channel); the others, in order, are the task's arguments,
    which Ray passes in once they exist. With all_but_two[i] the slot already holds all of that sequence but its
    last two tokens, so only those are fed. positions[i]: the row's output position of its first draft before
    the taken tokens (the noise key of probabilistic drafting)."""
    seq: int
    k: int
    slots: list[int]
    valid: list[int]
    tails: list[list[int]]
    takes: list[list[tuple[int, int]]]
    all_but_two: list[bool]
    seeds: list[int]
    positions: list[int]
    tables: KVEdits | None = None      # the drafter's block-table changes since its previous task
    tokens_over_link: LinkTokens | None = None

    @property
    def num_rows(self) -> int:
        return len(self.slots)

    def to_wire(self) -> list:
        # a row's (source, row) pairs flattened: msgpack takes lists, not tuples
        takes = [list(chain.from_iterable(row)) for row in self.takes]
        return [self.seq, self.k, self.slots, self.valid, self.tails, takes, self.all_but_two, self.seeds,
                self.positions, _wire(self.tables), _wire(self.tokens_over_link)]

    @classmethod
    def from_wire(cls, wire: list) -> "DraftRound":
        seq, k, slots, valid, tails, takes, all_but_two, seeds, positions, tables, over_link = wire
        takes = [list(zip(row[::2], row[1::2])) for row in takes]
        return cls(seq, k, slots, valid, tails, takes, all_but_two, seeds, positions, _kv_edits_of(tables),
                   None if over_link is None else LinkTokens.from_wire(over_link))


@dataclass(frozen=True)
class VerifierResult:
    """What a verifier task returns: the tokens each row emitted (and their logprobs), and timings. Wall
    times are on the manager's host: step times are measured where the work runs."""
    tokens: list[list[int]]
    logprobs: list[list[dict]] | None
    device_ms: float
    t_launch: float = 0.0     # wall time the launch began
    t_end: float = 0.0        # wall time at the end
    draft_ms: float = 0.0     # sd: the draft half of the step

    def to_wire(self) -> list:
        return [self.tokens, self.logprobs, self.device_ms, self.t_launch, self.t_end, self.draft_ms]

    @classmethod
    def from_wire(cls, wire: list) -> "VerifierResult":
        return cls(*wire)


@dataclass(frozen=True)
class WorkerConfig:
    """What each of an engine's worker actors starts from: the engine's settings and its pair's shared_vocab."""
    settings: dict                # EngineConfig.model_dump()
    vocab_limit: int | None       # ids both models may emit; None without a drafter


# ---- the ray_collective channel (runtime/ray_collective.py) ----------------------------------------------------
GLOO_PAIR = "MINEDRAFT_GLOO_PAIR"   # the CPU backend's name in Ray's registry
NCCL = "NCCL"


def backend_for(device: str) -> str:
    return NCCL if device.startswith("cuda") else GLOO_PAIR


@dataclass(frozen=True)
class ChannelSpec:
    """One drafter generation's channel, as the manager describes it to both ends."""
    name: str          # unique per engine and generation; its groups are `<name>-drafts` and `<name>-tokens`
    generation: int
    backend: str       # NCCL or GLOO_PAIR

    def group(self, direction: str) -> str:
        return f"{self.name}-{direction}"
