"""bench/psd_vs_sd.py in its --smoke form on the CPU (tiny models, the session's Ray cluster with its fake GPUs),
run in this process as several commands into one folder: each command's rows merge by configuration, every
column is written, the markdown names each command and the plot is drawn; request i gets the same synthetic
acceptance draws in every mode that drafts for it (psd, and sd over two replicas). The statistics and the merge are checked without Ray."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.psd_vs_sd import COLUMNS, main, merge, steady_stats


@pytest.fixture(scope="module")
def smoke(ray_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("psd_vs_sd")
    commands = ["--mode psd --ks 1 --loads 0.3,0.9 --online-s 0.5",   # closed, then online at 2 loads
                "--mode sd --ks 1 --replicas 2", "--mode ar", "--mode sd --ks 2 --acceptance real"]
    for command in commands:
        assert main(["--smoke", "--m", "2", "--waves", "2", "--out", str(out), *command.split()]) == 0
    return out, pq.read_table(out / "psd_vs_sd.parquet").to_pylist()


def find(rows, **where):
    return [r for r in rows if all(r[k] == v for k, v in where.items())]


def test_files_and_columns(smoke):
    out, rows = smoke
    assert list(pq.read_schema(out / "psd_vs_sd.parquet").names)[:len(COLUMNS)] == COLUMNS
    assert (out / "psd_vs_sd.png").stat().st_size > 10_000
    md = (out / "psd_vs_sd.md").read_text()
    for heading in ("## Commands", "## Closed workload", "## Online (Poisson arrivals)", "## Real acceptance"):
        assert heading in md
    assert md.count("`python -m bench.psd_vs_sd --smoke") == 4
    assert len(rows) == 6 and all(r["status"] == "ok" and r["git_sha"] for r in rows)


def test_closed_rows(smoke):
    _, rows = smoke
    for mode, gpus in (("psd", 2), ("sd", 1), ("ar", 1)):
        row = find(rows, mode=mode, workload="closed")[0]
        assert row["n_gpus"] == gpus and row["n_requests"] == row["completed"] == 8
        assert row["tokens_per_s"] > 0 and row["tokens_per_s_per_gpu"] == pytest.approx(row["tokens_per_s"] / gpus)
        assert 0 < row["verifier_busy"] <= 1 and row["steady_steps"] > 0
        assert row["lat_p50_s"] <= row["lat_p99_s"] and row["ttft_p99_s"] <= row["lat_p99_s"]
    psd = find(rows, mode="psd", workload="closed")[0]
    assert psd["in_flight"] == 2 * psd["batch"] and psd["t_draft_ms"] > 0 and psd["t_verify_ms"] > 0
    assert find(rows, mode="ar")[0]["alpha"] is None


def test_synthetic_acceptance_is_shared_across_modes(smoke):
    _, rows = smoke
    psd = find(rows, mode="psd", workload="closed", acceptance="synthetic")[0]
    dp = find(rows, mode="sd_dp2", workload="closed")[0]
    assert psd["alpha"] == 0.8 and 0.5 < psd["acceptance_rate"] < 1
    # same requests (seed i) in another mode, split over two replicas: the very same draws
    assert dp["acceptance_rate"] == psd["acceptance_rate"] and dp["n_gpus"] == 2


def test_online_and_real(smoke):
    _, rows = smoke
    online = sorted(find(rows, mode="psd", workload="online"), key=lambda r: r["load"])
    closed = find(rows, mode="psd", workload="closed")[0]
    capacity = closed["n_requests"] / closed["run_s"]   # no --capacity: this run's closed-loop capacity
    assert [r["rate_rps"] for r in online] == pytest.approx([0.3 * capacity, 0.9 * capacity])
    assert all(r["completed"] == r["n_requests"] > 0 and r["ttft_p99_s"] < r["lat_p99_s"] for r in online)
    real = find(rows, acceptance="real")[0]
    assert real["alpha"] == real["acceptance_rate"] and 0 < real["alpha"] <= 1
    assert real["temperature"] == 0.0 and real["alpha_group"] is None


def test_steady_stats_of_a_psd_run_that_stayed_sequential():
    """psd below 2 x max_batch runs sd_split's schedule: its steady-state columns come from those sequential
    steps, with sd_split's critical path (draft + verify); a run that mostly split is measured on its split
    steps (critical path max(draft, verify))."""
    from minedraft_ray.runtime.manager import StepRecord

    def steps(regime, n):
        return [StepRecord(regime=regime, sizes=(4, 0), verified=4, drafted=8, t_draft_ms=3.0, t_verify_ms=6.0,
                           step_ms=9.5) for _ in range(n)]
    seq = steady_stats([steps("seq", 40) + steps("psd", 2)], "psd")
    assert seq["steady_steps"] == 38 and seq["seq_share"] == pytest.approx(40 / 42)
    assert seq["ray_overhead_ms"] == pytest.approx(0.5) and seq["verifier_busy"] == pytest.approx(6 / 9.5)
    split = steady_stats([steps("psd", 40) + steps("seq", 2)], "psd")
    assert split["steady_steps"] == 38 and split["ray_overhead_ms"] == pytest.approx(3.5)


def test_merge_rows_replaces_configurations_and_keeps_the_rest(tmp_path):
    """bench.merge_rows: a run's ok rows replace the results' rows of the same configuration (alpha group and
    acceptance included) and add new ones; the rest stay; the markdown and plot are written again."""
    from bench.merge_rows import main as merge_main

    def row(k, tps, **extra):
        return {"mode": "psd", "workload": "closed", "m": 16, "batch": 16, "k": k, "replicas": 1, "alpha_group": 0.8,
                "alpha": 0.8, "acceptance": "synthetic", "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / 2,
                "status": "ok", "git_sha": "old", "n_gpus": 2, "verifier_busy": 0.9, "t_draft_ms": 1.0,
                "t_verify_ms": 2.0, "step_ms": 2.1, **extra}
    results, run = tmp_path / "psd_vs_sd.parquet", tmp_path / "run.parquet"
    pq.write_table(pa.Table.from_pylist([row(3, 100.0), row(4, 200.0)]), results)
    pq.write_table(pa.Table.from_pylist([row(4, 999.0, git_sha="new"),                    # replaces
                                         row(5, 1.0, git_sha="new"),                      # a new configuration
                                         row(4, 2.0, git_sha="new", alpha_group=0.6),     # another alpha: new too
                                         row(6, 3.0, git_sha="new", status="failed")]), run)  # not ok: left out
    assert merge_main([str(run), "--results", str(results)]) == 0
    rows = pq.read_table(results).to_pylist()
    assert sorted((r["k"], r["alpha_group"], r["tokens_per_s"], r["git_sha"]) for r in rows) == [
        (3, 0.8, 100.0, "old"), (4, 0.6, 2.0, "new"), (4, 0.8, 999.0, "new"), (5, 0.8, 1.0, "new")]
    assert "999" in (tmp_path / "psd_vs_sd.md").read_text() and (tmp_path / "psd_vs_sd.png").is_file()


def test_merge_keeps_order_and_replaces_in_place():
    old = [{"mode": "sd", "k": 1, "tokens_per_s": 1.0}, {"mode": "psd", "k": 1, "tokens_per_s": 2.0}]
    new = [{"mode": "psd", "k": 1, "tokens_per_s": 3.0}, {"mode": "ar", "k": 0, "tokens_per_s": 4.0}]
    assert [r["tokens_per_s"] for r in merge(old, new)] == [1.0, 3.0, 4.0]


def test_tp_counts_the_targets_gpus_and_old_rows_ran_at_tp_1(tmp_path):
    """A replica spans the target's tp GPUs plus the drafter's (psd, sd_split); rows written before the tp column
    read as tp 1, so a new tp-1 row replaces its old configuration."""
    from bench.psd_vs_sd import CONFIG, Spec, read_rows
    assert "tp" in CONFIG and "tp" in COLUMNS
    assert [Spec(mode, 8, 2, 0.8, tp=4).n_gpus for mode in ("psd", "sd_split", "sd", "ar")] == [5, 5, 4, 4]
    assert Spec("psd", 8, 2, 0.8, replicas=2, tp=2).n_gpus == 6
    path = tmp_path / "old.parquet"
    pq.write_table(pa.Table.from_pylist([{"mode": "psd", "k": 2, "tokens_per_s": 1.0}]), path)
    assert [r["tokens_per_s"] for r in merge(read_rows(path), [{"mode": "psd", "k": 2, "tp": 1, "tokens_per_s": 2.0},
                                                               {"mode": "psd", "k": 2, "tp": 2, "tokens_per_s": 3.0}])
            ] == [2.0, 3.0]
