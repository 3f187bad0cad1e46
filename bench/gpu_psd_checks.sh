#!/usr/bin/env bash
# The 2x H200 runs issue #3 needs, as two device calls of at most ~9.5 minutes each, each leaving at most 8
# files in $OUT (what the device tool brings back):
#   STAGE=1: the CUDA tests of the overlap copies and graphs; a draft's Ray hop on this host (bench.payload_hop);
#            the default pair in float32 (greedy outputs of sd, sd_split and psd == ar's, token for token, on the
#            GPUs); part 1 of bench.psd_vs_sd (closed workloads, m = 16 then 64, k sweeps, the sd / ar baselines)
#            in what time is left.
#   STAGE=2: part 2 (online Poisson arrivals psd / sd_split / sd_dp2, closed data-parallel baselines, the
#            real-acceptance pair), its best k taken from the committed part-1 rows.
#   STAGE=3: after a change to psd alone: psd's part 2 (closed, then online at the committed baselines' arrival
#            rates, CAPACITY req/s x 30/60/90 %), psd's float32 greedy equality with ar on the default pair, the
#            payload hop on this host.
#   STAGE=4: part 1 at m = 16 alone (k = 1-5 and the sd / ar baselines), in one call.
#   STAGE=5: the collective draft channel: the drafter-kill drill with it (psd, sd_split; greedy == ar on the
#            GPUs), the hop of each route (payload_hop), then psd's m = 16 sweep through the collective channel,
#            the object store and (time permitting) the direct channel, in the same call (the A/B).
#   STAGE=6: the collective channel with the threaded drafter: the drafter-kill drill (psd), psd's m = 16 sweep,
#            and sd at m = 16, k = 5 and 4 in the same call (the ratio's baseline).
#   STAGE=7: sd at m = 16, k = 5 and 4 (the psd/sd ratio's baseline, in the same call as nothing else), then a
#            same-call part 2 of psd and sd_split (closed, and online at 30/60/90 % of 51.9 req/s, 20 s each).
#   STAGE=8: the real-acceptance rows alone (psd and sd on the default pair at m = 64; no synthetic psd run first).
#   STAGE=9: psd's m = 16 sweep and sd at k = 2, 4, 5 in the same call (the psd/sd ratio from one call), then the
#            real-acceptance rows.
#   STAGE=10: online only (no closed runs): psd and sd_split at 30/60/90 % of 51.9 req/s, 50 s each, same call.
#   STAGE=11: ar_dp2 (closed, online at the same rates, 50 s each), then sd and ar at m = 64 with batches 64 and 128
#            (128: psd's requests in flight), two at a time, one per GPU.
#   STAGE=12: the alpha = 0.6 rows at m = 16: psd's sweep and sd at k = 2, 4, 5.
#   STAGE=13: m = 64, alpha 0.8: psd and sd at k = 4, 5 (the sweep "at least to 5"), ar_dp2 online at 90 %, then
#            sd and ar at b = 256 (4m) in what time is left.
#   STAGE=14: m = 64, alpha 0.6: psd's sweep k = 1-5 and sd at the k psd ran.
#   STAGE=15: online only, psd and sd_split at psd's best closed k (3), 55 s per load, same call.
#   STAGE=16: the 4m baselines at m = 16 (sd k = 2 and ar at b = 64, after b = 16 again), one per GPU.
#   OUT=/some/dir GIT_SHA=<sha> STAGE=1 bash bench/gpu_psd_checks.sh
# Back here: python -m bench.merge_rows <files_at>/*/psd_vs_sd.parquet --sha <sha>, then python -m bench.plot
# bench/results/psd_vs_sd.parquet --out bench/results/psd_vs_sd.png; keep the logs in bench/results/logs/.
set -u
: "${OUT:?}"
STAGE=${STAGE:-1}
S=$(date +%s)
say() { echo "[$(( $(date +%s) - S )) s] $*"; }
left() { echo $(( ${1:-560} - ($(date +%s) - S) )); }

if [ "$STAGE" = 1 ]; then
  timeout 150 python -m pytest -q -x -p no:cacheprovider tests/test_cuda_overlap.py tests/test_cuda_graphs.py \
    > "$OUT/cuda_tests.log" 2>&1
  say "CUDA tests rc=$?"; tail -2 "$OUT/cuda_tests.log"
  timeout 60 python -m bench.payload_hop --trips 200 --rounds 2 --out "$OUT/payload_hop" > "$OUT/payload_hop.log" 2>&1
  say "payload hop rc=$?"; grep "^{" "$OUT/payload_hop.log" | cut -c1-160
  rm -f "$OUT/payload_hop/"*.png "$OUT/payload_hop/"*.md   # at most 8 files come back: the rows are in the log
  timeout 240 python -m bench.default_pair_speed --dtype float32 --out "$OUT/default_pair_fp32" \
    > "$OUT/default_pair_fp32.log" 2>&1
  say "default pair rc=$?"; grep "^{" "$OUT/default_pair_fp32.log" | cut -c1-260
  rm -f "$OUT/default_pair_fp32/"*.png "$OUT/default_pair_fp32/"*.md
  l=$(left); say "part 1 with ${l} s"
  timeout "$l" python -m bench.psd_vs_sd --part 1 --ms 16,64 --alphas 0.8 --k-max 5 --batch-mults 1,2 \
    --temperature 0 --budget-s $(( l - 25 )) --out "$OUT/psd1" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/psd1.log"
  say "part 1 rc=$?"; grep -E '^\[|^skipped' "$OUT/psd1.log" | tail -30
  rm -f "$OUT/psd1/psd_vs_sd.png"
elif [ "$STAGE" = 4 ]; then
  timeout 540 python -m bench.psd_vs_sd --part 1 --ms 16 --alphas 0.8 --k-max 5 --batch-mults 1,2 \
    --temperature 0 --budget-s 510 --out "$OUT/psd1" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/psd1.log"
  say "part 1 rc=$?"; grep -E '^\[|^skipped' "$OUT/psd1.log" | tail -30
  rm -f "$OUT/psd1/psd_vs_sd.png"
elif [ "$STAGE" = 5 ]; then
  timeout 150 python -m bench.drafter_kill --modes psd,sd_split --transport collective --out "$OUT/kill" \
    > "$OUT/kill.log" 2>&1
  say "drafter kill (collective) rc=$?"; grep -E '^\{"mode' "$OUT/kill.log" | cut -c1-300
  timeout 60 python -m bench.payload_hop --trips 200 --rounds 1 --out "$OUT/payload_hop" > "$OUT/payload_hop.log" 2>&1
  say "payload hop rc=$?"; grep "^{" "$OUT/payload_hop.log" | cut -c1-160
  rm -f "$OUT/payload_hop/"*.png "$OUT/payload_hop/"*.md
  for t in collective object_store direct; do
    l=$(left 575); [ "$l" -lt 100 ] && { say "no time for $t"; break; }
    b=$(( l > 175 ? 160 : l - 15 ))
    timeout $(( b + 12 )) python -m bench.psd_vs_sd --part 1 --part1-modes psd --prior /nonexistent --transport $t \
      --ms 16 --alphas 0.8 --k-max 5 --temperature 0 --budget-s $b --out "$OUT/psd1_$t" 2>&1 | tr '\r' '\n' \
      | grep -v 'it/s\]' > "$OUT/psd1_$t.log"
    say "psd m=16 ($t) rc=$?"; grep -E '^\[|^skipped' "$OUT/psd1_$t.log" | tail -8
    rm -f "$OUT/psd1_$t/psd_vs_sd.png" "$OUT/psd1_$t/psd_vs_sd.md"
  done
elif [ "$STAGE" = 6 ]; then
  timeout 170 python -m bench.drafter_kill --modes psd --transport collective --out "$OUT/kill" > "$OUT/kill.log" 2>&1
  say "drafter kill (collective) rc=$?"; grep -E '^\{"mode' "$OUT/kill.log" | cut -c1-300
  timeout 185 python -m bench.psd_vs_sd --part 1 --part1-modes psd --prior /nonexistent --transport collective \
    --ms 16 --alphas 0.8 --k-max 5 --temperature 0 --budget-s 170 --out "$OUT/psd1" 2>&1 | tr '\r' '\n' \
    | grep -v 'it/s\]' > "$OUT/psd1.log"
  say "psd m=16 (collective) rc=$?"; grep -E '^\[|^skipped' "$OUT/psd1.log" | tail -8
  rm -f "$OUT/psd1/psd_vs_sd.png" "$OUT/psd1/psd_vs_sd.md"
  l=$(left 575)
  timeout "$l" python -m bench.psd_vs_sd --part 1 --part1-modes sd --sd-ks 5,4 --batch-mults 1 --prior /nonexistent \
    --ms 16 --alphas 0.8 --k-max 5 --temperature 0 --budget-s $(( l - 12 )) --out "$OUT/sd1" 2>&1 | tr '\r' '\n' \
    | grep -v 'it/s\]' > "$OUT/sd1.log"
  say "sd m=16 rc=$?"; grep -E '^\[|^skipped' "$OUT/sd1.log" | tail -8
  rm -f "$OUT/sd1/psd_vs_sd.png" "$OUT/sd1/psd_vs_sd.md"
elif [ "$STAGE" = 7 ]; then
  timeout 130 python -m bench.psd_vs_sd --part 1 --part1-modes sd --sd-ks 5,4 --batch-mults 1 --prior /nonexistent \
    --ms 16 --alphas 0.8 --k-max 5 --temperature 0 --budget-s 118 --out "$OUT/sd1" 2>&1 | tr '\r' '\n' \
    | grep -v 'it/s\]' > "$OUT/sd1.log"
  say "sd m=16 rc=$?"; grep -E '^\[|^skipped|^failed' "$OUT/sd1.log" | tail -8
  rm -f "$OUT/sd1/psd_vs_sd.png" "$OUT/sd1/psd_vs_sd.md"
  l=$(left 555)
  timeout "$l" python -m bench.psd_vs_sd --part 2 --part2-modes psd,sd_split --capacity 51.911 --online-s 20 \
    --prior bench/results/psd_vs_sd.parquet --ms 64 --alphas 0.8 --temperature 0 --budget-s $(( l - 15 )) \
    --out "$OUT/psd2" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/psd2.log"
  say "part 2 psd, sd_split rc=$?"; grep -E '^\[|^skipped|^failed|^online' "$OUT/psd2.log" | tail -12
  rm -f "$OUT/psd2/psd_vs_sd.png" "$OUT/psd2/psd_vs_sd.md"
elif [ "$STAGE" = 8 ]; then
  timeout 245 python -m bench.psd_vs_sd --part 2 --part2-modes real --prior bench/results/psd_vs_sd.parquet --ms 64 \
    --alphas 0.8 --temperature 0 --budget-s 230 --out "$OUT/real" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/real.log"
  say "part 2 real rows rc=$?"; grep -E '^\[|^skipped|^failed|^part 2' "$OUT/real.log" | tail -8
  rm -f "$OUT/real/psd_vs_sd.png" "$OUT/real/psd_vs_sd.md"
elif [ "$STAGE" = 9 ]; then
  timeout 305 python -m bench.psd_vs_sd --part 1 --part1-modes psd,sd --sd-ks 2,4,5 --batch-mults 1 --prior /nonexistent \
    --ms 16 --alphas 0.8 --k-max 5 --temperature 0 --budget-s 290 --out "$OUT/m16" 2>&1 | tr '\r' '\n' \
    | grep -v 'it/s\]' > "$OUT/m16.log"
  say "psd, sd m=16 rc=$?"; grep -E '^\[|^skipped|^failed' "$OUT/m16.log" | tail -10
  rm -f "$OUT/m16/psd_vs_sd.png" "$OUT/m16/psd_vs_sd.md"
  l=$(left 570)
  timeout "$l" python -m bench.psd_vs_sd --part 2 --part2-modes real --prior bench/results/psd_vs_sd.parquet --ms 64 \
    --alphas 0.8 --temperature 0 --budget-s $(( l - 15 )) --out "$OUT/real" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/real.log"
  say "part 2 real rows rc=$?"; grep -E '^\[|^skipped|^failed|^part 2' "$OUT/real.log" | tail -8
  rm -f "$OUT/real/psd_vs_sd.png" "$OUT/real/psd_vs_sd.md"
elif [ "$STAGE" = 10 ]; then
  timeout 555 python -m bench.psd_vs_sd --part 2 --part2-modes psd,sd_split --online-only --capacity 51.911 --online-s 50 \
    --prior bench/results/psd_vs_sd.parquet --ms 64 --alphas 0.8 --temperature 0 --budget-s 540 \
    --out "$OUT/online" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/online.log"
  say "online psd, sd_split rc=$?"; grep -E '^\[|^skipped|^failed|^online' "$OUT/online.log" | tail -12
  rm -f "$OUT/online/psd_vs_sd.png" "$OUT/online/psd_vs_sd.md"
elif [ "$STAGE" = 11 ]; then
  timeout 290 python -m bench.psd_vs_sd --part 2 --part2-modes ar_dp2 --capacity 51.911 --online-s 50 \
    --prior bench/results/psd_vs_sd.parquet --ms 64 --alphas 0.8 --temperature 0 --budget-s 280 \
    --out "$OUT/ar_dp2" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/ar_dp2.log"
  say "ar_dp2 rc=$?"; grep -E '^\[|^skipped|^failed|^online' "$OUT/ar_dp2.log" | tail -8
  rm -f "$OUT/ar_dp2/psd_vs_sd.png" "$OUT/ar_dp2/psd_vs_sd.md"
  l=$(left 560)
  timeout "$l" python -m bench.psd_vs_sd --part 1 --part1-modes sd,ar --sd-ks 3 --batch-mults 1,2 --prior /nonexistent \
    --ms 64 --alphas 0.8 --k-max 5 --temperature 0 --budget-s $(( l - 12 )) --out "$OUT/b2m" 2>&1 | tr '\r' '\n' \
    | grep -v 'it/s\]' > "$OUT/b2m.log"
  say "sd, ar at b = 64, 128 rc=$?"; grep -E '^\[|^skipped|^failed' "$OUT/b2m.log" | tail -8
  rm -f "$OUT/b2m/psd_vs_sd.png" "$OUT/b2m/psd_vs_sd.md"
elif [ "$STAGE" = 12 ]; then
  b=${BUDGET:-285}   # what the session's device time leaves
  timeout $(( b + 15 )) python -m bench.psd_vs_sd --part 1 --part1-modes psd,sd --sd-ks 2,4,5 --batch-mults 1 \
    --prior /nonexistent --ms 16 --alphas 0.6 --k-max 5 --temperature 0 --budget-s $b --out "$OUT/a06" 2>&1 | tr '\r' '\n' \
    | grep -v 'it/s\]' > "$OUT/a06.log"
  say "alpha 0.6 m=16 rc=$?"; grep -E '^\[|^skipped|^failed' "$OUT/a06.log" | tail -10
  rm -f "$OUT/a06/psd_vs_sd.png" "$OUT/a06/psd_vs_sd.md"
elif [ "$STAGE" = 13 ]; then
  timeout 265 python -m bench.psd_vs_sd --part 1 --part1-modes psd,sd --psd-ks 4,5 --sd-ks 4,5 --batch-mults 1 \
    --prior /nonexistent --ms 64 --alphas 0.8 --k-max 5 --temperature 0 --budget-s 250 --out "$OUT/m64k45" 2>&1 \
    | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/m64k45.log"
  say "psd, sd m=64 k=4,5 rc=$?"; grep -E '^\[|^skipped|^failed' "$OUT/m64k45.log" | tail -6
  rm -f "$OUT/m64k45/psd_vs_sd.png" "$OUT/m64k45/psd_vs_sd.md"
  timeout 170 python -m bench.psd_vs_sd --part 2 --part2-modes ar_dp2 --online-only --loads 0.9 --capacity 51.911 \
    --online-s 50 --prior bench/results/psd_vs_sd.parquet --ms 64 --alphas 0.8 --temperature 0 --budget-s 160 \
    --out "$OUT/ar_dp2" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/ar_dp2.log"
  say "ar_dp2 90 % rc=$?"; grep -E '^\[|^skipped|^failed|^online' "$OUT/ar_dp2.log" | tail -4
  rm -f "$OUT/ar_dp2/psd_vs_sd.png" "$OUT/ar_dp2/psd_vs_sd.md"
  l=$(left 565)   # the 4m baselines (sd, ar at b = 256), after b = 64 again: two at a time, one per GPU
  [ "$l" -gt 90 ] && timeout "$l" python -m bench.psd_vs_sd --part 1 --part1-modes sd,ar --sd-ks 3 --batch-mults 1,4 \
    --prior /nonexistent --ms 64 --alphas 0.8 --k-max 5 --temperature 0 --budget-s $(( l - 12 )) --out "$OUT/b4m" \
    2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/b4m.log"
  say "sd, ar at b = 64, 256 rc=$?"; grep -E '^\[|^skipped|^failed' "$OUT/b4m.log" 2>/dev/null | tail -6
  rm -f "$OUT/b4m/psd_vs_sd.png" "$OUT/b4m/psd_vs_sd.md"
elif [ "$STAGE" = 14 ]; then
  timeout 555 python -m bench.psd_vs_sd --part 1 --part1-modes psd,sd --batch-mults 1 --prior /nonexistent \
    --ms 64 --alphas 0.6 --k-max 5 --temperature 0 --budget-s 540 --out "$OUT/a06m64" 2>&1 | tr '\r' '\n' \
    | grep -v 'it/s\]' > "$OUT/a06m64.log"
  say "alpha 0.6 m=64 rc=$?"; grep -E '^\[|^skipped|^failed' "$OUT/a06m64.log" | tail -12
  rm -f "$OUT/a06m64/psd_vs_sd.png" "$OUT/a06m64/psd_vs_sd.md"
elif [ "$STAGE" = 15 ]; then
  timeout 555 python -m bench.psd_vs_sd --part 2 --part2-modes psd,sd_split --online-only --k-psd 3 --capacity 51.911 \
    --online-s 55 --prior bench/results/psd_vs_sd.parquet --ms 64 --alphas 0.8 --temperature 0 --budget-s 540 \
    --out "$OUT/online" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/online.log"
  say "online psd, sd_split k=3 rc=$?"; grep -E '^\[|^skipped|^failed|^online' "$OUT/online.log" | tail -12
  rm -f "$OUT/online/psd_vs_sd.png" "$OUT/online/psd_vs_sd.md"
elif [ "$STAGE" = 16 ]; then
  timeout 300 python -m bench.psd_vs_sd --part 1 --part1-modes sd,ar --sd-ks 2 --batch-mults 1,4 --prior /nonexistent \
    --ms 16 --alphas 0.8 --k-max 5 --temperature 0 --budget-s 285 --out "$OUT/b4m16" 2>&1 | tr '\r' '\n' \
    | grep -v 'it/s\]' > "$OUT/b4m16.log"
  say "sd, ar at b = 16, 64 rc=$?"; grep -E '^\[|^skipped|^failed' "$OUT/b4m16.log" | tail -6
  rm -f "$OUT/b4m16/psd_vs_sd.png" "$OUT/b4m16/psd_vs_sd.md"
elif [ "$STAGE" = 3 ]; then
  : "${CAPACITY:?}"
  timeout 260 python -m bench.psd_vs_sd --part 2 --part2-modes psd --capacity "$CAPACITY" --online-s 20 \
    --prior bench/results/psd_vs_sd.parquet --ms 64 --alphas 0.8 --temperature 0 --budget-s 235 --out "$OUT/psd2" \
    2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/psd2.log"
  say "psd part 2 rc=$?"; grep -E '^\[|^skipped|^online' "$OUT/psd2.log" | tail -30
  rm -f "$OUT/psd2/psd_vs_sd.png"
  timeout 150 python -m bench.default_pair_speed --dtype float32 --modes ar,psd --out "$OUT/default_pair_fp32" \
    > "$OUT/default_pair_fp32.log" 2>&1
  say "default pair rc=$?"; grep "^{" "$OUT/default_pair_fp32.log" | cut -c1-260
  rm -f "$OUT/default_pair_fp32/"*.png "$OUT/default_pair_fp32/"*.md
  timeout 60 python -m bench.payload_hop --trips 200 --rounds 2 --out "$OUT/payload_hop" > "$OUT/payload_hop.log" 2>&1
  say "payload hop rc=$?"; grep "^{" "$OUT/payload_hop.log" | cut -c1-160
  rm -f "$OUT/payload_hop/"*.png "$OUT/payload_hop/"*.md
else
  timeout 100 python -m pytest -q -p no:cacheprovider tests/test_cuda_overlap.py tests/test_cuda_graphs.py \
    > "$OUT/cuda_tests.log" 2>&1
  say "CUDA tests rc=$?"; tail -2 "$OUT/cuda_tests.log"
  l=$(left 575)
  timeout "$l" python -m bench.psd_vs_sd --part 2 --prior bench/results/psd_vs_sd.parquet --ms 64 --alphas 0.8 \
    --temperature 0 --budget-s $(( l - 25 )) --out "$OUT/psd2" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' > "$OUT/psd2.log"
  say "part 2 rc=$?"; grep -E '^\[|^skipped|^online' "$OUT/psd2.log" | tail -30
  rm -f "$OUT/psd2/psd_vs_sd.png"
fi
