"""Merge the rows of benchmark runs (e.g. device calls, each with its own psd_vs_sd.parquet) into the results:
a run's ok rows replace the results' rows of the same configuration and add the rest; then the markdown and
the plot are written again. Git keeps the replaced rows.

    python -m bench.merge_rows RUN.parquet [RUN2.parquet ...] [--results bench/results/psd_vs_sd.parquet]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.psd_vs_sd import merge, read_rows, write


def merge_files(results: Path, runs: list[Path]) -> tuple[int, int]:
    """-> (rows merged, rows now in the results)."""
    new = [r for run in runs for r in read_rows(run) if r.get("status", "ok") == "ok"]
    rows = merge(read_rows(results), new)
    write(results.parent, rows)
    try:
        from bench.plot import plot_psd_vs_sd

        plot_psd_vs_sd(results, results.with_suffix(".png"))
    except ImportError:  # no matplotlib here: python -m bench.plot later
        pass
    return len(new), len(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--results", type=Path, default=Path("bench/results/psd_vs_sd.parquet"))
    args = p.parse_args(argv)
    merged, total = merge_files(args.results, args.runs)
    print(f"{args.results}: {merged} rows merged, {total} in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
