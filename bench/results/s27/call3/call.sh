#!/usr/bin/env bash
# Session 27, call 3: which sub-unit makes ncu's "L2 Cache Throughput" (lts__throughput) 97 %
# in the KV sum pass, when call 2's breakdown table shows none above 75 %. ncu's
# `breakdown:` lists every sub-metric of lts__throughput, at doc64k, doc256k and doc256k under
# 9,2,12/kv (bundle .gpu/s25b, main's PTX). Run as bash bench/results/s27/call3/call.sh
set -uo pipefail
O=$OUT
F=.gpu/s25b
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
timeout 60 $F/bench --cases doc64k,doc256k --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
for a in "doc64k doc64k 0" "doc256k doc256k 0" "doc256k_w12 doc256k 20 9,2,12/kv"; do
  set -- $a
  BENCH_KV_ONLY=1 timeout 90 ncu --clock-control none --kernel-name msa_forward_kv_f16_sm90 --launch-skip $3 --launch-count 1 \
    --metrics breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum $F/bench_forward /tmp/msa_in $2 1 ${4:-} > $O/ncu_$1.txt 2>&1
  echo "rc $?" >> $O/ncu_$1.txt
  echo "== $1"; grep -E "lts__|ltc|gpu__time|^rc" $O/ncu_$1.txt | sort -k3 -n -r | head -40
done
