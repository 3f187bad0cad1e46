"""The ingress replica's event-loop lag: how late a short timer on its loop fires.

Every stream's chunks, every admission and every delivery of the engine's outputs run on that one loop (Serve's
user-code loop), so anything that holds it, or holds the GIL from another thread of the process, delays every
running stream by as much: the lag is that delay, measured where it happens instead of inferred from clients'
inter-chunk gaps. It is observed into the ingress's own registry (`minedraft_api_event_loop_lag_seconds` at
/metrics), beside vLLM's inter-token latency.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

PERIOD_S = 0.005   # the probe's timer: short against the stream interval, cheap (one wake-up per period)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
               1.0, 2.5)


class LoopLagWatch:
    """A task on the running loop that sleeps PERIOD_S at a time and observes how much later than that it woke."""

    def __init__(self, observe: Callable[[float], None], period_s: float = PERIOD_S):
        self.observe, self.period_s = observe, period_s
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        """On the loop to watch (from a coroutine or a callback running on it)."""
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run(), name="minedraft-loop-lag")

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def _run(self) -> None:
        while True:
            due = time.perf_counter() + self.period_s
            await asyncio.sleep(self.period_s)
            self.observe(max(0.0, time.perf_counter() - due))
