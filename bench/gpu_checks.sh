#!/usr/bin/env bash
# The GPU checks of one session on the 2x H200 machine, each under its own time limit, logs in $OUT:
# CUDA kernel tests, the attention launch-config sweep, the 8B decode step (default and swept config),
# the Serve smoke run of deployments/minedraft-gpu.yaml and the default pair's speed-ups.
#   OUT=/some/dir GIT_SHA=<sha> bash bench/gpu_checks.sh
set -u
: "${OUT:?}"
S=$(date +%s)
say() { echo "[$(( $(date +%s) - S )) s] $*"; }

timeout 100 python -m pytest -q -p no:cacheprovider tests/test_attention_triton.py tests/test_rejection.py \
  tests/test_sampling.py -k cuda > "$OUT/cuda_tests.log" 2>&1
rc=$?; say "cuda tests rc=$rc: $(tail -1 "$OUT/cuda_tests.log")"
if [ $rc -ne 0 ]; then export MINEDRAFT_ROPE_KV_KERNEL=0; say "RoPE/KV kernel off for the rest"; fi

timeout 80 python -m bench.attention_sweep --out "$OUT/sweep" --budget-s 50 > "$OUT/attention_sweep.log" 2>&1
say "attention sweep rc=$?"
timeout 90 python -m bench.engine_speed --models 8b --batches 64 --no-transformers --profile 8b:64:1 \
  --out "$OUT/engine" > "$OUT/engine_speed.log" 2>&1
say "engine_speed rc=$?: $(grep -E '^\| 8b \| 64 \| 1 \| 512' "$OUT/engine_speed.log" | tail -1)"
best=$(python -c "import json,sys; print(json.dumps(json.load(open('$OUT/sweep/attention_sweep.json'))['best']['1']['config']))" 2>/dev/null)
if [ -n "$best" ]; then
  MINEDRAFT_ATTN_CONFIG="$best" timeout 90 python -m bench.engine_speed --models 8b --batches 64 --no-transformers \
    --out "$OUT/engine_tuned" > "$OUT/engine_speed_tuned.log" 2>&1
  say "engine_speed with $best rc=$?: $(grep -E '^\| 8b \| 64 \| 1 \| 512' "$OUT/engine_speed_tuned.log" | tail -1)"
fi

timeout 170 python -m bench.serve_smoke --out "$OUT/smoke" > "$OUT/serve_smoke.log" 2>&1
say "serve smoke rc=$?"; grep -E "^API|^request|streams" "$OUT/serve_smoke.log"
timeout 140 python -m bench.default_pair_speed --out "$OUT/default_pair" > "$OUT/default_pair_speed.log" 2>&1
say "default pair rc=$?"; grep "^{" "$OUT/default_pair_speed.log"
