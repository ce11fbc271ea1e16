#!/usr/bin/env bash
# NOT RUN (session 28 got no machine). The second call after call1/call.sh, on the same
# bundle .gpu/s28: the sanitizers (every sm_90a kernel, the paired ones included), the GPU
# tests forward, the A/B of call 1 at doc1m, and the L2 sides probe on this card (it ran on
# an H200 only).
#   BUDGET=<seconds, at most 570> bash bench/results/s28/call2/call.sh
set -uo pipefail
O=$OUT
F=.gpu/s28
. bench/results/s28/lib.sh
s start
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
if left 200; then
  timeout 190 bash scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1
  echo "rc $?" >> $O/sanitize.txt
  grep -E "whole run|rc |errors \([1-9]|[1-9][0-9]* errors|fwd_kv_homes|fwd_kv_pair_kv|f16p" $O/sanitize.txt | head -24
  s sanitize
fi
left 100 && test_bin forward 95
timeout 60 $F/bench --cases doc1m --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
left 150 && ab doc1m 35 && show | tail -10
if left 45; then
  nvcc -O2 -gencode=arch=compute_90a,code=sm_90a bench/probe/l2_sides.cu -o /tmp/l2_sides 2>&1 | tail -3
  timeout 35 /tmp/l2_sides > $O/probe.txt 2>&1; echo "rc $?" >> $O/probe.txt
  grep -E "^== |SMs on|runs of one home|differ" $O/probe.txt | head -16
  s probe
fi
s end
