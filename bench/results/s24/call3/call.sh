#!/usr/bin/env bash
# NOT RUN: no machine came for it (six attempts); call 4 ran a cut of it.
# Session 24 call 3: the new defaults (FORWARD_KV_LOCALITY 9,2 capped at 2^11 queries,
# L2Hints::auto: K/V evict_first from a mean document of 64K tokens; the task build's
# branch-free bin scan and bins cleared by every CTA) against the old ones ("9,2": no cap, no
# hint) in the same processes, at every bench length; the GPU tests of this PTX; the sanitizers.
# Bundle (git-ignored) .gpu/s24b: bench, bench_forward, sanitize_cases and the msa-tests binaries
# forward_kv, task_build, forward, backward. Run as BUDGET=<seconds> bash bench/results/s24/call3/call.sh.
set -uo pipefail
O=$OUT
F=.gpu/s24b
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
left() { [ $(( T0 + ${BUDGET:-400} - $(date +%s) )) -ge $1 ]; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
C=doc8k,doc16k,doc32k,packed64k,doc64k,doc128k,doc256k,doc1m
timeout 90 $F/bench --cases $C --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
s inputs
for t in forward_kv task_build forward backward; do
  left 40 || break
  (REQUIRE_GPU=1 timeout 80 $F/$t --test-threads=1 > /tmp/test_$t.txt 2>&1; echo "rc $?" >> /tmp/test_$t.txt)
  echo "== $t" >> $O/tests.txt; cat /tmp/test_$t.txt >> $O/tests.txt
  grep -E "test result|^rc|FAIL|panic" /tmp/test_$t.txt | head -5
  s test $t
done
for c in doc1m doc256k doc64k,doc128k doc8k,doc16k,doc32k,packed64k; do
  left 60 || break
  BENCH_KV_ONLY=1 timeout 55 $F/bench_forward /tmp/msa_in $c 5 "9,2;9,2,12/kv" >> $O/sweep.txt 2>&1
  echo "rc $?" >> $O/sweep.txt
  s sweep $c
done
grep -E "^\| [dp]|^rc|rror" $O/sweep.txt | cut -c1-96
for i in 1 2; do
  left 50 || break
  BENCH_KV_ONLY=1 timeout 40 $F/bench_forward /tmp/msa_in packed64k 10 "9,2" >> $O/packed.txt 2>&1
done
grep -E "^\| p" $O/packed.txt | cut -c1-96
s packed
if left 60; then
  timeout $(( T0 + BUDGET - $(date +%s) - 10 )) bash scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1
  echo "rc $?" >> $O/sanitize.txt
  grep -E "whole run|rc |errors \([1-9]|[1-9][0-9]* errors" $O/sanitize.txt | head -20
  s sanitize
fi
