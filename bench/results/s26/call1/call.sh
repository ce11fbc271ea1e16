#!/usr/bin/env bash
# Written in session 26 (no device time then); run as session 27's call 1 (results in
# bench/results/s27/call1/). On main's PTX
# (unchanged since e3e75a9: session 26 changed the test command's build settings, an example and docs).
# It holds session 25's call 4, which never ran (this script replaces it): the forward and
# backward GPU tests and the sanitizers on this PTX; then the sum pass's L2 traffic by
# operation and source at doc64k and doc256k (ncu); then, on an H200, every length. It adds
# the test that `model-2026-12-07-s26-forward-long-bound.md` asks for: the same ncu metrics at
# doc256k under 2^12-query windows with Q and o_pool evict_last (rule 9,2,12/kv,q,o), against
# the defaults' 2^11. Whether rows cross the L2 fabric, and whether Q reads miss more at 2^12,
# tells whether the rows' residency is lost to the two L2 partitions.
# Bundle (git-ignored) .gpu/s25b (still valid: same PTX): scripts/forward-kv-bundle.sh
# .gpu/s25b, plus bench (cargo build --release -p msa-runtime --example bench) and the
# msa-tests binary task_build copied in, then strip.
# Run as BUDGET=<seconds> bash bench/results/s26/call1/call.sh (about 540 s in full).
set -uo pipefail
O=$OUT
F=.gpu/s25b
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
left() { [ $(( T0 + ${BUDGET:-200} - $(date +%s) )) -ge $1 ]; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
python3 -c "import torch; p = torch.cuda.get_device_properties(0); print('L2 bytes', p.L2_cache_size, 'SMs', p.multi_processor_count)" 2>&1 | tee -a $O/gpu.txt
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
# The defaults' first sum-pass launch (launch-skip 0). With REPS = 1 the defaults make 10
# forwards (3 warm-up + 1 timed, then the breakdown's 1 + 5), each launching the sum pass twice
# (the pass, then the gated recompute pass): a rule's first launch is number 20.
ncu_case() { # name case skip [rule]
  BENCH_KV_ONLY=1 timeout 90 ncu --clock-control none --kernel-name msa_forward_kv_f16_sm90 --launch-skip $3 --launch-count 1 \
    --section SpeedOfLight --metrics $M $F/bench_forward /tmp/msa_in $2 1 ${4:-} > $O/ncu_$1.txt 2>&1
  echo "rc $?" >> $O/ncu_$1.txt
  grep -E "lts__|dram__|gpu__time|L2 Cache Throughput|^rc" $O/ncu_$1.txt
  s ncu $1
}
left 60 && ncu_case doc64k doc64k 0
left 60 && ncu_case doc256k doc256k 0
left 90 && ncu_case doc256k_w12 doc256k 20 '9,2,12/kv,q,o'
grep -q H200 $O/gpu.txt || exit 0
for c in doc1m doc256k,doc128k,doc64k doc8k,doc16k,doc32k,packed64k; do
  left 60 || break
  BENCH_KV_ONLY=1 timeout 55 $F/bench_forward /tmp/msa_in $c 3 >> $O/sweep.txt 2>&1
  echo "rc $?" >> $O/sweep.txt
  s sweep $c
done
grep -E "^\| [dp]|^rc|rror" $O/sweep.txt | cut -c1-96
