#!/usr/bin/env bash
# NOT RUN in session 30 (device loans paused after three failed starts). Session 30 found why
# the paired pool measured slower in session 29: ptxas ran each side probe's second %clock read
# before the atomic returned (3add716), so the labels were noise. This call measures the fixed
# kernels. Bundle, here: scripts/forward-kv-bundle.sh .gpu/s30 .whl/fla_core-0.6.0-py3-none-any.whl
# (the wheel: `python3 -m pip download --no-deps -d .whl fla-core==0.6.0`) plus session 29's
# `cp .gpu/s28/bench_forward .gpu/s30/bench_forward_prev` (its paired pass has the broken
# probes; rebuild it at d59661c if .gpu/s28 is gone), then `run` with carry [".gpu/s30"]:   BUDGET=<seconds, at most 570> bash bench/results/s30/call1/call.sh
# In priority order, each step only while BUDGET leaves room:
#  1. GPU test forward_kv: its paired pool and paired K/V cases against the CPU reference, and
#     paired_pool_labels_do_not_depend_on_who_measured_them (prints how far two labellings agree);
#  2. the KV forward alone, one process per variant (paired pool + K/V, paired pool,
#     unpaired, and session 29's paired pool with the broken probes), median of 5: doc64k,
#     packed64k, doc8k, then doc256k;
#  3. ncu on the sum pass at doc64k, paired pool against unpaired: reduction and read sectors
#     arriving from the L2 fabric, the fabric's activity;
#  4. bench/probe/l2_fabric.cu (s29/call3), with the probes' fixed timed atomic.
set -uo pipefail
R=$OUT
O=/tmp/s30c1; mkdir -p $O
F=.gpu/s30
. bench/results/s28/lib.sh
AB_VARIANTS="pairedkv paired unpaired broken"
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
left 90 && test_bin forward_kv 85
timeout 60 $F/bench --cases doc8k,packed64k,doc64k,doc256k --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
s inputs
left 120 && ab doc64k,packed64k,doc8k 45
left 100 && ab doc256k 40
show
M=lts__ltcfabric2ltc_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_red.sum,lts__t_sectors_srcunit_tex_op_red.sum,lts__t_sectors_srcunit_ltcfabric_op_red.sum,lts__t_sectors_srcunit_ltcfabric_op_read.sum,lts__t_sectors_srcunit_ltcfabric.sum,gpu__time_duration.sum
for v in 1 0; do
  left 45 || break
  BENCH_KV_PAIRED=$v BENCH_KV_ONLY=1 timeout 40 ncu --clock-control none --kernel-name regex:msa_forward_kv_f16p?_sm90 --launch-skip 0 --launch-count 1 \
    --metrics $M $F/bench_forward /tmp/msa_in doc64k 1 > $O/ncu_doc64k_paired$v.txt 2>&1
  echo "rc $?" >> $O/ncu_doc64k_paired$v.txt
  echo "== doc64k paired=$v"; grep -E "lts__|gpu__time|^rc" $O/ncu_doc64k_paired$v.txt
done
s ncu
if left 100; then
  mkdir -p $O/probe
  OUT=$O/probe timeout 95 bash bench/results/s29/call3/call.sh > $O/probe/stdout.txt 2>&1
  tail -12 $O/probe/stdout.txt
  s probe
fi
s end
tar czf $R/out.tgz -C /tmp s30c1
