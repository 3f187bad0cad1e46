#!/usr/bin/env bash
# The 2x H200 runs issue #3 needs, one device call (at most ~9.5 minutes) per stage, each leaving at most 8 files
# in $OUT (what the device tool brings back). Run on the device (kind nvidia-h200-x2, carry [".gpu-wheels"]):
#   site=$(mktemp -d) && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#     --target "$site" .gpu-wheels/*.whl && export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 \
#     MINEDRAFT_CACHE=/tmp/mdcache GIT_SHA=<sha> || exit 1; OUT=$OUT STAGE=13 bash bench/gpu_psd_checks.sh
# Back here: python -m bench.merge_rows <files_at>/*/psd_vs_sd.parquet --sha <sha>, then python -m bench.plot
# bench/results/psd_vs_sd.parquet --out bench/results/psd_vs_sd.png; keep the logs in bench/results/logs/.
#
#   STAGE=1: the CUDA tests of the overlap copies and graphs; a draft's Ray hop on this host (bench.payload_hop, with
#            packed q of width 128: probabilistic drafting's payload);
#            the default pair in float32 (greedy outputs of sd, sd_split and psd == ar's, token for token, on the
#            GPUs); part 1 of bench.psd_vs_sd (closed workloads, m = 16 then 64, k sweeps, the sd / ar baselines)
#            in what time is left.
#   STAGE=2: the CUDA tests, then part 2 (online Poisson arrivals psd / sd_split / sd_dp2, closed data-parallel
#            baselines, the real-acceptance pair), its best k taken from the committed rows.
#   What #3's grid still lacks (session 9); the one-off stages 3-12 that ran before are in git history:
#   STAGE=13: m = 64, alpha 0.8: psd and sd at k = 4, 5 (the sweep "at least to 5"), ar_dp2 online at 90 %, then
#            sd and ar at b = 256 (4m) in what time is left.
#   STAGE=14: m = 64, alpha 0.6: psd's sweep k = 1-5 and sd at the k psd ran.
#   STAGE=15: online only, psd and sd_split at psd's best closed k (3), 60 s per load (builds ~135 s), same call.
#   STAGE=16: the 4m baselines at m = 16 (sd k = 2 and ar at b = 64, after b = 16 again), one per GPU.
#   STAGE=17: 16, then 14 in the time left (both in one call, by stage 13's timings).
#   STAGE=18: 16's b = 64 rows alone (LIMIT=seconds, default 170).
#   STAGE=19, 20: what the grid still lacks after session 10 (below); one call each.
#   STAGE=21: psd at m = 128 (256 requests in flight, as many as sd's best batch 4m at m = 64) against sd at
#            b = 128 and 256 on the same 2048 requests, alpha 0.8 then 0.6 (LIMIT=seconds, default 540; not run:
#            22 ran its alpha 0.8 part).
#   STAGE=22: ar_dp2 online at 90 % for 60 s (20 skipped it: its budget missed by 2 s), then 21 at alpha 0.8 in the rest.
#   STAGE=23: sd at b = 256 (4m) at k = 2 on the m = 64 workload, alpha 0.8 (its b = 256 row ran k = 3; at m = 128
#            k = 2 was sd's best at b = 256), after b = 64 again (LIMIT=seconds, default 230; 230 ran b = 64 only).
set -u
: "${OUT:?}"
STAGE=${STAGE:-1}
S=$(date +%s)
say() { echo "[$(( $(date +%s) - S )) s] $*"; }
left() { echo $(( ${1:-560} - ($(date +%s) - S) )); }

psd_vs_sd() {   # NAME LIMIT_S ARGS...: python -m bench.psd_vs_sd ARGS, its rows in $OUT/NAME/, its log in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  timeout "$limit" python -m bench.psd_vs_sd "$@" --out "$OUT/$name" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' \
    > "$OUT/$name.log"
  say "$name rc=${PIPESTATUS[0]}"; grep -E '^\[|^skipped|^failed|^online|^part 2' "$OUT/$name.log" | tail -30
  rm -f "$OUT/$name/psd_vs_sd.png" "$OUT/$name/psd_vs_sd.md"   # at most 8 files come back: the rows are in the log
}

cuda_tests() {
  timeout "$1" python -m pytest -q -x -p no:cacheprovider tests/test_cuda_overlap.py tests/test_cuda_graphs.py \
    > "$OUT/cuda_tests.log" 2>&1
  say "CUDA tests rc=$?"; tail -2 "$OUT/cuda_tests.log"
}

SYNTH=(--alphas 0.8 --k-max 5 --temperature 0)   # synthetic acceptance 0.8, greedy, k up to 5
ONLINE=(--online-only --capacity 51.911 --prior bench/results/psd_vs_sd.parquet --ms 64)   # every earlier run's rates

if [ "$STAGE" = 1 ]; then
  cuda_tests 150
  timeout 90 python -m bench.payload_hop --trips 200 --rounds 2 --probs-widths 128 --out "$OUT/payload_hop" \
    > "$OUT/payload_hop.log" 2>&1
  say "payload hop rc=$?"; grep "^{" "$OUT/payload_hop.log" | cut -c1-160
  rm -f "$OUT/payload_hop/"*.png "$OUT/payload_hop/"*.md
  timeout 240 python -m bench.default_pair_speed --dtype float32 --out "$OUT/default_pair_fp32" \
    > "$OUT/default_pair_fp32.log" 2>&1
  say "default pair rc=$?"; grep "^{" "$OUT/default_pair_fp32.log" | cut -c1-260
  rm -f "$OUT/default_pair_fp32/"*.png "$OUT/default_pair_fp32/"*.md
  l=$(left)
  psd_vs_sd psd1 "$l" --part 1 --ms 16,64 "${SYNTH[@]}" --batch-mults 1,2 --budget-s $(( l - 25 ))
elif [ "$STAGE" = 13 ]; then
  psd_vs_sd m64k45 265 --part 1 --part1-modes psd,sd --psd-ks 4,5 --sd-ks 4,5 --batch-mults 1 --prior /nonexistent \
    --ms 64 "${SYNTH[@]}" --budget-s 250
  # ar_dp2's build took 77 s at 6bc5a92: 160 s fit it and 50 s of arrivals
  psd_vs_sd ar_dp2 170 --part 2 --part2-modes ar_dp2 "${ONLINE[@]}" --loads 0.9 --online-s 50 "${SYNTH[@]}" \
    --budget-s 160
  l=$(left 565)   # the 4m baselines (sd, ar at b = 256), after b = 64 again: two at a time, one per GPU
  [ "$l" -gt 90 ] && psd_vs_sd b4m "$l" --part 1 --part1-modes sd,ar --sd-ks 3 --batch-mults 1,4 --prior /nonexistent \
    --ms 64 "${SYNTH[@]}" --budget-s $(( l - 12 ))
elif [ "$STAGE" = 14 ]; then
  psd_vs_sd a06m64 555 --part 1 --part1-modes psd,sd --batch-mults 1 --prior /nonexistent --ms 64 --alphas 0.6 \
    --k-max 5 --temperature 0 --budget-s 540
elif [ "$STAGE" = 17 ]; then   # 16 then 14 in one call: stage 13 built psd in ~110 s and ran a 1024-request m = 64
  # psd row in ~18 s, sd two at a time, so 16 fits ~190 s and 14 the ~360 s after it
  psd_vs_sd b4m16 200 --part 1 --part1-modes sd,ar --sd-ks 2 --batch-mults 1,4 --prior /nonexistent --ms 16 \
    "${SYNTH[@]}" --budget-s 188
  l=$(left 565)
  psd_vs_sd a06m64 "$l" --part 1 --part1-modes psd,sd --batch-mults 1 --prior /nonexistent --ms 64 --alphas 0.6 \
    --k-max 5 --temperature 0 --budget-s $(( l - 15 ))
elif [ "$STAGE" = 18 ]; then   # what 17 skipped (a b = 64 engine's build did not fit after b = 16's): b = 64 alone
  l=${LIMIT:-170}
  psd_vs_sd b4m16 "$l" --part 1 --part1-modes sd,ar --sd-ks 2 --batch-mults 4 --prior /nonexistent --ms 16 \
    "${SYNTH[@]}" --budget-s $(( l - 12 ))
elif [ "$STAGE" = 19 ]; then   # what is left of the grid after session 10 (19 and 20): sd_dp2 online at sd's best k
  # (2), 60 s per load (~80 s to build, then three loads), then sd at m, 2m and 4m for alpha 0.6 (m = 64) in the rest
  psd_vs_sd sd_dp2 360 --part 2 --part2-modes sd_dp2 "${ONLINE[@]}" --online-s 60 "${SYNTH[@]}" --budget-s 348
  l=$(left 565)
  [ "$l" -gt 90 ] && psd_vs_sd sd_a06 "$l" --part 1 --part1-modes sd --sd-ks 2 --batch-mults 1,2,4 \
    --prior /nonexistent --ms 64 --alphas 0.6 --k-max 5 --temperature 0 --budget-s $(( l - 12 ))
elif [ "$STAGE" = 20 ]; then   # ar_dp2 online at 60 s per load (~60 s to build), then 18 in the rest (sd at b = 16,
  # its sweep, beside ar at 4m; then sd at 4m: ~180 s)
  psd_vs_sd ar_dp2 300 --part 2 --part2-modes ar_dp2 "${ONLINE[@]}" --online-s 60 "${SYNTH[@]}" --budget-s 288
  l=$(left 565)
  psd_vs_sd b4m16 "$l" --part 1 --part1-modes sd,ar --sd-ks 2 --batch-mults 4 --prior /nonexistent --ms 16 \
    "${SYNTH[@]}" --budget-s $(( l - 12 ))
elif [ "$STAGE" = 21 ]; then   # equal requests in flight at the baselines' best batch: psd m = 128 against sd 2m
  l=${LIMIT:-540}
  psd_vs_sd m128 "$l" --part 1 --part1-modes psd,sd --psd-ks 2,3 --sd-ks 2 --batch-mults 2 --prior /nonexistent \
    --ms 128 --alphas 0.8,0.6 --k-max 5 --temperature 0 --budget-s $(( l - 12 ))
elif [ "$STAGE" = 22 ]; then   # ar_dp2 built in ~40 s in 20; a 60 s load took ~61 s plus a drain of up to 30
  psd_vs_sd ar_dp2 170 --part 2 --part2-modes ar_dp2 "${ONLINE[@]}" --loads 0.9 --online-s 60 "${SYNTH[@]}" \
    --budget-s 160
  l=$(left 560)
  psd_vs_sd m128 "$l" --part 1 --part1-modes psd,sd --psd-ks 2,3 --sd-ks 2 --batch-mults 2 --prior /nonexistent \
    --ms 128 "${SYNTH[@]}" --budget-s $(( l - 12 ))
elif [ "$STAGE" = 23 ]; then
  l=${LIMIT:-230}
  psd_vs_sd sd4m "$l" --part 1 --part1-modes sd --sd-ks 2 --batch-mults 4 --prior /nonexistent --ms 64 "${SYNTH[@]}" \
    --budget-s $(( l - 12 ))
elif [ "$STAGE" = 15 ]; then
  psd_vs_sd online 565 --part 2 --part2-modes psd,sd_split "${ONLINE[@]}" --k-psd 3 --online-s 60 "${SYNTH[@]}" \
    --budget-s 550
elif [ "$STAGE" = 16 ]; then
  psd_vs_sd b4m16 300 --part 1 --part1-modes sd,ar --sd-ks 2 --batch-mults 1,4 --prior /nonexistent --ms 16 \
    "${SYNTH[@]}" --budget-s 285
else
  cuda_tests 100
  l=$(left 575)
  psd_vs_sd psd2 "$l" --part 2 --prior bench/results/psd_vs_sd.parquet --ms 64 --alphas 0.8 --temperature 0 \
    --budget-s $(( l - 25 ))
fi
