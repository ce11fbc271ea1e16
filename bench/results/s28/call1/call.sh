#!/usr/bin/env bash
# NOT RUN: session 28 got no machine (six starts failed, then device loans were paused). With
# call2/call.sh it replaces session 27's unrun `s27/call7/call.sh` (removed), adds paired K/V
# (`with_paired_kv`, BENCH_KV_PAIRED=kv) and the fabric counters, and runs the sanitizers over
# the paired kernels (sanitize_cases now runs them).
#
# Bundle, here: scripts/forward-kv-bundle.sh .gpu/s28 "" .gpu/s25b/bench_forward
# (bench_forward_prev: the build before the paired pool). Then `run` with carry [".gpu/s28"]:
#   BUDGET=<seconds, at most 570> bash bench/results/s28/call1/call.sh
# then the same for call2. Call 1, in priority order, each step only while BUDGET leaves room:
#  1. the GPU tests forward_kv (paired pool and paired K/V cases included);
#  2. the KV forward alone, one process per variant, 5 reps: paired pool and K/V
#     (BENCH_KV_PAIRED=kv), paired pool (=1), unpaired (this build's default), and the build
#     before the paired pool: doc64k, packed64k, doc8k, then doc256k;
#  3. ncu on the sum pass of each variant of this build at doc64k and doc256k: the fabric
#     between the L2 partitions, the crossbar into the slices, reductions and reads arriving
#     from the fabric.
set -uo pipefail
O=$OUT
F=.gpu/s28
. bench/results/s28/lib.sh
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
left 90 && test_bin forward_kv 85
timeout 60 $F/bench --cases doc8k,packed64k,doc64k,doc256k --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
s inputs
left 120 && ab doc64k,packed64k,doc8k 45
left 100 && ab doc256k 40
show
M=lts__ltcfabric2ltc_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__xbar2lts_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_srcunit_ltcfabric_op_red.sum,lts__t_sectors_srcunit_tex_op_red.sum,lts__t_sectors_srcunit_ltcfabric_op_read.sum,gpu__time_duration.sum
for c in doc64k doc256k; do
  for v in kv 1 0; do
    left 40 || break
    BENCH_KV_PAIRED=$v BENCH_KV_ONLY=1 timeout 35 ncu --clock-control none --kernel-name regex:msa_forward_kv_f16p?_sm90 --launch-skip 0 --launch-count 1 \
      --metrics $M $F/bench_forward /tmp/msa_in $c 1 > $O/ncu_${c}_paired$v.txt 2>&1
    echo "rc $?" >> $O/ncu_${c}_paired$v.txt
    echo "== $c paired=$v"; grep -E "lts__|gpu__time|^rc" $O/ncu_${c}_paired$v.txt
  done
done
s end
