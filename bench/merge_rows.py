"""Merge the rows of GPU runs into bench/results/psd_vs_sd.parquet, then rewrite its markdown.

Each device call writes its own psd_vs_sd.parquet (the rows it ran, and the prior rows it read). The rows of
that call's commit with status ok replace the rows of the same configuration in the results file; the
replaced rows are kept in bench/results/logs/psd_vs_sd_replaced_by_<sha>.parquet.

    python -m bench.merge_rows RUN.parquet [RUN2.parquet ...] --sha <commit of the call>
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from bench.psd_vs_sd import report, row_config


def merge(results: Path, runs: list[Path], sha: str, logs: Path) -> tuple[int, int]:
    """-> (rows added, rows replaced). The results file keeps its schema."""
    table = pq.read_table(results)
    old = table.to_pylist()
    new = [r for run in runs for r in pq.read_table(run).to_pylist()
           if r.get("status") == "ok" and r.get("git_sha") == sha]
    fresh = {row_config(r) for r in new}
    replaced = [r for r in old if row_config(r) in fresh]
    rows = [r for r in old if row_config(r) not in fresh] + [{c: r.get(c) for c in table.schema.names} for r in new]
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), results)
    if replaced:
        log = logs / f"{results.stem}_replaced_by_{sha}.parquet"
        earlier = pq.read_table(log).to_pylist() if log.exists() else []
        pq.write_table(pa.Table.from_pylist(earlier + replaced, schema=table.schema), log)
    results.with_suffix(".md").write_text(report(rows))
    return len(new), len(replaced)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--sha", required=True, help="the commit the device call ran (its rows' git_sha)")
    p.add_argument("--results", type=Path, default=Path("bench/results/psd_vs_sd.parquet"))
    args = p.parse_args(argv)
    added, replaced = merge(args.results, args.runs, args.sha, args.results.parent / "logs")
    print(f"{args.results}: {added} rows of {args.sha} merged, {replaced} replaced (kept in logs/)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
