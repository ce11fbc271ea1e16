#!/usr/bin/env bash
# Session 16's final device call: timings with fla in the same run first, then the GPU tests,
# the sanitizers and ncu on the combine; each writes straight into $OUT.
set -uo pipefail
O=$OUT
C=doc8k,doc16k,doc32k,doc64k,packed64k
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $O/gpu.txt
python3 bench/msa_inputs.py --cases $C --write /tmp/msa_in > /tmp/inputs.txt 2>&1
timeout 120 .gpu/fkv/bench_forward /tmp/msa_in $C 10 > $O/bench_forward.txt 2>&1
python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/fkv/fla_core-*.whl > /dev/null 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 240 python3 bench/forward_baselines.py \
  --cases $C --methods fla --reps 10 --json $O/forward_baselines.json > $O/forward_baselines.txt 2>&1
for t in forward_kv forward; do
  echo "== $t" >> $O/tests.txt
  REQUIRE_GPU=1 timeout 150 .gpu/fkv/$t --test-threads 1 --nocapture 2>&1 | tail -n 30 >> $O/tests.txt
done
timeout 150 scripts/sanitize.sh .gpu/fkv/sanitize_cases /tmp/sanitize > $O/sanitize.txt 2>&1
timeout 60 ncu --clock-control none --kernel-name fwd_kv_combine_f16 --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight .gpu/fkv/bench_forward /tmp/msa_in packed64k 1 > $O/ncu_combine.txt 2>&1
