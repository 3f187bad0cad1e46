"""Every committed benchmark result has a plot drawn from its Parquet file."""
from pathlib import Path

import pytest

from bench.plot import PLOTS, main

RESULTS = Path(__file__).parents[1] / "bench" / "results"


@pytest.mark.parametrize("parquet", sorted(RESULTS.glob("*.parquet")), ids=lambda p: p.stem)
def test_each_result_plots(parquet, tmp_path):
    assert parquet.stem in PLOTS, f"no plot for {parquet.name}"
    png = tmp_path / f"{parquet.stem}.png"
    assert main([str(parquet), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
