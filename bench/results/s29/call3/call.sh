#!/usr/bin/env bash
# Session 29, call 3: bench/probe/l2_fabric.cu, plainly timed, then each of its six `work`
# launches under ncu with the fabric and reduction sector counts.
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
nvcc -O2 -gencode=arch=compute_90a,code=sm_90a bench/probe/l2_fabric.cu -o /tmp/l2_fabric 2>&1 | tail -5
timeout 60 /tmp/l2_fabric 2>&1 | tee $OUT/probe.txt
M=lts__t_sectors.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_op_red.sum,lts__t_sectors_srcunit_tex_op_red.sum,lts__t_sectors_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__ltcfabric2ltc_cycles_active.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
timeout 120 ncu --clock-control none --kernel-name work --launch-skip 0 --launch-count 6 --metrics $M /tmp/l2_fabric > $OUT/ncu.txt 2>&1
echo "rc $?" >> $OUT/ncu.txt
grep -E "work|mode|lts__|gpu__time|^rc|rror" $OUT/ncu.txt | sed 's/  */ /g'
