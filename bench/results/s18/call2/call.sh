#!/usr/bin/env bash
# Session 18 call 2: the probe reference (fwd_kv_probe, no max pass) as the KV forward's
# default. GPU tests (forward_kv: every case with Bound, ExactMax and Probe on both pools;
# forward: MsaAttention with Auto), bench_forward on the five cases with fla in the same run,
# then the sanitizers.
set -uo pipefail
O=$OUT
F=.gpu/fkv
C=doc8k,doc16k,doc32k,doc64k,packed64k
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv > $O/gpu.txt
s() { echo "$(date +%s) $*" >> $O/times.txt; }
s start
(REQUIRE_GPU=1 timeout 120 $F/forward_kv --test-threads=1 --nocapture > $O/test_forward_kv.txt 2>&1; echo "rc $?" >> $O/test_forward_kv.txt)
s forward_kv
(REQUIRE_GPU=1 timeout 150 $F/forward --test-threads=1 > $O/test_forward.txt 2>&1; echo "rc $?" >> $O/test_forward.txt)
s forward
python3 bench/msa_inputs.py --cases $C --write /tmp/msa_in > /tmp/inputs.txt 2>&1
timeout 200 $F/bench_forward /tmp/msa_in $C 10 > $O/bench_forward.txt 2>&1
s bench
python3 -m pip install -q --no-deps --no-index --target /tmp/site $F/fla_core-*.whl > /dev/null 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 150 python3 bench/forward_baselines.py \
  --cases $C --methods fla --reps 10 --json $O/forward_baselines.json > $O/forward_baselines.txt 2>&1
s fla
(timeout 160 scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1; echo "rc $?" >> $O/sanitize.txt)
s sanitize
