#!/usr/bin/env bash
# Session 17 call 1: clocks during the packed64k timing (is the gap between the whole-call time
# and the breakdown's span the clock?), and ncu stall reasons of both passes.
set -uo pipefail
O=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv > $O/gpu.txt
python3 bench/msa_inputs.py --cases packed64k,doc64k --write /tmp/msa_in > /tmp/inputs.txt 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 100 > $O/clocks.csv 2>&1 &
SMI=$!
timeout 150 .gpu/fkv/bench_forward /tmp/msa_in packed64k,doc64k 10 > $O/bench_forward.txt 2>&1
kill $SMI
for k in msa_forward_kv_f16_sm90 msa_forward_kv_max_sm90; do
  timeout 150 ncu --clock-control none --kernel-name $k --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
    --section MemoryWorkloadAnalysis -o /tmp/$k .gpu/fkv/bench_forward /tmp/msa_in packed64k 1 > /tmp/$k.log 2>&1
  ncu -i /tmp/$k.ncu-rep > $O/ncu_$k.txt 2>&1
  ncu -i /tmp/$k.ncu-rep --page source --csv --print-source sass > /tmp/$k.csv 2>&1
  gzip -c /tmp/$k.csv > $O/src_$k.csv.gz
done
