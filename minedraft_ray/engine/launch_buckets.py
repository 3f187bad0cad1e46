"""The token counts a packed launch is padded to: the runner captures a CUDA graph per bucket, and the runtime prices
a launch by its bucket (runtime/chunk_budget.py), so this module imports no torch (the manager's process has none)."""
from __future__ import annotations

import bisect

# Graphed packed launches: token counts, a launch padded up to the next one. Up to 256 tokens an 8B launch's time
# hardly grows with its tokens (weight reads and fixed costs), so doubling steps cost little; above, it grows about
# linearly with them, so the steps are 64 tokens up to 384 and 128 beyond. No 448: an H200 ran a 448-token launch
# slower than a 512-token one (its GEMMs' kernel choice), so one pads to 512 instead (docs/design.md)
PACKED_GRAPH_TOKENS = (16, 32, 64, 128, 256, 320, 384, 512, 640, 768, 896, 1024)


def token_bucket(tokens: int, buckets) -> int | None:
    """The smallest of the ascending `buckets` that holds `tokens` tokens; None past the largest (eager)."""
    i = bisect.bisect_left(buckets, tokens)
    return buckets[i] if i < len(buckets) else None
