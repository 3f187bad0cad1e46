"""The scheduler alone (runtime/scheduler.py), driven by hypothesis: random sequences of arrivals, aborts, EOS,
stop strings, drafter faults and regime switches, with made-up verifier results, in milliseconds. A small
driver plays the manager's part (submit plans in order, complete the oldest task, commit its tokens with the
engine's own `commit_tokens`) and the invariants are checked after every event:

- batch balance: | |A| - |B| | <= 1 while psd splits;
- at most one verify in flight per request (psd, sd_split; `sd` and `ar` queue two by design);
- every request finishes exactly once, and all do once the engine drains;
- no KV slot leaked or shared;
- each draft round consistent with its batch: a verify's rows are members of its batch, each drafted rider
  finds itself at its row of the rounds the verify takes, and a round drafted ahead holds members of that
  batch whose tokens all come from the verify it follows;
- chunked prefill: no prefill task holds more prompt tokens than the per-step budget (nor, while anything
  decodes, than the adaptive chunk limit the manager sets between steps), a request's chunks
  cover its prompt in order without gaps or overlaps, at most one prefill task rides a step while anything
  decodes, and no request is verified (nor drafted) before its whole prompt has been prefilled;
- fused prefill (a chunk inside a verify's task): the launch's tokens (the verify's k + 1 per row, 1 in ar, and
  the chunk's) never exceed the budget, and a verify's rows are prefilled before its launch, not in it;
- the budget's order (`prefill_order`): with `shortest`, the prompt tokens planned for requests admitted after a
  prompt while it waits stay below two budgets (one, plus the step it became due in; its own prefill's tokens
  instead of the first when fewer): no prompt starves behind later, shorter ones; with `arrival` (outside psd,
  whose chunks put the batch just committed first) there are none;
- run beside the unchunked scheduler on the same events, a budget that every waiting prompt fits plans what
  whole prompts plan, call for call;
- KV blocks (here with pools large enough never to run short; tests/test_runtime_paging.py runs the same driver
  with small ones): every pool's bookkeeping is consistent (reference counts equal holders, no block lost), a
  block is shared only as a cached prefix, the table changes sent with each task leave the worker's tables
  equal to the scheduler's, and no block a task in flight writes is taken from its request before the task ends;
  a preempted request had nothing in flight, and every request is admitted once more than it is preempted.
"""
import ast
import gc
import functools
import pathlib
import random
import subprocess
import sys
import weakref
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minedraft_ray.engine.kv_blocks import HEADROOM, NULL_BLOCK
from minedraft_ray.engine.request import Request, commit_tokens
from minedraft_ray.engine.sampling import SamplingParams
from minedraft_ray.runtime.chunk_budget import ChunkLimit, ClassPrice
from minedraft_ray.runtime.scheduler import (DraftPlan, KVPoolSpec, KVRole, PrefillOrder, PrefillPlan, RequestState,
                                             Scheduler, SchedulerConfig, Status, VerifyPlan)

EOS = 1
K = 3
MAX_LEN = 40            # longest arrival: a 20-token prompt and 16 tokens
ROOT = pathlib.Path(__file__).resolve().parent.parent


class Driver:
    """The manager's part, without actors: plans go into a FIFO in submission order; completing the oldest
    commits tokens made up from the hypothesis draws."""

    def __init__(self, sched: Scheduler, schedule_after_prefill: bool = True):
        """schedule_after_prefill: schedule after every completed task; False: as the manager does, only after a
        verify (or when nothing is in flight), so a request between its prompt chunks is idle when the next
        verify's riders ask for blocks."""
        self.sched = sched
        self.schedule_after_prefill = schedule_after_prefill
        self.inflight: deque = deque()
        self.finished: dict[str, int] = {}
        self.states: list[RequestState] = []
        # id(state) -> tokens of this residency's prefill that its completed / submitted prefill tasks cover
        # (from its cached prefix on)
        self.prefilled: dict[int, int] = {}
        self.planned: dict[int, int] = {}
        # the workers' block tables, as the table changes sent with their tasks leave them
        self.tables = {role: [[NULL_BLOCK] * pool.blocks_per_slot for _ in range(sched.config.num_slots)]
                       for role, pool in sched.kv.items()}
        self.writes: dict[int, list] = {}     # id(task) -> [(slot, blocks it writes)] while in flight
        self.admissions: dict[int, int] = {}  # id(state) -> times admitted
        self.admitted_at: dict[int, int] = {}
        self.preemptions = 0
        self.plans: list[tuple] = []          # every schedule call's plan, by arrival numbers (plan_shape)
        self.preempted_between_chunks = 0     # preempted with prompt chunks still to plan
        # id(state) -> prompt tokens planned for requests admitted after it while its prefill waited (this residency)
        self.overtaken: dict[int, int] = {}

    # -- events --
    def arrive(self, prompt_len: int, max_tokens: int, eos: bool) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=not eos)
        state = RequestState(Request(list(range(2, 2 + prompt_len)), params, (EOS,)))
        self.states.append(state)
        self.sched.arrive(state)
        if not self.inflight:
            self.schedule(None)

    def abort(self, i: int) -> None:
        state = self.states[i % len(self.states)] if self.states else None
        if state is None or state.request.finished:
            return
        if self.sched.abort(state):
            self.finish(state, "abort")

    def drafter_fault(self) -> None:
        """The drafter died: rounds in flight fail, so their verifies run without drafts (as the manager does)."""
        if self.sched.drafter_down():
            for task in self.inflight:
                if isinstance(task, VerifyPlan) and task.drafted and task.regime != "sd":
                    self.sched.verify_failed_drafts(task)

    def drafter_back(self) -> None:
        if not self.sched.drafter_alive and self.sched.mode in ("psd", "sd_split"):
            self.sched.drafter_up()
            # a new drafter: its tables are all null
            pool = self.sched.kv[KVRole.DRAFT]
            self.tables[KVRole.DRAFT] = [[NULL_BLOCK] * pool.blocks_per_slot for _ in range(len(pool.held))]

    def complete(self, emit) -> None:
        """The oldest task's result: emit(num_drafts) tokens per row (1 without drafts, 1..k+1 with)."""
        if not self.inflight:
            if self.sched.waiting or self.sched.num_running():
                self.schedule(None)
            return
        task = self.inflight.popleft()
        check_writes_kept(self, task)
        if isinstance(task, PrefillPlan):
            rows = self.complete_prefill(task)
            num_drafts = [0] * len(rows)
        else:
            for s in task.rows:   # the verify runs now: every rider's prefill is in the KV (a fused chunk is not)
                assert self.prefilled.get(id(s), s.cached_tokens) == s.prefill_len, \
                    f"{s.id} verified before its prefill completed"
            started = self.complete_prefill(task.prefill) if task.prefill is not None else []
            self.sched.commit_verify(task)
            rows, num_drafts = started + task.rows, [0] * len(started) + [K if i >= 0 else 0 for i in task.draft_index]
        tokens = [emit(nd) for nd in num_drafts]
        live = []
        for state, toks, nd in zip(rows, tokens, num_drafts):
            if state.request.finished:
                self.sched.release(state)
            else:
                live.append((state, toks, nd))
        if live:
            commit_tokens([s.request for s, _, _ in live], [t for _, t, _ in live], None, [nd for *_, nd in live])
            for state, _, _ in live:
                if state.request.finished:
                    self.finish(state, None)
        if isinstance(task, VerifyPlan):
            self.schedule(task.batch)
        elif self.schedule_after_prefill or not self.inflight:
            self.schedule(None)

    def complete_prefill(self, task: PrefillPlan) -> list[RequestState]:
        """A prefill's chunks are in the KV -> the requests whose first token it sampled."""
        self.sched.commit_prefill(task)
        for c in task.chunks:   # the verifier runs its tasks in order: this one continues the chunks before
            assert self.prefilled.get(id(c.state), c.state.cached_tokens) == c.start, \
                f"{c.state.id}: a chunk out of order"
            self.prefilled[id(c.state)] = c.stop
            if not c.last or c.state.resumed:
                self.sched.release(c.state)
        # a resumed request's prefill samples nothing: it has its tokens
        return [c.state for c in task.chunks if c.last and not c.state.resumed]

    def stop_string(self, i: int) -> None:
        """A stop string is matched on the text, above the engine: the caller aborts the request."""
        running = [s for b in self.sched.batches for s in b if not s.request.finished]
        if running:
            state = running[i % len(running)]
            if state.request.output_ids:
                self.abort(self.states.index(state))

    # -- the manager's half of a step --
    def schedule(self, committed) -> None:
        decoding = any(isinstance(t, VerifyPlan) for t in self.inflight)
        plan = self.sched.schedule(committed)
        for state in plan.finished:
            self.finish(state, "abort")
        for state in plan.preempted:   # no task of it was in flight; its next residency starts afresh
            assert state.inflight == 0 and state.status is Status.WAITING and state.slot is None, state.id
            self.planned.pop(id(state), None)
            self.prefilled.pop(id(state), None)
            self.preemptions += 1
            self.preempted_between_chunks += not state.ready
        for state in self.states:
            if state.admitted_at != self.admitted_at.get(id(state), -1):
                self.admitted_at[id(state)] = state.admitted_at
                self.overtaken[id(state)] = 0
                self.admissions[id(state)] = self.admissions.get(id(state), 0) + 1
        # requests that decode in this call's verifies without having been started by its prefills
        fused = [v.prefill for v in plan.verifies if v.prefill is not None]
        started = {id(c.state) for p in plan.prefills + fused for c in p.chunks if c.last}
        decoding = decoding or any(id(s) not in started for v in plan.verifies for s in v.rows)
        riding = {id(v.prefill): len(v.rows) * self.sched.verify_width(v.regime)
                  for v in plan.verifies if v.prefill is not None}
        check_prefills(self, plan.prefills + fused, decoding, riding)
        if self.sched.chunk_limit is not None and self.sched.chunk_limit.probe:
            self.sched.chunk_limit = None   # a probe step lasts one call
        self.plans.append(self.plan_shape(plan))
        # the manager's order: each prefill (the drafter's chunks behind it), then each verify with the round it
        # takes first and the round drafted behind it after (a fused verify's chunks go to the drafter first)
        for prefill in plan.prefills:
            self.submit_to_verifier(prefill, [(c.state.slot, c.stop) for c in prefill.chunks])
            if any(c.to_drafter for c in prefill.chunks):
                self.submit_to_drafter([(c.state.slot, c.stop) for c in prefill.chunks if c.to_drafter])
        for verify in plan.verifies:
            check_round_consistency(self.sched, verify)
            check_prompts_planned(self, verify)
            check_verify_blocks(self, verify)
            check_fused(self, verify)
            chunks = verify.prefill.chunks if verify.prefill is not None else []
            if any(c.to_drafter for c in chunks):
                self.submit_to_drafter([(c.state.slot, c.stop) for c in chunks if c.to_drafter])
            if verify.fresh is not None:
                self.submit_to_drafter([(row.state.slot, None) for row in verify.fresh.rows])
            self.submit_to_verifier(verify, [(s.slot, None) for s in verify.rows] + [(c.state.slot, c.stop)
                                                                                   for c in chunks])
            if verify.next_round is not None:
                self.submit_to_drafter([(row.state.slot, None) for row in verify.next_round.rows])
        check_balance(self.sched)
        check_blocks(self)
        check_resumes_first(self.sched)

    def _apply_edits(self, role: KVRole) -> None:
        edits = self.sched.take_edits(role)
        if edits is not None:
            assert len(set(zip(edits.rows, edits.cols))) == len(edits), "a table entry changed twice in one task"
            for row, col, block in zip(edits.rows, edits.cols, edits.ids):
                self.tables[role][row][col] = block

    def _check_tables(self, role: KVRole, rows: list) -> None:
        """After the task's table changes, the worker's table of each row's slot is the scheduler's (its blocks, in
        order, then null), and covers what the row's task writes (`stop`; None: the pool's reach for it)."""
        pool = self.sched.kv[role]
        for slot, stop in rows:
            held = pool.held[slot]
            assert self.tables[role][slot] == held + [NULL_BLOCK] * (pool.blocks_per_slot - len(held)), \
                f"{role.value} table of slot {slot} differs from the scheduler's"
            if stop is not None:
                assert pool.covers(slot, stop), f"{role.value} slot {slot}: no blocks for positions below {stop}"

    def submit_to_verifier(self, task, rows: list) -> None:
        roles = [KVRole.TARGET] + ([KVRole.DRAFT] if self.sched.mode == "sd" else [])
        for role in roles:
            self._apply_edits(role)
            self._check_tables(role, rows)
        self.writes[id(task)] = [(slot, list(self.sched.kv[KVRole.TARGET].held[slot])) for slot, _ in rows]
        self.inflight.append(task)

    def submit_to_drafter(self, rows: list) -> None:
        if KVRole.DRAFT in self.sched.kv:
            self._apply_edits(KVRole.DRAFT)
            self._check_tables(KVRole.DRAFT, rows)

    def plan_shape(self, plan) -> tuple:
        """A plan as requests' arrival numbers: its prefill tasks' chunks, its verifies' rows and rounds."""
        number = {id(s): i for i, s in enumerate(self.states)}

        def rows(round_):
            return None if round_ is None else [(number[id(r.state)], r.verify_row, r.all_but_two) for r in round_.rows]
        prefills = [[(number[id(c.state)], c.start, c.stop, c.to_drafter) for c in p.chunks] for p in plan.prefills]
        verifies = [(v.batch, v.regime, [number[id(s)] for s in v.rows], v.draft_index, rows(v.ahead), rows(v.fresh),
                     rows(v.next_round), v.prefill is not None) for v in plan.verifies]
        return [number[id(s)] for s in plan.finished], prefills, verifies

    def finish(self, state: RequestState, reason) -> None:
        if reason and not state.request.finished:
            state.request.finish_reason = reason
        self.sched.finish(state)
        assert state.id not in self.finished, f"{state.id} finished twice"
        self.finished[state.id] = 1

    def drain(self, emit) -> None:
        for _ in range(10_000):
            if not (self.inflight or self.sched.waiting or self.sched.num_running()):
                return
            self.complete(emit)
        raise AssertionError("the engine did not drain")


# ---- invariants --------------------------------------------------------------------------------------
def check_balance(sched: Scheduler) -> None:
    a, b = len(sched.batches[0]), len(sched.batches[1])
    if sched.mode == "psd" and not sched.one_batch and a + b >= 2:
        assert abs(a - b) <= 1, (a, b)
    if sched.mode != "psd":
        assert b == 0


def check_resumes_first(sched: Scheduler) -> None:
    """Preempted requests wait in front of every new arrival: admission is FIFO, so they resume first (and
    `queue_full` counts them there)."""
    resuming = [bool(s.request.stats.preemptions) for s in sched.waiting]
    assert resuming == sorted(resuming, reverse=True), "a new arrival waits in front of a preempted request"


def check_one_verify_per_request(driver: Driver) -> None:
    if driver.sched.mode not in ("psd", "sd_split"):
        return
    seen = set()
    for task in driver.inflight:
        if isinstance(task, VerifyPlan):
            for s in task.rows:
                assert id(s) not in seen, f"{s.id} rides two verifies in flight"
                seen.add(id(s))


def check_slots(driver: Driver) -> None:
    sched = driver.sched
    held = [s.request.slot for s in driver.states if s.request.slot is not None]
    assert len(held) == len(set(held)), f"a slot is shared: {sorted(held)}"
    assert len(held) == sched.slots.num_used, f"a slot leaked: {sched.slots.num_used} used, {len(held)} held"
    for s in driver.states:
        if s.status is Status.FINISHED and s.inflight == 0:
            assert s.request.slot is None, f"{s.id} finished and idle but holds slot {s.request.slot}"
        if s.status is Status.RUNNING:
            assert s.request.slot is not None


def check_round_consistency(sched: Scheduler, verify: VerifyPlan) -> None:
    batch = {id(s) for s in sched.batches[verify.batch]}
    assert all(id(s) in batch for s in verify.rows), "a verify carries a request of the other batch"
    assert len(verify.draft_index) == len(verify.rows)
    if verify.regime in ("psd", "seq"):   # drafted on the drafter actor (sd drafts inside its step)
        rounds = [r for r in (verify.ahead, verify.fresh) if r is not None]
        drafted_rows = [row for r in rounds for row in r.rows]
        for s, i in zip(verify.rows, verify.draft_index):
            assert 0 <= i < len(drafted_rows), f"{s.id} has no drafts"
            assert drafted_rows[i].state is s, f"{s.id} takes another request's drafts"
    if verify.next_round is not None:
        for row in verify.next_round.rows:
            assert id(row.state) in batch, "a round drafted ahead holds a request of the other batch"
            if row.verify_row >= 0:
                assert verify.rows[row.verify_row] is row.state
            # every task in flight for it is the verify this round follows (and its prefill)
            assert row.state.inflight == (row.verify_row >= 0) + row.state.prefill_tasks


def check_prefills(driver: Driver, prefills: list[PrefillPlan], decoding: bool, riding: dict[int, int]) -> None:
    """Each prefill task within the budget (and the adaptive chunk's: its launch's tokens, the verify's it rides
    in (`riding`: id -> the verify's tokens) included, or its floor), each chunk continuing its prompt where the one
    before ended; more than one task per step only while nothing decodes, and then only until a prompt is
    complete."""
    budget = driver.sched.config.prefill_budget
    for i, prefill in enumerate(prefills):
        assert prefill.chunks and all(c.stop > c.start for c in prefill.chunks)
        if budget is not None:
            assert prefill.num_tokens <= budget, f"a prefill of {prefill.num_tokens} tokens, budget {budget}"
            if decoding and driver.sched.mode == "psd" and all(driver.sched.batches) and not driver.sched.one_batch:
                # a request's period spans both batches' verifies: half the budget each (while nothing decodes,
                # there is no period to bound: the whole budget)
                assert prefill.num_tokens <= max(1, budget // 2), (prefill.num_tokens, budget)
            limit = driver.sched.chunk_limit
            if decoding and limit is not None:   # the adaptive chunk, while anything decodes
                verify_tokens = riding.get(id(prefill), 0)
                assert prefill.num_tokens <= limit.chunk_tokens(verify_tokens), (prefill.num_tokens, limit,
                                                                                   verify_tokens)
                if limit.key_ms > 0 and limit.prices:   # and at its depth: its class's price and its prior keys fit
                    smallest = max(limit.floor, limit.prices[0].launch_tokens - verify_tokens)
                    if prefill.num_tokens > smallest:   # not the floor or the smallest class: a class that fits
                        launch = prefill.num_tokens + verify_tokens
                        price = next(p.added_ms for p in limit.prices if p.launch_tokens >= launch)
                        assert price + limit.key_ms * prefill.prior_keys <= limit.allowed_ms, (prefill, limit)
        for c in prefill.chunks:
            assert driver.planned.get(id(c.state), c.state.cached_tokens) == c.start, \
                f"{c.state.id}: chunk gap or overlap"
            driver.planned[id(c.state)] = c.stop
        check_overtaking(driver, prefill)
        if i < len(prefills) - 1:
            assert not decoding and not any(c.last for c in prefill.chunks), "two prefills rode one step"


def check_overtaking(driver: Driver, prefill: PrefillPlan) -> None:
    """After each prefill task (its chunks counted as planned): every prompt still waiting for chunks adds the tokens
    this task gave requests admitted after it. `shortest`: that total stays below one budget (or its own prefill's
    tokens, when fewer) plus one budget (it is due once overtaken by the first, and then nobody later goes before
    it); `arrival`: nobody later goes before it at all (outside psd, whose committed batch goes first)."""
    sched = driver.sched
    budget = sched.config.prefill_budget
    for s in driver.states:
        if s.status is not Status.RUNNING or s.done or driver.planned.get(id(s), s.cached_tokens) == s.prefill_len:
            continue
        later = sum(c.stop - c.start for c in prefill.chunks if c.state.admitted_at > s.admitted_at)
        driver.overtaken[id(s)] = overtaken = driver.overtaken.get(id(s), 0) + later
        if sched.config.prefill_order is PrefillOrder.SHORTEST and budget is not None:
            own = s.prefill_len - s.cached_tokens
            assert overtaken < min(own, budget) + budget, f"{s.id} ({own} to prefill) overtaken by {overtaken}"
        elif sched.config.prefill_order is PrefillOrder.ARRIVAL and sched.mode != "psd":
            assert overtaken == 0, f"{s.id} overtaken by {overtaken} tokens of later prompts"


def check_fused(driver: Driver, verify: VerifyPlan) -> None:
    """A verify carrying a prefill: fusion on, its launch (k + 1 tokens per row, 1 in ar, and the chunks) within
    the step's budget (half of it while psd splits), none of its rows started by its own chunks, and the chunks'
    first tokens after its rows in its result."""
    if verify.prefill is None:
        return
    sched = driver.sched
    assert sched.config.fuse_prefill and sched.config.prefill_budget is not None
    budget = sched.config.prefill_budget
    if sched.mode == "psd" and all(sched.batches) and not sched.one_batch:
        budget = max(1, budget // 2)
    width = 1 if verify.regime == "ar" else K + 1
    tokens = len(verify.rows) * width + verify.prefill.num_tokens
    assert tokens <= budget, f"a fused launch of {tokens} tokens, budget {budget}"
    chunk_states = {id(c.state) for c in verify.prefill.chunks}
    assert not any(id(s) in chunk_states for s in verify.rows), "a request rides the launch its own chunk is in"
    assert verify.prefill.first_row == len(verify.rows)
    for row, c in enumerate(verify.prefill.chunks):
        if c.last:
            assert c.state.prefill_row == len(verify.rows) + row


def check_prompts_planned(driver: Driver, verify: VerifyPlan) -> None:
    """A verify (and the rounds it takes and is followed by) holds only requests whose every prompt chunk is
    submitted ahead of it."""
    # (the round drafted ahead may hold rows no longer wanted, e.g. of a request preempted since: only the riders'
    # rows of it are used, and the riders are checked)
    rounds: list[DraftPlan] = [r for r in (verify.fresh, verify.next_round) if r is not None]
    for s in verify.rows + [row.state for r in rounds for row in r.rows]:
        assert driver.planned.get(id(s), s.cached_tokens) == s.prefill_len, f"{s.id} rides before its prefill"


def check_verify_blocks(driver: Driver, verify: VerifyPlan) -> None:
    """Each rider's slot has blocks for what this verify writes (its length then: the committed tokens, the first
    token of a prefill in flight, up to k + 1 per verify in flight before it; then k + 1 more) in the target, and in
    the drafter for its round (in psd and sd_split the round drafted behind it too: k more)."""
    sched, k = driver.sched, (0 if driver.sched.mode == "ar" else K)
    cap = MAX_LEN + HEADROOM
    for s in verify.rows:
        before = sum(isinstance(t, VerifyPlan) and any(x is s for x in t.rows) for t in driver.inflight)
        length = s.request.seq_len + (not s.request.output_ids) + (k + 1) * before
        wants = {KVRole.TARGET: length + k, KVRole.DRAFT: length + k + (k if sched.mode in ("psd", "sd_split") else 0)}
        for role, pool in sched.kv.items():
            assert pool.covers(s.slot, min(wants[role], cap)), f"{s.id} rides without blocks in the {role.value} pool"


def check_writes_kept(driver: Driver, task) -> None:
    """The target blocks a verifier task wrote were still its requests' when it ended (none freed or moved to
    another request while it was in flight)."""
    for slot, blocks in driver.writes.pop(id(task)):
        held = driver.sched.kv[KVRole.TARGET].held[slot]
        assert held[:len(blocks)] == blocks, f"slot {slot} lost blocks while a task writing them was in flight"


def check_blocks(driver: Driver) -> None:
    """Every pool's bookkeeping is consistent, and a block held by two slots is a cached prefix block; each
    running request holds blocks, a waiting or finished idle one none."""
    sched = driver.sched
    for pool in sched.kv.values():
        pool.check_blocks()
        shared = {b for b in range(1, pool.num_blocks) if pool.pool.refcount[b] > 1}
        assert shared <= set(pool.block_key), f"blocks held by two requests, not cached: {shared - set(pool.block_key)}"
    for s in driver.states:
        if s.status is Status.WAITING:
            assert s.slot is None and id(s) not in {id(x) for b in sched.batches for x in b}, s.id
        if s.status is Status.RUNNING:
            assert len(sched.kv[KVRole.TARGET].held[s.slot]) > 0, f"{s.id} runs without blocks"


def check_drained_blocks(driver: Driver) -> None:
    """Nothing runs: every block is free or an idle cached one, and every request was admitted once more than
    it was preempted (once less when it was aborted while queued after a preemption)."""
    for pool in driver.sched.kv.values():
        pool.check_blocks()
        assert pool.num_available == pool.num_blocks - 1 and not any(pool.held), "blocks leaked"
    for s in driver.states:
        admitted = driver.admissions.get(id(s), 0)
        resumes_owed = 0 if (s.aborted and s.slot is None and admitted == s.request.stats.preemptions) else 1
        assert admitted == s.request.stats.preemptions + resumes_owed, \
            (s.id, admitted, s.request.stats.preemptions, s.aborted)
    assert driver.preemptions == driver.sched.counters["preemptions"] == \
        sum(s.request.stats.preemptions for s in driver.states)


def check_all(driver: Driver) -> None:
    check_one_verify_per_request(driver)
    check_slots(driver)
    check_balance(driver.sched)
    check_blocks(driver)
    check_resumes_first(driver.sched)


# ---- the property --------------------------------------------------------------------------------------
ARRIVE = st.tuples(st.just("arrive"), st.integers(1, 20), st.integers(1, 16), st.booleans())
BUDGETS = st.sampled_from([None, 1, 2, 3, 5, 8, 13])   # prompt tokens per step (None: unchunked)
# fused prefill's budgets bound a verify's rows too (k + 1 = 4 tokens each): some fit no verify, some a few rows
FUSED_BUDGETS = st.sampled_from([None, 1, 3, 5, 9, 13, 21, 40])
ORDERS = st.sampled_from(list(PrefillOrder))
COMPLETE = st.tuples(st.just("complete"))
EVENTS = st.one_of(
    ARRIVE, ARRIVE, ARRIVE, COMPLETE, COMPLETE, COMPLETE, COMPLETE,
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("abort_running"), st.integers(0, 50)),
    st.tuples(st.just("stop_string"), st.integers(0, 50)),
    st.tuples(st.just("drafter_fault")),
    st.tuples(st.just("drafter_back")),
    st.tuples(st.just("regime"), st.sampled_from(["psd", "seq"]), st.sampled_from(["psd", "seq", "auto"])),
)
# the adaptive chunk (runtime/chunk_budget.py) moves between steps: any launch size and floor, or none; a probe
# step (no chunk while anything decodes) the manager holds for one schedule call
PRICES = (ClassPrice(1, 0.5), ClassPrice(2, 0.6), ClassPrice(4, 0.8), ClassPrice(8, 1.0), ClassPrice(16, 1.5),
          ClassPrice(100, 2.5))


@st.composite
def priced_limits(draw):
    """A limit as ChunkBudget.next_limit builds it: the classes up to its launch priced, and what depth adds (a
    prompt's later chunks shrink as they start deeper)."""
    top = draw(st.integers(0, len(PRICES) - 1))
    return ChunkLimit(PRICES[top].launch_tokens, draw(st.sampled_from([1, 2])), prices=PRICES[:top + 1],
                      key_ms=draw(st.sampled_from([0.0, 0.002, 0.05])), allowed_ms=3.0)


CHUNK_LIMITS = st.one_of(st.none(), st.just(ChunkLimit(8, 1, probe=True)),
                         st.builds(ChunkLimit, st.sampled_from([1, 2, 3, 5, 8, 13, 100]), st.sampled_from([1, 2])),
                         priced_limits())
WITH_CHUNK_LIMITS = st.one_of(EVENTS, st.tuples(st.just("chunk_limit"), CHUNK_LIMITS))


@functools.cache
def tokens(num_drafts: int):
    """A verify row's emitted tokens: 1..num_drafts + 1 of them, EOS possible anywhere. Built once per width (a
    strategy built afresh at each of a run's thousands of draws cost more than the draws)."""
    return st.integers(1, num_drafts + 1).flatmap(_tokens_of_length)


@functools.cache
def _tokens_of_length(n: int):
    return st.lists(st.sampled_from([EOS, 7, 8, 9]), min_size=n, max_size=n)


def make_scheduler(mode: str, max_batch: int, min_requests: int, budget: int | None = None,
                   num_blocks: int | None = None, block_size: int = 4, prefix_caching: bool = False,
                   fuse: bool = False, order: PrefillOrder = PrefillOrder.SHORTEST, max_len: int = MAX_LEN
                   ) -> Scheduler:
    """num_blocks: blocks per model (None: enough that no pool runs short); fuse: fused prefill; order: who takes
    the prefill budget first."""
    max_running = 2 * max_batch if mode == "psd" else max_batch
    sched = Scheduler(SchedulerConfig(mode, max_batch, max_running, max_running, min_requests, "psd", "psd",
                                      budget, fuse_prefill=fuse, k=K, prefix_caching=prefix_caching,
                                      prefill_order=order))
    sched.drafter_alive = mode in ("psd", "sd_split")
    per_slot = -(-(max_len + HEADROOM) // block_size)
    spec = KVPoolSpec(num_blocks or max_running * per_slot + 1, block_size, per_slot)
    sched.attach_kv(spec, None if mode == "ar" else spec, max_len)
    return sched


def run_events(mode, max_batch, min_requests, events, emit, budget=None, schedule_after_prefill=True,
               **pools) -> Driver:   # pools: make_scheduler's keywords (fuse too)
    """Play the events, then drain; emit(num_drafts) -> a verify row's tokens."""
    driver = Driver(make_scheduler(mode, max_batch, min_requests, budget, **pools), schedule_after_prefill)
    for event in events:
        kind, *args = event
        if kind == "arrive":
            driver.arrive(*args)
        elif kind == "complete":
            driver.complete(emit)
        elif kind == "abort":
            driver.abort(args[0])
        elif kind == "abort_running":
            running = [s for b in driver.sched.batches for s in b if not s.request.finished]
            if running:
                driver.abort(driver.states.index(running[args[0] % len(running)]))
        elif kind == "stop_string":
            driver.stop_string(args[0])
        elif kind == "drafter_fault":
            driver.drafter_fault()
        elif kind == "drafter_back":
            driver.drafter_back()
        elif kind == "regime":
            driver.sched.config.psd_low_load, driver.sched.config.psd_high_load = args
        elif kind == "chunk_limit":
            driver.sched.chunk_limit = args[0]
        check_all(driver)
    driver.drafter_back()
    driver.drain(emit)
    check_all(driver)
    # every request finished exactly once (finish asserts the once), and nothing is held
    assert set(driver.finished) == {s.id for s in driver.states}
    assert driver.sched.slots.num_used == 0
    assert not driver.inflight and driver.sched.queued == [0, 0]
    check_drained_blocks(driver)
    return driver


def drawn(data):
    """emit from hypothesis' draws."""
    return lambda num_drafts: data.draw(tokens(num_drafts))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_batch=st.integers(1, 4), min_requests=st.integers(2, 3), budget=BUDGETS, order=ORDERS,
       events=st.lists(WITH_CHUNK_LIMITS, min_size=30, max_size=150), data=st.data())
def test_psd_invariants_hold_through_random_events(max_batch, min_requests, budget, order, events, data):
    run_events("psd", max_batch, min_requests, events, drawn(data), budget, order=order)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["sd_split", "sd", "ar"]), max_batch=st.integers(1, 4), budget=BUDGETS, order=ORDERS,
       events=st.lists(WITH_CHUNK_LIMITS, min_size=10, max_size=80), data=st.data())
def test_single_chain_invariants_hold_through_random_events(mode, max_batch, budget, order, events, data):
    run_events(mode, max_batch, 2, events, drawn(data), budget, order=order)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["psd", "sd_split", "sd", "ar"]), max_batch=st.integers(1, 4), budget=FUSED_BUDGETS,
       events=st.lists(WITH_CHUNK_LIMITS, min_size=10, max_size=100), data=st.data())
def test_fused_prefill_invariants_hold_through_random_events(mode, max_batch, budget, events, data):
    """Every invariant above with the chunk riding inside the verify's launch, at budgets that fit no verify, a few
    rows, or whole prompts: no fused launch over the budget, no request verified in its own chunk's launch."""
    run_events(mode, max_batch, 2, events, drawn(data), budget, fuse=True)


@st.composite
def verify_rows(draw):
    """A verify row's drafts (0: none) and its emitted tokens: 1..drafts + 1 of them."""
    num_drafts = draw(st.integers(0, K))
    return num_drafts, draw(st.lists(st.sampled_from([EOS, 7, 8, 9]), min_size=1, max_size=num_drafts + 1))


@settings(max_examples=300, deadline=None)
@given(max_tokens=st.integers(1, 12), stops=st.sets(st.sampled_from([EOS, 7]), max_size=2),
       rows=st.lists(verify_rows(), max_size=8))
def test_a_commit_keeps_a_rows_tokens_up_to_its_first_stop_or_max_tokens(max_tokens, stops, rows):
    """commit_tokens (Request.append, sliced) against the cut read token by token: a row's tokens are kept up to and
    including the first stop id, or up to max_tokens (a stop id that is the last token allowed is a stop), its
    logprobs with them; a finished request gets no more rows (the manager drops them). Its acceptance counts:
    draft position j of a drafted row was accepted when the row emitted more than j + 1 tokens."""
    r = Request([2, 3], SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=tuple(stops)))
    out, reason, drafted, accepted = [], None, [0] * K, [0] * K
    for step, (num_drafts, toks) in enumerate(rows):
        if reason is not None:
            break
        logprobs = [{tok: -float(step * 10 + i)} for i, tok in enumerate(toks)]
        kept = commit_tokens([r], [toks], [logprobs], [num_drafts])[0]
        expected = []
        for tok in toks:
            expected.append(tok)
            if tok in stops:
                reason = "stop"
                break
            if len(out) + len(expected) >= max_tokens:
                reason = "length"
                break
        assert kept == expected, (out, toks)
        assert r.logprobs[len(out):] == logprobs[:len(expected)]
        out += expected
        assert r.output_ids == out and r.finish_reason == reason and len(out) <= max_tokens
        for j in range(num_drafts):
            drafted[j] += 1
            accepted[j] += j < len(toks) - 1
    n = max((j + 1 for j in range(K) if drafted[j]), default=0)
    assert r.stats.drafted_per_position == drafted[:n] and r.stats.accepted_per_position == accepted[:n]


@pytest.mark.parametrize("mode", ["psd", "sd_split", "sd", "ar"])
def test_chunks_ride_inside_verifies_while_requests_decode(mode):
    """Not vacuous: with requests decoding, later prompts' chunks ride inside verifies (and while nothing decodes
    they go on their own, back to back); a budget no verify leaves room in keeps every chunk its own task."""
    def fused_verifies(budget):
        events = [("arrive", 3, 12, False)] + [("complete",)] * 3 + [("arrive", 20, 4, False)] + [("complete",)] * 6
        driver = run_events(mode, 2, 2, events, seeded(1), budget, fuse=True)
        return sum(v[-1] for _, _, verifies in driver.plans for v in verifies)
    assert fused_verifies(13) > 0
    assert fused_verifies(1) == 0


def chunk_sizes(limit: ChunkLimit | None) -> list[int]:
    """sd, fused, budget 16: eight requests decode, whose verify (8 rows x (k + 1) tokens) fills the budget, so a
    30-token prompt's chunks go as tasks of their own -> their sizes, under `limit`."""
    driver = Driver(make_scheduler("sd", 9, 1, budget=16, fuse=True, max_len=40))
    emit = lambda num_drafts: [7] * (num_drafts + 1)   # noqa: E731
    for _ in range(8):
        driver.arrive(3, 34, False)
    for _ in range(6):
        driver.complete(emit)
    driver.sched.chunk_limit = limit
    driver.arrive(30, 2, False)
    sizes, seen = [], []   # the tasks themselves, held: a finished task's id may be reused by a later one
    while not driver.states[-1].request.output_ids:
        for task in driver.inflight:
            if not any(task is t for t in seen):
                seen.append(task)
                if isinstance(task, PrefillPlan):
                    sizes.append(task.num_tokens)
        driver.complete(emit)
    return sizes


def test_an_adaptive_limit_on_a_chunk_of_its_own_leaves_out_no_verify():
    """The limit is on the launch that carries the chunk: the verify's tokens come off it only where the chunk rides
    in the verify's launch. A chunk of its own (the verify fills the budget) keeps the whole limit; it took the
    floor when they came off it anyway (a cold review found it)."""
    assert chunk_sizes(None) == chunk_sizes(ChunkLimit(16, 1)) == [16, 14]
    assert chunk_sizes(ChunkLimit(8, 1)) == [8, 8, 8, 6]


def test_a_prompt_s_chunks_shrink_as_they_start_deeper():
    """The scheduler hands the limit where the chunk's tokens would start (their prior keys): 16 tokens fit at the
    start; 16 tokens in, 16 x 16 prior keys add 2.56 ms to a 16-token launch's 1.0 and 8 x 16 add 1.28 to an 8's,
    both past the 2.0 allowed, 4 x 16 add 0.64; from 28 in nothing fits and the smallest class goes."""
    limit = ChunkLimit(16, 1, prices=(ClassPrice(4, 1.0), ClassPrice(8, 1.0), ClassPrice(16, 1.0)), key_ms=0.01,
                       allowed_ms=2.0)
    assert chunk_sizes(limit) == [16, 4, 4, 4, 2]


def prefill_waits(order: PrefillOrder, shorts: int, short_len: int, every_step: bool) -> list[int]:
    """ar, fused, budget 16, one request decoding: a 150-token prompt is admitted, then `shorts` prompts of
    `short_len` tokens (all with the long one's first chunk in flight, or one per step) -> the schedule calls from
    the long one's first chunk until each prompt's last chunk is planned, the long one's first."""
    driver = Driver(make_scheduler("ar", 8, 2, budget=16, fuse=True, order=order, max_len=200),
                    schedule_after_prefill=False)
    one = lambda num_drafts: [7]   # noqa: E731
    driver.arrive(3, 150, False)   # decodes throughout
    for _ in range(3):
        driver.complete(one)
    driver.arrive(150, 4, False)
    driver.complete(one)           # its first chunk is planned
    start, planned_at = len(driver.plans), {}
    for step in range(200):
        if step < shorts and (every_step or step == 0):
            for _ in range(1 if every_step else shorts):
                driver.arrive(short_len, 1, False)
        driver.complete(one)
        for s in driver.states[1:]:
            if id(s) not in planned_at and s.prefill_len and driver.planned.get(id(s)) == s.prefill_len:
                planned_at[id(s)] = len(driver.plans) - start
    return [planned_at[id(s)] for s in driver.states[1:]]


def test_a_short_prompt_behind_a_long_one_waits_for_its_chunks_only_in_arrival_order():
    """The fused engines' TTFT tail, reproduced: a long prompt takes the budget chunk after chunk, so in arrival
    order a short prompt admitted behind it waits for all of its chunks (its TTFT then holds the long prompt's
    prefill); `shortest` gives the short one the next step's budget, and the long one finishes one step later."""
    arrival = prefill_waits(PrefillOrder.ARRIVAL, 1, 6, every_step=False)
    shortest = prefill_waits(PrefillOrder.SHORTEST, 1, 6, every_step=False)
    assert arrival[1] >= 9 and shortest[1] == 1, (arrival, shortest)
    assert shortest[0] == arrival[0] + 1, (arrival, shortest)


def test_the_long_prompt_is_not_starved_by_a_stream_of_short_ones():
    """One short prompt a step, each filling what the step's verify leaves of the budget: shortest-first alone
    would plan none of the long prompt while they keep coming (40 steps); it is due once they have overtaken it by
    a budget's tokens, and then goes first, so it finishes at most two steps later than first come, first served
    would finish it (the overtaking bound itself is checked on every plan: check_overtaking)."""
    waits = prefill_waits(PrefillOrder.SHORTEST, 40, 15, every_step=True)
    arrival = prefill_waits(PrefillOrder.ARRIVAL, 40, 15, every_step=True)
    assert waits[0] <= arrival[0] + 2, (waits, arrival)


def seeded(seed: int):
    """emit from a seeded generator: two runs that emit alike get the same tokens."""
    rng = random.Random(seed)
    return lambda num_drafts: [rng.choice([EOS, 7, 8, 9]) for _ in range(rng.randint(1, num_drafts + 1))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["psd", "sd_split", "sd", "ar"]), max_batch=st.integers(1, 4),
       events=st.lists(EVENTS, min_size=10, max_size=100), seed=st.integers(0, 2 ** 16))
def test_a_budget_the_prompts_fit_plans_what_whole_prompts_plan(mode, max_batch, events, seed):
    """Chunking costs nothing where it cuts nothing: with a budget that every prompt waiting at once fits (psd's
    split halves it), each schedule call plans the very prefill tasks, chunks, verifies and rounds that the
    unchunked scheduler plans, no task more and no prompt later."""
    fits = 2 * sum(e[1] for e in events if e[0] == "arrive") + 2
    whole = run_events(mode, max_batch, 2, events, seeded(seed))
    chunked = run_events(mode, max_batch, 2, events, seeded(seed), budget=fits)
    assert len(chunked.plans) == len(whole.plans)
    for call, (c, w) in enumerate(zip(chunked.plans, whole.plans)):
        assert c == w, f"schedule call {call}: chunked {c} != whole {w}"


def test_psd_takes_the_whole_budget_while_nothing_decodes():
    """psd's split halves the budget to bound a decoding request's period; from idle nobody decodes, so a burst's
    first prefill takes the whole budget, and once requests decode the chunks get half."""
    sched = make_scheduler("psd", 4, 2, budget=16, fuse=True)
    for _ in range(8):
        sched.arrive(RequestState(Request(list(range(2, 10)), SamplingParams(temperature=0, max_tokens=4,
                                                                             ignore_eos=True), (EOS,))))
    plan = sched.schedule(None)
    assert all(sched.batches) and not sched.one_batch
    assert [p.num_tokens for p in plan.prefills] == [16]
    fused = [v.prefill.num_tokens + len(v.rows) * (K + 1) for v in plan.verifies if v.prefill is not None]
    assert fused == [] and sched.launch_budget() == 8


def chunk_launches(mode: str, batch: int, prompt_lens: list[int], budget: int) -> list[list[int]]:
    """`batch` requests decode (ar, or sd at k = K), then prompts of `prompt_lens` tokens arrive one after the
    other, each once the one before has its first token; the manager schedules after every verify (and when
    nothing is in flight) -> for each prompt, the tokens of the packed launches its chunks made, in order: a fused
    verify's (its rows' and the chunk's) or a chunk's alone."""
    width = 1 if mode == "ar" else K + 1
    sched = make_scheduler(mode, batch + 1, 2, budget, block_size=64, fuse=True, max_len=max(prompt_lens) + 64)
    driver = Driver(sched, schedule_after_prefill=False)
    accept_all = lambda num_drafts: [7] * (num_drafts + 1)   # noqa: E731
    for _ in range(batch):
        driver.arrive(1, 120, False)
    while not all(s.ready and s.request.output_ids for s in driver.states):
        driver.complete(accept_all)
    launches, schedule = [], sched.schedule

    def recording(committed):
        plan = schedule(committed)
        launches.extend(len(v.rows) * width + v.prefill.num_tokens for v in plan.verifies if v.prefill is not None)
        launches.extend(p.num_tokens for p in plan.prefills)
        return plan
    sched.schedule = recording
    per_prompt = []
    for n in prompt_lens:
        driver.arrive(n, 1, False)
        prompt = driver.states[-1]
        while not prompt.request.finished:
            driver.complete(accept_all)
        per_prompt.append(launches[:])
        launches.clear()
    assert not any(s.request.finished for s in driver.states[:batch]), "a decoding request finished: rows changed"
    return per_prompt


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_chunk_launches_fill_the_gpu_default_budget_and_pad_little(mode):
    """At the GPU's default per-step budget and batch sizes up to 256: while requests decode, a long prompt's chunks
    fill every launch to exactly the budget (fused: the verify's rows plus the chunk, the chunk being the budget less
    the rows; alone where the rows fill the budget), which is a graph bucket, so only the launch of its last chunk
    can pad, and that one, of any size, pads to its bucket by fewer than 64 tokens up to 384 and 128 above (where
    a launch's time grows with its tokens: runner.PACKED_GRAPH_TOKENS)."""
    from minedraft_ray.engine.runner import PACKED_GRAPH_TOKENS, token_bucket
    from minedraft_ray.runtime.manager import default_prefill_chunk

    budget = default_prefill_chunk(on_gpu=True)
    width = 1 if mode == "ar" else K + 1
    for batch in (1, 16, 64, 100, 128, 256):
        rows = batch * width
        fused = rows < budget
        # the last launch's tokens: two full launches, then one of `last` tokens
        lasts = [n for n in (300, 449, 511) if n > rows] if fused else [300, 449]
        prompts = [2 * (budget - rows) + last - rows if fused else 2 * budget + last for last in lasts]
        for last, launches in zip(lasts, chunk_launches(mode, batch, prompts, budget)):
            assert launches == [budget, budget, last], (batch, launches)
            padded = token_bucket(last, PACKED_GRAPH_TOKENS)
            assert padded - last < (64 if last <= 384 else 128), \
                f"batch {batch}: a launch of {last} tokens runs as {padded}"


def test_psd_splits_and_rebalances_a_burst():
    """A plain run: psd with the split forced holds 2 x max_batch, in two batches that stay balanced as
    requests of different lengths finish, and every request is drafted in every verify it rides."""
    sched = make_scheduler("psd", 3, 2)
    driver = Driver(sched)
    for n in range(10):
        driver.arrive(3, 2 + 3 * n % 11, False)
    splits = 0
    for _ in range(400):
        if not (driver.inflight or sched.waiting or sched.num_running()):
            break
        driver.complete(lambda num_drafts: [7] * (num_drafts + 1))   # every draft accepted
        check_all(driver)
        splits += not sched.one_batch and all(sched.batches)
    assert splits > 0 and len(driver.finished) == 10 and sched.slots.num_used == 0


@pytest.mark.parametrize("mode", ["psd", "sd_split"])
def test_committed_plans_are_freed_while_the_chains_run(mode):
    """A step's plans are garbage once committed, freed by reference counting alone: no plan keeps the plans
    before it (a round drafted ahead once referenced its verify, which references the round before it, and so on:
    every plan of a batch since it started stayed reachable, each round's Ray objects with it, and freed only by
    the cyclic collector once the batch emptied)."""
    sched = make_scheduler(mode, 2, 2)
    driver = Driver(sched)
    for _ in range(4):
        driver.arrive(3, MAX_LEN - 3 - HEADROOM, False)   # long requests: the chains run unbroken
    planned = []
    schedule = sched.schedule

    def recording(committed):
        plan = schedule(committed)
        planned.extend(weakref.ref(p) for v in plan.verifies for p in (v, v.ahead, v.fresh, v.next_round)
                       if p is not None)
        return plan
    sched.schedule = recording
    gc.disable()   # what outlives its step without the collector
    try:
        for _ in range(40):
            driver.complete(lambda num_drafts: [7])   # one token per verify: many steps
        live = sum(ref() is not None for ref in planned)
    finally:
        gc.enable()
    assert len(planned) > 60 and live <= 8, (len(planned), live)


# ---- purity ----------------------------------------------------------------------------------------------
def _project_imports(module: pathlib.Path, seen: set) -> set:
    """Top-level module names imported by `module` and the project modules it imports, transitively."""
    if module in seen:
        return set()
    seen.add(module)
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: follow it inside the project
                base = module.parent
                for _ in range(node.level - 1):
                    base = base.parent
                target = base.joinpath(*(node.module or "").split("."))
                for path in (target.with_suffix(".py"), target / "__init__.py"):
                    if path.exists() and path.name != "__init__.py":
                        names |= _project_imports(path, seen)
            else:
                names.add(node.module.split(".")[0])
    return names


def test_scheduler_imports_neither_ray_nor_asyncio():
    imports = _project_imports(ROOT / "minedraft_ray/runtime/scheduler.py", set())
    assert "ray" not in imports and "asyncio" not in imports, imports
    # and at run time: the module loads without Ray (the runtime package's __init__ left out)
    code = ("import sys, types, pathlib, minedraft_ray\n"
            "pkg = types.ModuleType('minedraft_ray.runtime')\n"
            "pkg.__path__ = [str(pathlib.Path(minedraft_ray.__file__).parent / 'runtime')]\n"
            "sys.modules['minedraft_ray.runtime'] = pkg\n"
            "import minedraft_ray.runtime.scheduler\n"
            "assert 'ray' not in sys.modules, 'ray was imported'\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
