"""A change against its parent commit, measured in the same device call: two psd_vs_sd runs (one per tree) of
the same configurations, side by side, with the ratio of each row's throughput.

    (cd parent-tree && GIT_SHA=<parent> python -m bench.psd_vs_sd --mode ar --m 16 --out OUT/parent)
    GIT_SHA=<change> python -m bench.psd_vs_sd --mode ar --m 16 --out OUT/change
    python -m bench.parity OUT/parent/psd_vs_sd.parquet OUT/change/psd_vs_sd.parquet --name runtime_parity

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
        med = lambda col: statistics.median(r[col] for r in group if r.get(col) is not None)  # noqa: E731
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
    args = p.parse_args(argv)
    if len(args.runs) % 2:
        raise SystemExit("runs come in (parent, change) pairs")
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
             "repeats"]
    write_results(rows, args.out, args.name, COLUMNS, args.title, command_line("bench.parity", argv),
                  rows[0]["device"] or "unknown", notes)
    print((args.out / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
