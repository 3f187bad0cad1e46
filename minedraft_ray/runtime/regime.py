"""psd or one sequential batch: chosen by measurement, at low load by per-request cadence, at high load by
the verifier's time per row (docs/design.md, "Low load" and "High load", gives the measurements behind it).

PSD splits the running requests into two batches that take turns on the verifier, so each request advances
once every two verifies. When every running request fits one batch (at most max_batch), a single sequential
batch (draft, then verify: `sd_split`'s schedule) advances each of them once per draft + verify + hops
instead. psd wins when a verify outlasts drafting plus the sequential step's Ray hops, and loses otherwise;
which holds depends on the pair, k and the host. So the manager measures both: the cadence of a request is
the time between two ends of its batch's verifies, kept per regime, and the regime without a recent
measurement is tried for a few steps now and then (both regimes are lossless, so trying costs time only).

At high load (more requests want to run than one batch holds), the split holds up to 2 x max_batch requests
and the sequential batch holds max_batch and queues the rest. The split buys throughput only where a verify
of half the rows costs clearly less than a sequential step of all of them, and it costs latency: a queue in
front of the faster sequential chain serves requests of similar length sooner than sharing the verifier
among twice as many (FIFO against processor sharing). So psd considers the split only once the demand fills
both batches ("saturated"), and leaves it only when one batch holds the demand again (no drain needed).
While saturated a second chooser compares the verifier's time per row advanced, prefills left out (every
request is prefilled once in either regime). It measures the sequential batch first: demand rises from one
batch's worth, so neither first measurement needs a drain.

A regime's cost is the median of its latest samples (a trial's worth), so one slow step (a graph capture, a
restart) does not decide.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class RegimeChooser:
    explore_every: int = 400     # steps between re-measurements of the regime not in use
    explore_steps: int = 6       # samples a (re-)measurement takes; a regime's cost is the median of its latest as many
    margin: float = 0.05         # the other regime must be this much cheaper to switch (no flapping)
    metric: str = "cadence_ms"   # what a sample is (lower is better): a request's period, or ms per row
    cost: dict = field(default_factory=lambda: {"psd": None, "seq": None})
    recent: dict = field(default_factory=dict)   # per regime: its latest explore_steps samples
    last_sample: dict = field(default_factory=lambda: {"psd": -10**9, "seq": -10**9})
    samples: dict = field(default_factory=lambda: {"psd": 0, "seq": 0})   # since the latest trial began
    current: str = "psd"
    order: tuple = ("psd", "seq")   # which regime a first measurement tries first
    trial: str | None = None     # the regime being (re-)measured now

    def observe(self, regime: str, value: float, step: int) -> None:
        """One sample of the metric (e.g. ms between two verify ends of one batch) in `regime` at `step`."""
        recent = self.recent.setdefault(regime, deque(maxlen=self.explore_steps))
        recent.append(value)
        self.cost[regime] = statistics.median(recent)
        self.last_sample[regime] = step
        self.samples[regime] += 1

    def choose(self, step: int) -> str:
        """The regime for the next steps at a load one batch holds: 'psd' or 'seq'."""
        if self.trial is not None:
            if self.samples[self.trial] < self.explore_steps:
                return self.trial
            self.trial = None
        for regime in self.order:   # measure whichever is unknown or stale
            if step - self.last_sample[regime] > self.explore_every:
                self.trial, self.samples[regime] = regime, 0
                return regime
        # both measured (a regime never sampled is always stale)
        other = "seq" if self.current == "psd" else "psd"
        if self.cost[other] < self.cost[self.current] * (1 - self.margin):
            self.current = other
        return self.current

    def info(self) -> dict:
        return {"current": self.current, "trial": self.trial,
                self.metric: {k: None if v is None else round(v, 4) for k, v in self.cost.items()}}
