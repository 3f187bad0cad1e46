#!/usr/bin/env bash
# The 2x H200 runs issue #3 still needs, in one device call of at most ~9.5 minutes, leaving at most 8 files in
# $OUT (what the device tool brings back):
#   1. the drafter-kill drill on the GPUs (bench/drafter_kill.py: psd and sd_split, output == ar, restart);
#   2. the verifier_overlap A/B: part 1 at m=64, alpha 0.8, k 1..3 with --verifier-overlap, to read against the
#      committed part-1 rows (launch_gap_ms, verifier_busy, ray_overhead_ms, step_ms).
#   OUT=/some/dir GIT_SHA=<sha> bash bench/gpu_psd_checks.sh
set -u
: "${OUT:?}"
S=$(date +%s)
say() { echo "[$(( $(date +%s) - S )) s] $*"; }

timeout 320 python -m bench.drafter_kill --out "$OUT" > "$OUT/drafter_kill.log" 2>&1
say "drafter kill rc=$?"; grep -E '^\{"mode"|^ar reference' "$OUT/drafter_kill.log"

left=$(( 560 - ($(date +%s) - S) ))
if [ "$left" -gt 120 ]; then
  timeout "$left" python -m bench.psd_vs_sd --part 1 --ms 64 --alphas 0.8 --k-max 3 --batch-mults 1 --temperature 0 \
    --verifier-overlap --budget-s $(( left - 30 )) --out "$OUT/overlap" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' \
    > "$OUT/overlap.log"
  say "overlap A/B rc=$?"; grep -E '^\[|^skipped' "$OUT/overlap.log" | tail -12
else
  say "no time left for the overlap A/B"
fi
rm -f "$OUT/overlap/psd_vs_sd.png"
