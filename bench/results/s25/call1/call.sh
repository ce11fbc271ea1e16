#!/usr/bin/env bash
# Session 25 call 1: branch s24-multi-cta-scan (285055a, the bin scan on a CTA per 8192 bins,
# rebased on main 3a46013) — its GPU tests, then the KV forward at every bench length with the
# defaults against the old rule "9,2", doc1m also with main's bench_forward (single-CTA scan) in
# the same call, and with walks split in 4 and 8 CTAs (also capped at 2^12); then the sanitizers on the branch's PTX.
# Call 2 (call2.sh, chained on the same machine): every other length, and ncu of the sum pass.
# Bundle (git-ignored) .gpu/s25: scripts/forward-kv-bundle.sh .gpu/s25 on the branch, plus bench
# and task_build, plus main's bench_forward as bench_forward_main.
# Run as BUDGET=<seconds> bash bench/results/s25/call1/call.sh.
set -uo pipefail
O=$OUT
F=.gpu/s25
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
left() { [ $(( T0 + ${BUDGET:-400} - $(date +%s) )) -ge $1 ]; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
for t in task_build forward_kv backward forward; do
  left 40 || break
  (REQUIRE_GPU=1 timeout 80 $F/$t --test-threads=1 > /tmp/test_$t.txt 2>&1; echo "rc $?" >> /tmp/test_$t.txt)
  echo "== $t" >> $O/tests.txt; cat /tmp/test_$t.txt >> $O/tests.txt
  grep -E "test result|^rc|FAIL|panic" /tmp/test_$t.txt | head -5
  s test $t
done
C=doc8k,doc16k,doc32k,packed64k,doc64k,doc128k,doc256k,doc1m
timeout 90 $F/bench --cases $C --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
s inputs
for b in bench_forward bench_forward_main; do
  left 80 || break
  BENCH_KV_ONLY=1 timeout 75 $F/$b /tmp/msa_in doc1m 3 "9,2" > $O/doc1m_$b.txt 2>&1
  echo "rc $?" >> $O/doc1m_$b.txt
  grep -E "^\| [dp]|^rc|rror|breakdown" $O/doc1m_$b.txt | cut -c1-400
  s doc1m $b
done
for w in 4 8; do
  left 80 || break
  BENCH_KV_WALK_SPLIT=$w BENCH_KV_ONLY=1 timeout 75 $F/bench_forward /tmp/msa_in doc1m 3 "9,2,12/kv" > $O/doc1m_split$w.txt 2>&1
  echo "rc $?" >> $O/doc1m_split$w.txt
  grep -E "^\| [dp]|^rc|rror|breakdown" $O/doc1m_split$w.txt | cut -c1-400
  s doc1m split $w
done
if left 200; then
  timeout 170 bash scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1
  echo "rc $?" >> $O/sanitize.txt
  grep -E "whole run|rc |errors \([1-9]|[1-9][0-9]* errors" $O/sanitize.txt | head -20
  s sanitize
fi
