"""Who takes the prefill budget first (`prefill_order`), replayed on the CPU: bench/real_traffic.py's online
workload through the scheduler alone (runtime/scheduler.py, no Ray, no model), each verifier task costing what a
step-cost model says, so TTFT and the gaps between outputs follow the order and the budget, not the device.

`ar`, max_batch 32, fused prefill: the verifier runs its tasks back to back in submission order, two verifies in
flight (the manager's chain), the scheduler called as the manager calls it (after each verify, and when idle).
A task costs (--cost, milliseconds):
- a verify: `verify_ms`, plus `fused_fixed_ms + fused_ms_per_token` x the chunk's tokens when a chunk rides in it;
- a prefill task of its own (nothing decodes, or the verify alone fills the budget): `prefill_fixed_ms +
  prefill_ms_per_token` x its tokens.
Budget 0: whole prompts (unchunked, packed: no padding). Per configuration, --seeds runs of --seconds of Poisson
arrivals at --rate requests/s (real_traffic's Workload and request ids; --long-prompts adds its online_long
prompts); the rows hold the mean (and for TTFT P99 the median) over the seeds. --cost may be given more than once
(a row set per model: what a cheaper fused step would change); --note lines go into the md.

    python -m bench.prefill_order_sim --rate 6.25 --cost verify_ms=6.1,fused_fixed_ms=3.0,...   # seconds a config
    python -m bench.prefill_order_sim --smoke          # a few seeds, seconds
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path

from bench.common import command_line, fmt, git_sha, say, write_results
from bench.psd_vs_sd import poisson_arrivals
from bench.real_traffic import TAIL_IDS, Requests, Trace, Workload, long_arrivals, online_stats
from minedraft_ray.engine.kv_blocks import HEADROOM
from minedraft_ray.engine.request import Request, commit_tokens
from minedraft_ray.runtime.scheduler import (KVPoolSpec, PrefillOrder, PrefillPlan, RequestState, Scheduler,
                                             SchedulerConfig, VerifyPlan)

NAME = "prefill_order_sim"
COLUMNS = ["fused_fixed_ms", "order", "budget", "long_prompts", "rate_rps", "seeds", "requests", "ttft_p50_ms",
           "ttft_p99_ms", "ttft_p99_median_ms", "gap_p99_ms", "n_long", "long_over_quiet", "cost", "git_sha", "command",
           "device"]
TABLE = ["fused_fixed_ms", "order", "budget", "long_prompts", "rate_rps", "seeds", "requests", "ttft_p50_ms",
         "ttft_p99_ms", "ttft_p99_median_ms", "gap_p99_ms", "n_long", "long_over_quiet"]
MAX_BATCH = 32
BLOCK = 16


@dataclass(frozen=True)
class StepCost:
    verify_ms: float
    fused_fixed_ms: float
    fused_ms_per_token: float
    prefill_fixed_ms: float
    prefill_ms_per_token: float

    @classmethod
    def parse(cls, text: str) -> "StepCost":
        values = dict(item.split("=") for item in text.split(",") if item)
        missing = {f.name for f in fields(cls)} - set(values)
        if missing:
            raise ValueError(f"--cost lacks {', '.join(sorted(missing))}")
        return cls(**{k: float(v) for k, v in values.items()})

    def of(self, task) -> float:
        if isinstance(task, PrefillPlan):
            return self.prefill_fixed_ms + self.prefill_ms_per_token * task.num_tokens
        chunk = task.prefill.num_tokens if task.prefill is not None else 0
        return self.verify_ms + (self.fused_fixed_ms + self.fused_ms_per_token * chunk if chunk else 0.0)

    def describe(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self))


def replay(order: PrefillOrder, budget: int, cost: StepCost, work: Workload, timed: list[tuple[float, int]]
           ) -> list[Trace]:
    """The requests (arrival s, request id) through the scheduler -> their traces (output times in s)."""
    requests = Requests(work, vocab=1000)
    sched = Scheduler(SchedulerConfig("ar", MAX_BATCH, MAX_BATCH, MAX_BATCH, prefill_budget=budget or None,
                                      fuse_prefill=bool(budget), prefill_order=order))
    per_slot = -(-(work.max_len + HEADROOM) // BLOCK)
    sched.attach_kv(KVPoolSpec(MAX_BATCH * per_slot + 1, BLOCK, per_slot), None, work.max_len)
    traces: dict[str, Trace] = {}
    inflight: deque = deque()   # (task, end s), in submission = run order
    device_free = 0.0

    def schedule(committed: int | None, now: float) -> None:
        nonlocal device_free
        plan = sched.schedule(committed)
        for task in plan.prefills + plan.verifies:
            device_free = max(device_free, now) + cost.of(task) / 1e3
            inflight.append((task, device_free))

    upcoming = deque(timed)
    while upcoming or inflight:
        if upcoming and (not inflight or upcoming[0][0] <= inflight[0][1]):
            now, i = upcoming.popleft()
            prompt, params = requests(i)
            state = RequestState(Request(prompt, params, ()))
            traces[state.id] = Trace(now, len(prompt), [])
            sched.arrive(state)
            if not inflight:
                schedule(None, now)
            continue
        task, now = inflight.popleft()
        prefill = task if isinstance(task, PrefillPlan) else task.prefill
        riders = []
        if prefill is not None:
            sched.commit_prefill(prefill)
            for c in prefill.chunks:
                if not c.last:
                    sched.release(c.state)
            riders = [c.state for c in prefill.chunks if c.last]
        if isinstance(task, VerifyPlan):
            sched.commit_verify(task)
            riders += task.rows
        live = [s for s in riders if not s.request.finished]
        for s in riders:
            if s.request.finished:   # rode one step past its end (ar keeps two in flight): its slot goes now
                sched.release(s)
        if live:
            commit_tokens([s.request for s in live], [[7] for _ in live], None, [0] * len(live))
            for s in live:
                traces[s.id].outputs.append(now)
                if s.request.finished:
                    sched.finish(s)
        if isinstance(task, VerifyPlan):
            schedule(task.batch, now)
        elif not inflight:
            schedule(None, now)
    return list(traces.values())


def arrivals(rate: float, seconds: float, seed: int, long_prompts: int) -> list[tuple[float, int]]:
    """A run's requests: Poisson arrivals (request ids of their own per seed) and online_long's tail prompts."""
    timed = [(at, 10**5 + 10**4 * seed + n) for n, at in enumerate(poisson_arrivals(rate, seconds, seed))]
    timed += [(at, TAIL_IDS + n) for n, at in enumerate(long_arrivals(long_prompts, seconds))] if long_prompts else []
    return sorted(timed)


def mean(runs: list[dict], key: str) -> float | None:
    """The mean of a statistic over the runs that have it (a run with no long prompt has no gap ratio)."""
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.fmean(values) if values else None


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost", action="append", help="the step-cost model: " +
                   ",".join(f"{f.name}=MS" for f in fields(StepCost)) + " (repeatable)")
    p.add_argument("--note", action="append", default=[], help="a line for the md (where the costs come from)")
    p.add_argument("--rate", type=float, help="arrivals per second")
    p.add_argument("--budgets", default="0,256,128", help="prefill budgets (0: whole prompts, unchunked)")
    p.add_argument("--orders", default="arrival,shortest")
    p.add_argument("--long-prompts", default="0,8", help="online_long's added tail prompts per run (0: none)")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--seeds", type=int, default=40)
    p.add_argument("--out", default=None, help="default bench/results; smoke: /tmp/prefill_order_sim_smoke")
    p.add_argument("--smoke", action="store_true", help="a small made-up cost, three seeds of 3 s")
    args = p.parse_args(argv)
    if args.smoke:
        args.cost = args.cost or ["verify_ms=6,fused_fixed_ms=3,fused_ms_per_token=0.005,prefill_fixed_ms=2,"
                                  "prefill_ms_per_token=0.03"]
        args.rate, args.seeds, args.seconds, args.long_prompts = args.rate or 6.0, 3, 3.0, "0,2"
    if args.cost is None or args.rate is None:
        p.error("--cost and --rate are required (the device's step costs and arrival rate)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    costs, work = [StepCost.parse(c) for c in args.cost], Workload()
    rows = []
    for cost, long_prompts in ((c, int(n)) for c in costs for n in args.long_prompts.split(",")):
        for budget in (int(b) for b in args.budgets.split(",")):
            for order in (PrefillOrder(o) for o in args.orders.split(",")):
                if not budget and order is not PrefillOrder.SHORTEST:
                    continue   # whole prompts: every waiting prompt in each prefill, no order to choose
                runs = [online_stats(replay(order, budget, cost, work, arrivals(args.rate, args.seconds, 600 + seed,
                                                                                long_prompts)), work.long_tokens)
                        for seed in range(args.seeds)]
                row = {"fused_fixed_ms": cost.fused_fixed_ms, "order": order.value if budget else "whole", "budget": budget, "long_prompts": long_prompts,
                       "rate_rps": args.rate, "seeds": args.seeds, "requests": mean(runs, "completed"),
                       "ttft_p50_ms": mean(runs, "ttft_p50_ms"), "ttft_p99_ms": mean(runs, "ttft_p99_ms"),
                       "ttft_p99_median_ms": statistics.median(r["ttft_p99_ms"] for r in runs),
                       "gap_p99_ms": mean(runs, "gap_p99_ms"), "n_long": mean(runs, "n_long"),
                       "long_over_quiet": mean(runs, "long_over_quiet"), "cost": cost.describe()}
                rows.append(row)
                say(f"fixed {cost.fused_fixed_ms} ms, +{long_prompts} long, budget {budget}, {row['order']}: TTFT P50 "
                    f"{fmt(row['ttft_p50_ms'])} P99 {fmt(row['ttft_p99_ms'])} ms")
    out = Path(args.out or ("/tmp/prefill_order_sim_smoke" if args.smoke else "bench/results"))
    command = command_line("bench.prefill_order_sim", argv)
    rows = [{**r, "command": command, "git_sha": git_sha(), "device": "CPU (the scheduler alone, a step-cost model)"}
            for r in rows]
    notes = [work.describe() + f"; Poisson arrivals at {args.rate} requests/s for {args.seconds:.0f} s, seeds "
             f"600..{599 + args.seeds} (request ids of their own per seed); long_prompts: online_long's added tail "
             "prompts (bench/real_traffic.py)",
             f"ar, max_batch {MAX_BATCH}, fused prefill (budget 0: whole prompts, packed); step-cost models (ms): "
             + "; ".join(c.describe() for c in costs),
             "each value is the mean over the seeds of one run's statistic (ttft_p99_median_ms: the median of the runs' "
             "TTFT P99); long_over_quiet: real_traffic's gap ratio (P99 gap overlapping a long prompt's prefill / "
             "median gap overlapping none)",
             "a model, not a measurement: it orders the policies by what the scheduler decides, at the step costs "
             "given; the device's numbers are bench/results/real_traffic.md's"] + args.note
    write_results(rows, out, NAME, COLUMNS, "Prefill order on the scheduler alone: TTFT and gaps from a step-cost "
                  "model", command, rows[0]["device"], notes, TABLE)
    say(f"wrote {out / NAME}.{{parquet,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
