"""The batch scheduler: which requests run, in which batch, in which regime, and what each verify and draft
round carries. Pure bookkeeping, no Ray and no asyncio (tests/test_scheduler.py drives it alone, with
hypothesis): the manager (manager.py) turns its plans into actor calls and feeds the results back.

One psd step, as the manager drives it:
  1. `schedule(committed)` retires finished and aborted requests, admits waiting ones (a `PrefillPlan`),
     places them in the smaller batch, restores the balance, and plans the next verify of every batch
     with room in its chain (`VerifyPlan`), each with the draft round that will follow it (`DraftPlan`).
  2. The manager submits those in order; the verifier runs them in that order.
  3. `commit(task)` for the oldest task in flight when its result is back; the manager appends the tokens,
     streams them, and schedules again.

A request rides at most one verify in flight in psd and sd_split (plus its prefill, when new): the draft round
behind a verify is built from the verify's own result, so a second verify would draft from a stale state.
`sd` and `ar` build a step from the verifier's slot state alone, so their chain keeps two in flight.

Chunked prefill: the scheduler owns the per-step token budget (`prefill_budget`, prompt tokens per verifier
step). Each `schedule` call plans at most one prefill task within the budget, cut mid-prompt where it falls, in
front of the verify it plans (in psd, half the budget while it splits and requests decode, since a request's
period then spans both batches' verifies). The prompts admitted and not yet all planned share it
(`prefill_order`): by default the prompt with the fewest tokens left goes first, so a short prompt admitted
behind a long one is not kept waiting for all of the long one's chunks (in psd members of the batch just
committed go first, so a chunk rides with its own batch's verify). A prompt that later admitted ones have
overtaken by one budget's tokens (or its own prefill's, when fewer) is due, and due prompts go first, in
admission order: no prompt starves, and none waits for more than two budgets of later prompts' tokens, so the
long prompts that hold the TTFT tail lose at most about two steps to the short ones. `arrival` hands the budget
out in admission order (first come, first served). The task's chunks keep admission order whatever the shares
(so a budget every prompt fits plans what whole prompts plan). A running request's
time between tokens thus grows by at most one chunk's time. While nothing decodes there is nothing to
stall: chunks take the whole budget, back to back until one completes a prompt. A request rides no verify and no
draft round until its last chunk is planned (the verifier runs its tasks in order, so that chunk is done
by the time the verify runs), and its first token comes from that last chunk.

Fused prefill (`fuse_prefill`): while anything decodes, the step's chunk rides inside the first verify this
call plans, in the same task and the same launch (`VerifyPlan.prefill`, under the prefill's task number), so a
running request waits for one launch, not two. The budget then bounds the whole launch: the verify's tokens
(k + 1 per row, 1 in ar) plus the chunk's. A request whose last chunk rides a verify is not one of its rows (its
first token is sampled in that launch); it rides the next one. Where the verify alone fills the budget, the chunk
is its own task, as without fusion, so that prompts still progress.

An adaptive chunk (`chunk_limit`, set by the manager from measured step times: runtime/chunk_budget.py) bounds a
step's chunk further while anything decodes: the tokens of the launch that carries it (fused: less the verify's
tokens, down to a floor), or none (a step that measures the time without one); everything above holds at any
limit, as at any budget.

KV blocks: the scheduler hands out both models' KV blocks (one `PlannedBlocks` pool per model, in this process) and
the workers only apply its table changes, sent with their next task (`take_edits`): a worker runs its tasks in
submission order, so a block freed here and given to another request is written by the new owner only after
every task of the old one. A request is admitted when its slot and the blocks of its prefill and first verify are
free (in both models; its prefix found in the cache, the same run of blocks in both, is mapped, not recomputed).
Before each verify a rider's blocks are extended to what that verify (and in psd / sd_split the round drafted
behind it) may write; when a pool runs short, the most recently admitted requests with nothing in flight are
preempted (their blocks freed, back to the front of the queue) before the batches are balanced, so psd's
balance rule holds after a preemption too. A preempted request is resumed by recompute: its prefill is every
token but the newest, nothing is sampled there, and the verifier's slot state is set from its tokens
(`RequestState.resumed`); the drafter catches up as after a restart. Full blocks whose K/V no task will write again
are offered to the prefix cache after every commit (`_register`).
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from ..engine.kv_blocks import HEADROOM, BlockManager, SlotAllocator, TableEdits
from ..engine.request import Request
from .chunk_budget import ChunkLimit
from .regime import RegimeChooser


UNBOUNDED = 1 << 62   # a length no request reaches


class KVRole(enum.Enum):
    TARGET = "target"
    DRAFT = "draft"


@dataclass(frozen=True)
class KVPoolSpec:
    """One model's KV pool as its worker built it (from its device's memory)."""
    num_blocks: int                  # the null block included
    block_size: int
    blocks_per_slot: int             # entries of a slot's block table

    @property
    def holds(self) -> int:
        """The longest request the pool can hold: all its blocks, less the verify's headroom."""
        return (self.num_blocks - 1) * self.block_size - HEADROOM


class PlannedBlocks(BlockManager):
    """One model's KV pool as the scheduler hands it out. The table entries it changes are queued for the worker
    that holds the table and sent with that worker's next task (`take_edits`; the last change of an entry wins)."""

    def __init__(self, spec: KVPoolSpec, num_slots: int, prefix_caching: bool):
        super().__init__(spec.num_blocks, spec.block_size, num_slots, spec.blocks_per_slot, prefix_caching)
        self._edits: dict[tuple[int, int], int] = {}

    def _map(self, rows: list[int], cols: list[int], ids: list[int]) -> None:
        edits = self._edits
        for row, col, block in zip(rows, cols, ids):
            edits[row, col] = block

    def grow(self, slots: list[int], counts: list[int]) -> None:
        # BlockManager.grow with its changes queued directly: every step grows riders' tables
        new = self._take(sum(counts))
        edits, taken = self._edits, 0
        for slot, n in zip(slots, counts):
            held = self.held[slot]
            for block in new[taken:taken + n]:
                edits[slot, len(held)] = block
                held.append(block)
            taken += n

    def take_edits(self) -> TableEdits | None:
        if not self._edits:
            return None
        edits, self._edits = self._edits, {}
        return TableEdits([r for r, _ in edits], [c for _, c in edits], list(edits.values()))


@dataclass(slots=True)
class PoolGrowth:
    """One pool's blocks that a `_reserve` call hands out: what is left to hand out, and each slot's growth, taken from
    the pool in one allocation at the end of the call."""
    pool: PlannedBlocks
    ahead: int                       # how far the pool's draft rounds write past a verify (`_reaches`)
    block_size: int
    available: int                   # blocks not yet handed out
    slots: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


class PrefillOrder(enum.Enum):
    """Who gets a step's prefill budget first, among the prompts admitted and not yet all planned."""
    ARRIVAL = "arrival"      # admission order: first come, first served
    SHORTEST = "shortest"    # fewest prompt tokens left first; a prompt overtaken by a budget's tokens is due first


class Status(enum.Enum):
    WAITING = "waiting"        # queued for a slot (new, or preempted)
    RUNNING = "running"        # holds a slot and its KV blocks, in a batch
    FINISHED = "finished"      # done (stop, length or abort); its slot is freed once nothing in flight writes it


@dataclass(eq=False)
class RequestState:
    """The scheduler's view of one request: the engine's Request (tokens, params, stats) plus where it is."""
    request: Request
    status: Status = Status.WAITING
    aborted: bool = False            # the caller gave up; finished at the next retire
    inflight: int = 0                # verifier tasks in flight that hold it (prefill chunks or verify)
    prompt_planned: int = 0          # prompt tokens in the prefill chunks planned so far
    prefill_tasks: int = 0           # of those, chunks in flight
    prefilling: bool = False         # its last chunk (the one that samples its first token) is in flight
    prefill: "PrefillPlan | None" = None   # that chunk's task, while in flight (a round takes its first token there)
    prefill_row: int = -1
    drafter_generation: int = -1     # the drafter that holds its prompt's chunks so far (-1: none)
    last_seq: int = -1               # task number of the latest task committed for it
    # this residency (admission to finish or preemption)
    admitted_at: int = -1            # admission number (preemption takes the latest admitted first)
    overtaken: int = 0               # prompt tokens planned for requests admitted after it while its prefill waited
    resumed: bool = False            # preempted before: its prefill recomputes its tokens and samples nothing
    prefill_len: int = 0             # tokens to prefill: the prompt, or every token but the newest when resumed
    cached_tokens: int = 0           # of those, found in the prefix cache (mapped, not recomputed)
    prefilled: int = 0               # of those, in the KV once the tasks committed so far ran
    blocks_cover: int = -1           # the longest length (plus a step) its blocks cover in every pool (_reserve)
    reserved_in: int = -1            # the schedule call that found blocks for its next verify, until one is planned

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def slot(self) -> int | None:
        return self.request.slot

    @property
    def done(self) -> bool:
        """No more tokens wanted: it stopped, hit its length, or was aborted."""
        return self.request.finished or self.aborted

    @property
    def ready(self) -> bool:
        """Its whole prefill is planned: it may ride a verify (behind its last chunk) and a draft round."""
        return self.prompt_planned == self.prefill_len

    @property
    def takes_first_token(self) -> bool:
        """Its prefill in flight samples its first token (a resumed request has its tokens)."""
        return self.prefilling and not self.resumed


@dataclass(frozen=True)
class PromptChunk:
    """Tokens [start, stop) of a request's prefill (its prompt; when resumed, every token but the newest),
    prefilled in one task; the chunk that ends the prefill (`last`) samples the request's first token, or, when
    resumed, sets the verifier's slot state from its tokens."""
    state: RequestState
    start: int
    stop: int
    to_drafter: bool                 # the drafter prefills it too (psd, sd_split: it holds the chunks before it)

    @property
    def last(self) -> bool:
        return self.stop == self.state.prefill_len

    @property
    def tokens(self) -> list[int]:
        return self.state.request.span(self.start, self.stop)


@dataclass(eq=False)
class PrefillPlan:
    """One prefill task: prompt chunks (at most the step's token budget in all) into their requests' verifier
    slots, a first token for each chunk that ends its prompt, and the same chunks on the drafter where it
    holds the ones before. Fused, it runs inside a verify's task (`VerifyPlan.prefill`), its result rows after
    the verify's (`first_row`)."""
    seq: int
    chunks: list[PromptChunk]
    handle: object = None            # the manager's reference to the result (a draft round may take it)
    first_row: int = 0               # its chunks' first row in that result

    @property
    def requests(self) -> list[RequestState]:
        return [c.state for c in self.chunks]

    @property
    def num_tokens(self) -> int:
        return sum(c.stop - c.start for c in self.chunks)

    @property
    def prior_keys(self) -> int:
        """Each chunk's tokens x its start: the keys before their own that their queries read (a deep chunk's
        cost, runtime/chunk_budget.py)."""
        return sum((c.stop - c.start) * c.start for c in self.chunks)


@dataclass(slots=True)   # built for every member every step: no frozen __setattr__, so cheap
class DraftRow:
    """One row of a draft round: a request, and where the tokens it ends with come from. Past its committed
    tokens come the first token of its prefill in flight (`from_prefill`) and the tokens of the verify the
    round follows (`verify_row`, -1: none). With `all_but_two` the drafter's slot already holds all of the
    resulting sequence but its last two tokens (after a round that drafted it, or a drafter prefill)."""
    state: RequestState
    from_prefill: PrefillPlan | None
    verify_row: int
    all_but_two: bool


@dataclass(eq=False)
class DraftPlan:
    """A draft round: its rows, for one batch's verify (drafted from committed tokens now) or drafted ahead behind
    the verify numbered `after_seq` (from that verify's tokens, for the batch's next verify). A number, not the
    plan: that verify takes the round before it (`VerifyPlan.ahead`), so a reference would chain every plan of the
    batch since it started, each round's Ray objects with it."""
    batch: int
    rows: list[DraftRow]
    after_seq: int | None = None
    generation: int = 0               # the drafter it goes to (restarts count up)
    handle: object = None             # the manager's reference to the drafts (or the channel's key)
    timing: object = None             # the manager's reference to the round's device time
    built: dict = field(default_factory=dict)   # id(state) -> (row, last_seq when built)


@dataclass(eq=False)
class VerifyPlan:
    """One verify of batch `batch`: its rows, each with its row in the drafts it takes (-1: none), from the round
    drafted ahead (`ahead`) and / or a round of its own (`fresh`), in that order."""
    seq: int
    batch: int
    regime: str                       # psd | seq | sd | ar
    rows: list[RequestState]
    draft_index: list[int]
    ahead: DraftPlan | None = None
    fresh: DraftPlan | None = None
    next_round: DraftPlan | None = None   # the batch's next round, drafted behind this verify
    admitted: int = 0
    low_load: bool = True
    high_load: str | None = None
    draft_generation: int = 0
    prefill: PrefillPlan | None = None    # prompt chunks riding in its launch (fused), under the same seq

    @property
    def drafted(self) -> int:
        """Rows with drafts."""
        return len(self.draft_index) - self.draft_index.count(-1)


@dataclass
class SchedulerConfig:
    mode: str                         # psd | sd_split | sd | ar
    max_batch: int
    max_running: int
    num_slots: int
    psd_min_requests: int = 2
    psd_low_load: str = "seq"         # auto | psd | seq
    psd_high_load: str = "auto"
    prefill_budget: int | None = None  # prompt tokens prefilled per verifier step; None: whole prompts (unchunked)
    fuse_prefill: bool = False         # a budgeted chunk rides inside the step's verify launch (bounding it all)
    k: int = 4                         # draft tokens per verify (what a step writes past a request's length)
    prefix_caching: bool = False
    prefill_order: PrefillOrder = PrefillOrder.SHORTEST   # who takes the prefill budget first


@dataclass
class SchedulePlan:
    """What one `schedule` call decided, in submission order: the prefills first, then the verifies."""
    finished: list[RequestState] = field(default_factory=list)   # aborted now (retired): tell their callers
    preempted: list[RequestState] = field(default_factory=list)  # blocks ran short: back in the queue
    prefills: list[PrefillPlan] = field(default_factory=list)
    verifies: list[VerifyPlan] = field(default_factory=list)
    dropped: list[DraftPlan] = field(default_factory=list)       # rounds drafted ahead that no verify will name


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.mode = config.mode
        self.slots = SlotAllocator(config.num_slots)
        self.waiting: deque[RequestState] = deque()
        self.unprefilled: deque[RequestState] = deque()   # admitted, prompt not all planned: admission order
        self.batches: list[list[RequestState]] = [[], []]   # psd uses both; other modes only batches[0]
        # verifies queued per chain: sd and ar build a step from the verifier's slot state alone, so one waits
        # behind the running one; psd and sd_split draft from committed tokens on another actor: one
        self.depth = 2 if self.mode in ("sd", "ar") else 1
        self.queued = [0, 0]
        # the launch a step's chunk may ride in while anything decodes, below the budget's share (None: the
        # budget alone); the manager sets it from measured step times (runtime/chunk_budget.py)
        self.chunk_limit: ChunkLimit | None = None
        self.draft_ahead: list[DraftPlan | None] = [None, None]
        self.drafter_alive = self.mode in ("sd_split", "psd")
        self.drafter_generation = 0
        self.steps = 0                      # verify steps recorded (the choosers' clock; the manager counts)
        self._seq = 0                       # verifier tasks numbered so far
        # low load: psd or one sequential batch by per-request cadence; high load, once saturated, by the
        # verifier's time per row, sequential until the split measures cheaper (re-measured rarely: trying the
        # sequential batch means draining to max_batch first)
        self.reset_choosers()
        self.saturated = False
        self.one_batch = False
        # prefix_cache_*: vLLM's prefix-cache stats (prompt tokens looked up and found, at a request's first
        # admission only: a resumed request finds its own blocks, which says nothing of shared prefixes)
        self.counters = {"moves": 0, "balance_violations": 0, "drafts_ahead_used": 0, "draft_rows_unused": 0,
                         "preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        # KV blocks per model, once the workers have sized their pools (attach_kv)
        self.kv: dict[KVRole, PlannedBlocks] = {}
        self.max_len = 0                    # tokens a request may hold (prompt + output)
        self._draft_spec: KVPoolSpec | None = None
        self._admissions = 0
        self._waiting_for_blocks: set[int] = set()   # id() of members `_grow` could not extend this step
        self._committed: list[RequestState] = []     # riders of the tasks committed since the last schedule
        self._calls = 0                              # schedule calls so far (RequestState.reserved_in)
        self._ended = False                          # a request finished or was aborted since the last retire
        self._kv_changed()

    # ---- KV blocks -----------------------------------------------------------------------------
    def attach_kv(self, target: KVPoolSpec, draft: KVPoolSpec | None, max_len: int) -> None:
        """The pools the workers built (draft: None in ar), and the longest request they admit."""
        if any(max_len > spec.holds for spec in (target, draft) if spec is not None):
            raise ValueError(f"max_len {max_len} does not fit the KV pools")
        self.max_len = max_len
        self.kv = {KVRole.TARGET: PlannedBlocks(target, self.config.num_slots, self.config.prefix_caching)}
        self._draft_spec = draft
        if draft is not None and (self.mode == "sd" or self.drafter_alive):
            self.kv[KVRole.DRAFT] = PlannedBlocks(draft, self.config.num_slots, self.config.prefix_caching)
        self._kv_changed()

    def take_edits(self, role: KVRole) -> TableEdits | None:
        """The table changes of `role`'s pool not yet sent: for the next task of the worker holding that model."""
        pool = self.kv.get(role)
        return pool.take_edits() if pool is not None else None

    def _reaches(self, s: RequestState) -> list[tuple[PlannedBlocks, int]]:
        """Per pool, the positions of s's slot that its tasks may write up to the end of one more verify (and in
        psd and sd_split the draft round behind it), capped at what one request may hold. Runs for riders every
        step: kept to a few operations."""
        k = self._step_tokens
        r = s.request
        # its length at that verify: a prefill in flight brings the first token, each verify up to k + 1
        length = len(r.prompt_ids) + (len(r.output_ids) or 1) + (k + 1) * (s.inflight - s.prefill_tasks)
        # a verify writes k + 1 tokens from length - 1; a round writes from length - 2 up to k - 1 drafts past its
        # sequence, which the round drafted behind the verify extends by up to k + 1
        return [(pool, min(length + k + ahead, self._cap)) for pool, ahead in self._pools]

    def _reserve(self, states: list[RequestState]) -> list[RequestState]:
        """Blocks for the next verify of each of `states` in every model, each all or nothing, in order -> those a
        pool is short for (the others' blocks cover it). Runs for a step's riders: a rider found covered in this call
        and not planned since is not looked at again, the check is kept to a few operations, and each pool's growth
        is taken in one allocation at the end."""
        k, call = self._step_tokens, self._calls
        short = []
        growth: list[PoolGrowth] | None = None   # once some rider grows
        for s in states:
            if s.reserved_in == call:   # covered when `_grow` looked, and no verify planned since
                continue
            r = s.request
            # `_reaches` inline, for the common case: every pool already covers it (a block lasts several steps)
            length = len(r.prompt_ids) + (len(r.output_ids) or 1) + (k + 1) * (s.inflight - s.prefill_tasks) + k
            if length > s.blocks_cover:
                if growth is None:
                    growth = [PoolGrowth(pool, ahead, pool.block_size, pool.num_available)
                              for pool, ahead in self._pools]
                if not self._plan_growth(s, length, growth):
                    short.append(s)
                    continue
            s.reserved_in = call
        for g in growth or ():
            if g.slots:
                g.pool.grow(g.slots, g.counts)
        return short

    def _plan_growth(self, s: RequestState, length: int, growth: list[PoolGrowth]) -> bool:
        """Add the blocks each pool lacks for s to reach `length` (and the pool's rounds their `ahead` past it) to
        `growth`, and note what its blocks will then cover (as `length` counts it; a full table covers any length);
        False, nothing added, when a pool has too few left."""
        slot, cap, cover, wants = s.request.slot, self._cap, UNBOUNDED, []
        for g in growth:
            held = len(g.pool.held[slot])
            missing = -(-min(length + g.ahead, cap) // g.block_size) - held
            if missing > 0:
                if missing > g.available:
                    return False
                wants.append((g, missing))
                held += missing
            mapped = held * g.block_size
            if mapped < cap and mapped - g.ahead < cover:
                cover = mapped - g.ahead
        for g, missing in wants:
            g.available -= missing
            g.slots.append(slot)
            g.counts.append(missing)
        s.blocks_cover = cover
        return True

    def _covered(self, s: RequestState) -> bool:
        return all(pool.covers(s.slot, reach) for pool, reach in self._reaches(s))

    def set_k(self, k: int) -> None:
        """Draft tokens per verify from now on (an idle engine's reconfigure)."""
        self.config.k = k
        self._kv_changed()

    def _kv_changed(self) -> None:
        """Cache what `_reaches` reads per rider: the pools (and how far each one's rounds run ahead of a verify),
        the tokens a step writes past a request's length, and the longest request."""
        k = self._step_tokens = 0 if self.mode == "ar" else self.config.k
        ahead = k if self.mode in ("psd", "sd_split") else 0
        self._pools = [(pool, ahead if role is KVRole.DRAFT else 0) for role, pool in self.kv.items()]
        self._cap = self.max_len + HEADROOM

    def _register(self, s: RequestState) -> None:
        """Prefix caching: offer the full blocks whose K/V no task will write again. The target's below its KV
        length (seq_len - 1; during the prefill, what committed chunks hold); the drafter's below what its slot is
        known to hold, and below seq_len - 2, where every round starts writing."""
        if not self.config.prefix_caching or s.slot is None:
            return
        r = s.request
        for role, pool in self.kv.items():
            if role is KVRole.TARGET:
                final = r.seq_len - 1 if s.prefilled == s.prefill_len else s.prefilled
            else:
                final = min(r.draft_valid, r.seq_len - 2)
            if final >= pool.registered(s.slot) + pool.block_size:   # a new full block: hash it
                pool.register(s.slot, r.tokens, final)

    def _free_blocks(self, s: RequestState) -> None:
        self._register(s)   # what it leaves behind stays cached, idle, for a request that starts the same way
        for pool in self.kv.values():
            pool.release(s.slot)

    # ---- requests ------------------------------------------------------------------------------
    def arrive(self, state: RequestState) -> None:
        self.waiting.append(state)

    def abort(self, state: RequestState) -> bool:
        """Mark it aborted; True when it was waiting and so is finished now (a running one is retired by the
        next `schedule`, once its slot is no longer written)."""
        state.aborted = True
        self._ended = True
        if state in self.waiting:
            self.waiting.remove(state)
            state.status = Status.FINISHED
            return True
        return False

    def num_running(self) -> int:
        return len(self.batches[0]) + len(self.batches[1])

    def demand(self) -> int:
        return self.num_running() + len(self.waiting)

    def queue_full(self, max_queued: int) -> bool:
        """Whether a new arrival is refused: max_queued new arrivals may wait beyond the room left in max_running.
        A preempted request was admitted: it keeps its place in max_running while it waits to resume, in front
        of every new arrival, so preemptions take no queue room from arrivals, and it is never refused (it does
        not arrive again)."""
        resuming = 0
        for s in self.waiting:   # the preempted wait in front (`schedule` puts them back there)
            if not s.request.stats.preemptions:
                break
            resuming += 1
        arrivals = len(self.waiting) - resuming
        return arrivals >= max_queued + max(self.config.max_running - self.num_running() - resuming, 0)

    def release(self, state: RequestState) -> None:
        """Free a finished request's slot and KV blocks once no task in flight still writes to them."""
        if state.status is Status.FINISHED and state.inflight == 0 and state.request.slot is not None:
            self._free_blocks(state)
            self.slots.free(state.request.slot)
            state.request.slot = None

    def finish(self, state: RequestState) -> None:
        """state ended (its tokens stopped it, or it was aborted): the next `schedule` drops it from its batch, and
        its slot and blocks are freed once no task in flight writes them."""
        state.status = Status.FINISHED
        self._ended = True
        self.release(state)

    def fail_all(self) -> list[RequestState]:
        """The verifier is gone: every request known is finished; -> those not finished before."""
        states = [s for s in self.waiting if s.status is not Status.FINISHED]
        states += [s for b in self.batches for s in b if s.status is not Status.FINISHED]
        self.waiting.clear()
        self.unprefilled.clear()
        self.batches = [[], []]
        for s in states:
            s.inflight = 0
            s.status = Status.FINISHED
        return states

    # ---- task numbers --------------------------------------------------------------------------
    def next_seq(self) -> int:
        """Number the next verifier task: the verifier launches its tasks' device work in this order."""
        self._seq += 1
        return self._seq - 1

    @property
    def tasks_numbered(self) -> int:
        return self._seq

    def reset_choosers(self) -> None:
        """Measure both regimes afresh (what either costs depends on k)."""
        self.chooser = RegimeChooser()
        self.high_chooser = RegimeChooser(explore_every=2000, explore_steps=12, metric="ms_per_row",
                                          current="seq", order=("seq", "psd"))

    # ---- regimes -------------------------------------------------------------------------------
    def high_load(self) -> bool:
        """More requests want to run than one batch holds."""
        return self.demand() > self.config.max_batch

    def update_saturation(self) -> None:
        """Saturated from a demand that fills both batches until one batch holds it again (hysteresis)."""
        if self.demand() >= 2 * self.config.max_batch:
            self.saturated = True
        elif self.demand() <= self.config.max_batch:
            self.saturated = False

    def low_load_regime(self) -> str:
        policy = self.config.psd_low_load
        return self.chooser.choose(self.steps) if policy == "auto" else policy

    def high_load_regime(self) -> str:
        """psd under a queue: forced by psd_high_load, else sequential (FIFO) until saturated, then measured."""
        policy = self.config.psd_high_load
        if policy != "auto":
            return policy
        return self.high_chooser.choose(self.steps) if self.saturated else "seq"

    def high_load_choice(self) -> str | None:
        """The regime a verify planned now runs under a queue, where it was a choice (forced, or measured while
        the demand fills both batches): what the high-load chooser's samples are filed under."""
        if self.mode != "psd" or not self.high_load():
            return None
        if self.config.psd_high_load == "auto" and (not self.saturated or self.demand() < 2 * self.config.max_batch):
            return None
        return self.high_load_regime()

    def sequential(self) -> bool:
        """psd: run one sequential batch now (everyone fits one batch and the policy or measurements say so)."""
        if self.num_running() > self.config.max_batch:
            return False
        return (self.high_load_regime() if self.high_load() else self.low_load_regime()) == "seq"

    def regime(self, b: int) -> str:
        if self.mode in ("ar", "sd"):
            return self.mode
        if not self.drafter_alive:
            return "ar"
        return "psd" if self.mode == "psd" and self.batches[1 - b] else "seq"

    def drafter_down(self) -> bool:
        """The drafter failed: rounds sent to it are void, and so are its KV blocks; -> False when it was already
        down."""
        if not self.drafter_alive:
            return False
        self.drafter_alive = False
        self.drafter_generation += 1
        self.kv.pop(KVRole.DRAFT, None)
        self._kv_changed()
        return True

    def drafter_up(self, pool: KVPoolSpec | None = None) -> None:
        """A new drafter (its pool: as the last one's unless given) holds no KV: every request catches up from the
        start, in blocks it takes from the new pool at its next verify."""
        for s in self.batches[0] + self.batches[1] + list(self.waiting):
            s.request.draft_valid = 0
            s.blocks_cover = -1   # nothing in the new pool yet
        self._draft_spec = pool or self._draft_spec
        if self.kv and self._draft_spec is not None:
            self.kv[KVRole.DRAFT] = PlannedBlocks(self._draft_spec, self.config.num_slots, self.config.prefix_caching)
        self._kv_changed()
        self.drafter_alive = True

    # ---- membership ----------------------------------------------------------------------------
    def _retire(self) -> list[RequestState]:
        """Drop done requests from the batches; -> the aborted ones, finished now. Only after a request ended
        (`finish`, `abort`): most steps retire nobody."""
        if not self._ended:
            return []
        self._ended = False
        aborted = []
        for b, batch in enumerate(self.batches):
            for s in batch:
                if s.done:
                    break
            else:
                continue
            keep = []
            for s in batch:
                if s.request.finished:
                    continue
                if s.aborted:
                    self.finish(s)
                    aborted.append(s)
                    continue
                keep.append(s)
            self.batches[b] = keep
        return aborted

    def _admit(self) -> list[RequestState]:
        new, limit = [], self.config.max_running
        if self.mode == "psd" and self.drafter_alive and self.high_load() and self.high_load_regime() == "seq":
            limit = self.config.max_batch   # one sequential batch; the rest wait (and psd drains to it)
        while self.waiting and self.num_running() + len(new) < limit and self.slots.num_free > 0:
            if not self._start(self.waiting[0], reserve_for=self.num_running() + len(new)):
                break   # FIFO: the head waits for blocks, and nobody overtakes it
            s = self.waiting.popleft()
            s.status = Status.RUNNING
            new.append(s)
        return new

    def _start(self, s: RequestState, reserve_for: int) -> bool:
        """Give s a slot, its cached prefix and the blocks of its prefill and first verify in every model, leaving
        one block per running request for their next steps (`reserve_for` of them); False (nothing held) when
        the pools cannot."""
        r = s.request
        s.resumed = bool(r.output_ids)
        s.prefill_len = r.seq_len - 1 if s.resumed else len(r.prompt_ids)
        first_len = r.seq_len + (not s.resumed)   # its length at its first verify
        slot = self.slots.alloc()
        r.slot = slot
        # a hit stops two tokens short of the first verify's length: the target recomputes the newest prompt token
        # (its logits), the drafter re-feeds the last two tokens of every round. The same run of blocks in both
        # models, so that one prefill serves both
        found = {role: pool.lookup(r.tokens, first_len - 2) for role, pool in self.kv.items()}
        hit = min(map(len, found.values()))
        reaches = dict(self._reaches(s))   # pool -> positions its prefill and first verify write
        for role, pool in self.kv.items():
            # adopting idle cached blocks takes them out of what a reservation may evict
            available = pool.num_available - sum(b in pool.idle for b in found[role][:hit])
            if pool.blocks_for(reaches[pool]) - hit + reserve_for > available:
                self.slots.free(slot)
                r.slot = None
                return False
        for role, pool in self.kv.items():
            pool.adopt(slot, found[role][:hit])
            pool.reserve(slot, reaches[pool])
            pool.count_lookup(first_len - 2, hit * pool.block_size)
        s.blocks_cover = -1
        s.overtaken = 0
        s.cached_tokens = r.num_cached_tokens = hit * self.kv[KVRole.TARGET].block_size
        s.prompt_planned = s.prefilled = s.cached_tokens
        if self.config.prefix_caching and not r.stats.preemptions:
            self.counters["prefix_cache_queries"] += len(r.prompt_ids)
            self.counters["prefix_cache_hits"] += s.cached_tokens
        # the drafter holds the cached prefix (and catches up from there on its first round, or takes the chunks)
        with_drafter = KVRole.DRAFT in self.kv
        r.draft_valid = s.cached_tokens if with_drafter else 0
        s.drafter_generation = self.drafter_generation if with_drafter else -1
        s.admitted_at, self._admissions = self._admissions, self._admissions + 1
        return True

    def _grow(self) -> list[RequestState]:
        """Blocks for the next verify of every member that waits for one (nothing in flight but its prefill);
        when a pool runs short, the most recently admitted members with nothing in flight are preempted until
        the rest fit (vLLM's recompute preemption). -> the preempted, most recent first."""
        preempted = []
        # `ready` inline: this runs over every member every step
        short = self._reserve([s for batch in self.batches for s in batch
                               if s.inflight == s.prefill_tasks and s.prompt_planned == s.prefill_len])
        self._waiting_for_blocks.clear()
        for s in sorted(short, key=lambda s: s.admitted_at):
            while s.status is Status.RUNNING and self._reserve([s]):
                victim = self._victim()
                if victim is None or victim.admitted_at < s.admitted_at:
                    # only requests admitted before it are idle: it waits for tasks in flight to end
                    self._waiting_for_blocks.add(id(s))
                    break
                self._preempt(victim)
                preempted.append(victim)
        return preempted

    def _victim(self) -> RequestState | None:
        """The most recently admitted member with nothing in flight (no task writes its blocks)."""
        idle = [s for batch in self.batches for s in batch if s.inflight == 0 and s.status is Status.RUNNING]
        return max(idle, key=lambda s: s.admitted_at, default=None)

    def _preempt(self, s: RequestState) -> None:
        """Free s's blocks and slot and put it back in the queue; it is resumed by recompute (`_start`)."""
        self._free_blocks(s)
        self.slots.free(s.slot)
        s.request.slot = None
        for batch in self.batches:
            if s in batch:
                batch.remove(s)
        if s in self.unprefilled:
            self.unprefilled.remove(s)
        s.status = Status.WAITING
        s.request.stats.preemptions += 1
        self.counters["preemptions"] += 1

    def _place(self, new: list[RequestState], committed: int | None) -> None:
        """New requests join the smaller batch; on a tie, the batch committed now (its next verify goes first)."""
        for s in new:
            if self.mode != "psd":
                self.batches[0].append(s)
                continue
            a, b = len(self.batches[0]), len(self.batches[1])
            if a != b:
                self.batches[0 if a < b else 1].append(s)
            else:
                self.batches[committed if committed is not None else 0].append(s)

    def _rebalance(self) -> None:
        """psd: keep | |A| - |B| | <= 1 by moving requests to the smaller batch, preferring ones with nothing in
        flight (one moved out of a verify in flight waits a step). Below psd_min_requests, or when one
        sequential batch is the regime, everyone goes to one batch."""
        if self.mode != "psd":
            return
        total = self.num_running()
        if total < self.config.psd_min_requests or self.sequential():
            self.one_batch = True
            keep = 0 if len(self.batches[0]) >= len(self.batches[1]) else 1
            if self.batches[1 - keep]:
                self.counters["moves"] += len(self.batches[1 - keep])
                self.batches[keep] += self.batches[1 - keep]
                self.batches[1 - keep] = []
            return
        self.one_batch = False
        while abs(len(self.batches[0]) - len(self.batches[1])) > 1:
            big = 0 if len(self.batches[0]) > len(self.batches[1]) else 1
            batch = self.batches[big]
            idle = [i for i, s in enumerate(batch) if s.inflight == 0]
            self.batches[1 - big].append(batch.pop(idle[-1] if idle else -1))
            self.counters["moves"] += 1
        if total >= 2 and abs(len(self.batches[0]) - len(self.batches[1])) > 1:
            self.counters["balance_violations"] += 1

    # ---- plans ---------------------------------------------------------------------------------
    def schedule(self, committed: int | None) -> SchedulePlan:
        """Membership changes (retire, admit, place, rebalance) and the next verify of every batch with room in
        its chain. Runs when batch `committed` has just been committed (None: from idle)."""
        assert self.kv, "the KV pools are not attached (attach_kv)"
        self._calls += 1
        plan = SchedulePlan(finished=self._retire())
        if self.config.prefix_caching:   # the requests whose tasks committed since: their K/V grew
            for s in self._committed:
                if s.status is Status.RUNNING:
                    self._register(s)
        self._committed.clear()
        self.update_saturation()
        plan.preempted = self._grow()
        self.waiting.extendleft(plan.preempted)   # back in front, the earliest admitted first
        # nobody is admitted in a step that preempted: the blocks just freed are the running requests'
        new = [] if plan.preempted else self._admit()
        self.unprefilled.extend(new)
        self._place(new, committed)
        self._rebalance()
        order = [committed, 1 - committed] if committed is not None else [0, 1]
        carry = self._plan_prefills(committed, plan, order)
        for b in order:
            admitted = len(new) if b == committed or committed is None else 0
            while self.queued[b] < self.depth and self.batches[b]:
                verify = self._plan_verify(b, admitted, plan, carry)
                if verify is None:
                    break
                if verify.prefill is not None:   # the chunk rides in this verify's task
                    plan.prefills.remove(carry)
                carry = None   # only the first verify may carry it: a later one is numbered after it
                plan.verifies.append(verify)
                admitted = 0
            if not self.batches[b]:
                self._drop_ahead(b, plan)   # no verify will name its round: its members all left the batch
        return plan

    def _plan_prefills(self, committed: int | None, plan: SchedulePlan, order: list[int]) -> PrefillPlan | None:
        """The prefill task(s) in front of this call's verifies: one within the budget while anything decodes;
        back to back while nothing does (nothing to stall), until one completes a prompt, whose verify then
        carries the next chunk along. -> the one that may ride in the first verify's launch (fuse_prefill), sized
        to what that verify leaves of the budget; None when none may."""
        if not self.unprefilled:
            return None
        # decoding: a verify in flight, or a started request that will ride one (this call's, or its next)
        decoding = any(self.queued) or any(s.ready and not s.done for batch in self.batches for s in batch)
        fusing = decoding and self.config.fuse_prefill and self.config.prefill_budget is not None
        while self.unprefilled:
            # the rows the first verify may carry: only requests started before this call (a chunk that completes
            # a prompt makes its request a rider of the next verify, not of the one the chunk rides)
            verify_tokens = self._expected_verify_tokens(order) if fusing else 0
            prefill = self._plan_prefill(committed, verify_tokens, decoding)
            if prefill is None:
                return None
            plan.prefills.append(prefill)
            if decoding or any(c.last for c in prefill.chunks):
                fits = 0 < verify_tokens and verify_tokens + prefill.num_tokens <= self.launch_budget()
                return prefill if fits else None
        return None

    def launch_budget(self, decoding: bool = True) -> int | None:
        """Tokens one verifier step may prefill (fused: its whole launch); None: unbounded (whole prompts).
        decoding: some request decodes (its period is what the halving below bounds)."""
        if not self.config.prefill_budget:
            return None
        if decoding and self.mode == "psd" and not self.one_batch and all(self.batches):
            # the split: a request's period spans both batches' verifies, each with its chunk: half the budget
            # each keeps a request's gap within one chunk's time
            return max(1, self.config.prefill_budget // 2)
        return self.config.prefill_budget

    def verify_width(self, regime: str) -> int:
        """Tokens a verify of `regime` runs per row: the last token and k drafts (ar: the last token)."""
        return 1 if regime == "ar" else self.config.k + 1

    def _expected_verify_tokens(self, order: list[int]) -> int:
        """The tokens of the first verify this call will plan, at most (blocks may leave a rider out)."""
        for b in order:
            if self.queued[b] < self.depth and self.batches[b]:
                rows = sum(s.ready and (self.depth > 1 or s.inflight == s.prefill_tasks)
                           and id(s) not in self._waiting_for_blocks for s in self.batches[b])
                if rows:
                    return rows * self.verify_width(self.regime(b))
        return 0

    def _plan_prefill(self, committed: int | None, verify_tokens: int = 0, decoding: bool = True
                      ) -> PrefillPlan | None:
        """Chunks of the prompts not yet planned, at most `prefill_budget` tokens, less `verify_tokens` (those of
        the verify it may ride) where that leaves any; the whole budget while nothing decodes (`launch_budget`).
        The prompts share it as `prefill_order` says (`_prefill_shares`); the chunks go in admission order (in psd,
        members of the batch just committed first)."""
        pending = [s for s in self.unprefilled if not s.done]
        self.unprefilled = deque(pending)
        mine = set()
        if committed is not None and self.mode == "psd":
            mine = {id(s) for s in self.batches[committed]}
            pending.sort(key=lambda s: id(s) not in mine)   # stable: admission order within each group
        room = self.launch_budget(decoding) or sum(s.prefill_len - s.prompt_planned for s in pending)
        rides = 0 < verify_tokens < room   # the budget leaves the verify's launch room for a chunk
        if rides:
            room -= verify_tokens
        order = self._prefill_order(pending, mine)
        if decoding and self.chunk_limit is not None and self.config.prefill_budget:
            def prior_keys(tokens: int) -> int:
                """Of a chunk of that many tokens (at most the room), dealt as the shares will be."""
                return sum(take * start for take, start in self._deal(order, min(tokens, room)).values())

            room = min(room, self.chunk_limit.chunk_tokens(verify_tokens if rides else 0, prior_keys))
        shares = self._prefill_shares(order, pending, room)
        chunks = []
        for s in pending:
            if not shares.get(id(s)):
                continue
            start = s.prompt_planned
            stop = start + shares[id(s)]
            # psd and sd_split: the drafter takes the chunks while the verifier prefills them, so the first round
            # feeds two tokens, not the prompt (the drafter runs its tasks in order: before any round). Only a
            # drafter that holds the chunks before takes one (a drafter restarted meanwhile holds none), into
            # blocks it has for them
            to_drafter = self.mode in ("psd", "sd_split") and self.drafter_alive and \
                (start == 0 or s.drafter_generation == self.drafter_generation) and \
                KVRole.DRAFT in self.kv and self.kv[KVRole.DRAFT].covers(s.slot, stop)
            s.drafter_generation = self.drafter_generation if to_drafter else -1
            chunks.append(PromptChunk(s, start, stop, to_drafter))
        if not chunks:
            return None
        prefill = PrefillPlan(self.next_seq(), chunks)
        for row, c in enumerate(chunks):
            s = c.state
            s.prompt_planned = c.stop
            s.inflight += 1
            s.prefill_tasks += 1
            if c.last:
                s.prefilling, s.prefill, s.prefill_row = True, prefill, row
                if c.to_drafter:
                    s.request.draft_valid = s.prefill_len
                elif s.drafter_generation != self.drafter_generation:
                    s.request.draft_valid = min(s.request.draft_valid, s.cached_tokens)
                self.unprefilled.remove(s)
        return prefill

    def _prefill_order(self, pending: list[RequestState], mine: set[int]) -> list[RequestState]:
        """The order the prompts share a task's tokens in. `shortest`: due prompts first, in admission order, then
        (in psd, the batch just committed first) the fewest tokens left first; `arrival`: `pending`'s order."""
        if self.config.prefill_order is not PrefillOrder.SHORTEST:
            return pending
        due = sorted((s for s in pending if self.prefill_due(s)), key=lambda s: s.admitted_at)
        rest = sorted((s for s in pending if not self.prefill_due(s)),
                      key=lambda s: (id(s) not in mine, s.prefill_len - s.prompt_planned, s.admitted_at))
        return due + rest

    @staticmethod
    def _deal(order: list[RequestState], room: int) -> dict[int, tuple[int, int]]:
        """-> id(state) -> (prompt tokens of its chunk, where the chunk starts): `room` tokens dealt in `order`."""
        shares = {}
        for s in order:
            if room == 0:
                break
            take = min(s.prefill_len - s.prompt_planned, room)
            shares[id(s)] = (take, s.prompt_planned)
            room -= take
        return shares

    def _prefill_shares(self, order: list[RequestState], pending: list[RequestState], room: int) -> dict[int, int]:
        """-> id(state) -> prompt tokens of its chunk in this task (`room` in all, dealt in `order`), and each
        prompt still waiting after it counts the tokens given to those admitted after it
        (`RequestState.overtaken`)."""
        shares = {key: take for key, (take, _) in self._deal(order, room).items()}
        # the latest admitted first: each waiting prompt adds what went to those admitted after it
        later = 0
        for s in sorted(pending, key=lambda s: -s.admitted_at):
            if s.prompt_planned + shares.get(id(s), 0) < s.prefill_len:
                s.overtaken += later
            later += shares.get(id(s), 0)
        return shares

    def prefill_due(self, s: RequestState) -> bool:
        """Later admitted prompts have overtaken s by one budget's tokens, or by its own prefill's when fewer
        (short-first ordering no longer passes it over)."""
        return s.overtaken >= min(s.prefill_len - s.cached_tokens, self.config.prefill_budget or UNBOUNDED)

    def _drop_ahead(self, b: int, plan: SchedulePlan) -> None:
        ahead, self.draft_ahead[b] = self.draft_ahead[b], None
        if ahead is not None:
            self.counters["draft_rows_unused"] += len(ahead.rows)
            plan.dropped.append(ahead)

    def _plan_verify(self, b: int, admitted: int, plan: SchedulePlan, carry: PrefillPlan | None = None
                     ) -> VerifyPlan | None:
        """Batch b's next verify (and the rounds it takes and is followed by); None when no member can ride.
        carry: a prefill planned in this call that may ride in its launch (fused) where the budget holds both."""
        # only requests whose whole prompt is planned ride (their chunks run before this verify); in sd and ar
        # everything the step needs is in the verifier's slot state, otherwise a request rides when its state is
        # committed, or only its prefill is ahead of it. And when it has the blocks the verify writes (mostly
        # `_grow` or its admission gave them; a second verify queued in sd and ar takes more, as does a restarted
        # drafter's pool); without them it rides a later one. A member `_grow` covered in this call meets them all
        any_inflight, waiting, call = self.depth > 1, self._waiting_for_blocks, self._calls
        candidates = [s for s in self.batches[b] if s.reserved_in == call or (
            s.ready and (any_inflight or s.inflight == s.prefill_tasks) and (not waiting or id(s) not in waiting))]
        # mostly all were covered by `_grow` in this call: then there is nothing to reserve
        uncovered = [s for s in candidates if s.reserved_in != call]
        short = self._reserve(uncovered) if uncovered else ()
        rows = [s for s in candidates if s not in short] if short else candidates
        regime = self.regime(b)
        fused = None
        if carry is not None:
            # fused, the chunk that completes a prompt runs in the verify's launch: its request rides the next one
            riders = [s for s in rows if s.prefill is not carry]
            if riders and len(riders) * self.verify_width(regime) + carry.num_tokens <= self.launch_budget():
                rows, fused = riders, carry
        if not rows:
            return None   # every member is still in flight in the other batch (moved): next commit
        ahead = self.draft_ahead[b]
        if ahead is not None and (regime == "ar" or ahead.generation != self.drafter_generation):
            self._drop_ahead(b, plan)   # for a drafter that died since, or no longer wanted
            ahead = None
        self.draft_ahead[b] = None
        # fused: one task, under the prefill's number (the next one: nothing was numbered after it)
        verify = VerifyPlan(fused.seq if fused is not None else self.next_seq(), b, regime, rows, [-1] * len(rows),
                            admitted=admitted, low_load=not self.high_load(), high_load=self.high_load_choice(),
                            draft_generation=self.drafter_generation, prefill=fused)
        if fused is not None:
            fused.first_row = len(rows)
            for c in fused.chunks:
                if c.last:
                    c.state.prefill_row += len(rows)
        if regime == "sd":
            verify.draft_index = list(range(len(rows)))
        elif regime != "ar":
            # every rider is drafted, a new one from its prefill's first token, as `sd` drafts it: so a
            # request is drafted at the same positions in every mode. Riders the round drafted ahead covers
            # (nothing committed for them since it was built) take its rows; the others (new, or moved here)
            # a round of their own, drafted now
            index, missing = verify.draft_index, []   # a rider's row in the round ahead; -1: in its own round
            if ahead is not None:
                built = ahead.built
                for i, s in enumerate(rows):
                    entry = built.get(id(s)) if s.inflight == 0 else None
                    if entry is not None and entry[1] == s.last_seq:
                        index[i] = entry[0]
                    else:
                        missing.append(i)
                if len(missing) == len(rows):   # it covers no rider
                    self.counters["draft_rows_unused"] += len(ahead.rows)
                    plan.dropped.append(ahead)
                    ahead = None
                else:
                    verify.ahead = ahead
                    self.counters["drafts_ahead_used"] += 1
                    self.counters["draft_rows_unused"] += len(ahead.rows) - (len(rows) - len(missing))
            else:
                missing = list(range(len(rows)))
            if missing:
                verify.fresh = DraftPlan(b, [self._fresh_row(rows[i]) for i in missing],
                                         generation=self.drafter_generation)
                offset = len(ahead.rows) if ahead is not None else 0
                for j, i in enumerate(missing):
                    index[i] = offset + j
        for s in rows:
            s.inflight += 1
            s.reserved_in = -1   # its next verify writes further
        self.queued[b] += 1
        if regime in ("psd", "seq") and self.drafter_alive:
            verify.next_round = self._plan_next_round(b, verify)
            self.draft_ahead[b] = verify.next_round
        return verify

    @staticmethod
    def _fresh_row(s: RequestState) -> DraftRow:
        """A rider drafted from its committed tokens now (a new one also from its prefill's first token)."""
        if s.takes_first_token:
            return DraftRow(s, s.prefill, -1, s.request.draft_valid >= s.prefill_len)
        return DraftRow(s, None, -1, False)

    def _plan_next_round(self, b: int, verify: VerifyPlan) -> DraftPlan | None:
        """Batch b's next round, drafted behind `verify` (psd, sd_split): every member whose tasks in flight are
        at most its prefill and this verify gets a row: its committed tokens plus those tasks' tokens, which
        the drafter reads from their results. The chain verify -> draft -> verify then runs without waiting
        for the manager's commit; at the next verify, members not covered get a fresh round."""
        batch, draft_index = self.batches[b], verify.draft_index
        # the verify's rows are members of the batch in its order: all of them (mostly), or a dict says which
        at_verify = None if len(verify.rows) == len(batch) else {id(s): row for row, s in enumerate(verify.rows)}
        rows, built = [], {}
        for member, s in enumerate(batch):
            vrow = member if at_verify is None else at_verify.get(id(s), -1)
            # the drafter's slot holds every token but the last two of the sequence the row ends with: after
            # a round that drafted it (accepted drafts included), or a prompt the drafter prefilled
            if vrow >= 0:   # a rider of the verify: live, its prompt planned, in flight there and in its prefill only
                last, all_but_two = verify.seq, draft_index[vrow] >= 0
            elif s.done or not s.ready or s.inflight != s.prefill_tasks:
                continue   # in flight elsewhere too (moved from the other batch): its tokens are not all here
            elif not self._covered(s):
                continue   # no blocks for its drafts yet (the verify left it out for that)
            else:
                last, all_but_two = s.prefill.seq if s.prefilling else s.last_seq, False
            first_token = s.prefilling and not s.resumed   # takes_first_token, inline: per member per step
            if first_token and not all_but_two:
                all_but_two = s.request.draft_valid >= s.prefill_len
            built[id(s)] = (len(rows), last)
            rows.append(DraftRow(s, s.prefill if first_token else None, vrow, all_but_two))
        if not rows:
            return None
        return DraftPlan(b, rows, after_seq=verify.seq, generation=self.drafter_generation, built=built)

    # ---- results -------------------------------------------------------------------------------
    def commit_prefill(self, prefill: PrefillPlan) -> None:
        if self.config.prefix_caching:
            self._committed += prefill.requests
        for c in prefill.chunks:
            s = c.state
            s.inflight -= 1
            s.prefill_tasks -= 1
            s.prefilled = c.stop
            if c.last:
                s.prefilling, s.prefill, s.prefill_row = False, None, -1
                s.last_seq = prefill.seq

    def commit_verify(self, verify: VerifyPlan) -> None:
        """verify's result is committed (the manager appended its tokens): its riders are free to ride again."""
        if self.config.prefix_caching:
            self._committed += verify.rows
        for s in verify.rows:
            s.inflight -= 1
            s.last_seq = verify.seq
        self.queued[verify.batch] -= 1

    def verify_failed_drafts(self, verify: VerifyPlan) -> None:
        """verify's drafts failed: it runs without them."""
        verify.draft_index = [-1] * len(verify.rows)
        verify.regime = "ar"
