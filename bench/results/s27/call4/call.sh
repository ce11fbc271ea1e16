#!/usr/bin/env bash
# Session 27, call 4: the L2 sides probe (bench/probe/l2_sides.cu: which partition each SM sits
# next to, where addresses are homed and at what granularity), then the sum pass's fabric
# sectors by operation at doc64k (ncu, bundle .gpu/s25b). Run as bash bench/results/s27/call4/call.sh
set -uo pipefail
O=$OUT
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
nvcc -O2 -gencode=arch=compute_90a,code=sm_90a bench/probe/l2_sides.cu -o /tmp/l2_sides 2>&1 | tail -5
timeout 120 /tmp/l2_sides > $O/probe.txt 2>&1; echo "rc $?" >> $O/probe.txt
cat $O/probe.txt | head -120
F=.gpu/s25b
timeout 60 $F/bench --cases doc64k --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
M=lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_srcunit_ltcfabric_op_read.sum,lts__t_sectors_srcunit_ltcfabric_op_red.sum,lts__t_sectors_srcunit_ltcfabric_op_write.sum,lts__t_sectors_srcunit_ltcfabric_op_atom.sum,lts__t_sectors_srcunit_ltcfabric_lookup_hit.sum,lts__t_sectors_srcunit_ltcfabric_lookup_miss.sum,gpu__time_duration.sum
BENCH_KV_ONLY=1 timeout 90 ncu --clock-control none --kernel-name msa_forward_kv_f16_sm90 --launch-skip 0 --launch-count 1 \
  --metrics $M $F/bench_forward /tmp/msa_in doc64k 1 > $O/ncu_doc64k.txt 2>&1
echo "rc $?" >> $O/ncu_doc64k.txt
grep -E "lts__|gpu__|^rc|rror" $O/ncu_doc64k.txt
