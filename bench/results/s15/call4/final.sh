#!/usr/bin/env bash
# Session 15's last device call: the tests first, then the timings, then the sanitizers; each
# writes straight into $OUT, so a call cut short still returns what finished.
set -uo pipefail
O=$OUT
C=doc8k,doc16k,doc32k,doc64k,packed64k
nvidia-smi --query-gpu=name,driver_version --format=csv > $O/gpu.txt
python3 bench/msa_inputs.py --cases $C --write /tmp/msa_in > $O/inputs.txt 2>&1
for t in forward_kv forward; do
  REQUIRE_GPU=1 timeout 100 .gpu/fkv/$t --test-threads 1 --nocapture > $O/test_$t.txt 2>&1
done
timeout 80 .gpu/fkv/bench_forward /tmp/msa_in $C 10 > $O/bench_forward.txt 2>&1
timeout 120 scripts/sanitize.sh .gpu/fkv/sanitize_cases /tmp/sanitize > $O/sanitize.txt 2>&1
