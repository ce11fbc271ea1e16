#!/usr/bin/env bash
# Bundle: scripts/forward-kv-hints-bundle.sh .gpu/s23. Run as BUDGET=<seconds of the call> bash ...
# Session 23 call 2 (not run: no machine came): why the KV forward slows past 64K tokens (call 1: 432 useful TFLOP/s at
# doc64k, 254 at doc256k, 191 at doc1m on an H100). Three builds of the same host code:
# main (no L2 hints, main's PTX), kvfirst (K/V TMA loads evict_first), all (K/V evict_first,
# Q loads and o_pool reduce-adds evict_last); each at packed64k, doc64k, doc256k and doc1m
# with the task-order locality rules 9,2 (the default), 9,0, 9,1 and 9,3; packed64k
# alternated three times more per build; the forward_kv GPU tests of both hinted builds.
set -uo pipefail
O=$OUT
F=.gpu/s23
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
# Steps start only while at least `need` seconds remain of BUDGET (the call's limit).
left() { [ $(( T0 + ${BUDGET:-400} - $(date +%s) )) -ge $1 ]; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
timeout 60 $F/bench --cases packed64k,doc64k,doc256k,doc1m --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
s inputs
for v in main all kvfirst; do
  left 100 || break
  echo "== $v" >> $O/sweep.txt
  BENCH_KV_ONLY=1 timeout 170 $F/$v/bench_forward /tmp/msa_in packed64k,doc64k,doc256k,doc1m 5 "9,0;9,1;9,3" >> $O/sweep.txt 2>&1
  echo "rc $?" >> $O/sweep.txt
  grep -E "^==|^\| (doc|packed)|^rc|rror" $O/sweep.txt | tail -17 | cut -c1-100
  s sweep $v
done
for i in 1; do
  for v in main kvfirst all; do
    left 50 || break 2
    echo "== $v $i" >> $O/ab.txt
    BENCH_KV_ONLY=1 timeout 40 $F/$v/bench_forward /tmp/msa_in packed64k 10 2>&1 | grep -E "^\| packed|breakdown|rror" >> $O/ab.txt
  done
done
grep -E "^==|^\|" $O/ab.txt | cut -c1-90
s ab
for v in all kvfirst; do
  left 45 || break
  echo "== $v" >> $O/tests.txt
  (REQUIRE_GPU=1 timeout 45 $F/$v/forward_kv --test-threads=1 >> $O/tests.txt 2>&1; echo "rc $?" >> $O/tests.txt)
done
grep -E "^==|test result|^rc|FAIL|panic" $O/tests.txt
s tests
# Added in session 24: quarter walks (a smaller span of concurrent rows) with K/V evict_first.
if left 60; then
  echo "== kvfirst split 4" >> $O/sweep.txt
  BENCH_KV_WALK_SPLIT=4 BENCH_KV_ONLY=1 timeout 55 $F/kvfirst/bench_forward /tmp/msa_in doc256k,doc1m 3 "9,0" >> $O/sweep.txt 2>&1
  echo "rc $?" >> $O/sweep.txt
  grep -E "^==|^\| (doc|packed)|^rc" $O/sweep.txt | tail -6 | cut -c1-100
  s split4
fi
