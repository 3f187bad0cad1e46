"""The garbage collector in the long-lived serving processes: startup objects kept out of its scans, and its pauses
exported.

A full (generation 2) collection scans every tracked object of the process, and a process that imported torch,
transformers, FastAPI and Ray holds hundreds of thousands: each full collection then holds the GIL for a tenth of
a second or more, and every stream that process serves (the ingress's, the manager's step loop) stalls with it.
`freeze` moves what startup allocated into the permanent generation, so later collections scan only what the
process allocated since. The pauses are exported (`ray_minedraft_gc_pause_seconds`, docs/observability.md) so a
stall of that kind shows on the dashboard instead of only in a client's inter-token latency.
"""
from __future__ import annotations

import gc
import threading
import time
from collections import deque

from ray.util.metrics import Gauge, Histogram

GC_PAUSE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
# young collections are frequent and cheap: only those that took this long are exported (full ones always)
MIN_EXPORTED_S = 0.001
EXPORT_S = 2.0
LABELS = ("model", "mode", "replica", "process")   # the engine series' labels, so the dashboard filters both


class CollectorWatch:
    """One process's collector: `freeze` after startup, and each collection's pause exported. The GC callback only
    appends to a deque (it may run inside any code, Ray's included, so it takes no lock and calls no library); a
    daemon thread hands the pauses to Ray every EXPORT_S."""

    def __init__(self, process: str, model: str, mode: str, replica: str | None = None):
        from .metrics import SERIES, replica_name
        self.tags = {"model": model, "mode": mode, "replica": replica or replica_name(), "process": process}
        self.pauses = Histogram("minedraft_gc_pause_seconds", description=SERIES["ray_minedraft_gc_pause_seconds"][1],
                                boundaries=GC_PAUSE_BUCKETS, tag_keys=LABELS + ("generation",))
        self.frozen = Gauge("minedraft_gc_frozen_objects", description=SERIES["ray_minedraft_gc_frozen_objects"][1],
                            tag_keys=LABELS)
        self._started = 0.0
        # gc.get_freeze_count() walks the whole permanent generation holding the GIL (O(frozen objects), tens of
        # ms in a serving process): it is read until the count has settled (Serve freezes once, after a replica's
        # constructor), then the export re-sends the number it knows
        self._frozen_count: int | None = None
        self._frozen_settled = False
        self._recorded: deque[tuple[int, float]] = deque(maxlen=10_000)
        self._stop = threading.Event()
        gc.callbacks.append(self._on_collection)
        threading.Thread(target=self._export_loop, name="minedraft-gc", daemon=True).start()

    def close(self) -> None:
        """Stop watching (an engine shut down in a process that lives on): the callback and the thread go."""
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
        self._stop.set()

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        if took >= MIN_EXPORTED_S or info["generation"] == 2:
            self._recorded.append((info["generation"], took))

    def freeze(self) -> None:
        """Everything allocated so far lives as long as the process: collect once, then keep it out of every
        later scan."""
        gc.collect()
        gc.freeze()
        self._frozen_count, self._frozen_settled = gc.get_freeze_count(), True
        self.frozen.set(self._frozen_count, tags=self.tags)

    def frozen_count(self) -> int:
        """The objects frozen: counted (a walk of the permanent generation) until two counts in a row agree on a
        non-zero number, known from then on."""
        if not self._frozen_settled:
            count = gc.get_freeze_count()
            self._frozen_settled = count > 0 and count == self._frozen_count
            self._frozen_count = count
        return self._frozen_count

    def _export_loop(self) -> None:
        while not self._stop.wait(EXPORT_S):
            while self._recorded:
                generation, took = self._recorded.popleft()
                self.pauses.observe(took, tags={**self.tags, "generation": str(generation)})
            # Ray ages out a gauge that is not re-reported
            self.frozen.set(self.frozen_count(), tags=self.tags)
