#!/usr/bin/env bash
# Session 18 call 1: main's GPU tests (forward_kv, forward), the Python gpu_check, the
# sanitizers; then bench_forward A/B: base (main) vs exp/s17-uniform-desc (ud),
# exp/s17-tree-max (tm), exp/s17-chain (ch), each in its own process, plus the branches'
# forward_kv GPU tests.
set -uo pipefail
O=$OUT
F=.gpu/fkv
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv > $O/gpu.txt
(REQUIRE_GPU=1 timeout 120 $F/forward_kv --test-threads=1 > $O/test_forward_kv.txt 2>&1; echo "rc $?" >> $O/test_forward_kv.txt) 
(REQUIRE_GPU=1 timeout 150 $F/forward --test-threads=1 > $O/test_forward.txt 2>&1; echo "rc $?" >> $O/test_forward.txt)
python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/py/msa_ptx-*.whl $F/fla_core-*.whl > $O/pip.txt 2>&1
(PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 200 python3 python/tests/gpu_check.py --json $O/python-h200.json > $O/gpu_check.txt 2>&1; echo "rc $?" >> $O/gpu_check.txt)
(timeout 200 scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1; echo "rc $?" >> $O/sanitize.txt)
python3 bench/msa_inputs.py --cases packed64k,doc64k --write /tmp/msa_in > /tmp/inputs.txt 2>&1
for v in base ud tm ch base ud ch; do
  echo "== $v" >> $O/bench.txt
  timeout 40 $F/bench_forward_$v /tmp/msa_in packed64k,doc64k 10 2>&1 | grep -v "bound\|exact max" >> $O/bench.txt
done
for v in ud tm ch; do
  (REQUIRE_GPU=1 timeout 60 $F/forward_kv_$v --test-threads=1 > $O/test_forward_kv_$v.txt 2>&1; echo "rc $?" >> $O/test_forward_kv_$v.txt)
done
