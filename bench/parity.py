"""A change against its parent commit, measured in the same device call: two psd_vs_sd runs (one per tree) of
the same configurations, side by side, with the ratio of each row's throughput.

    (cd parent-tree && GIT_SHA=<parent> python -m bench.psd_vs_sd --mode ar --m 16 --out OUT/parent)
    GIT_SHA=<change> python -m bench.psd_vs_sd --mode ar --m 16 --out OUT/change
    python -m bench.parity OUT/parent/psd_vs_sd.parquet OUT/change/psd_vs_sd.parquet --name runtime_parity

Engine steps instead (`--engine`): two bench.engine_speed runs, rows paired by (model, batch, q, context,
lengths), ratio of step ms, written to engine_parity:

    python -m bench.parity OUT/parent/engine_speed.parquet OUT/change/engine_speed.parquet --engine --keep \
        bench/results/engine_parity.parquet

Repeats: pass more (parent, change) pairs, each pair interleaved in the call; every pair is a row (`repeat`),
and each configuration gets a `median` row over its repeats. `--keep` carries the rows of earlier calls.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import command_line, write_results
from bench.psd_vs_sd import read_rows

NAME = "runtime_parity"
KEY = ("mode", "workload", "m", "batch", "k", "alpha_group")
COLUMNS = ["mode", "m", "batch", "k", "alpha_group", "repeat", "n_requests", "tokens_per_s_parent", "tokens_per_s_change",
           "change_over_parent", "step_ms_parent", "step_ms_change", "git_sha_parent", "git_sha_change", "device",
           "git_sha"]


def pair_rows(parent: list[dict], change: list[dict]) -> list[dict]:
    """One row per configuration both runs measured (closed workload, status ok)."""
    def keyed(rows):
        return {tuple(r.get(c) for c in KEY): r for r in rows
                if r.get("workload") == "closed" and r.get("status", "ok") == "ok"}
    before, after = keyed(parent), keyed(change)
    rows = []
    for key in sorted(before.keys() & after.keys(), key=str):
        a, b = before[key], after[key]
        rows.append({**dict(zip(KEY, key)), "n_requests": b.get("n_requests"),
                     "tokens_per_s_parent": a["tokens_per_s"], "tokens_per_s_change": b["tokens_per_s"],
                     "change_over_parent": b["tokens_per_s"] / a["tokens_per_s"],
                     "step_ms_parent": a.get("step_ms"), "step_ms_change": b.get("step_ms"),
                     "git_sha_parent": a.get("git_sha"), "git_sha_change": b.get("git_sha"),
                     "device": b.get("device"), "git_sha": b.get("git_sha")})
    return rows


ENGINE_KEY = ("model", "batch", "q", "context", "lengths")
ENGINE_COLUMNS = [*ENGINE_KEY, "ms_parent", "ms_change", "change_over_parent", "git_sha_parent", "git_sha_change",
                  "device", "git_sha"]


def engine_pair_rows(parent: list[dict], change: list[dict]) -> list[dict]:
    """One row per engine step both runs timed: change_over_parent is the ratio of step ms (lower is faster)."""
    def keyed(rows):
        return {tuple(r.get(c) for c in ENGINE_KEY): r for r in rows}
    before, after = keyed(parent), keyed(change)
    return [{**dict(zip(ENGINE_KEY, key)), "ms_parent": before[key]["ms"], "ms_change": after[key]["ms"],
             "change_over_parent": after[key]["ms"] / before[key]["ms"],
             "git_sha_parent": before[key].get("git_sha"), "git_sha_change": after[key].get("git_sha"),
             "device": after[key].get("device"), "git_sha": after[key].get("git_sha")}
            for key in sorted(before.keys() & after.keys(), key=str)]


def write_engine_parity(args, argv) -> int:
    import pyarrow.parquet as pq

    rows = []
    for i in range(0, len(args.runs), 2):
        rows += engine_pair_rows(read_rows(args.runs[i]), read_rows(args.runs[i + 1]))
    if not rows:
        raise SystemExit("no engine step was timed by both runs")
    if args.keep is not None:
        mine = {r["git_sha_change"] for r in rows}
        rows = [r for r in pq.read_table(args.keep).to_pylist() if r.get("git_sha_change") not in mine] + rows
    notes = ["change_over_parent = step ms of the change / step ms of the parent (lower is faster); both trees "
             "ran bench.engine_speed in the same device call (random weights, bf16, CUDA graphs, median step)",
             *args.note]
    name = "engine_parity" if args.name == NAME else args.name
    write_results(rows, args.out, name, ENGINE_COLUMNS, "The engine step against its parent, same device call",
                  command_line("bench.parity", argv), rows[-1]["device"] or "unknown", notes)
    print((args.out / f"{name}.md").read_text())
    return 0


def median_rows(rows: list[dict]) -> list[dict]:
    """Per configuration and pair of commits with several repeats, the median over them."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("repeat") != "median":
            groups.setdefault(tuple(r.get(c) for c in (*KEY[:1], *KEY[2:], "git_sha_parent", "git_sha_change")),
                              []).append(r)
    medians = []
    for group in (g for g in groups.values() if len(g) > 1):
        def med(col):
            values = [r[col] for r in group if r.get(col) is not None]
            return statistics.median(values) if values else None
        medians.append({**group[0], "repeat": "median", "n_repeats": len(group),
                        "tokens_per_s_parent": med("tokens_per_s_parent"),
                        "tokens_per_s_change": med("tokens_per_s_change"),
                        "change_over_parent": med("change_over_parent"),
                        "step_ms_parent": med("step_ms_parent"), "step_ms_change": med("step_ms_change")})
    return medians


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", metavar="PARENT CHANGE",
                   help="psd_vs_sd.parquet of the parent tree's run, then the change's; more pairs are repeats")
    p.add_argument("--keep", type=Path, default=None, help="an earlier parity parquet whose rows stay (other calls)")
    p.add_argument("--name", default=NAME)
    p.add_argument("--title", default="The runtime change against its parent, same device call")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--note", action="append", default=[], help="a line for the md's notes (repeatable)")
    p.add_argument("--engine", action="store_true", help="the runs are bench.engine_speed parquets")
    args = p.parse_args(argv)
    if len(args.runs) % 2:
        raise SystemExit("runs come in (parent, change) pairs")
    if args.engine:
        return write_engine_parity(args, argv)
    rows = []
    for i in range(0, len(args.runs), 2):
        pairs = pair_rows(read_rows(args.runs[i]), read_rows(args.runs[i + 1]))
        call = args.runs[i + 1].parent.name
        rows += [{**r, "repeat": call} for r in pairs]
    if not rows:
        raise SystemExit("no configuration was measured by both runs")
    if args.keep is not None:
        import pyarrow.parquet as pq

        kept = [{**r, "repeat": r.get("repeat") or "earlier"} for r in pq.read_table(args.keep).to_pylist()
                if r.get("repeat") != "median"]
        mine = {(r["repeat"], r["git_sha_change"]) for r in rows}
        rows = [r for r in kept if (r.get("repeat"), r.get("git_sha_change")) not in mine] + rows
    rows += median_rows(rows)
    rows.sort(key=lambda r: (r["mode"], r["m"], r.get("git_sha_change") or "", r["repeat"] == "median"))
    notes = ["change_over_parent = tokens_per_s_change / tokens_per_s_parent; each `repeat` is one run of each "
             "tree, interleaved (parent, change) in one call; `median` rows are the median over a configuration's "
             "repeats", *args.note]
    write_results(rows, args.out, args.name, COLUMNS, args.title, command_line("bench.parity", argv),
                  rows[0]["device"] or "unknown", notes)
    print((args.out / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
