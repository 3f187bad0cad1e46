"""What the manager records per step, and the declared snapshot metrics and info read."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .chunk_budget import PromptLaunch


@dataclass
class StepRecord:
    """One step, for tests, benchmarks and metrics."""
    regime: str                      # psd | seq | sd | ar
    sizes: tuple[int, int]           # batch sizes after the step (psd: A, B)
    verified: int
    drafted: int
    t_draft_ms: float = 0.0
    t_verify_ms: float = 0.0
    t_prefill_ms: float = 0.0        # verifier device time of the prefill of admitted requests
    prefill_tokens: int = 0          # prompt tokens prefilled in this cycle (fused into the verify or before it)
    prefill_launches: tuple[PromptLaunch, ...] = ()   # each launch that carried them
    chunk_limit: int | None = None   # the adaptive chunk's launch tokens for the steps after this one, if on
    chunk_key_ms: float | None = None   # and what it prices a prior key at (a deep chunk's cost)
    chunk_margin: float | None = None   # and the margin its predicted cycles take (what they missed by)
    step_ms: float = 0.0
    host_ms: float = 0.0             # manager time in the step not spent waiting on actors
    launch_gap_ms: float = 0.0       # verifier: start of this task - end of the previous verify
    cadence_ms: float | None = None  # end of the batch's previous verify -> end of this one (a request's period)
    emitted: int = 0
    accepted: int = 0
    draft_tokens: int = 0
    admitted: int = 0
    batch: int = 0                   # the batch verified (psd, sd_split: 0 = A, 1 = B; otherwise 0)
    streamed: int = 0                # rows whose tokens went to their streams (not those of requests ended meanwhile)
    joined: int = 0                  # requests given their first token by a prefill since the previous step
    t_emit: float = 0.0              # wall clock when its tokens were handed to the requests' streams
    extra: dict = field(default_factory=dict)

    @property
    def ms_per_row(self) -> float:
        """The verifier's wall time per row advanced, prefills left out (every request is prefilled once in
        either regime): what psd's high-load choice compares (runtime/regime.py)."""
        return (self.step_ms - self.t_prefill_ms) / self.verified


@dataclass
class RegimeSteps:
    """The regimes verify steps ran in at one load (psd's info reports these, not what a chooser would pick)."""
    steps: Counter = field(default_factory=Counter)
    last: str | None = None

    def add(self, regime: str) -> None:
        self.steps[regime] += 1
        self.last = regime


@dataclass(frozen=True)
class KVPoolStats:
    """One model's KV pool: blocks (the null block not counted), blocks held by requests, and the prefix cache's
    tokens found / looked up so far."""
    model: str                       # target | draft
    blocks: int
    blocks_in_use: int
    hit_tokens: int
    query_tokens: int


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state as metrics read it after a step."""
    k: int
    waiting: int
    running: int
    batch_sizes: tuple[int, int]
    slots_in_use: int
    num_slots: int
    drafter_alive: bool
    kv_pools: tuple[KVPoolStats, ...] = ()
    preemptions: int = 0             # so far
