"""A change against its parent commit, measured in the same device call: two psd_vs_sd runs (one per tree) of
the same configurations, side by side, with the ratio of each row's throughput.

    (cd parent-tree && GIT_SHA=<parent> python -m bench.psd_vs_sd --mode ar --m 16 --out OUT/parent)
    GIT_SHA=<change> python -m bench.psd_vs_sd --mode ar --m 16 --out OUT/change
    python -m bench.parity OUT/parent/psd_vs_sd.parquet OUT/change/psd_vs_sd.parquet --name runtime_parity
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import command_line, write_results
from bench.psd_vs_sd import read_rows

NAME = "runtime_parity"
KEY = ("mode", "workload", "m", "batch", "k", "alpha_group")
COLUMNS = ["mode", "m", "batch", "k", "alpha_group", "n_requests", "tokens_per_s_parent", "tokens_per_s_change",
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parent", type=Path, help="psd_vs_sd.parquet of the parent tree's run")
    p.add_argument("change", type=Path, help="psd_vs_sd.parquet of the change's run")
    p.add_argument("--name", default=NAME)
    p.add_argument("--title", default="The runtime change against its parent, same device call")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args(argv)
    rows = pair_rows(read_rows(args.parent), read_rows(args.change))
    if not rows:
        raise SystemExit("no configuration was measured by both runs")
    notes = ["change_over_parent = tokens_per_s_change / tokens_per_s_parent; one run of each, interleaved "
             "(parent, change) per configuration in one call"]
    write_results(rows, args.out, args.name, COLUMNS, args.title, command_line("bench.parity", argv),
                  rows[0]["device"] or "unknown", notes)
    print((args.out / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
