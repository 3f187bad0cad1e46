"""bench/real_traffic.py: its workload and statistics without Ray, and its --smoke form on the CPU (tiny models,
the session's Ray cluster): both engines in both modes, the files written with the command, the workload's
parameters and the target ratios."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.common import write_results
from bench.real_traffic import (COLUMNS, TAIL_IDS, EngineSpec, Requests, Trace, Workload, long_arrivals,
                                long_prompt_gaps, main)


def test_prompt_lengths_are_long_tailed_and_seeded():
    work = Workload()
    requests = Requests(work, vocab=1000)
    lengths = np.array([len(requests(i)[0]) for i in range(3000)])
    assert 250 <= np.median(lengths) <= 350 and 2200 <= np.percentile(lengths, 99) <= 3600
    outs = [requests(i)[1].max_tokens for i in range(300)]
    assert min(outs) >= 64 and max(outs) <= 512
    assert all(len(requests(i)[0]) + requests(i)[1].max_tokens <= work.max_len for i in range(3000))
    assert requests(7)[0] == Requests(work, vocab=1000)(7)[0]


def test_tail_requests_are_long_seeded_and_fit_the_context():
    """online_long's added prompts: from the lognormal above long_tokens (so >= long_tokens, spread over the tail,
    not piled at its start), within the context, the same in every engine; evenly spaced arrivals."""
    work = Workload()
    requests = Requests(work, vocab=1000)
    lengths = np.array([len(requests(TAIL_IDS + i)[0]) for i in range(1000)])
    assert lengths.min() >= work.long_tokens and np.median(lengths) > 2400
    assert all(len(p) + s.max_tokens <= work.max_len for p, s in map(requests, range(TAIL_IDS, TAIL_IDS + 300)))
    assert requests(TAIL_IDS + 3)[0] == Requests(work, vocab=1000)(TAIL_IDS + 3)[0]
    assert long_arrivals(4, 8.0) == [1.0, 3.0, 5.0, 7.0]


def test_long_prompt_gaps_split_the_gaps_by_overlap():
    traces = [Trace(0.0, 10, [0.10, 0.11, 0.12, 0.50]),   # its 0.12 -> 0.50 gap overlaps the long prefill
              Trace(0.20, 3000, [0.45, 0.46])]
    stats = long_prompt_gaps(traces, long_tokens=2000)
    assert stats["n_long"] == 1
    assert stats["gap_long_p99_ms"] == pytest.approx(380, rel=1e-3)
    assert stats["gap_quiet_p50_ms"] == pytest.approx(10, rel=1e-3)
    assert stats["long_over_quiet"] == pytest.approx(38, rel=1e-2)


def test_smoke(ray_cluster, tmp_path):
    # sd only (ar is the same code without the drafter): three engines built, the suite's time kept short. Half a
    # second of arrivals per online run: the load is a share of the padded engine's closed capacity (~150 requests/s
    # on an idle CPU), which the chunked and fused engines fall behind, so every second of it costs seconds of drain
    assert main(["--smoke", "--modes", "sd", "--n-closed", "6", "--loads", "0.5", "--online-s", "0.5", "--chunk", "16",
                 "--long-prompts", "2", "--engines", "padded,chunked,fused@1.5/typical", "--steps",
                 "--out", str(tmp_path)]) == 0
    assert list(pq.read_schema(tmp_path / "real_traffic.parquet").names) == COLUMNS
    rows = pq.read_table(tmp_path / "real_traffic.parquet").to_pylist()
    closed = {(r["mode"], r["engine"]): r for r in rows if r["workload"] == "closed"}
    # fused@1.5/typical: fused, chunks sized from its step times (chunk_gap_ratio, typical reference) in the budget
    assert set(closed) == {("sd", "padded"), ("sd", "chunked"), ("sd", "fused@1.5/typical")}
    for (mode, engine), r in closed.items():
        assert r["completed"] == 6 and r["tokens_per_s"] > 0
        # fused chunks' time is inside their verifies': no prefill rate then
        fused = engine == "fused@1.5/typical"
        assert r["prefill_tokens_per_s"] > 0 if not fused or not r["fused_prefills"] else \
            r["prefill_tokens_per_s"] is None
        assert r["prefill_chunk_tokens"] == (0 if engine == "padded" else 16)
        assert r["fused_prefill"] == fused and r["chunk_gap_ratio"] == (1.5 if fused else 0.0)
        assert r["fused_prefills"] == 0 or fused
        assert r["verify_ms_p50"] > 0 and (r["fused_verify_ms_p50"] is None) == (r["fused_prefills"] == 0)
    # more prefill tasks than requests only where prompts are cut
    assert closed[("sd", "chunked")]["prefill_tasks"] > closed[("sd", "padded")]["prefill_tasks"]
    online = [r for r in rows if r["workload"] == "online"]
    assert len({r["rate_rps"] for r in online}) == 1   # the same absolute rate for both engines
    assert all(r["completed"] >= 1 and r["ttft_p50_ms"] > 0 for r in online)
    assert {r["engine"] for r in rows if r["workload"] == "online_pooled"} == {"padded", "chunked", "fused@1.5/typical"}
    assert all(r["prefill_order"] == "shortest" for r in rows)
    # online_long: the added long prompts each open a window of the gap ratio
    long = [r for r in rows if r["workload"] == "online_long"]
    assert {r["engine"] for r in long} == {"padded", "chunked", "fused@1.5/typical"}
    assert all(r["added_long"] == 2 and r["n_long"] >= 2 and r["gap_quiet_p50_ms"] > 0 for r in long)
    # --steps: online_long's verifier cycles, each with its prompt tokens and the launches that carried them
    steps = pq.read_table(tmp_path / "real_traffic_steps.parquet").to_pylist()
    assert {r["engine"] for r in steps} == {"padded", "chunked", "fused@1.5/typical"}
    adaptive = [r for r in steps if r["engine"] == "fused@1.5/typical"]
    assert all(r["chunk_limit"] is not None and r["chunk_key_ms"] is not None and r["chunk_margin"] is not None
               for r in adaptive)
    assert all(r["step_ms"] > 0 for r in steps)
    assert all(r["chunk_limit"] is None for r in steps if r["engine"] != "fused@1.5/typical")
    assert all((r["prefill_launches"] > 0) == (r["prefill_tokens"] > 0) for r in steps)
    # chunked: chunks of their own, within the budget, and some steps carried one
    assert 0 < max(r["launch_tokens"] for r in steps if r["engine"] == "chunked") <= 16
    md = (tmp_path / "real_traffic.md").read_text()
    assert "`python -m bench.real_traffic --smoke" in md and "lognormal" in md and "seed 0" in md
    assert "prefill prompt tokens/s chunked / padded" in md and "fused" in md
    assert "online_long: 0.5 s of Poisson arrivals" in md and "long prompts (online_long; target <= 2)" in md
    assert (tmp_path / "real_traffic.png").is_file()


def test_merge_replaces_and_adds_configurations(tmp_path):
    """--merge: a run's rows replace the results' of the same mode, engine, workload and load and add the rest; the
    md lists every run's command and the ratios of the new engine (the committed results as the old rows)."""
    import shutil

    from pathlib import Path

    from bench.real_traffic import NAME

    shutil.copy(Path(__file__).resolve().parent.parent / "bench" / "results" / f"{NAME}.parquet",
                tmp_path / f"{NAME}.parquet")
    old = pq.read_table(tmp_path / f"{NAME}.parquet").to_pylist()
    closed = next(r for r in old if (r["mode"], r["engine"], r["workload"]) == ("ar", "padded", "closed"))
    run = [{**closed, "tokens_per_s": 1.0, "command": "python -m bench.real_traffic --run-a", "git_sha": "aaaaaaa"},
           {**closed, "engine": "fused:384@1.5", "tokens_per_s": 2.0, "chunk_gap_ratio": 1.5,
            "command": "python -m bench.real_traffic --run-a", "git_sha": "aaaaaaa"}]
    write_results(run, tmp_path / "run", NAME, COLUMNS, "run", run[0]["command"], run[0]["device"])
    # its --steps: two cycles of the adaptive engine, one with a chunk in a 300-token launch (class 320)
    steps = [{"mode": "ar", "engine": "fused:384@1.5", "workload": "online_long", "step": i, "step_ms": ms,
              "prefill_tokens": tokens, "prefill_launches": int(tokens > 0), "launch_tokens": launch,
              "chunk_limit": 320, "git_sha": "aaaaaaa", "command": "python -m bench.real_traffic --run-a --steps",
              "device": closed["device"]} for i, (ms, tokens, launch) in enumerate([(6.0, 0, 0), (11.0, 280, 300)])]
    pq.write_table(pa.Table.from_pylist(steps), tmp_path / "run" / f"{NAME}_steps.parquet")
    assert main(["--merge", str(tmp_path / "run" / f"{NAME}.parquet"), "--out", str(tmp_path)]) == 0
    rows = pq.read_table(tmp_path / f"{NAME}.parquet").to_pylist()
    assert len(rows) == len(old) + 1
    by = {(r["mode"], r["engine"], r["workload"], r["load"]): r for r in rows}
    assert by["ar", "padded", "closed", None]["tokens_per_s"] == 1.0
    assert by["ar", "fused:384@1.5", "closed", None]["chunk_gap_ratio"] == 1.5
    md = (tmp_path / f"{NAME}.md").read_text()
    assert "Rows from: " in md and "--run-a` at aaaaaaa" in md and "closed tok/s fused:384@1.5 / padded = 2.00" in md
    # the run's steps are merged beside the results' and described, in real_traffic.md and their own md and plot
    merged_steps = pq.read_table(tmp_path / f"{NAME}_steps.parquet").to_pylist()
    steps_md = (tmp_path / f"{NAME}_steps.md").read_text()
    assert "`python -m bench.real_traffic --run-a --steps`" in steps_md and "aaaaaaa" in steps_md
    assert (tmp_path / f"{NAME}_steps.png").is_file()
    assert [r["step_ms"] for r in merged_steps if r["engine"] == "fused:384@1.5"] == [6.0, 11.0]
    assert ("ar fused:384@1.5, online_long's cycles (steps parquet): 1 with a prompt chunk, P50/P99 11.0/11.0 ms, "
            "against 1 without, P50/P99 6.00/6.00 ms; by launch class (tokens: cycles, P50/P99 ms) 320: 1, "
            "11.0/11.0") in md
    # a later run wins; a run on another device (or batch, k, alpha) is refused, the results untouched
    later = [{**run[0], "tokens_per_s": 3.0, "command": "python -m bench.real_traffic --run-b"}]
    write_results(later, tmp_path / "later", NAME, COLUMNS, "run", later[0]["command"], later[0]["device"])
    assert main(["--merge", str(tmp_path / "run" / f"{NAME}.parquet"), str(tmp_path / "later" / f"{NAME}.parquet"),
                 "--out", str(tmp_path)]) == 0
    rows = pq.read_table(tmp_path / f"{NAME}.parquet").to_pylist()
    assert [r["tokens_per_s"] for r in rows if (r["mode"], r["engine"], r["workload"]) == ("ar", "padded", "closed")
            ] == [3.0]
    cpu = [{**run[0], "device": "2 x CPU (smoke)"}]
    write_results(cpu, tmp_path / "cpu", NAME, COLUMNS, "run", cpu[0]["command"], cpu[0]["device"])
    with pytest.raises(SystemExit, match="would mix"):
        main(["--merge", str(tmp_path / "cpu" / f"{NAME}.parquet"), "--out", str(tmp_path)])
    assert pq.read_table(tmp_path / f"{NAME}.parquet").to_pylist() == rows


def test_engine_specs_parse_budget_ratio_and_reference():
    assert EngineSpec.parse("fused") == EngineSpec("fused")
    assert EngineSpec.parse("fused:256") == EngineSpec("fused", 256)
    assert EngineSpec.parse("fused:512@2") == EngineSpec("fused", 512, 2.0)
    assert EngineSpec.parse("fused:512@2/typical") == EngineSpec("fused", 512, 2.0, "typical")
    for bad in ("padded:256", "padded@2", "fused/typical", "fused@2/usual", "fused@2/", "fused@/typical", "wide"):
        with pytest.raises(ValueError):
            EngineSpec.parse(bad)
