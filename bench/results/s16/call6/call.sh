#!/usr/bin/env bash
# Session 16, last call: bench_forward with the baselines' timing method (events read after
# one final sync) and fla in the same run.
set -uo pipefail
O=$OUT
C=doc8k,doc16k,doc32k,doc64k,packed64k
nvidia-smi --query-gpu=name,driver_version --format=csv > $O/gpu.txt
python3 bench/msa_inputs.py --cases $C --write /tmp/msa_in > /tmp/inputs.txt 2>&1
timeout 150 .gpu/fkv/bench_forward /tmp/msa_in $C 10 > $O/bench_forward.txt 2>&1
python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/fkv/fla_core-*.whl > /dev/null 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 200 python3 bench/forward_baselines.py \
  --cases $C --methods fla --reps 10 --json $O/forward_baselines.json > $O/forward_baselines.txt 2>&1
