#!/usr/bin/env bash
# The one-H200 measurements the open issues still need (#21 parity, #22 serve vs offline, #24 real traffic), in
# parts that each fit one device command (limits summing to <= 560 s of the 600), every step under its own limit;
# a step writes into $OUT/<step>/ and its log to $OUT/<step>.log, and a step cut by its limit leaves the rest of
# the part running.
#
#   OUT=/some/dir GIT_SHA=<sha> PARENT_SHA=bd2b7ee bash bench/gpu_pending.sh PART
#
# PART 1: the manager's torch-free CUDA check against torch's; the CUDA tests of the kernels and graphs; the fused
# step profile.
# PART 3: real traffic ar: padded vs fused vs fused in arrival order, long prompts (#24); runtime parity ar m=64
# (second: a fresh machine's first run pays the kernels' compile).
# PART 4: real traffic sd (padded, fused); serve vs offline ar max_batch 64, proxy (2 x 1 CPU) and direct (1 replica) (#22).
# PART 5: serve vs offline sd k=2 max_batch 64 proxy and direct (200 s each: sd's offline run and app start take ~110 s); ar max_batch 256 direct (#22).
# PART 7 (#24): real traffic sd at a budget of 384 beside padded (512, the default, ran at 237892e).
# PART 13: serve vs offline's online loads (never run on a GPU: every call so far passed --loads ''), ar and sd.
# PARTS 14 (ar) and 15 (sd) (#24, first): the adaptive chunk (chunk_gap_ratio 2) beside the fixed 512 budget and
# padded in one call: does sizing chunks from step times meet the gap ratio, and at what TTFT P99.
# PART 16 (#24): the gpt-fast peer (bench/gpt_fast_peer.py; carry third_party/gpt-fast): decode, verify and prefill
# step times at the 8B shape, batches 1 and 32, its compile inside the limit.
# Parts 2, 6 and 8 (and 9-12, which split them) ran at 237892e in session 22 (bench/results; git history).
# PART 17 (#24): the adaptive chunk priced per launch class, ar and sd beside padded, with online_long's steps
# (ran at 6a6e9ae, and at eb0c24e with depth-aware prices).
# PART 18 (#22): serve vs offline sd k=2 max_batch 256 with chunk_gap_ratio 1.5 (ran at d971251: its offline half
# delivered a third of the fixed budget's tok/s, and the HTTP half ran past the limit; not worth repeating as is).
# PART 19 (#24): the packed kernel's key splits for deep chunks (CONFIG.PREFILL_WAVES 1, 2, 4, 8 through
# MINEDRAFT_ATTN_CONFIG): the fused step profile of 32 rows with a 256-token launch at chunk starts 0, 1024, 2816.
# A chunk deep in a long prompt ran its attention at ~86 TFLOP/s (real_traffic_steps at 6a6e9ae): 112 programs of
# 64 rows split only in two, each walking ~1,000 keys alone. (Ran at 5cf5fb7: more splits bought nothing; the
# kernel's own time per tile is the cost.)
# PART 20 (#24): bench.packed_attention, the kernel with unmasked tiles below each block's earliest position vs the
# kernel before it (`mkdir -p .baseline && git show 5cf5fb7:minedraft_ray/engine/attention_packed_triton.py >
# .baseline/attention_packed_triton.py` before the call: an untracked file travels) and SDPA; the fused profile.
# (Ran at 10c356c: the unmasked tiles 0.90x the time; 4 warps instead of 8 on the 64-row tile half again.)
# PARTS 21 and 22 (#24): the 4-warp tiles at larger launches, the fused profile and real traffic ar (21), sd (22),
# with the chunk budget's margin (what its predictions missed by). (Ran at 0c80791: results in bench/results.)
# PART 23 (#24): a fused step's chunk launch at 1 and 2 waves of key splits (the split rule for 288-token launches).
# PART 24 (#22): serve vs offline sd k=2 max_batch 64 with chunks sized to 1.8 x the cycle (the interval / the cycle).
# (Parts 23 and 24 ran at 4887f19: results in bench/results and docs/design.md.)
# PART 25 (#24): real traffic ar and sd, the adaptive chunk with the typical reference beside the recent one.
# (Ran at cb5a030; sd's step needed more than its 290 s with three engines: rerun one mode per call.) PART 26 (#24):
# the split merge with several rows per program; part 23 again. (Ran at e4ac53a.)
# Order for the next 30-minute device budget: 3, 7; 13 again at max_batch 256 with two direct replicas for sd.
# Order for the next 30-minute device budget: 23, 24; then 21 and 22 again after a change to the split rule or to
# the chunk budget's reference (docs/design.md, "Adaptive chunks"); 5's proxy rows, 1, 3, 7.
# Parts 13 and 16 ran at d971251. Order for a 30-minute device budget: 19, 5; 17 again after a change to the
# chunk's pricing or the kernel; 1, 3, 7.
# A call carries at most 64 MiB: the tracked tree (~15.4 MB) and the wheel bundle (~51.6 MB) are at that limit. A
# part that needs neither the default pair's weights nor the plots can leave them out of the copy: move
# bench/results/default_pair and a few large bench/results/*.png aside for the call (a file missing from the
# working tree does not travel), then put them back.
# Parity needs a checkout of the parent at .parent (`git worktree add --detach .parent $PARENT_SHA`, carried with
# the call; strip it to what runs: `rm -rf .parent/{bench/results,docs,tests,deployments,minedraft_ray/assets,minedraft_ray/training}`,
# or the tree, the wheels and it pass the 64 MiB a call carries). Afterwards, on the CPU machine: bench.parity / serve_vs_offline --merge as their docstrings say,
# and `python -m bench.real_traffic --loads 0.6 --online-s 15 --long-prompts 8 --merge RUN.parquet ...` for real traffic.
set -u
: "${OUT:?}" "${GIT_SHA:?}"
OUT=$(realpath -m "$OUT")   # the parent's steps run inside .parent
PARENT_SHA=${PARENT_SHA:-bd2b7ee}
S=$(date +%s)
say() { echo "[$(( $(date +%s) - S )) s] $*"; }
step() {   # step NAME LIMIT_S CMD...: CMD is a program (timeout runs no shell function)
    local name=$1 limit=$2; shift 2
    mkdir -p "$OUT/$name"
    timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    say "$name rc=$? $(tail -1 "$OUT/$name.log" | cut -c1-200)"
}
PARENT=(env -C .parent GIT_SHA="$PARENT_SHA")
parity() {   # parity NAME ARGS...: the parent's run, then the change's
    local name=$1; shift
    step "${name}_parent" 130 "${PARENT[@]}" python -m bench.psd_vs_sd "$@" --out "$OUT/${name}_parent"
    step "${name}_change" 130 python -m bench.psd_vs_sd "$@" --out "$OUT/${name}_change"
}
serve_pair() {   # serve_pair NAME LIMIT ARGS...: through Serve's proxy (2 ingress replicas), then direct (1)
    local name=$1 limit=$2; shift 2
    step "${name}_proxy" "$limit" python -m bench.serve_vs_offline "$@" --loads '' --ingress-cpus 1 \
      --ingress-replicas 2 --ingress-http proxy --label proxy --out "$OUT/${name}_proxy"
    step "${name}_direct" "$limit" python -m bench.serve_vs_offline "$@" --loads '' --ingress-cpus 1 \
      --ingress-replicas 1 --ingress-http direct --label direct --out "$OUT/${name}_direct"
}

case "${1:?PART}" in
1)
  step cuda_check 30 python -m pytest -q -p no:cacheprovider tests/test_layering.py -k cuda_check
  step cuda_kernels 120 python -m pytest -q -p no:cacheprovider tests/test_attention_triton.py -k cuda
  step cuda_graphs 180 python -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_fused_step.py
  step fused_profile 150 python -m bench.fused_step_profile --batches 32 --chunks 0,64,128,256 \
    --chunk-starts 0,1024,2816 --kernel-chunks 64,128,512 --out "$OUT/fused_profile"
  ;;
3)
  step real_traffic_ar 280 python -m bench.real_traffic --modes ar --engines padded,fused:256,fused_arrival:256 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_ar"
  parity parity_ar64 --mode ar --m 64
  ;;
4)
  step real_traffic_sd 280 python -m bench.real_traffic --modes sd --engines padded,fused:256 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_sd"
  serve_pair serve_ar64 130 --mode ar --max-batch 64
  ;;
5)
  serve_pair serve_sd64 200 --mode sd --k 2 --max-batch 64
  step serve_ar256_direct 150 python -m bench.serve_vs_offline --mode ar --max-batch 256 --n-requests 1024 \
    --loads '' --ingress-cpus 1 --ingress-replicas 1 --ingress-http direct --label direct --out "$OUT/serve_ar256_direct"
  ;;
7)
  step real_traffic_sd384 270 python -m bench.real_traffic --modes sd --engines padded,fused:384 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_sd384"
  ;;
13)  # #22's online load (30/60/90 % of the HTTP capacity, 20 s of arrivals each), ar and sd at max_batch 64, direct
  step serve_ar64_online 240 python -m bench.serve_vs_offline --mode ar --max-batch 64 --loads 0.3,0.6,0.9 \
    --online-s 20 --ingress-cpus 1 --ingress-replicas 1 --ingress-http direct --label direct --out "$OUT/serve_ar64_online"
  step serve_sd64_online 300 python -m bench.serve_vs_offline --mode sd --k 2 --max-batch 64 --loads 0.3,0.6,0.9 \
    --online-s 20 --ingress-cpus 1 --ingress-replicas 1 --ingress-http direct --label direct --out "$OUT/serve_sd64_online"
  ;;
14)
  step real_traffic_ar_adaptive 450 python -m bench.real_traffic --modes ar --engines padded,fused:512,fused:512@2 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_ar_adaptive"
  ;;
15)
  step real_traffic_sd_adaptive 450 python -m bench.real_traffic --modes sd --engines padded,fused:512,fused:512@2 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_sd_adaptive"
  ;;
17)  # #24: the adaptive chunk priced per launch class (runtime/chunk_budget.py) beside padded, ar and sd, with the
     # online_long steps (--steps: what made the long gaps)
  step real_traffic_ar_classes 270 python -m bench.real_traffic --modes ar --engines padded,fused:512@2 \
    --loads 0.6 --online-s 15 --long-prompts 8 --steps --out "$OUT/real_traffic_ar_classes"
  step real_traffic_sd_classes 290 python -m bench.real_traffic --modes sd --engines padded,fused:512@2 \
    --loads 0.6 --online-s 15 --long-prompts 8 --steps --out "$OUT/real_traffic_sd_classes"
  ;;
18)  # #22: sd k=2 at max_batch 256 missed its chunk gap P50 / P99 by 12 % / 9 % (237892e) because 91 % of the burst's
     # cycles carried a prefill chunk: the same run with chunks sized to 1.5 x a cycle without (chunk_gap_ratio)
  step serve_sd256_adaptive 330 python -m bench.serve_vs_offline --mode sd --k 2 --max-batch 256 --n-requests 1024 \
    --loads '' --ingress-cpus 1 --ingress-replicas 1 --ingress-http direct --chunk-gap-ratio 1.5 --label direct-r1.5 \
    --out "$OUT/serve_sd256_adaptive"
  ;;
19)
  for waves in 1 2 4 8; do
    step "fused_profile_waves$waves" 120 env MINEDRAFT_ATTN_CONFIG="{\"PREFILL_WAVES\": $waves}" \
      python -m bench.fused_step_profile --batches 32 --chunks 0,256 --chunk-starts 0,1024,2816 --kernel-chunks 256 \
      --out "$OUT/fused_profile_waves$waves"
  done
  ;;
20)  # #24: the packed kernel's unmasked tiles (keys below a block's earliest position) against the kernel before
     # them (--baseline: a copy of 5cf5fb7's, made before the call as below) and torch's flash SDPA, over tiles,
     # stages and splits; then the fused step profile at the defaults (part 19's waves1 is the kernel before)
  base=.baseline/attention_packed_triton.py
  step packed_attention 330 python -m bench.packed_attention --baseline "$base" --out "$OUT/packed_attention"
  step fused_profile 120 python -m bench.fused_step_profile --batches 32 --chunks 0,256 --chunk-starts 0,1024,2816 \
    --kernel-chunks 256 --out "$OUT/fused_profile"
  ;;
21)  # #24: 64 x 64 tiles on 4 warps at every launch (part 20: twice as fast as 8 warps on chunks deep in a prompt),
     # checked at larger launches beside the kernel before (.baseline, as part 20), then real traffic ar
  step packed_attention 120 python -m bench.packed_attention --baseline .baseline/attention_packed_triton.py \
    --chunks 64,256,1024,2048 --starts 0,1024,2816 --out "$OUT/packed_attention"
  step fused_profile 80 python -m bench.fused_step_profile --batches 32 --chunks 0,256 --chunk-starts 0,1024,2816 \
    --kernel-chunks 256 --out "$OUT/fused_profile"
  step real_traffic_ar_classes 300 python -m bench.real_traffic --modes ar --engines padded,fused:512@2 \
    --loads 0.6 --online-s 15 --long-prompts 8 --steps --out "$OUT/real_traffic_ar_classes"
  ;;
22)  # #24: part 21's kernel on CUDA against the reference (blocks straddling requests, graphs), and in real traffic sd
  step cuda_kernels 100 python -m pytest -q -p no:cacheprovider tests/test_attention_triton.py -k cuda
  step real_traffic_sd_classes 290 python -m bench.real_traffic --modes sd --engines padded,fused:512@2 \
    --loads 0.6 --online-s 15 --long-prompts 8 --steps --out "$OUT/real_traffic_sd_classes"
  ;;
23)  # #24: key splits of a fused step's chunk launch (part 21: its 288 tokens make 144 programs of 64 rows, one split;
     # the 256-token chunk alone ran 1.5x faster in two). Chunks of 128, 256 and 480 beside 32 rows run in graphs of
     # 256, 320 and 512 tokens, so as chunk launches of 224, 288 and 480: 2 / 1 / 1 splits at PREFILL_WAVES 1, 3 / 2 /
     # 2 at 2. The fused step both ways
  for waves in 1 2; do
    step "fused_profile_waves$waves" 100 env MINEDRAFT_ATTN_CONFIG="{\"PREFILL_WAVES\": $waves}" \
      python -m bench.fused_step_profile --batches 32 --chunks 0,128,256,480 --chunk-starts 0,1024,2816 \
      --kernel-chunks 256 --out "$OUT/fused_profile_waves$waves"
  done
  ;;
24)  # #22: sd k=2 max_batch 64's chunk gap P50 (20.7 ms at 0c80791) is the closed burst's admission: its cycles with a
     # chunk (a 512-token launch, the verify's 192 and 320 of prompt) take ~23 ms against 11 without, above the 20 ms
     # interval, while after the last admission the P50 is 19.98. At this batch the chunk rides the verify, so sizing
     # it to 1.8 x the cycle (20 / 11) keeps those cycles inside the interval without the separate small launches
     # that sank part 18 at batch 256: does the P50 meet the interval, and at what tok/s and TTFT
  step serve_sd64_adaptive 220 python -m bench.serve_vs_offline --mode sd --k 2 --max-batch 64 --loads '' \
    --ingress-cpus 1 --ingress-replicas 1 --ingress-http direct --chunk-gap-ratio 1.8 --label direct-r1.8 \
    --out "$OUT/serve_sd64_adaptive"
  ;;
25)  # #24: the typical reference (chunk_gap_reference typical: a chunk cycle held to 2 x the shorter of the base and
     # the median cycle without a chunk over the last 256) beside the recent base alone and padded, ar then sd
  for mode in ar sd; do
    step "real_traffic_${mode}_typical" 290 python -m bench.real_traffic --modes $mode \
      --engines padded,fused:512@2,fused:512@2/typical --loads 0.6 --online-s 15 --long-prompts 8 --steps \
      --out "$OUT/real_traffic_${mode}_typical"
  done
  ;;
26)  # #24: the split merge (_combine_kernel) with several rows per program (part 23: at 2 waves a 288-token chunk
     # launch's merge took 356 us per step against 79 without its splits, eating most of what the splits saved deep
     # in a prompt); the CUDA kernel tests, then part 23's fused step at 1 and 2 waves again
  step cuda_kernels 100 python -m pytest -q -p no:cacheprovider tests/test_attention_triton.py -k cuda
  for waves in 1 2; do
    step "fused_profile_waves$waves" 100 env MINEDRAFT_ATTN_CONFIG="{\"PREFILL_WAVES\": $waves}" \
      python -m bench.fused_step_profile --batches 32 --chunks 0,128,256,480 --chunk-starts 0,1024,2816 \
      --kernel-chunks 256 --out "$OUT/fused_profile_waves$waves"
  done
  ;;
16)  # needs third_party/gpt-fast (ignored: fetch pytorch-labs/gpt-fast's model.py there) in the call's carry
  step gpt_fast_peer 540 python -m bench.gpt_fast_peer --gpt-fast third_party/gpt-fast --out "$OUT/gpt_fast_peer"
  ;;
*) echo "PART is 1, 3, 4, 5, 7, 13-26" >&2; exit 2 ;;
esac
# the device hands back only a few files per call: everything goes back as one archive
tar czf "/tmp/part$1.tgz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "/tmp/part$1.tgz" "$OUT/" && say "$OUT/part$1.tgz"

