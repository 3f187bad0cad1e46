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


@pytest.mark.parametrize("parquet", sorted(RESULTS.glob("*.parquet")), ids=lambda p: p.stem)
def test_each_result_has_its_md_and_png_naming_command_and_commit(parquet):
    import pyarrow.parquet as pq

    md = parquet.with_suffix(".md").read_text()
    assert parquet.with_suffix(".png").is_file()
    assert "Command" in md and "python -m bench." in md
    shas = {r.get("git_sha") for r in pq.read_table(parquet).to_pylist()}
    assert None not in shas and all(sha in md for sha in shas), f"{parquet.name}: rows of {shas}"
