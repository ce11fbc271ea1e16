#!/usr/bin/env bash
# Session 25 call 5: task_assign_segments adding the bin-chunk totals once per warp and chunk
# (calls 1-2 showed one red.add per task into them costing 0.04 → 0.36 ms at packed64k).
# GPU tests of this PTX, the KV forward with it (bench_forward) against the build before it
# (bench_forward_prev, calls 1-4's) in the same call, synccheck over the sanitize cases, then
# doc1m. Bundle (git-ignored) .gpu/s25b: scripts/forward-kv-bundle.sh .gpu/s25b, plus bench and
# task_build, plus .gpu/s25's bench_forward as bench_forward_prev.
# Run as BUDGET=<seconds> bash bench/results/s25/call5/call.sh.
set -uo pipefail
O=$OUT
F=.gpu/s25b
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
left() { [ $(( T0 + ${BUDGET:-300} - $(date +%s) )) -ge $1 ]; }
s start
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
t() {
  (REQUIRE_GPU=1 timeout $2 $F/$1 --test-threads=1 > /tmp/test_$1.txt 2>&1; echo "rc $?" >> /tmp/test_$1.txt)
  echo "== $1" >> $O/tests.txt; cat /tmp/test_$1.txt >> $O/tests.txt
  grep -E "test result|^rc|FAIL|panic" /tmp/test_$1.txt | head -5
  s test $1
}
t task_build 60
t forward_kv 60
timeout 60 $F/bench --cases packed64k,doc64k,doc1m --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
s inputs
for b in bench_forward bench_forward_prev bench_forward; do
  left 30 || break
  BENCH_KV_ONLY=1 timeout 30 $F/$b /tmp/msa_in packed64k,doc64k 10 > /tmp/b.txt 2>&1
  echo "== $b" >> $O/bench.txt; cat /tmp/b.txt >> $O/bench.txt
  grep -E "^\| [dp]" /tmp/b.txt | cut -c1-90; grep -o "task_assign_segments [0-9.]*" /tmp/b.txt
  s bench $b
done
if left 60; then
  cs=$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | tail -n 1)
  timeout 55 $cs --tool synccheck $F/sanitize_cases all > $O/synccheck.txt 2>&1
  echo "rc $?" >> $O/synccheck.txt
  grep -E "SUMMARY|^rc|^case" $O/synccheck.txt | head
  s synccheck
fi
left 30 && t forward 30
left 85 && t backward 80
if left 45; then
  BENCH_KV_ONLY=1 timeout 40 $F/bench_forward /tmp/msa_in doc1m 3 > $O/doc1m.txt 2>&1
  echo "rc $?" >> $O/doc1m.txt
  grep -E "^\| [dp]|^rc|rror|breakdown" $O/doc1m.txt | cut -c1-300
  s doc1m
fi
