#!/usr/bin/env bash
# NOT RUN: session 28 got no machine (six starts failed, then device loans were paused). It
# replaces session 27's unrun `s27/call7/call.sh` (removed) and adds the paired pool's fabric
# counters and the sanitizers over it (sanitize_cases now runs the paired pool).
#
# Bundle, here: scripts/forward-kv-bundle.sh .gpu/s28 "" .gpu/s25b/bench_forward
# (bench_forward_prev: the build before the paired pool). Then `run` with carry [".gpu/s28"]:
#   BUDGET=<seconds, at most 570> bash bench/results/s28/call1/call.sh
# In priority order, each step only while BUDGET leaves room for it:
#  1. the KV forward alone, paired (BENCH_KV_PAIRED=1) / unpaired (this build's default) /
#     the build before, one process each, 5 reps: doc64k, packed64k, doc8k, then doc256k;
#  2. the GPU tests forward_kv (paired cases included);
#  3. ncu on the sum pass, paired and unpaired, doc64k and doc256k: the fabric between the
#     L2 partitions, the crossbar into the slices, reductions arriving from the fabric;
#  4. the sanitizers; 5. the GPU tests forward; 6. the A/B at doc1m; 7. the L2 sides probe
#     on this card.
set -uo pipefail
O=$OUT
F=.gpu/s28
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
left() { [ $(( T0 + ${BUDGET:-200} - $(date +%s) )) -ge $1 ]; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
timeout 60 $F/bench --cases doc8k,packed64k,doc64k,doc256k,doc1m --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
s inputs
ab() { # cases timeout
  for v in paired unpaired prev; do
    case $v in
      paired) B=$F/bench_forward; E=1;;
      unpaired) B=$F/bench_forward; E=0;;
      prev) B=$F/bench_forward_prev; E=0;;
    esac
    echo "== $v $1" >> $O/ab.txt
    BENCH_KV_PAIRED=$E BENCH_KV_ONLY=1 timeout $2 $B /tmp/msa_in $1 5 >> $O/ab.txt 2>&1
    echo "rc $?" >> $O/ab.txt
  done
  s ab $1
}
show() { grep -E "^== |^\| [dp]|^rc|rror|panic" $O/ab.txt | cut -c1-100; grep -o "msa_forward_kv_f16p\?_sm90 [0-9.]*\|fwd_kv_combine_f16p\? [0-9.]*\|fwd_kv_homes [0-9.]*" $O/ab.txt | paste -sd' ' | fold -w 200; }
test_bin() { # name timeout
  (REQUIRE_GPU=1 timeout $2 $F/$1 --test-threads=1 > /tmp/test_$1.txt 2>&1; echo "rc $?" >> /tmp/test_$1.txt)
  echo "== $1" >> $O/tests.txt; cat /tmp/test_$1.txt >> $O/tests.txt
  grep -E "test result|^rc|FAIL|panic" /tmp/test_$1.txt | head -5
  s test $1
}
left 100 && ab doc64k,packed64k,doc8k 45
left 80 && ab doc256k 40
show
left 90 && test_bin forward_kv 85
M=lts__ltcfabric2ltc_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__xbar2lts_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_srcunit_ltcfabric_op_red.sum,lts__t_sectors_srcunit_tex_op_red.sum,lts__t_sectors_srcunit_ltcfabric_op_read.sum,gpu__time_duration.sum
for c in doc64k doc256k; do
  for v in 1 0; do
    left 60 || break
    BENCH_KV_PAIRED=$v BENCH_KV_ONLY=1 timeout 45 ncu --clock-control none --kernel-name regex:msa_forward_kv_f16p?_sm90 --launch-skip 0 --launch-count 1 \
      --metrics $M $F/bench_forward /tmp/msa_in $c 1 > $O/ncu_${c}_paired$v.txt 2>&1
    echo "rc $?" >> $O/ncu_${c}_paired$v.txt
    echo "== $c paired=$v"; grep -E "msa_forward|lts__|gpu__time|^rc" $O/ncu_${c}_paired$v.txt
  done
done
s ncu
if left 200; then
  timeout 190 bash scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1
  echo "rc $?" >> $O/sanitize.txt
  grep -E "whole run|rc |errors \([1-9]|[1-9][0-9]* errors|fwd_kv_homes|f16p" $O/sanitize.txt | head -24
  s sanitize
fi
left 100 && test_bin forward 95
left 100 && ab doc1m 45 && show | tail -8
# Last, on this card (the probe ran on an H200 only): which side each SM and address is on.
if left 45; then
  nvcc -O2 -gencode=arch=compute_90a,code=sm_90a bench/probe/l2_sides.cu -o /tmp/l2_sides 2>&1 | tail -3
  timeout 35 /tmp/l2_sides > $O/probe.txt 2>&1; echo "rc $?" >> $O/probe.txt
  grep -E "^== |SMs on|runs of one home|differ" $O/probe.txt | head -16
  s probe
fi
s end
