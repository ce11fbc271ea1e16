#!/usr/bin/env bash
# NOT RUN: session 27 had no device time left (five starts failed). For the next session's
# first call, on main's build: the paired o_pool (`with_paired_pool(true)`, opt-in) on a GPU. Bundle .gpu/s27
# (scripts/forward-kv-bundle.sh .gpu/s27, plus bench, plus .gpu/s25b's bench_forward as
# bench_forward_prev: the build before the paired pool). In priority order: the KV forward
# alone, the paired pool (bench_forward with BENCH_KV_PAIRED=1), the same build unpaired (its
# default) and the build before it (bench_forward_prev) in the same call, 5 reps; the GPU
# tests forward_kv (their paired case included); doc1m the same way; the GPU tests forward;
# the sanitizers (the harness runs the defaults: unpaired). The .gpu/s27 on disk predates
# f55fe06 (the paired pool's own kernels): rebuild it first, as above.
# Run as BUDGET=<seconds> bash bench/results/s27/call7/call.sh
set -uo pipefail
O=$OUT
F=.gpu/s27
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
left() { [ $(( T0 + ${BUDGET:-200} - $(date +%s) )) -ge $1 ]; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
timeout 60 $F/bench --cases doc8k,packed64k,doc64k,doc256k,doc1m --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
s inputs
ab() { # cases timeout
  for v in paired unpaired prev; do
    case $v in
      paired) B=$F/bench_forward; E=1;;
      unpaired) B=$F/bench_forward; E=0;;
      prev) B=$F/bench_forward_prev; E=0;;
    esac
    echo "== $v $1" >> $O/ab.txt
    BENCH_KV_PAIRED=$E BENCH_KV_ONLY=1 timeout $2 $B /tmp/msa_in $1 5 >> $O/ab.txt 2>&1
    echo "rc $?" >> $O/ab.txt
  done
  s ab $1
}
show() { grep -E "^== |^\| [dp]|^rc|rror|panic" $O/ab.txt | cut -c1-100; grep -o "msa_forward_kv_f16_sm90 [0-9.]*\|fwd_kv_combine_f16 [0-9.]*\|fwd_kv_probe [0-9.]*" $O/ab.txt | paste -sd' ' | fold -w 200; }
left 100 && ab doc64k,packed64k,doc8k 45
left 80 && ab doc256k 40
show
t=forward_kv
if left 90; then
  (REQUIRE_GPU=1 timeout 85 $F/$t --test-threads=1 > /tmp/test_$t.txt 2>&1; echo "rc $?" >> /tmp/test_$t.txt)
  echo "== $t" >> $O/tests.txt; cat /tmp/test_$t.txt >> $O/tests.txt
  grep -E "test result|^rc|FAIL|panic" /tmp/test_$t.txt | head -5
  s test $t
fi
left 100 && ab doc1m 45 && show | tail -8
t=forward
if left 100; then
  (REQUIRE_GPU=1 timeout 95 $F/$t --test-threads=1 > /tmp/test_$t.txt 2>&1; echo "rc $?" >> /tmp/test_$t.txt)
  echo "== $t" >> $O/tests.txt; cat /tmp/test_$t.txt >> $O/tests.txt
  grep -E "test result|^rc|FAIL|panic" /tmp/test_$t.txt | head -5
  s test $t
fi
if left 180; then
  timeout 170 bash scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1
  echo "rc $?" >> $O/sanitize.txt
  grep -E "whole run|rc |fwd_kv_homes|f16_sm90" $O/sanitize.txt | head -20
  s sanitize
fi
s end
