"""The GPU-only bench scripts run end to end in their --smoke form on the CPU (tiny shapes), so they do not
rot between GPU sessions: GEMM layout sweep, graphed vs eager prefill, the drafter-kill drill."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("script, variants", [("gemm_sweep", {"linear", "matmul_t"}),
                                              ("prefill_speed", {"eager", "graph"})])
def test_sweep_smoke(tmp_path, script, variants):
    run(f"bench.{script}", "--smoke", "--out", str(tmp_path))
    rows = json.loads((tmp_path / f"{script}.json").read_text())
    assert rows and (tmp_path / f"{script}.md").read_text().startswith("# ")
    assert variants <= {r.get("variant", r.get("path")) for r in rows}
    key = "us" if script == "gemm_sweep" else "wall_ms"
    assert all(r[key] > 0 for r in rows)


def test_drafter_kill_drill_smoke(tmp_path):
    run("bench.drafter_kill", "--fake-gpus", "--modes", "psd", "--requests", "4", "--max-tokens", "30",
        "--out", str(tmp_path))
    summary = json.loads((tmp_path / "drafter_kill.json").read_text())
    assert summary["passed"] and summary["results"][0]["equal_to_ar"] == 4
