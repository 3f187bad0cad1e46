"""A test drafter's faults, in a module without torch: they travel through the manager (faulty_drafter's WorkerSet,
set_drafter_faults), whose process must stay as production runs it, without torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterFaults:
    """What a FaultyDrafterWorker does to its draft rounds (numbered from 1, in the order they run)."""
    delay_s: float = 0.0           # every round sleeps this long first (a kill then lands mid-round)
    error_at: int | None = None    # this round raises; the actor stays alive
    hang_at: int | None = None     # this round never returns (sleeps an hour); the actor stays alive
    prefill_delay_s: float = 0.0   # every prompt (chunk) prefill sleeps this long first (a kill lands mid-prompt)
