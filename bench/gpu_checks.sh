#!/usr/bin/env bash
# The single-GPU-and-Serve checks of a session on the 2x H200 machine, each under its own time limit (about
# 7 minutes in all), leaving at most 8 files in $OUT (what the device tool brings back):
#   CUDA kernel tests, the engine step table (8B and 1B, against transformers), the Serve smoke run of
#   deployments/minedraft-gpu.yaml, the default pair's speed-ups.
#   OUT=/some/dir GIT_SHA=<sha> bash bench/gpu_checks.sh
# The psd benchmark runs separately, one configuration per command (bench/psd_vs_sd.py says how).
set -u
: "${OUT:?}"
S=$(date +%s)
say() { echo "[$(( $(date +%s) - S )) s] $*"; }

timeout 100 python -m pytest -q -p no:cacheprovider tests/test_attention_triton.py tests/test_rejection.py \
  tests/test_sampling.py tests/test_cuda_graphs.py tests/test_cuda_overlap.py -k cuda > "$OUT/cuda_tests.log" 2>&1
rc=$?; say "cuda tests rc=$rc: $(tail -1 "$OUT/cuda_tests.log")"
if grep -qi "FAILED.*rope" "$OUT/cuda_tests.log"; then export MINEDRAFT_ROPE_KV_KERNEL=0; say "RoPE/KV kernel off for the rest"; fi

timeout 150 python -m bench.engine_speed --out "$OUT/engine" > /tmp/engine_speed.log 2>&1
say "engine_speed rc=$?"; grep -E '^\| (8b|1b) ' /tmp/engine_speed.log | tail -20

timeout 200 python -m bench.serve_smoke --out "$OUT/smoke" > "$OUT/serve_smoke.log" 2>&1
say "serve smoke rc=$?"; grep -E "^API|^request|streams|^engine" "$OUT/serve_smoke.log"
tail -c 2000 "$OUT/smoke/serve_smoke_server.log"; rm -f "$OUT/smoke/serve_smoke_server.log" "$OUT/smoke/serve_config.yaml"

timeout 240 python -m bench.default_pair_speed --out "$OUT/default_pair" > /tmp/default_pair_speed.log 2>&1
say "default pair rc=$?"; grep "^{" /tmp/default_pair_speed.log
