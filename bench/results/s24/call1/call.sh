#!/usr/bin/env bash
# Session 24 call 1. Bundle (built here, git-ignored): .gpu/s24 = bench (inputs), bench_forward,
# and the msa-tests binaries forward_kv, forward, task_build, backward of the same commit.
# Run as BUDGET=<seconds of the call> bash bench/results/s24/call1/call.sh (device tool, carry .gpu/s24).
# 1. The KV forward at packed64k, doc64k, doc256k and doc1m: its defaults (9,2, no hint) and
#    the rules of RULES (MIN,BLOCKS[,MAX][/hints]): the L2 hints (kv = K/V evict_first,
#    q/o = evict_last) and windows capped under one query per key block (MAX).
# 2. The GPU tests of the new PTX (the hints' policies in every KV pass, the cap in task_scan_work).
set -uo pipefail
O=$OUT
F=.gpu/s24
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
left() { [ $(( T0 + ${BUDGET:-400} - $(date +%s) )) -ge $1 ]; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
timeout 60 $F/bench --cases packed64k,doc64k,doc256k,doc1m --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
s inputs
RULES="9,2/kv;9,0/kv;9,0,12/kv;9,0,11/kv;9,0;9,0,12;9,0,12/kv,q,o"
for c in packed64k doc64k doc256k doc1m; do
  left 120 || break
  BENCH_KV_ONLY=1 timeout 110 $F/bench_forward /tmp/msa_in $c 5 "$RULES" >> $O/sweep.txt 2>&1
  echo "rc $?" >> $O/sweep.txt
  grep -E "^\| $c|^rc|rror" $O/sweep.txt | tail -9 | cut -c1-100
  s sweep $c
done
for t in forward_kv task_build forward backward; do
  left 40 || break
  (REQUIRE_GPU=1 timeout 100 $F/$t --test-threads=1 > /tmp/test_$t.txt 2>&1; echo "rc $?" >> /tmp/test_$t.txt)
  echo "== $t" >> $O/tests.txt; cat /tmp/test_$t.txt >> $O/tests.txt
  grep -E "test result|^rc|FAIL|panic" /tmp/test_$t.txt | head -5
  s test $t
done
