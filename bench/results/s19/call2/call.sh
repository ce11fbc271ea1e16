#!/usr/bin/env bash
# Session 19 call 2: main (34e7e6e), kv2 (two K/V stages) and pz (kv2 + the probe zeroing
# o_pool/l_pool in place of the memsets), each binary in its own process, alternating; pz's
# forward_kv and forward GPU tests and the sanitizers; pz on every issue length with fla in
# the same call; the Python GPU check with a wheel built from pz.
set -uo pipefail
O=$OUT
F=.gpu/fkv
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv
C=doc8k,doc16k,doc32k,doc64k,packed64k,docs2k,docs4k,doc128k
python3 bench/msa_inputs.py --cases $C --write /tmp/msa_in > /tmp/inputs.txt 2>&1
s inputs
for v in main kv2 pz main kv2 pz; do
  b=$F/bench_forward; [ $v != main ] && b=$F/bench_forward_$v
  echo "== $v" >> $O/ab.txt
  BENCH_KV_ONLY=1 timeout 60 $b /tmp/msa_in packed64k,doc64k,doc8k 10 2>&1 | grep -E "^\| (doc|packed)|kv breakdown|rror" >> $O/ab.txt
done
s ab
grep -E "^==|^\|" $O/ab.txt
(REQUIRE_GPU=1 timeout 80 $F/forward_kv_pz --test-threads=1 > $O/test_forward_kv.txt 2>&1; echo "rc $?" >> $O/test_forward_kv.txt)
(REQUIRE_GPU=1 timeout 80 $F/forward_pz --test-threads=1 > $O/test_forward.txt 2>&1; echo "rc $?" >> $O/test_forward.txt)
grep -E "test result|^rc|FAIL|panic" $O/test_forward_kv.txt $O/test_forward.txt
s tests
(timeout 130 scripts/sanitize.sh $F/sanitize_cases_pz /tmp/san > $O/sanitize.txt 2>&1; echo "rc $?" >> $O/sanitize.txt)
grep -E "fwd_kv_probe|forward_kv_f16|whole|^rc" $O/sanitize.txt
s sanitize
BENCH_KV_ONLY=1 timeout 90 $F/bench_forward_pz /tmp/msa_in $C 10 > $O/bench_forward.txt 2>&1
grep -E "^\|" $O/bench_forward.txt
s bench
python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/py/msa_ptx-*.whl $F/fla_core-*.whl > /tmp/pip.txt 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 130 python3 bench/forward_baselines.py \
  --cases $C --methods fla --reps 10 --json $O/forward_baselines.json > /tmp/fla.txt 2>&1
grep -E "fla: " /tmp/fla.txt
s fla
(PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 110 python3 python/tests/gpu_check.py --json /tmp/python-h200.json > $O/gpu_check.txt 2>&1; echo "rc $?" >> $O/gpu_check.txt)
tail -n 4 $O/gpu_check.txt
s gpu_check
