#!/usr/bin/env bash
# The one-H200 measurements the open issues still need (#21 parity, #22 serve vs offline, #24 real traffic), in
# parts that each fit one device command (limits summing to <= 560 s of the 600), every step under its own limit;
# a step writes into $OUT/<step>/ and its log to $OUT/<step>.log, and a step cut by its limit leaves the rest of
# the part running.
#
#   OUT=/some/dir GIT_SHA=<sha> PARENT_SHA=bd2b7ee bash bench/gpu_pending.sh PART
#
# PART 1: the manager's torch-free CUDA check against torch's; the CUDA tests of the kernels and graphs; the fused
# step profile. (PART 2's runs are the first of the runtime's torch-free actor classes on a GPU.)
# PART 2: runtime parity sd m=64 (k=2) and ar m=16 (#21: within 2 % of the parent, same call).
# PART 3: runtime parity ar m=64; real traffic ar: padded vs fused vs fused in arrival order, long prompts (#24).
# PART 4: real traffic sd (padded, fused); serve vs offline ar max_batch 64, proxy (2 x 1 CPU) and direct (1 replica) (#22).
# PART 5: serve vs offline sd k=2 max_batch 64 proxy and direct (200 s each: sd's offline run and app start take ~110 s); ar max_batch 256 direct (#22).
# PART 6 (#24, graph buckets of 64 tokens above 256): the CUDA graph tests (the new buckets replay the eager
# logits); fused steps whose launches fall between the old doubling buckets, timed under the fine buckets and the
# old ones in one call (buckets column); real traffic ar at the GPU's default budget (fused:512) vs padded.
# PART 7 (#24): real traffic sd at the default budget (fused:512) and at 384, each beside padded.
# PART 9: PART 2's sd m=64 pair, the change first (a fresh machine's first run compiles), and PART 8's first step.
# PART 10: PART 8's second step (sd max_batch 256 direct) and PART 6's first (the CUDA graph tests).
# PART 11: PART 6 after its first step.
# PART 12: PART 7's first step.
# PART 13: serve vs offline's online loads (never run on a GPU: every call so far passed --loads ''), ar and sd.
# PART 8: serve vs offline at max_batch 256 (1,024 requests): ar with two direct ingress replicas (clients spread
# over both URLs), sd k=2 direct with one (#22).
# Parity needs a checkout of the parent at .parent (`git worktree add --detach .parent $PARENT_SHA`, carried with
# the call; strip it to what runs: `rm -rf .parent/{bench/results,docs,tests,deployments,minedraft_ray/assets,minedraft_ray/training}`,
# or the tree, the wheels and it pass the 64 MiB a call carries). Afterwards, on the CPU machine: bench.parity / serve_vs_offline --merge as their docstrings say.
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
2)
  parity parity_sd64 --mode sd --m 64 --ks 2 --alphas 0.8
  parity parity_ar16 --mode ar --m 16
  ;;
3)
  parity parity_ar64 --mode ar --m 64
  step real_traffic_ar 280 python -m bench.real_traffic --modes ar --engines padded,fused:256,fused_arrival:256 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_ar"
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
6)
  step cuda_graphs_buckets 150 python -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py
  # b=16/32/64, chunks of 128..480: launches of 144..544 tokens, most between two doubling buckets (b=32, chunk 240:
  # 272 tokens, run as a 320-token graph (fine) vs a 512 one (pow2)); 128 and b+chunk=512 pad alike in both
  step fused_buckets 150 python -m bench.fused_step_profile --batches 16,32,64 --chunks 0,128,240,320,400,480 \
    --chunk-starts 1024 --bucket-sets fine,pow2 --kernel-chunks '' --out "$OUT/fused_buckets"
  step real_traffic_ar512 260 python -m bench.real_traffic --modes ar --engines padded,fused:512 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_ar512"
  ;;
7)
  step real_traffic_sd512 280 python -m bench.real_traffic --modes sd --engines padded,fused:512 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_sd512"
  step real_traffic_sd384 270 python -m bench.real_traffic --modes sd --engines padded,fused:384 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_sd384"
  ;;
8)
  step serve_ar256_direct2 200 python -m bench.serve_vs_offline --mode ar --max-batch 256 --n-requests 1024 \
    --loads '' --ingress-cpus 1 --ingress-replicas 2 --ingress-http direct --label direct2 --out "$OUT/serve_ar256_direct2"
  step serve_sd256_direct 300 python -m bench.serve_vs_offline --mode sd --k 2 --max-batch 256 --n-requests 1024 \
    --loads '' --ingress-cpus 1 --ingress-replicas 1 --ingress-http direct --label direct --out "$OUT/serve_sd256_direct"
  ;;
9)   # a fresh machine's first run pays the kernels' compile: the change runs first, each tree given 170 s
  step parity_sd64_change 170 python -m bench.psd_vs_sd --mode sd --m 64 --ks 2 --alphas 0.8 --out "$OUT/parity_sd64_change"
  step parity_sd64_parent 170 "${PARENT[@]}" python -m bench.psd_vs_sd --mode sd --m 64 --ks 2 --alphas 0.8 --out "$OUT/parity_sd64_parent"
  step serve_ar256_direct2 200 python -m bench.serve_vs_offline --mode ar --max-batch 256 --n-requests 1024 \
    --loads '' --ingress-cpus 1 --ingress-replicas 2 --ingress-http direct --label direct2 --out "$OUT/serve_ar256_direct2"
  ;;
10)  # PART 8's second step and PART 6's first
  step serve_sd256_direct 300 python -m bench.serve_vs_offline --mode sd --k 2 --max-batch 256 --n-requests 1024 \
    --loads '' --ingress-cpus 1 --ingress-replicas 1 --ingress-http direct --label direct --out "$OUT/serve_sd256_direct"
  step cuda_graphs_buckets 150 python -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py
  ;;
11)  # PART 6 after its first step
  step fused_buckets 150 python -m bench.fused_step_profile --batches 16,32,64 --chunks 0,128,240,320,400,480 \
    --chunk-starts 1024 --bucket-sets fine,pow2 --kernel-chunks '' --out "$OUT/fused_buckets"
  step real_traffic_ar512 260 python -m bench.real_traffic --modes ar --engines padded,fused:512 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_ar512"
  ;;
12)  # PART 7's first step
  step real_traffic_sd512 280 python -m bench.real_traffic --modes sd --engines padded,fused:512 \
    --loads 0.6 --online-s 15 --long-prompts 8 --out "$OUT/real_traffic_sd512"
  ;;
13)  # #22's online load (30/60/90 % of the HTTP capacity, 20 s of arrivals each), ar and sd at max_batch 64, direct
  step serve_ar64_online 240 python -m bench.serve_vs_offline --mode ar --max-batch 64 --loads 0.3,0.6,0.9 \
    --online-s 20 --ingress-cpus 1 --ingress-replicas 1 --ingress-http direct --label direct --out "$OUT/serve_ar64_online"
  step serve_sd64_online 300 python -m bench.serve_vs_offline --mode sd --k 2 --max-batch 64 --loads 0.3,0.6,0.9 \
    --online-s 20 --ingress-cpus 1 --ingress-replicas 1 --ingress-http direct --label direct --out "$OUT/serve_sd64_online"
  ;;
*) echo "PART is 1-13" >&2; exit 2 ;;
esac
# the device hands back only a few files per call: everything goes back as one archive
tar czf "/tmp/part$1.tgz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "/tmp/part$1.tgz" "$OUT/" && say "$OUT/part$1.tgz"

