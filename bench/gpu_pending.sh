#!/usr/bin/env bash
# The one-H200 measurements the open issues still need (#21 parity, #22 serve vs offline, #24 real traffic), in
# parts that each fit one device command (<= 10 min), every step under its own limit; what a step writes goes to
# $OUT/<step>/ and its log to $OUT/<step>.log, and a step cut by its limit leaves the rest of the part running.
#
#   OUT=/some/dir GIT_SHA=<sha> PARENT_SHA=bd2b7ee bash bench/gpu_pending.sh PART
#
# PART 1: the CUDA tests of the kernels and graphs, the fused step profile, runtime parity sd m=64.
# PART 2: runtime parity ar m=64 and m=16 (#21: within 2 % of the parent).
# PART 3: real traffic, ar and sd: padded vs fused vs fused with arrival order, with long prompts (#24).
# PART 4: serve vs offline (#22): proxy vs direct ingress, max_batch 64 and 256.
# Parity needs a checkout of the parent at .parent (`git worktree add --detach .parent $PARENT_SHA`, carried with
# the call). Afterwards, on the CPU machine: bench.parity / serve_vs_offline --merge as their docstrings say.
set -u
: "${OUT:?}" "${GIT_SHA:?}"
PARENT_SHA=${PARENT_SHA:-bd2b7ee}
S=$(date +%s)
say() { echo "[$(( $(date +%s) - S )) s] $*"; }
step() {   # step NAME LIMIT_S CMD...: runs CMD with --out-style folder $OUT/NAME available as $DIR
    local name=$1 limit=$2; shift 2
    DIR="$OUT/$name"; mkdir -p "$DIR"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    say "$name rc=$? $(tail -1 "$OUT/$name.log" | cut -c1-200)"
}
parent() { (cd .parent && GIT_SHA=$PARENT_SHA "$@"); }

case "${1:?PART}" in
1)
  step cuda_kernels 120 python -m pytest -q -p no:cacheprovider tests/test_attention_triton.py -k cuda
  step cuda_graphs 150 python -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_fused_step.py
  step fused_profile 120 python -m bench.fused_step_profile --batches 32 --chunks 0,64,128,256 \
    --chunk-starts 0,1024,2816 --kernel-chunks 64,128,512 --out "$OUT/fused_profile"
  step parity_sd64_parent 140 parent python -m bench.psd_vs_sd --mode sd --m 64 --ks 2 --alphas 0.8 \
    --out "$OUT/parity_sd64_parent"
  step parity_sd64_change 140 python -m bench.psd_vs_sd --mode sd --m 64 --ks 2 --alphas 0.8 \
    --out "$OUT/parity_sd64_change"
  ;;
2)
  for m in 64 16; do
    step "parity_ar${m}_parent" 140 parent python -m bench.psd_vs_sd --mode ar --m "$m" --out "$OUT/parity_ar${m}_parent"
    step "parity_ar${m}_change" 140 python -m bench.psd_vs_sd --mode ar --m "$m" --out "$OUT/parity_ar${m}_change"
  done
  ;;
3)
  step real_traffic_ar 280 python -m bench.real_traffic --modes ar --engines padded,fused:256,fused_arrival:256 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_ar"
  step real_traffic_sd 280 python -m bench.real_traffic --modes sd --engines padded,fused:256,fused_arrival:256 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_sd"
  ;;
4)
  for http in proxy direct; do
    replicas=$([ "$http" = proxy ] && echo 2 || echo 1)
    step "serve_ar64_$http" 140 python -m bench.serve_vs_offline --mode ar --max-batch 64 --loads '' \
      --ingress-cpus 1 --ingress-replicas "$replicas" --ingress-http "$http" --label "$http" --out "$OUT/serve_ar64_$http"
    step "serve_sd64_$http" 140 python -m bench.serve_vs_offline --mode sd --k 2 --max-batch 64 --loads '' \
      --ingress-cpus 1 --ingress-replicas "$replicas" --ingress-http "$http" --label "$http" --out "$OUT/serve_sd64_$http"
  done
  step serve_ar256_direct 150 python -m bench.serve_vs_offline --mode ar --max-batch 256 --n-requests 1024 \
    --loads '' --ingress-cpus 1 --ingress-replicas 1 --ingress-http direct --label direct --out "$OUT/serve_ar256_direct"
  ;;
*) echo "PART is 1-4" >&2; exit 2 ;;
esac
