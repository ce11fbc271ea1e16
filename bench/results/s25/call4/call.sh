#!/usr/bin/env bash
# NOT RUN: no machine came for it before the session's device time was spent. For the next
# session's first call, on this PTX (main after 0c6d796).
# Session 25 call 4: the GPU tests and sanitizers that call 5 had no time for (forward,
# backward, scripts/sanitize.sh), then where the sum pass's L2 traffic goes (ncu, L2 sectors by
# operation and source, first launch of msa_forward_kv_f16_sm90) at doc64k and doc256k; then,
# on an H200 only, the KV forward at every bench length with the defaults.
# Bundle (git-ignored) .gpu/s25b: scripts/forward-kv-bundle.sh .gpu/s25b, plus bench
# (cargo build --release -p msa-runtime --example bench) and the msa-tests binary task_build.
# Run as BUDGET=<seconds> bash bench/results/s25/call4/call.sh (about 480 s in full).
set -uo pipefail
O=$OUT
F=.gpu/s25b
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
left() { [ $(( T0 + ${BUDGET:-200} - $(date +%s) )) -ge $1 ]; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
for t in forward backward; do
  left 100 || break
  (REQUIRE_GPU=1 timeout 95 $F/$t --test-threads=1 > /tmp/test_$t.txt 2>&1; echo "rc $?" >> /tmp/test_$t.txt)
  echo "== $t" >> $O/tests.txt; cat /tmp/test_$t.txt >> $O/tests.txt
  grep -E "test result|^rc|FAIL|panic" /tmp/test_$t.txt | head -5
  s test $t
done
if left 200; then
  timeout 170 bash scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1
  echo "rc $?" >> $O/sanitize.txt
  grep -E "whole run|rc |errors \([1-9]|[1-9][0-9]* errors" $O/sanitize.txt | head -20
  s sanitize
fi
timeout 60 $F/bench --cases doc8k,doc16k,doc32k,packed64k,doc64k,doc128k,doc256k,doc1m --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
s inputs
M=lts__t_bytes.sum,lts__t_sectors.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_atom.sum
M=$M,lts__t_requests_op_red.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_red.sum
M=$M,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,lts__t_sectors_srcunit_tex_op_red_lookup_miss.sum,dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum
for c in doc64k doc256k; do
  left 40 || break
  BENCH_KV_ONLY=1 timeout 60 ncu --clock-control none --kernel-name msa_forward_kv_f16_sm90 --launch-skip 0 --launch-count 1 \
    --section SpeedOfLight --metrics $M $F/bench_forward /tmp/msa_in $c 1 > $O/ncu_$c.txt 2>&1
  echo "rc $?" >> $O/ncu_$c.txt
  grep -E "lts__|dram__|gpu__time|L2 Cache Throughput|^rc" $O/ncu_$c.txt
  s ncu $c
done
grep -q H200 $O/gpu.txt || exit 0
for c in doc1m doc256k,doc128k,doc64k doc8k,doc16k,doc32k,packed64k; do
  left 60 || break
  BENCH_KV_ONLY=1 timeout 55 $F/bench_forward /tmp/msa_in $c 3 >> $O/sweep.txt 2>&1
  echo "rc $?" >> $O/sweep.txt
  s sweep $c
done
grep -E "^\| [dp]|^rc|rror" $O/sweep.txt | cut -c1-96
