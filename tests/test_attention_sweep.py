"""bench/attention_sweep.py --smoke end to end (tiny shape, 2 configs; Triton's interpreter without a GPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_writes_best_config_per_q(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.attention_sweep", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "attention_sweep.json").read_text())
    assert [r["status"] for r in result["rows"]] == ["ok"] * 4, result["rows"]
    assert set(result["best"]) == {"1", "5"}
    for best in result["best"].values():
        assert best["us"] > 0 and set(best["config"]) >= {"BLOCK_N", "num_warps", "num_stages", "TARGET_WAVES"}
    assert "MINEDRAFT_ATTN_CONFIG=" in proc.stdout
