"""The prompt chunk a step may carry while requests decode, sized from the engine's own step times
(`chunk_gap_ratio`): a running request waits one verifier cycle per output, so a cycle that carries a chunk should
take at most ratio x one that does not.

What a chunk adds to its cycle is priced per launch class, not per token: a launch is padded to its token bucket (the
CUDA graph it replays: engine/launch_buckets.py), so its time is a step function of its tokens, with a jump where the
launch leaves the decode path (on an H200 a fused launch padded to 128 tokens costs nearly what one padded to 256
does). A per-token price learnt from one size misprices the next, and a chunk sized from it swings between a bucket
that fits and one that does not, the second's cycles overrunning the ratio. So each class is priced by the time its
last few launches added (the cycle less the base, the moving average of cycles without a chunk; their median, so one
stalled cycle does not reprice a class in use, and a rising cost is followed closely), and the next chunk's launch is
the largest class whose time fits ratio x reference - base (the reference: the base, or below). A class not yet run
is priced as the nearest one below it (optimistic, as a launch costs no less for holding more: it is then tried,
once, and known), or with none below, as the nearest above scaled down to its tokens; so is one not run for
`stale_after` chunk cycles, since it may have been measured in a stall or at another batch: the class above the one
in use is tried again about that often. Nothing measured: the configured budget. The same classes price an unpadded
launch (no graphs, the CPU), whose time grows smoothly: a coarser grid, not a wrong one.

A chunk deep in a long prompt costs more than one at its start with the same tokens: its queries attend to every
key before them, so its time grows with its tokens x their depth, and a class priced at one depth misprices it at
another (the cost of a long prompt's chunks of one class rose by half over its prompt on an H200, and the classes
below, priced near depth 0, overran the ratio in turn). So a launch's added time is modelled as its class's price
plus `key_ms` per prior key (a chunk's tokens x its start: the keys before its own that its queries read), `key_ms`
the median of the slopes between launches of one class at different depths (Theil-Sen: robust to a stalled
cycle), a class's price the median of its recent launches' times less their depth's share. The scheduler, which
knows where each prompt's next chunk starts, asks the limit for the largest class whose price plus its chunk's
depth fits.

The prices are medians, so about half the cycles they size run over what they were sized to, and a cycle without a
chunk varies by itself (the base is an average): a limit sized to the ratio would hold it at the median cycle, not at
the tail the ratio is meant for. So the budget also keeps what its own predictions missed by: each cycle of a class
already priced is compared with the cycle predicted for it (the base plus the class's price at the chunk's depth),
and a class fits when its predicted cycle times the `MARGIN_QUANTILE` of the last `ERRORS` such ratios (`margin`, at
least 1) is within ratio x the reference. A model that predicts well keeps its chunks; one that misses widely takes
smaller ones, as much smaller as it misses. A cycle more than `STALL` x its prediction was stalled by something a
chunk does not cause (a Ray turnaround, a collection) and is left out, as the prices' medians leave it out: a smaller
chunk would not have shortened it.

The limit is on the launch that carries the chunk: with fused chunks the verify's tokens and the chunk's (the
scheduler takes the verify's out), otherwise the chunk's own. A chunk never goes below `floor` tokens, so prompts
progress whatever the times say.

The base follows the batch, so while prompts arrive (the batch larger than usual) it is held to ratio x a longer
cycle than a running request usually waits. With `typical_window` the reference is the shorter of the base and
the median cycle without a chunk over the last `typical_window` cycles: a chunk cycle is held to ratio x what a
request typically waits, at the cost of smaller chunks while the batch is larger than usual.

Under a steady stream of prompts every cycle carries a chunk and the base would age while the batch grows (the
rows' added time then charged to the chunk, which shrinks it, which keeps prompts waiting, which keeps every
cycle carrying one): after `probe_every` cycles with chunks, one step carries none and measures the base afresh.

Pure: the manager feeds it each verify's cycle and the launches in it that carried prompt tokens, and hands the
scheduler `next_limit()` (Scheduler.chunk_limit)."""
from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..engine.launch_buckets import PACKED_GRAPH_TOKENS, token_bucket

RECENT = 3   # a class's last cycles, whose median prices it
DEPTH_SAMPLES = 8   # a class's last cycles, whose pairs at different depths give key_ms's slopes
SLOPES = 64         # the newest slopes, whose median is key_ms
MIN_SPREAD = 0.25   # a pair's prior keys differ by at least this share of the larger, or its slope is noise
ERRORS = 32             # the newest cycles measured against their prediction, whose quantile is the margin
MIN_ERRORS = 16         # fewer: no margin (1)
STALL = 1.5             # a cycle above this many times its prediction was stalled: not a prediction's miss
MARGIN_QUANTILE = 0.9   # of the measured / predicted cycle ratios: the margin a class's predicted cycle takes
TYPICAL_CYCLES = 256    # chunk_gap_reference "typical": the cycles whose median without a chunk is the typical one
# below the smallest graph, doublings: a small budget (a test's, a small CPU model's) still has sizes to choose from
LAUNCH_CLASSES = tuple(n for n in (1, 2, 4, 8) if n < PACKED_GRAPH_TOKENS[0]) + PACKED_GRAPH_TOKENS


@dataclass(frozen=True)
class PromptLaunch:
    """A launch that carried prompt tokens: all its tokens (a fused one's with its verify's) and its chunks' prior
    keys (each chunk's tokens x its start: the keys before its own that its queries read)."""
    tokens: int
    prior_keys: int = 0


@dataclass(frozen=True)
class ClassPrice:
    launch_tokens: int    # a launch class
    added_ms: float       # what a launch of it adds to its cycle at depth 0


@dataclass(frozen=True)
class ChunkLimit:
    """What the next step's prompt chunk may take while requests decode."""
    launch_tokens: int    # the launch that carries it holds at most these (fused: with the verify's); 0: no chunk
    floor: int            # prompt tokens it may take whatever the launch holds (prompts progress)
    probe: bool = False   # a step without a chunk, which measures the base (launch_tokens: the size after it)
    # the classes up to launch_tokens, ascending, and what a prior key adds: the limit at a chunk's depth
    prices: tuple[ClassPrice, ...] = ()
    key_ms: float = 0.0
    allowed_ms: float = math.inf
    margin: float = 1.0   # what the predicted cycles were scaled by (ChunkBudget.margin): a record of it

    def chunk_tokens(self, verify_tokens: int, prior_keys: Callable[[int], int] | None = None) -> int:
        """Prompt tokens of a chunk riding a launch with `verify_tokens` of a verify (0: its own launch).
        prior_keys(tokens): the prior keys of a chunk of that many tokens (where the prompts it would take stand);
        None: depth 0."""
        if self.probe or self.launch_tokens == 0:
            return 0
        tokens = max(self.floor, self.launch_tokens - verify_tokens)
        if prior_keys is None or self.key_ms <= 0.0 or not self.prices:
            return tokens
        for price in reversed(self.prices):   # the largest class whose time at that depth fits
            tokens = max(self.floor, price.launch_tokens - verify_tokens)
            if price.added_ms + self.key_ms * prior_keys(tokens) <= self.allowed_ms:
                break
        return tokens   # none fits: the smallest class's


@dataclass
class ClassCost:
    recent: tuple[tuple[float, int], ...]   # the last launches of this class: (time added to its cycle, prior keys)
    seen_at: int                            # the chunk cycle that last ran one

    def added_ms(self, key_ms: float) -> float:
        """At depth 0: the median of its last RECENT launches less their depth's share (one cycle stalled by
        something else does not reprice the class; a rising cost the depth does not explain is followed a cycle
        behind)."""
        return statistics.median(added - key_ms * keys for added, keys in self.recent[-RECENT:])


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
    slopes: deque = field(default_factory=lambda: deque(maxlen=SLOPES))   # ms per prior key, newest last
    errors: deque = field(default_factory=lambda: deque(maxlen=ERRORS))   # measured / predicted cycles, newest last
    typical_window: int = 0             # cycles whose median without a chunk caps the reference; 0: the base alone
    quiet: deque = field(default_factory=deque)   # (cycle, ms) of the cycles without a chunk in that window
    quiet_sorted: list = field(default_factory=list)   # their ms, ascending
    cycles: int = 0                     # cycles observed, all told
    chunk_cycles: int = 0               # cycles with chunks, all told
    since_base: int = 0                 # cycles with chunks since the last one without

    @classmethod
    def for_budget(cls, cap: int, ratio: float, buckets: tuple[int, ...] = LAUNCH_CLASSES,
                   typical_window: int = 0) -> ChunkBudget:
        return cls(cap, ratio, floor=max(1, cap // 32), classes=tuple(b for b in buckets if b < cap) + (cap,),
                   typical_window=typical_window)

    def observe(self, cycle_ms: float, launches: Sequence[PromptLaunch]) -> None:
        """One verifier cycle (the end of the previous verify to the end of this one) and each launch in it that
        carried prompt tokens. A cycle of several (prompts admitted back to back while nothing decoded, or a chunk
        of its own beside a fused one) has no one class to charge: it counts for nothing."""
        self.cycles += 1
        if self.typical_window:
            self._track_typical(cycle_ms if not launches else None)
        if not launches:
            self.base_ms = self._average(self.base_ms, cycle_ms)
            self.since_base = 0
            return
        self.since_base += 1
        self.chunk_cycles += 1
        if self.base_ms is None or len(launches) > 1 or launches[0].tokens > self.cap:
            return
        launch = launches[0]
        c = token_bucket(launch.tokens, self.classes)
        # signed: a chunk measured as free (a base taken in a stall) averages out rather than being dropped
        sample = (cycle_ms - self.base_ms, launch.prior_keys)
        known = self.costs.get(c)
        earlier = () if known is None or self._stale(known) else known.recent
        if earlier:   # a class already priced: how far was its prediction off
            predicted = self._predicted(known, launch.prior_keys)
            if 0.0 < predicted and cycle_ms <= STALL * predicted:
                self.errors.append(cycle_ms / predicted)
        added, keys = sample
        self.slopes.extend((added - a) / (keys - k) for a, k in earlier
                           if abs(keys - k) >= MIN_SPREAD * max(keys, k, 1))
        self.costs[c] = ClassCost((*earlier, sample)[-DEPTH_SAMPLES:], self.chunk_cycles)

    def predicted_cycle_ms(self, launch: PromptLaunch) -> float | None:
        """The cycle its class's price predicts for a launch: the base, the price and key_ms per prior key (None:
        no base, or the class not measured or stale)."""
        known = self.costs.get(token_bucket(launch.tokens, self.classes))
        if self.base_ms is None or known is None or self._stale(known):
            return None
        return self._predicted(known, launch.prior_keys)

    def _predicted(self, known: ClassCost, prior_keys: int) -> float:
        key_ms = self.key_ms
        return self.base_ms + known.added_ms(key_ms) + key_ms * prior_keys

    @property
    def margin(self) -> float:
        """What a predicted cycle is scaled by before it is held to the ratio: the MARGIN_QUANTILE of the recent
        measured / predicted ratios, at least 1 (1 until MIN_ERRORS are measured)."""
        if len(self.errors) < MIN_ERRORS:
            return 1.0
        errors = sorted(self.errors)
        return max(1.0, errors[min(len(errors) - 1, int(MARGIN_QUANTILE * len(errors)))])

    @property
    def reference_ms(self) -> float | None:
        """The cycle a chunk cycle is held to ratio x of: the base, or the typical cycle where that is shorter."""
        if self.base_ms is None or self.typical_ms is None:
            return self.base_ms
        return min(self.base_ms, self.typical_ms)

    @property
    def key_ms(self) -> float:
        """What one prior key adds to a launch: the median slope (none measured, or negative: 0)."""
        return max(0.0, statistics.median(self.slopes)) if self.slopes else 0.0

    def next_limit(self) -> ChunkLimit:
        """The next step's: `limit()` at depth 0 with the prices that size a deeper chunk, and a probe step (no
        chunk) when the base is `probe_every` chunk cycles old."""
        probe = self.since_base >= self.probe_every
        if self.base_ms is None:
            return ChunkLimit(self.cap, self.floor, probe)
        key_ms = self.key_ms
        known = self._fresh_prices(key_ms)
        prices = tuple(ClassPrice(c, ms) for c in self.classes if (ms := self.estimate(c, known)) is not None)
        if not prices:
            return ChunkLimit(self.cap, self.floor, probe)
        margin = self.margin
        # margin x (base + added) <= ratio x reference
        allowed_ms = self.ratio * self.reference_ms / margin - self.base_ms
        # depth 0: the largest class that fits (the smallest where none does)
        top = next((i for i in reversed(range(len(prices))) if prices[i].added_ms <= allowed_ms), 0)
        return ChunkLimit(prices[top].launch_tokens, self.floor, probe, prices[:top + 1], key_ms, allowed_ms, margin)

    def limit(self) -> int:
        """Launch tokens the next chunk's launch may hold at depth 0: the largest class whose added time fits the
        ratio (the smallest where none does; the cap until a base is measured)."""
        return self.next_limit().launch_tokens

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

    def _fresh_prices(self, key_ms: float | None = None) -> dict[int, float]:
        key_ms = self.key_ms if key_ms is None else key_ms
        return {k: v.added_ms(key_ms) for k, v in self.costs.items() if not self._stale(v)}

    @property
    def typical_ms(self) -> float | None:
        """The median cycle without a chunk over the window (None: none in it)."""
        ordered, n = self.quiet_sorted, len(self.quiet_sorted)
        if not n:
            return None
        return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2

    def _track_typical(self, quiet_ms: float | None) -> None:
        """The window's cycles without a chunk, kept in order as well (a median per cycle without a sort)."""
        if quiet_ms is not None:
            self.quiet.append((self.cycles, quiet_ms))
            bisect.insort(self.quiet_sorted, quiet_ms)
        while self.quiet and self.quiet[0][0] <= self.cycles - self.typical_window:
            _, ms = self.quiet.popleft()
            del self.quiet_sorted[bisect.bisect_left(self.quiet_sorted, ms)]

    def _stale(self, cost: ClassCost) -> bool:
        return self.chunk_cycles - cost.seen_at >= self.stale_after

    def _average(self, mean: float | None, value: float) -> float:
        return value if mean is None else mean + self.smoothing * (value - mean)
