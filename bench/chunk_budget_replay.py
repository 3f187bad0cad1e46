"""Replay the adaptive chunk's controller (runtime/chunk_budget.py, the code as it is now) over verifier cycles a
GPU run recorded (`bench.real_traffic --steps`: bench/results/real_traffic_steps.parquet), and say how well its
prices predicted them and what held the chunk cycles where they were. An analysis of a recorded run, not a
benchmark: nothing runs on a device, and it writes nothing to bench/results.

    python -m bench.chunk_budget_replay [STEPS.parquet] [--typical-cycles 256]

Per mode and adaptive engine (online_long's cycles, in order): the cycles are fed to a fresh ChunkBudget at the
engine's ratio, and before each single-launch cycle of a class it had priced, the cycle it would have predicted
(base + the class's price + key_ms x the launch's prior keys) is set against the one measured. Reported:
- measured / predicted: P10/P50/P90/P99, over all such cycles and over those 200k+ prior keys deep;
- margin and key_ms over the run's chunk cycles (P10/P50/P90);
- the chunk cycles against the reference the budget held them to (the base, its moving average then, or with
  chunk_gap_reference typical the shorter of that and its window's median) and against the run's median cycle
  without a chunk (the issue's yardstick), and that reference against the same median;
- how often a reference of min(base, the median cycle without a chunk over the last --typical-cycles cycles) would
  have bound (cut the added time the base allows by 5 % or more), and by how much;
- the chunk cycles above ratio x the run's median (those that set the issue's gap P99), by why: their class had no
  price yet (explored), they ran over 1.1x their prediction (missed), or they were predicted and allowed because
  the reference then was high (predicted).
The replay cannot say which chunks the budget would then have chosen: only a run can.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter, deque
from pathlib import Path

from bench.common import markdown_table

DEEP_KEYS = 200_000   # prior keys from which a chunk counts as deep in its prompt
MISSED = 1.1          # a cycle above this many times its prediction: the price missed it


def quantiles(values: list[float], points=(0.1, 0.5, 0.9)) -> str:
    if not values:
        return "–"
    ordered = sorted(values)
    return " / ".join(f"{ordered[int(p * (len(ordered) - 1))]:.3g}" for p in points)


def replay(cycles: list[dict], engine: str, typical_cycles: int) -> dict:
    """One engine's cycles through a fresh budget at its ratio and reference -> the row of the report."""
    from bench.real_traffic import EngineSpec
    from minedraft_ray.runtime.chunk_budget import TYPICAL_CYCLES, ChunkBudget, PromptLaunch

    spec = EngineSpec.parse(engine)
    budget = ChunkBudget.for_budget(max(r["launch_tokens"] for r in cycles) or 512, spec.gap_ratio,
                                    typical_window=TYPICAL_CYCLES if spec.gap_reference == "typical" else 0)
    quiet_median = statistics.median(r["step_ms"] for r in cycles if not r["prefill_launches"])
    recent = deque(maxlen=typical_cycles)   # (cycle, ms) without a chunk
    errors, deep, margins, key_ms, over_base, over_median, base_share, cuts = [], [], [], [], [], [], [], []
    over_ratio = Counter()   # chunk cycles above ratio x the run's median, by why
    for i, r in enumerate(cycles):
        launches = r["prefill_launches"]
        if launches and budget.base_ms is not None:
            margins.append(budget.margin)
            key_ms.append(budget.key_ms)
            over_base.append(r["step_ms"] / budget.reference_ms)
            over_median.append(r["step_ms"] / quiet_median)
            base_share.append(budget.reference_ms / quiet_median)
            typical = [ms for j, ms in recent if j >= i - typical_cycles]   # the budget's window at this cycle
            if typical:
                held = budget.base_ms * (budget.ratio - 1.0)
                reference = budget.ratio * min(budget.base_ms, statistics.median(typical)) - budget.base_ms
                if reference < 0.95 * held:
                    cuts.append(max(0.0, reference) / held)
            predicted = budget.predicted_cycle_ms(PromptLaunch(r["launch_tokens"], r["prior_keys"]))
            if r["step_ms"] > budget.ratio * quiet_median:
                over_ratio["several launches" if launches > 1 else "explored" if predicted is None else
                           "missed" if r["step_ms"] > MISSED * predicted else "predicted"] += 1
            if launches == 1 and predicted:
                errors.append(r["step_ms"] / predicted)
                if r["prior_keys"] >= DEEP_KEYS:
                    deep.append(r["step_ms"] / predicted)
        if not launches:
            recent.append((i, r["step_ms"]))
        # a cycle of several launches counts for no class, as the manager's does
        budget.observe(r["step_ms"], [PromptLaunch(r["launch_tokens"], r["prior_keys"])] * min(launches, 2))
    chunk_cycles = len(over_base)
    return {"cycles": len(cycles), "chunk_cycles": chunk_cycles,
            "measured_over_predicted P10/50/90/99": quantiles(errors, (0.1, 0.5, 0.9, 0.99)) + f" (n {len(errors)})",
            "deep P10/50/90": quantiles(deep) + f" (n {len(deep)})",
            "margin P10/50/90": quantiles(margins), "key_ms P10/50/90": quantiles(key_ms),
            "chunk / reference P50/90/99": quantiles(over_base, (0.5, 0.9, 0.99)),
            "chunk / run median P50/90/99": quantiles(over_median, (0.5, 0.9, 0.99)),
            "reference / run median P10/50/90": quantiles(base_share),
            "min(base, typical) binds": f"{len(cuts)} of {chunk_cycles}, allowed x {quantiles(cuts)}",
            "over ratio x run median": ", ".join(f"{why} {n}" for why, n in sorted(over_ratio.items())) or "0"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("steps", nargs="?", default="bench/results/real_traffic_steps.parquet")
    p.add_argument("--typical-cycles", type=int, default=256, help="the window of the typical cycle's median")
    args = p.parse_args(argv)
    import pyarrow.parquet as pq

    steps = pq.read_table(Path(args.steps)).to_pylist()
    rows = []
    for mode, engine in sorted({(r["mode"], r["engine"]) for r in steps if "@" in r["engine"]}):
        cycles = sorted((r for r in steps if (r["mode"], r["engine"]) == (mode, engine)
                         and r["workload"] == "online_long"), key=lambda r: r["step"])
        if cycles:
            sha = cycles[0]["git_sha"]
            rows.append({"mode": mode, "engine": engine, "git_sha": sha,
                         **replay(cycles, engine, args.typical_cycles)})
    if not rows:
        print(f"{args.steps}: no adaptive engine's online_long cycles")
        return 1
    print(markdown_table(rows, list(rows[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
