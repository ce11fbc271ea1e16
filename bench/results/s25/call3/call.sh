#!/usr/bin/env bash
# Session 25 call 3, on call 2's machine: ncu of the sum pass's first launch (call 2's
# --launch-skip 1 caught the second launch, the empty recompute pass). Bundle .gpu/s25.
for c in doc256k doc64k; do BENCH_KV_ONLY=1 timeout 80 ncu --clock-control none --kernel-name msa_forward_kv_f16_sm90 --launch-skip 0 --launch-count 1 --section SpeedOfLight --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_bytes.sum,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active .gpu/s25/bench_forward /tmp/msa_in $c 1 > $OUT/ncu_$c.txt 2>&1; echo "rc $?" >> $OUT/ncu_$c.txt; grep -E "dram__|lts__|pipe_shared|Duration|Throughput|^rc|SM Frequency|DRAM Frequency" $OUT/ncu_$c.txt | head -16; done
