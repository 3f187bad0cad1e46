"""psd or one sequential batch, at loads one batch holds: chosen by measured per-request cadence.

PSD splits the running requests into two batches that take turns on the verifier, so each request advances
once every two verifies. When every running request fits one batch (at most max_batch), a single sequential
batch (draft, then verify, on the same two GPUs: `sd_split`'s schedule) advances each of them once per
draft + verify + hops instead. Which is faster depends on the pair, k and the host: psd wins when a verify
outlasts drafting plus the sequential step's Ray hops, and loses otherwise (2x H200, 8B/1B, k=2: psd's
P50 latency was 1.15-1.52x sd_split's at 30-90 % load at adac596; bench/results/psd_vs_sd_analysis.md). So the manager
measures both: the cadence of a request is the time between two ends of its batch's verifies, averaged per
regime over steps at such loads, and the regime without a recent measurement is tried for a few steps now
and then (both regimes are lossless, so trying costs time only).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RegimeChooser:
    explore_every: int = 400     # steps between re-measurements of the regime not in use
    explore_steps: int = 6       # cadence samples a (re-)measurement takes
    smoothing: float = 0.2       # weight of a new sample in the running average
    margin: float = 0.05         # the other regime must be this much faster to switch (no flapping)
    cadence_ms: dict = field(default_factory=lambda: {"psd": None, "seq": None})
    last_sample: dict = field(default_factory=lambda: {"psd": -10**9, "seq": -10**9})
    samples: dict = field(default_factory=lambda: {"psd": 0, "seq": 0})   # since the latest trial began
    current: str = "psd"
    trial: str | None = None     # the regime being (re-)measured now

    def observe(self, regime: str, cadence_ms: float, step: int) -> None:
        """One request cadence (ms between two verify ends of one batch) measured in `regime` at `step`."""
        old = self.cadence_ms[regime]
        self.cadence_ms[regime] = cadence_ms if old is None else (1 - self.smoothing) * old + self.smoothing * cadence_ms
        self.last_sample[regime] = step
        self.samples[regime] += 1

    def choose(self, step: int) -> str:
        """The regime for the next steps at a load one batch holds: 'psd' or 'seq'."""
        if self.trial is not None:
            if self.samples[self.trial] < self.explore_steps:
                return self.trial
            self.trial = None
        for regime in ("psd", "seq"):   # measure whichever is unknown or stale (psd, the paper's, first)
            if step - self.last_sample[regime] > self.explore_every:
                self.trial, self.samples[regime] = regime, 0
                return regime
        # both measured (a regime never sampled is always stale)
        other = "seq" if self.current == "psd" else "psd"
        if self.cadence_ms[other] < self.cadence_ms[self.current] * (1 - self.margin):
            self.current = other
        return self.current

    def info(self) -> dict:
        return {"current": self.current, "trial": self.trial,
                "cadence_ms": {k: None if v is None else round(v, 3) for k, v in self.cadence_ms.items()}}
