#!/usr/bin/env bash
# Session 24 call 4: call 3 cut to what the device time left allows. The GPU tests of the
# task build's new scans and the KV forward's new defaults first, then the new defaults against
# the old ("9,2") at doc1m and doc256k, then the forward tests. Bundle .gpu/s24b (call 3's).
# Run as BUDGET=<seconds> bash bench/results/s24/call4/call.sh.
set -uo pipefail
O=$OUT
F=.gpu/s24b
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
left() { [ $(( T0 + ${BUDGET:-200} - $(date +%s) )) -ge $1 ]; }
s start
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
for t in task_build forward_kv backward; do
  (REQUIRE_GPU=1 timeout 60 $F/$t --test-threads=1 > /tmp/test_$t.txt 2>&1; echo "rc $?" >> /tmp/test_$t.txt)
  echo "== $t" >> $O/tests.txt; cat /tmp/test_$t.txt >> $O/tests.txt
  grep -E "test result|^rc|FAIL|panic" /tmp/test_$t.txt | head -5
  s test $t
done
if left 50; then
  timeout 40 $F/bench --cases doc256k,doc1m --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
  s inputs
  BENCH_KV_ONLY=1 timeout $(( T0 + BUDGET - $(date +%s) - 5 )) $F/bench_forward /tmp/msa_in doc1m,doc256k 3 "9,2" > $O/sweep.txt 2>&1
  echo "rc $?" >> $O/sweep.txt
  grep -E "^\| [dp]|^rc|rror" $O/sweep.txt | cut -c1-96
  s sweep
fi
if left 55; then
  (REQUIRE_GPU=1 timeout 50 $F/forward --test-threads=1 > /tmp/test_forward.txt 2>&1; echo "rc $?" >> /tmp/test_forward.txt)
  echo "== forward" >> $O/tests.txt; cat /tmp/test_forward.txt >> $O/tests.txt
  grep -E "test result|^rc|FAIL|panic" /tmp/test_forward.txt | head -5
  s test forward
fi
# Afterwards, on the same machine (device time ran out for more):
#   REQUIRE_GPU=1 timeout 75 .gpu/s24b/forward --test-threads=1 > $OUT/forward.txt  (forward_tests.txt)
