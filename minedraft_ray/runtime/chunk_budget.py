"""The prompt chunk a step may carry while requests decode, sized from the engine's own step times
(`chunk_gap_ratio`): a running request waits one verifier cycle per output, so a cycle that carries a chunk should
take at most ratio x one that does not.

What a chunk adds to its cycle is priced per launch class, not per token: a launch is padded to its token
bucket (the CUDA graph it replays: engine/launch_buckets.py), so its time is a step function of its tokens, with a
jump where the launch leaves the decode path (on an H200 a fused launch padded to 128 tokens costs nearly what one
padded to 256 does). A per-token price learnt from one size misprices the next, and a chunk sized from it swings
between a bucket that fits and one that does not, the second's cycles overrunning the ratio. So each class is priced
by the time its last few launches added (the cycle less the base, the moving average of cycles without a chunk;
their median, so one stalled cycle does not reprice a class in use, and a rising cost is followed closely), and the
next chunk's launch is the largest class whose time fits (ratio - 1) x base. A class not yet run is priced as the
nearest one below it (optimistic, as a launch costs no less for holding more: it is then tried, once, and known),
or with none below, as the nearest above scaled down to its tokens; so is one not run for `stale_after` chunk
cycles, since it may have been measured in a stall or at another batch: the class above the one in use is tried
again about that often. Nothing measured: the configured budget. The same classes price an unpadded launch (no
graphs, the CPU), whose time grows smoothly: a coarser grid, not a wrong one.

The limit is on the launch that carries the chunk: with fused chunks the verify's tokens and the chunk's (the
scheduler takes the verify's out), otherwise the chunk's own. A chunk never goes below `floor` tokens, so prompts
progress whatever the times say.

Under a steady stream of prompts every cycle carries a chunk and the base would age while the batch grows (the
rows' added time then charged to the chunk, which shrinks it, which keeps prompts waiting, which keeps every
cycle carrying one): after `probe_every` cycles with chunks, one step carries none and measures the base afresh.

Pure: the manager feeds it each verify's cycle and the launches in it that carried prompt tokens, and hands the
scheduler `next_limit()` (Scheduler.chunk_limit)."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..engine.launch_buckets import PACKED_GRAPH_TOKENS, token_bucket

RECENT = 3   # a class's last cycles, whose median prices it
# below the smallest graph, doublings: a small budget (a test's, a small CPU model's) still has sizes to choose from
LAUNCH_CLASSES = tuple(n for n in (1, 2, 4, 8) if n < PACKED_GRAPH_TOKENS[0]) + PACKED_GRAPH_TOKENS


@dataclass(frozen=True)
class ChunkLimit:
    """What the next step's prompt chunk may take while requests decode."""
    launch_tokens: int    # the launch that carries it holds at most these (fused: with the verify's); 0: no chunk
    floor: int            # prompt tokens it may take whatever the launch holds (prompts progress)
    probe: bool = False   # a step without a chunk, which measures the base (launch_tokens: the size after it)

    def chunk_tokens(self, verify_tokens: int) -> int:
        """Prompt tokens of a chunk riding a launch with `verify_tokens` of a verify (0: its own launch)."""
        if self.probe or self.launch_tokens == 0:
            return 0
        return max(self.floor, self.launch_tokens - verify_tokens)


@dataclass
class ClassCost:
    recent: tuple[float, ...]    # what the last few of this class's launches added to their cycles
    seen_at: int                 # the chunk cycle that last ran one

    @property
    def added_ms(self) -> float:
        """Their median: one cycle stalled by something else does not reprice the class, and a cost that keeps
        rising (a chunk deep in a long prompt attends to more keys each step) is followed a cycle behind."""
        return statistics.median(self.recent)


@dataclass
class ChunkBudget:
    cap: int                            # launch tokens at most (the configured budget, prefill_chunk_tokens)
    ratio: float                        # a cycle with a chunk takes at most this many times one without
    floor: int                          # prompt tokens per chunk at least, whatever the times say
    classes: tuple[int, ...]            # launch sizes priced alike (the token buckets up to the cap), ascending
    smoothing: float = 0.5              # weight of the newest cycle in the base's moving average
    probe_every: int = 16               # cycles with chunks before one without re-measures the base
    stale_after: int = 256              # chunk cycles after which a class's price is estimated again
    base_ms: float | None = None        # a verifier cycle without a prompt chunk
    costs: dict[int, ClassCost] = field(default_factory=dict)
    chunk_cycles: int = 0               # cycles with chunks, all told
    since_base: int = 0                 # cycles with chunks since the last one without

    @classmethod
    def for_budget(cls, cap: int, ratio: float, buckets: tuple[int, ...] = LAUNCH_CLASSES) -> ChunkBudget:
        return cls(cap, ratio, floor=max(1, cap // 32), classes=tuple(b for b in buckets if b < cap) + (cap,))

    def observe(self, cycle_ms: float, launches: Sequence[int]) -> None:
        """One verifier cycle (the end of the previous verify to the end of this one) and the tokens of each launch
        in it that carried prompt tokens (a fused one's with its verify's). A cycle of several (prompts admitted
        back to back while nothing decoded, or a chunk of its own beside a fused one) has no one class to charge:
        it counts for nothing."""
        if not launches:
            self.base_ms = self._average(self.base_ms, cycle_ms)
            self.since_base = 0
            return
        self.since_base += 1
        self.chunk_cycles += 1
        if self.base_ms is None or len(launches) > 1 or launches[0] > self.cap:
            return
        c = token_bucket(launches[0], self.classes)
        # signed: a chunk measured as free (a base taken in a stall) averages out rather than being dropped
        added = cycle_ms - self.base_ms
        known = self.costs.get(c)
        recent = (added,) if known is None or self._stale(known) else (*known.recent, added)[-RECENT:]
        self.costs[c] = ClassCost(recent, self.chunk_cycles)

    def next_limit(self) -> ChunkLimit:
        """The next step's: `limit()`, and a probe step (no chunk) when the base is `probe_every` chunk cycles
        old."""
        return ChunkLimit(self.limit(), self.floor, probe=self.since_base >= self.probe_every)

    def limit(self) -> int:
        """Launch tokens the next chunk's launch may hold: the largest class whose added time fits the ratio (the
        smallest where none does; the cap until a base is measured)."""
        if self.base_ms is None:
            return self.cap
        allowed_ms = (self.ratio - 1.0) * self.base_ms
        known = self._fresh_prices()
        for c in reversed(self.classes):
            estimate = self.estimate(c, known)
            if estimate is None or estimate <= allowed_ms:
                return c
        return self.classes[0]

    def estimate(self, c: int, known: dict[int, float] | None = None) -> float | None:
        """What a launch of class c adds: measured, or else the nearest fresh class below's (optimistic, as a
        launch costs no less for holding more: the class is then tried and known), or else the nearest above's
        scaled down in proportion to its tokens; None: nothing measured. known: `_fresh_prices()`, when at hand."""
        known = self._fresh_prices() if known is None else known
        if c in known:
            return known[c]
        below = max((k for k in known if k < c), default=None)
        if below is not None:
            return known[below]
        above = min((k for k in known if k > c), default=None)
        return known[above] * c / above if above is not None else None

    def _fresh_prices(self) -> dict[int, float]:
        return {k: v.added_ms for k, v in self.costs.items() if not self._stale(v)}

    def _stale(self, cost: ClassCost) -> bool:
        return self.chunk_cycles - cost.seen_at >= self.stale_after

    def _average(self, mean: float | None, value: float) -> float:
        return value if mean is None else mean + self.smoothing * (value - mean)
