#!/usr/bin/env bash
# Session 18 call 3: the msa_ptx wheel with the probe reference as the KV forward's default
# (python/tests/gpu_check.py); bench_forward and fla at 64K tokens in 2K and 4K documents
# (Auto's threshold) and at doc128k; the sanitizers with the probe in the harness; then main against the uniform-descriptor build (ud),
# each binary in its own process.
set -uo pipefail
O=$OUT
F=.gpu/fkv
s() { echo "$(date +%s) $*" >> $O/times.txt; }
s start
python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/py/msa_ptx-*.whl $F/fla_core-*.whl > $O/pip.txt 2>&1
(PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 200 python3 python/tests/gpu_check.py --json $O/python-h200.json > $O/gpu_check.txt 2>&1; echo "rc $?" >> $O/gpu_check.txt)
s gpu_check
(timeout 150 scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1; echo "rc $?" >> $O/sanitize.txt)
grep -E "^case|MsaForwardKv" /tmp/san/memcheck.log > $O/sanitize_cases.txt 2>&1
s sanitize
C=docs2k,docs4k,doc128k
python3 bench/msa_inputs.py --cases $C,packed64k,doc64k --write /tmp/msa_in > /tmp/inputs.txt 2>&1
timeout 120 $F/bench_forward /tmp/msa_in $C 10 > $O/bench_forward.txt 2>&1
s bench
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 100 python3 bench/forward_baselines.py \
  --cases $C --methods fla --reps 10 --json $O/forward_baselines.json > $O/forward_baselines.txt 2>&1
s fla
(REQUIRE_GPU=1 timeout 60 $F/forward_kv_ud --test-threads=1 > $O/test_forward_kv_ud.txt 2>&1; echo "rc $?" >> $O/test_forward_kv_ud.txt)
s ud_tests
for v in main ud main ud; do
  b=$F/bench_forward; [ $v = ud ] && b=$F/bench_forward_ud
  echo "== $v" >> $O/ab.txt
  timeout 45 $b /tmp/msa_in packed64k,doc64k 10 2>&1 | grep -E "^\| (doc|packed)|kv breakdown" >> $O/ab.txt
done
s ab
