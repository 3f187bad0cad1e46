"""The GPU-only bench scripts run end to end in their --smoke form on the CPU (tiny shapes), so they do not
rot between GPU sessions: GEMM layout sweep, graphed vs eager prefill (each writes its parquet, md and png),
the drafter-kill drill, the payload hop over every route, and psd_vs_sd comparing two draft channels in one
call (the last three in the session's Ray cluster, 2 fake GPUs); and the prefill-order replay (the scheduler
alone)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]


# python -c RUN_MAINS COMMAND...: each command ("bench.x ARGS", one string) through its module's main, one after
# another in this one process (one torch import for all), between "### COMMAND" and "### exit STATUS" lines; a main
# that raises prints its traceback and gives "raised"
RUN_MAINS = """import importlib, sys, traceback
for command in sys.argv[1:]:
    module, *args = command.split()
    print("### " + command, flush=True)
    sys.argv = ["-m " + module, *args]   # what a main that reads sys.argv would see
    try:
        status = importlib.import_module(module).main(args) or 0
    except BaseException:
        traceback.print_exc()
        status = "raised"
    print(f"### exit {status}", flush=True)
"""
# the --smoke benches run without Ray, each with its own folder (prefill_speed's three workloads share one)
SMOKES = {"gemm_sweep": ("bench.gemm_sweep", "gemm_sweep", ""),
          "prefill_speed": ("bench.prefill_speed", "prefill_speed", "--workload graphs"),
          "longtail": ("bench.prefill_speed", "prefill_speed", "--workload longtail"),
          "check": ("bench.prefill_speed", "prefill_speed", "--workload check"),
          "paged_kv": ("bench.paged_kv", "paged_kv", ""),
          "fused_step_profile": ("bench.fused_step_profile", "fused_step_profile", "--bucket-sets fine,pow2")}


@pytest.fixture(scope="module")
def smokes(tmp_path_factory):
    """Every --smoke of SMOKES in one fresh process -> {name: (its folder, what it printed, its exit status)}; the
    process' stderr under "stderr"."""
    base = tmp_path_factory.mktemp("smokes")
    commands = {name: f"{module} --smoke {args} --out {base / folder}" for name, (module, folder, args) in SMOKES.items()}
    proc = subprocess.run([sys.executable, "-c", RUN_MAINS, *commands.values()], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=900)
    ran = {"stderr": proc.stderr}
    for name, command in commands.items():
        printed, _, rest = proc.stdout.partition(f"### {command}\n")[2].partition("### exit ")
        ran[name] = (base / SMOKES[name][1], printed, rest.split("\n")[0] or f"never ran (exit {proc.returncode})")
    return ran


def smoke(smokes, name):
    """The folder and printout of SMOKES[name], which must have exited 0."""
    out, printed, status = smokes[name]
    assert status == "0", f"{name}: {status}\n" + printed[-3000:] + smokes["stderr"][-3000:]
    return out, printed


@pytest.mark.parametrize("script, variants", [("gemm_sweep", {"linear", "matmul_t"}),
                                              ("prefill_speed", {"eager", "graph", "packed"})])
def test_sweep_smoke(smokes, script, variants):
    tmp_path, _ = smoke(smokes, script)
    rows = pq.read_table(tmp_path / f"{script}.parquet").to_pylist()
    md = (tmp_path / f"{script}.md").read_text()
    assert rows and md.startswith("# ") and f"python -m bench.{script} --smoke" in md and "Git: " in md
    assert (tmp_path / f"{script}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert variants <= {r.get("variant", r.get("path")) for r in rows}
    key = "us" if script == "gemm_sweep" else "wall_ms"
    assert all(r[key] > 0 and r["git_sha"] for r in rows)


def test_drafter_kill_drill_smoke(ray_cluster, tmp_path):
    from bench.drafter_kill import main

    assert main(["--fake-gpus", "--modes", "psd", "--requests", "4", "--max-tokens", "30", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "drafter_kill.json").read_text())
    assert summary["passed"] and summary["results"][0]["equal_to_ar"] == 4


def test_prefill_longtail_and_check_smoke(smokes):
    """Packed vs padded prefill on long-tailed lengths writes both rows and the ratio; the correctness check
    (packed, one at a time, chunked vs padded, fp32 and bf16) passes."""
    tmp_path, _ = smoke(smokes, "longtail")
    _, printed = smoke(smokes, "check")
    assert "all ok" in printed and printed.count(" ok") >= 6
    rows = {r["path"]: r for r in pq.read_table(tmp_path / "prefill_longtail.parquet").to_pylist()}
    assert set(rows) == {"padded", "packed"} and rows["padded"]["speedup_over_padded"] == 1.0
    assert rows["packed"]["tokens"] == rows["padded"]["tokens"] > 0 and rows["packed"]["tokens_per_s"] > 0
    assert "lognormal, median 10" in (tmp_path / "prefill_longtail.md").read_text()


def test_payload_hop_smoke(ray_cluster, tmp_path):
    """Every route of the hop benchmark, the ray_collective channel's included, in the session's cluster."""
    from bench.payload_hop import ROUTES, main

    main(["--smoke", "--out", str(tmp_path)])
    rows = pq.read_table(tmp_path / "payload_hop_cpu.parquet").to_pylist()
    assert {r["route"] for r in rows} == set(ROUTES)
    assert {(r["route"], r["probs_width"]) for r in rows} >= {("ray_collective", 0), ("ray_collective", 16),
                                                              ("link", 16)}
    assert all(r["hop_ms"] > 0 and r["trips"] > 0 for r in rows)


def test_psd_vs_sd_compares_channels_in_one_call(ray_cluster, tmp_path):
    from bench.psd_vs_sd import main

    assert main(["--smoke", "--mode", "psd", "--ks", "1", "--m", "2", "--waves", "1", "--transport",
                 "collective,ray_collective", "--out", str(tmp_path)]) == 0
    rows = pq.read_table(tmp_path / "psd_vs_sd.parquet").to_pylist()
    assert sorted(r["transport"] for r in rows) == ["collective", "ray_collective"]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows)


def test_paged_kv_smoke(smokes):
    """Concurrency (requests admitted into the pool the engine built, against the static slots of its memory),
    prefix cache (same tokens with and without it, hits with it), decode and attention-tile rows of the paged-KV
    bench."""
    tmp_path, _ = smoke(smokes, "paged_kv")
    rows = pq.read_table(tmp_path / "paged_kv.parquet").to_pylist()
    assert {r["part"] for r in rows} == {"concurrency", "prefix", "prefix tokens/s", "decode", "tiles"}
    prefix = {r["variant"]: r for r in rows if r["part"] == "prefix"}
    assert prefix["cached"]["same_tokens"] and prefix["cached"]["hit_rate"] > 0 == prefix["uncached"]["hit_rate"]
    concurrency = {r["variant"]: r for r in rows if r["part"] == "concurrency"}
    static, whole, admitted = (concurrency[v] for v in ("static", "paged, whole sequence", "paged, at admission"))
    # the smoke pool: 200 blocks of 16 tokens; each resident request holds what it was admitted with
    assert static["requests"] == static["kv_tokens"] // (256 + 10) > 0
    assert static["requests"] < whole["requests"] < admitted["requests"]
    assert whole["requests"] * whole["mean_tokens"] <= whole["kv_tokens"]
    assert all(r["step_ms"] > 0 for r in rows if r["part"] in ("decode", "tiles"))
    assert [r["chosen"] for r in rows if r["part"] == "tiles"] == ["64x64/4w"] * 2
    assert (tmp_path / "paged_kv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def test_fused_step_profile_smoke(smokes):
    """The fused-step profile's --smoke form: a decode and fused steps per batch at every chunk start (the fused
    ones' over_decode against that batch's decode), both row layouts' plans (the rows mode never walks more tiles
    in one program than 16-row blocks do), and the kernels of the decode step and of a fused step per kernel chunk
    and start, in one table by step, written with the command; each fused step under both graph bucket sets."""
    tmp_path, _ = smoke(smokes, "fused_step_profile")
    rows = pq.read_table(tmp_path / "fused_step_profile.parquet").to_pylist()
    steps = [r for r in rows if r["part"] == "step"]
    assert {(r["batch"], r["chunk_tokens"], r["chunk_start"]) for r in steps} == \
        {(b, 0, None) for b in (2, 4)} | {(b, c, s) for b in (2, 4) for c in (8, 16) for s in (0, 24)}
    assert all(r["ms"] > 0 and r["launch_tokens"] == r["batch"] + r["chunk_tokens"] for r in steps)
    assert all(r["over_decode"] == 1.0 for r in steps if r["chunk_tokens"] == 0)
    sets = [(r["batch"], r["chunk_tokens"], r["chunk_start"], r["buckets"]) for r in steps if r["chunk_tokens"]]
    assert sorted(sets) == sorted((b, c, s, name) for b in (2, 4) for c in (8, 16) for s in (0, 24)
                                  for name in ("fine", "pow2"))
    plans = {(r["batch"], r["variant"]): r for r in rows if r["part"].startswith("plan_")}
    for batch in (2, 4):
        assert plans[batch, "rows"]["programs"] > plans[batch, "blocks16"]["programs"]
        assert plans[batch, "rows"]["longest_tiles"] <= plans[batch, "blocks16"]["longest_tiles"]
    chunk_plans = {(r["chunk_tokens"], r["chunk_start"]): r for r in rows if r["part"] == "chunk_attention"}
    assert chunk_plans.keys() == {(c, s) for c in (8, 16) for s in (0, 24)}
    assert all(r["variant"] == "plan" and r["programs"] > 0 and r["splits"] >= 1 for r in chunk_plans.values())
    kernels = [r for r in rows if r["part"] == "kernels"]
    assert {(r["chunk_tokens"], r["chunk_start"]) for r in kernels} == \
        {(0, None)} | {(c, s) for c in (8, 16) for s in (0, 24)}
    assert all(r["us"] > 0 and r["batch"] == 4 for r in kernels)
    md = (tmp_path / "fused_step_profile.md").read_text()
    assert "`python -m bench.fused_step_profile --smoke --bucket-sets fine,pow2" in md and "## Kernels per step" in md
    header = next(line for line in md.splitlines() if line.startswith("| kernel |"))
    assert header == "| kernel | decode | fused 8@0 | fused 8@24 | fused 16@0 | fused 16@24 |"
    assert "| total (all kernels) |" in md
    assert (tmp_path / "fused_step_profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_packed_attention_smoke(tmp_path):
    """The packed kernel's tuner in its --smoke form (a process of its own: Triton's interpreter must be chosen
    before Triton is first imported): every variant, the launch's own and a baseline file's (here the current one,
    through the loader) at every chunk and start, each checked against a float32 reference."""
    proc = subprocess.run([sys.executable, "-m", "bench.packed_attention", "--smoke", "--baseline",
                           "minedraft_ray/engine/attention_packed_triton.py", "--out", str(tmp_path)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = pq.read_table(tmp_path / "packed_attention.parquet").to_pylist()
    assert {(r["chunk"], r["start"]) for r in rows} == {(8, 0), (8, 24)}
    assert {r["kernel"] for r in rows} == {"current, default", "current", "baseline, default"}
    assert all(r["status"] == "ok" and r["us"] > 0 and r["max_err"] < 1e-3 for r in rows), rows
    md = (tmp_path / "packed_attention.md").read_text()
    assert "`python -m bench.packed_attention --smoke --baseline" in md and "| chunk | start | baseline_us |" in md
    assert (tmp_path / "packed_attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prefill_order_sim_smoke(tmp_path):
    """The prefill-order replay (the scheduler alone, a step-cost model, in process): every order at every budget
    and long-prompt count, written with the command and the cost model; chunking bounds the gap ratio that whole
    prompts blow up, the added tail prompts each open a window, and short-first lowers the median TTFT where the
    budget cuts prompts most."""
    from bench.prefill_order_sim import COLUMNS, main

    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = pq.read_table(tmp_path / "prefill_order_sim.parquet").to_pylist()
    assert list(rows[0]) == COLUMNS
    by = {(r["order"], r["budget"], r["long_prompts"]): r for r in rows}
    assert set(by) == {(o, b, n) for n in (0, 2) for o, b in
                       [("whole", 0), ("arrival", 256), ("shortest", 256), ("arrival", 128), ("shortest", 128)]}
    assert all(r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 and r["requests"] > 0 for r in rows)
    assert all(by[o, b, 2]["n_long"] >= 2 for o, b, _ in by)
    assert all(by[o, b, 2]["long_over_quiet"] < by["whole", 0, 2]["long_over_quiet"] for o, b, _ in by if b)
    assert by["shortest", 128, 2]["ttft_p50_ms"] < by["arrival", 128, 2]["ttft_p50_ms"]
    md = (tmp_path / "prefill_order_sim.md").read_text()
    assert "`python -m bench.prefill_order_sim --smoke" in md and "verify_ms 6" in md and "a model" in md
    assert (tmp_path / "prefill_order_sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


GPT_FAST = ROOT / "third_party" / "gpt-fast"


@pytest.mark.skipif(not (GPT_FAST / "model.py").is_file(),
                    reason="gpt-fast's files are fetched into third_party/gpt-fast (ignored), not shipped")
def test_gpt_fast_peer_smoke(tmp_path):
    """The peer comparison's --smoke form: both engines' decode, verify and prefill rows, written with the
    command."""
    proc = subprocess.run([sys.executable, "-m", "bench.gpt_fast_peer", "--smoke", "--gpt-fast", str(GPT_FAST),
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = pq.read_table(tmp_path / "gpt_fast_peer.parquet").to_pylist()
    assert {(r["engine"], r["step"]) for r in rows} == {(e, s) for e in ("gpt-fast", "minedraft")
                                                        for s in ("decode", "verify", "prefill")}
    assert all(r["ms"] > 0 for r in rows)
    assert "`python -m bench.gpt_fast_peer --smoke" in (tmp_path / "gpt_fast_peer.md").read_text()


def test_parity_pairs_runtime_and_engine_rows(tmp_path):
    """bench.parity: each configuration both trees measured becomes one row with change / parent; a median row
    over repeats; engine steps pair by shape and take the ratio of step ms."""
    import pyarrow as pa

    from bench import parity

    def run(name, rows):
        path = tmp_path / name / "x.parquet"
        path.parent.mkdir()
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    closed = {"mode": "ar", "workload": "closed", "m": 16, "batch": 16, "k": None, "alpha_group": None,
              "device": "d", "status": "ok"}
    runs = [run(f"r{i}", [{**closed, "tokens_per_s": tps, "git_sha": sha}, {**closed, "m": 64, "tokens_per_s": 1.0,
                                                                           "git_sha": sha, "status": "error"}])
            for i, (tps, sha) in enumerate([(100.0, "p"), (110.0, "c"), (100.0, "p"), (90.0, "c"), (100.0, "p"),
                                            (105.0, "c")])]
    assert parity.main([*map(str, runs), "--out", str(tmp_path / "out")]) == 0
    rows = pq.read_table(tmp_path / "out" / "runtime_parity.parquet").to_pylist()
    assert sorted(round(r["change_over_parent"], 3) for r in rows if r["repeat"] != "median") == [0.9, 1.05, 1.1]
    assert [round(r["change_over_parent"], 3) for r in rows if r["repeat"] == "median"] == [1.05]

    shape = {"model": "8b", "batch": 64, "q": 1, "context": 512, "lengths": "512", "device": "d"}
    parent = run("ep", [{**shape, "ms": 6.0, "git_sha": "p"}, {**shape, "q": 5, "ms": 10.0, "git_sha": "p"}])
    change = run("ec", [{**shape, "ms": 6.6, "git_sha": "c"}])
    assert parity.main([str(parent), str(change), "--engine", "--out", str(tmp_path / "out")]) == 0
    (row,) = pq.read_table(tmp_path / "out" / "engine_parity.parquet").to_pylist()
    assert (row["q"], round(row["change_over_parent"], 3), row["git_sha_parent"]) == (1, 1.1, "p")


def test_chunk_budget_replay_reads_recorded_cycles(tmp_path, capsys):
    """The replay of the adaptive chunk's controller over recorded cycles: on a made-up run whose chunk cycles are
    exactly the base plus their class's cost, every prediction after the first of a class is exact."""
    import pyarrow as pa

    from bench.chunk_budget_replay import main

    base, added = 6.0, {128: 3.0, 256: 3.6}
    rows = []
    for step in range(120):
        launch = (128, 256)[step % 4 == 1] if step % 2 else 0
        rows.append({"mode": "ar", "engine": "fused:512@2", "workload": "online_long", "step": step,
                     "git_sha": "abc1234", "step_ms": base + added.get(launch, 0.0),
                     "prefill_launches": int(bool(launch)), "launch_tokens": launch, "prior_keys": 0})
    rows.append({**rows[0], "engine": "padded"})   # not adaptive: not replayed
    path = tmp_path / "real_traffic_steps.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert main([str(path)]) == 0
    table = capsys.readouterr().out
    line = next(row for row in table.splitlines() if row.startswith("| ar | fused:512@2 | abc1234 | 120 | 60 |"))
    assert "| 1 / 1 / 1 / 1 (n 58) |" in line, line   # the two classes' first launches predict nothing
    assert "padded" not in table
    assert line.endswith("| 0 |"), line   # no chunk cycle above 2 x the run's median (9.6 against 12 ms)
    # a 256-token cycle at 20 ms (its price predicts 9.6) and a first 512-token one at 13 (no price): above 2 x 6
    rows[-1:] = [{**rows[1], "step": 120, "step_ms": 20.0, "launch_tokens": 256},
                 {**rows[1], "step": 121, "step_ms": 13.0, "launch_tokens": 512}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("| explored 1, missed 1 |")
