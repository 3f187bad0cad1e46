"""The prompt chunk a step may carry while requests decode, sized from the engine's own step times
(`chunk_gap_ratio`): a verifier cycle with a chunk of n prompt tokens takes about base + n x per_token, and a
running request waits one cycle per output, so the chunk that keeps its gap within ratio x base is
(ratio - 1) x base / per_token tokens. Both terms are measured as the engine runs (moving averages over its
cycles: those without a chunk give the base, those with one the time a chunk's tokens add), so the chunk follows
the batch's rows, the mode's verify width and the device, where a fixed token budget fits one of them. Bounded
by the configured budget (prefill_chunk_tokens) above and by a floor below, so prompts always progress.

Under a steady stream of prompts every cycle carries a chunk and the base would age while the batch grows (the
rows' added time then charged to the chunk, which shrinks it, which keeps prompts waiting, which keeps every
cycle carrying one): after `probe_every` cycles with chunks, one step carries none (`probe_due`) and measures the
base afresh.

Pure: the manager feeds it each verify's cycle and the prompt tokens prefilled in it, and hands the scheduler
`limit()`, or 0 on a probe step (Scheduler.chunk_limit)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ChunkBudget:
    cap: int                            # prompt tokens per step at most (the configured budget)
    ratio: float                        # a cycle with a chunk takes at most this many times one without
    floor: int                          # prompt tokens per step at least, whatever the times say
    smoothing: float = 0.2              # weight of the newest cycle in the moving averages
    probe_every: int = 16               # cycles with chunks before one without re-measures the base
    base_ms: float | None = None        # a verifier cycle without a prompt chunk
    extra_ms: float | None = None       # what a chunk added to its cycle (signed: noise averages out)
    chunk_tokens: float | None = None   # the prompt tokens of those chunks
    since_base: int = 0                 # cycles with chunks since the last one without

    @classmethod
    def for_budget(cls, cap: int, ratio: float) -> ChunkBudget:
        return cls(cap, ratio, floor=max(1, cap // 32))

    def observe(self, cycle_ms: float, prompt_tokens: int) -> None:
        """One verifier cycle (the end of the previous verify to the end of this one) and the prompt tokens
        prefilled in it (a chunk fused into the verify, or prefill launches before it)."""
        if prompt_tokens == 0:
            self.base_ms = self._average(self.base_ms, cycle_ms)
            self.since_base = 0
            return
        self.since_base += 1
        if self.base_ms is not None:
            # averages of the added time and of the tokens, not of their ratio: a small chunk's few tokens
            # would otherwise weigh its cycle's noise as much as a full chunk's
            self.extra_ms = self._average(self.extra_ms, cycle_ms - self.base_ms)
            self.chunk_tokens = self._average(self.chunk_tokens, prompt_tokens)

    def probe_due(self) -> bool:
        """The next step should carry no chunk: the base is `probe_every` chunk cycles old (or never measured)."""
        return self.since_base >= self.probe_every

    def limit(self) -> int:
        """Prompt tokens the next step's chunk may hold while requests decode (the cap until both terms are
        measured, and while chunks measure as free)."""
        if self.base_ms is None or self.extra_ms is None or not self.chunk_tokens:
            return self.cap
        allowed_ms = (self.ratio - 1.0) * self.base_ms
        if self.extra_ms * self.cap <= allowed_ms * self.chunk_tokens:   # per token <= allowed / cap: the cap fits
            return self.cap
        per_token = self.extra_ms / self.chunk_tokens
        return max(self.floor, min(self.cap, int(allowed_ms / per_token)))

    def _average(self, mean: float | None, value: float) -> float:
        return value if mean is None else mean + self.smoothing * (value - mean)
