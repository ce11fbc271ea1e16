#!/usr/bin/env bash
# Session 27, call 6: the paired o_pool (branch s27-paired-pool) on a GPU. Bundle .gpu/s27
# (scripts/forward-kv-bundle.sh .gpu/s27, plus bench, plus .gpu/s25b's bench_forward as
# bench_forward_prev: main's build). A/B in one call: the paired pool (bench_forward), the same
# build unpaired (BENCH_KV_PAIRED=0) and main's build (bench_forward_prev), KV forward alone,
# 5 reps; then the GPU tests, the sanitizers, and doc1m.
# Run as BUDGET=<seconds> bash bench/results/s27/call6/call.sh
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
  for v in paired unpaired main; do
    case $v in
      paired) B=$F/bench_forward; E=1;;
      unpaired) B=$F/bench_forward; E=0;;
      main) B=$F/bench_forward_prev; E=1;;
    esac
    echo "== $v $1" >> $O/ab.txt
    BENCH_KV_PAIRED=$E BENCH_KV_ONLY=1 timeout $2 $B /tmp/msa_in $1 5 >> $O/ab.txt 2>&1
    echo "rc $?" >> $O/ab.txt
  done
  s ab $1
}
left 150 && ab doc64k,packed64k 45
left 150 && ab doc256k,doc8k 50
grep -E "^== |^\| [dp]|^rc|rror|panic" $O/ab.txt | cut -c1-100
grep -o "msa_forward_kv_f16_sm90 [0-9.]*" $O/ab.txt | head -20
for t in forward_kv forward; do
  left 110 || break
  (REQUIRE_GPU=1 timeout 100 $F/$t --test-threads=1 > /tmp/test_$t.txt 2>&1; echo "rc $?" >> /tmp/test_$t.txt)
  echo "== $t" >> $O/tests.txt; cat /tmp/test_$t.txt >> $O/tests.txt
  grep -E "test result|^rc|FAIL|panic" /tmp/test_$t.txt | head -5
  s test $t
done
if left 190; then
  timeout 175 bash scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1
  echo "rc $?" >> $O/sanitize.txt
  grep -E "whole run|rc |errors \([1-9]|[1-9][0-9]* errors|fwd_kv_homes|f16_sm90" $O/sanitize.txt | head -20
  s sanitize
fi
left 150 && ab doc1m 45
grep -E "^== |^\| [dp]|^rc|rror|panic" $O/ab.txt | tail -8 | cut -c1-100
s end
