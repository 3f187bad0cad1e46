"""The GPU-only bench scripts run end to end in their --smoke form on the CPU (tiny shapes), so they do not
rot between GPU sessions: GEMM layout sweep, graphed vs eager prefill (each writes its parquet, md and png),
the drafter-kill drill, the payload hop over every route, and psd_vs_sd comparing two draft channels in one
call (the last three in the session's Ray cluster, 2 fake GPUs)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, variants", [("gemm_sweep", {"linear", "matmul_t"}),
                                              ("prefill_speed", {"eager", "graph", "packed"})])
def test_sweep_smoke(tmp_path, script, variants):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", f"bench.{script}", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
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


def test_prefill_longtail_and_check_smoke(tmp_path):
    """Packed vs padded prefill on long-tailed lengths writes both rows and the ratio; the correctness check
    (packed, one at a time, chunked vs padded, fp32 and bf16) passes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for workload in ("longtail", "check"):
        proc = subprocess.run([sys.executable, "-m", "bench.prefill_speed", "--smoke", "--workload", workload,
                               "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all ok" in proc.stdout and proc.stdout.count(" ok") >= 6
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


def test_paged_kv_smoke(tmp_path):
    """Concurrency, prefix cache (same tokens with and without it, hits with it) and decode rows of the paged-KV
    bench."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "bench.paged_kv", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = pq.read_table(tmp_path / "paged_kv.parquet").to_pylist()
    assert {r["part"] for r in rows} == {"concurrency", "prefix", "prefix tokens/s", "decode"}
    prefix = {r["variant"]: r for r in rows if r["part"] == "prefix"}
    assert prefix["cached"]["same_tokens"] and prefix["cached"]["hit_rate"] > 0 == prefix["uncached"]["hit_rate"]
    concurrency = next(r for r in rows if r["part"] == "concurrency")
    assert concurrency["peak_running"] > 0 and concurrency["slots_static"] > 0
    assert all(r["step_ms"] > 0 for r in rows if r["part"] == "decode")
    assert (tmp_path / "paged_kv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
