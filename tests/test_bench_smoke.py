"""bench/psd_vs_sd.py --smoke end to end on the CPU (tiny models, a private Ray cluster with 2 fake GPUs):
both parts run, the Parquet has every column, the markdown states the targets, the plot is drawn, and
request i gets the same synthetic acceptance draws in every mode that drafts for it from its first step."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pq = pytest.importorskip("pyarrow.parquet")

from bench.psd_vs_sd import COLUMNS, EXTRA_COLUMNS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("psd_vs_sd")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "bench.psd_vs_sd", "--smoke", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, pq.read_table(out / "psd_vs_sd.parquet").to_pylist()


def find(rows, **where):
    return [r for r in rows if all(r[k] == v for k, v in where.items())]


def test_files_and_columns(smoke):
    out, rows = smoke
    assert list(pq.read_schema(out / "psd_vs_sd.parquet").names) == COLUMNS + EXTRA_COLUMNS
    assert (out / "psd_vs_sd.png").stat().st_size > 10_000
    md = (out / "psd_vs_sd.md").read_text()
    for heading in ("## Commands", "## Targets", "## Where psd loses", "## Online (Poisson arrivals)",
                    "## Real acceptance"):
        assert heading in md
    assert "python -m bench.psd_vs_sd --smoke" in md
    assert all(r["status"] == "ok" for r in rows), [r["note"] for r in rows if r["status"] != "ok"]


def test_closed_rows(smoke):
    _, rows = smoke
    for mode, gpus in (("psd", 2), ("sd", 1), ("ar", 1)):
        row = find(rows, part=1, mode=mode, workload="closed")[0]
        assert row["n_gpus"] == gpus and row["n_requests"] == row["completed"] == 8
        assert row["tokens_per_s"] > 0 and row["tokens_per_s_per_gpu"] == pytest.approx(row["tokens_per_s"] / gpus)
        assert 0 < row["verifier_busy"] <= 1 and row["steady_steps"] > 0
        assert row["lat_p50_s"] <= row["lat_p99_s"] and row["ttft_p99_s"] <= row["lat_p99_s"]
    psd = find(rows, part=1, mode="psd", workload="closed")[0]
    assert psd["in_flight"] == 2 * psd["batch"] and psd["t_draft_ms"] > 0 and psd["t_verify_ms"] > 0
    # the psd step takes at least its slower half: the overhead is step - max(draft, verify)
    assert psd["step_ms"] >= max(psd["t_draft_ms"], psd["t_verify_ms"]) * 0.5
    assert find(rows, mode="ar")[0]["alpha"] is None


def test_synthetic_acceptance_is_shared_across_modes(smoke):
    _, rows = smoke
    sd = find(rows, part=1, mode="sd", workload="closed")[0]
    dp = find(rows, part=2, mode="sd_dp2", workload="closed")[0]
    assert sd["acceptance"] == "synthetic" and sd["alpha"] == 0.8
    # greedy drafts of the noised tiny pair at temperature 1 are accepted far less often than 0.8
    assert 0.5 < sd["acceptance_rate"] < 1
    # same requests (seed i), split over two replicas: the very same draws
    assert dp["acceptance_rate"] == sd["acceptance_rate"]


def test_online_and_real(smoke):
    _, rows = smoke
    for mode in ("psd", "sd_dp2"):
        online = sorted(find(rows, mode=mode, workload="online"), key=lambda r: r["load"])
        assert [r["load"] for r in online] == [0.3, 0.6, 0.9]
        rates = [r["rate_rps"] for r in online]
        assert rates[0] < rates[1] < rates[2]
        assert all(r["completed"] == r["n_requests"] > 0 and r["ttft_p99_s"] < r["lat_p99_s"] for r in online)
    real = find(rows, acceptance="real")[0]
    assert real["alpha"] == real["acceptance_rate"] and 0 < real["alpha"] <= 1
    assert real["temperature"] == 0.0


def test_part2_subset_at_given_rates_through_the_collective_channel(tmp_path):
    """--part2-modes psd,real: psd alone and the real-acceptance rows; --capacity: the arrival rates an earlier run's
    baselines met (loads x capacity); --loads: which of them; --online-only: psd's online runs without its closed
    run; every row through the collective channel."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "bench.psd_vs_sd", "--smoke", "--part", "2", "--part2-modes", "psd,real",
                           "--capacity", "3", "--online-only", "--loads", "0.3,0.9", "--online-s", "1",
                           "--transport", "collective",
                           "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = pq.read_table(tmp_path / "psd_vs_sd.parquet").to_pylist()
    assert all(r["status"] == "ok" and r["transport"] == "collective" for r in rows)
    real = [r for r in rows if r["acceptance"] == "real"]   # the smoke's real-acceptance mode is sd
    assert [r["mode"] for r in real] == ["sd"] and 0 < real[0]["alpha"] < 1
    rows = [r for r in rows if r["acceptance"] != "real"]
    assert {(r["mode"], r["workload"]) for r in rows} == {("psd", "online")}
    online = sorted(find(rows, workload="online"), key=lambda r: r["load"])
    assert [r["rate_rps"] for r in online] == pytest.approx([0.9, 2.7])   # --loads 0.3,0.9 of 3 req/s
    assert all(r["duration_s"] == 1 and r["completed"] == r["n_requests"] > 0 for r in online)


def test_part2_real_rows_alone_run_nothing_else(tmp_path):
    """--part2-modes real: only the real-acceptance rows (no synthetic psd run for a capacity nobody uses), so a
    short device call spends its time on them."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "bench.psd_vs_sd", "--smoke", "--part", "2", "--part2-modes", "real",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = pq.read_table(tmp_path / "psd_vs_sd.parquet").to_pylist()
    assert [(r["mode"], r["acceptance"], r["status"]) for r in rows] == [("sd", "real", "ok")]


def test_steady_stats_of_a_psd_run_that_stayed_sequential():
    """psd below 2 x max_batch runs sd_split's schedule (psd_low_load=seq): its steady-state columns come from
    those sequential steps, with sd_split's critical path (draft + verify), not from the split steps it never
    ran; a run that mostly split is measured on its split steps (critical path max(draft, verify))."""
    from bench.psd_vs_sd import steady_stats
    from minedraft_ray.runtime.manager import StepRecord

    def steps(regime, n):
        return [StepRecord(regime=regime, sizes=(4, 0), verified=4, drafted=8, t_draft_ms=3.0, t_verify_ms=6.0,
                           step_ms=9.5) for _ in range(n)]
    seq = steady_stats([steps("seq", 40) + steps("psd", 2)], "psd")
    assert seq["steady_steps"] == 38 and seq["seq_share"] == pytest.approx(40 / 42)
    assert seq["ray_overhead_ms"] == pytest.approx(0.5) and seq["verifier_busy"] == pytest.approx(6 / 9.5)
    split = steady_stats([steps("psd", 40) + steps("seq", 2)], "psd")
    assert split["steady_steps"] == 38 and split["ray_overhead_ms"] == pytest.approx(3.5)


def test_part2_looks_up_earlier_part2_rows_without_writing_them_again(tmp_path):
    """A part 2 that runs only online (or only a baseline) takes psd's k and the arrival rates from the earlier
    part-2 closed row, where psd's best k was measured, not just from part 1's rows; those rows are not written
    again. A row of this run replaces an earlier one of the same configuration."""
    import pyarrow as pa

    from bench.psd_vs_sd import Results

    def row(part, k, tps, **extra):
        return {"part": part, "mode": "psd", "m": 64, "batch": 64, "replicas": 1, "workload": "closed", "k": k,
                "alpha_group": 0.8, "tokens_per_s": tps, "status": "ok", "device": "gpu", **extra}
    prior = tmp_path / "prior.parquet"
    pq.write_table(pa.Table.from_pylist([row(1, 1, 8000.0), row(1, 2, 9000.0), row(2, 3, 9260.0)]), prior)
    results = Results(tmp_path / "out", [prior], {2}, {"device": "gpu"})
    assert results.best_k("psd", 64, 0.8, default=4) == 3
    assert [r["k"] for r in results.rows] == [1, 2]   # part 1 kept; the part-2 row is only looked up
    assert results.find(mode="psd", k=3) == [] and results.find(mode="psd", k=3, earlier=True)[0]["tokens_per_s"] == 9260
    results.rows.append(row(2, 3, 8900.0))   # this run's row of a configuration replaces the earlier one
    assert results.best_k("psd", 64, 0.8, default=4) == 2


def test_psd_ks_gives_psds_sweep_in_order(tmp_path):
    """--psd-ks 4,5: psd's part-1 sweep runs exactly those k, in that order, then stops (the k an earlier run
    did not reach, without k = 1, 2 and the predicted balance again)."""
    import argparse

    from bench.psd_vs_sd import Bench, Results

    bench = Bench.__new__(Bench)
    bench.args = argparse.Namespace(psd_ks="4,5")
    bench.results = Results(tmp_path, [], {1}, {"device": "gpu"})
    first = bench._psd_next(64, 0.8)
    bench.results.rows.append({"part": 1, "mode": "psd", "m": 64, "batch": 64, "alpha_group": 0.8,
                               "workload": "closed", "k": first.k, "status": "ok"})
    second = bench._psd_next(64, 0.8)
    bench.results.rows.append({**bench.results.rows[-1], "k": second.k})
    assert (first.k, second.k, bench._psd_next(64, 0.8)) == (4, 5, None)


def test_merge_rows_replaces_configurations_and_keeps_the_old_rows(tmp_path):
    """bench.merge_rows: a device call's ok rows of its commit replace the results' rows of the same
    configuration (alpha group and acceptance included), add new ones, and leave the rest; the replaced rows go
    to logs/, the markdown is rewritten."""
    import shutil

    from bench.merge_rows import main as merge_main

    results = tmp_path / "psd_vs_sd.parquet"
    shutil.copy(ROOT / "bench/results/psd_vs_sd.parquet", results)
    (tmp_path / "logs").mkdir()
    old = pq.read_table(results).to_pylist()
    psd16 = next(r for r in old if r["mode"] == "psd" and r["m"] == 16 and r["k"] == 4 and r["alpha_group"] == 0.8)
    run = [{**psd16, "git_sha": "abc1234", "tokens_per_s": 9999.0},                # replaces
           {**psd16, "git_sha": "abc1234", "k": 7, "tokens_per_s": 1.0},             # a new configuration
           {**psd16, "git_sha": "abc1234", "alpha_group": 0.7, "tokens_per_s": 2.0},  # another alpha: new too
           {**psd16, "git_sha": "abc1234", "k": 8, "status": "skipped"},            # not ok: left out
           {**psd16, "git_sha": "0000000", "k": 9}]                                 # a prior row it read
    import pyarrow as pa
    pq.write_table(pa.Table.from_pylist(run), tmp_path / "run.parquet")
    assert merge_main([str(tmp_path / "run.parquet"), "--sha", "abc1234", "--results", str(results)]) == 0
    rows = pq.read_table(results).to_pylist()
    assert len(rows) == len(old) + 2
    mine = sorted((r["k"], r["alpha_group"], r["tokens_per_s"]) for r in rows if r["git_sha"] == "abc1234")
    assert mine == [(4, 0.7, 2.0), (4, 0.8, 9999.0), (7, 0.8, 1.0)]
    kept = pq.read_table(tmp_path / "logs/psd_vs_sd_replaced_by_abc1234.parquet").to_pylist()
    assert [(r["k"], r["tokens_per_s"]) for r in kept] == [(4, psd16["tokens_per_s"])]
    assert "9999" in (tmp_path / "psd_vs_sd.md").read_text()


@pytest.mark.parametrize("mults", ["1,4", "4", "1,2,4"])
def test_baseline_batches_plan_sd_and_ar_at_each(tmp_path, mults):
    """--batch-mults: ar runs at every batch listed and sd at each too, besides its k sweep at b = m, also when m
    itself is not listed (--batch-mults 4 planned no sd at 4m)."""
    import argparse

    from bench.psd_vs_sd import Bench, Results, Setup

    listed = {16 * int(x) for x in mults.split(",")}
    bench = Bench.__new__(Bench)
    bench.setup = Setup(smoke=False, models={}, ms=[16], alphas=[0.8], k_min=1, k_max=2, split_ablation=False,
                        batch_mults=tuple(int(x) for x in mults.split(",")))
    bench.args = argparse.Namespace(psd_ks=None)
    bench.results = Results(tmp_path, [], {1}, {"device": "gpu"})
    jobs = bench.plan_part1()
    planned = lambda mode: {j.estimate.batch for j in jobs if j.estimate.mode == mode}
    assert planned("sd") == listed | {16} and planned("ar") == listed
