#!/usr/bin/env bash
set -uo pipefail
O=$OUT
C=doc8k,doc16k,doc32k,doc64k,packed64k
nvidia-smi --query-gpu=name,driver_version --format=csv > $O/gpu.txt
python3 bench/msa_inputs.py --cases $C --write /tmp/msa_in > $O/inputs.txt 2>&1
for t in forward_kv forward; do REQUIRE_GPU=1 timeout 100 .gpu/fkv/$t --test-threads 1 --nocapture > $O/test_$t.txt 2>&1; done
timeout 90 .gpu/fkv/bench_forward /tmp/msa_in $C 10 > $O/bench_forward.txt 2>&1
for k in msa_forward_kv_max_sm90 msa_forward_kv_f16_sm90; do
timeout 60 ncu --clock-control none --kernel-name $k --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --metrics sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum,sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active \
  .gpu/fkv/bench_forward /tmp/msa_in packed64k 1 > $O/ncu_$k.txt 2>&1
done
