#!/usr/bin/env bash
# Session 19 call 3: main (aa1cd8c: kv2 + probe zeroing) against sa (3021bc5: each S GEMM
# issued a task ahead), each binary in its own process, alternating; sa's forward_kv and
# forward GPU tests and the sanitizers; sa on every issue length; fla on the five main ones.
set -uo pipefail
O=$OUT
F=.gpu/fkv
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv
C=doc8k,doc16k,doc32k,doc64k,packed64k,docs2k,docs4k,doc128k
python3 bench/msa_inputs.py --cases $C --write /tmp/msa_in > /tmp/inputs.txt 2>&1
s inputs
for v in main sa main sa; do
  b=$F/bench_forward; [ $v != main ] && b=$F/bench_forward_$v
  echo "== $v" >> $O/ab.txt
  BENCH_KV_ONLY=1 timeout 60 $b /tmp/msa_in packed64k,doc64k,doc8k 10 2>&1 | grep -E "^\| (doc|packed)|kv breakdown|rror" >> $O/ab.txt
done
s ab
grep -E "^==|^\|" $O/ab.txt
grep -E "breakdown" $O/ab.txt | grep -oE "msa_forward_kv_f16_sm90 [0-9.]+; fwd_kv_combine_f16 [0-9.]+; .*span [0-9.]+"
(REQUIRE_GPU=1 timeout 80 $F/forward_kv_sa --test-threads=1 > $O/test_forward_kv.txt 2>&1; echo "rc $?" >> $O/test_forward_kv.txt)
(REQUIRE_GPU=1 timeout 80 $F/forward_sa --test-threads=1 > $O/test_forward.txt 2>&1; echo "rc $?" >> $O/test_forward.txt)
grep -E "test result|^rc|FAIL|panic" $O/test_forward_kv.txt $O/test_forward.txt
s tests
(timeout 130 scripts/sanitize.sh $F/sanitize_cases_sa /tmp/san > $O/sanitize.txt 2>&1; echo "rc $?" >> $O/sanitize.txt)
grep -E "fwd_kv_probe|forward_kv_f16|whole|^rc" $O/sanitize.txt
s sanitize
BENCH_KV_ONLY=1 timeout 60 $F/bench_forward_sa /tmp/msa_in $C 10 > $O/bench_forward.txt 2>&1
grep -E "^\|" $O/bench_forward.txt
s bench
python3 -m pip install -q --no-deps --no-index --target /tmp/site $F/fla_core-*.whl > /tmp/pip.txt 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 100 python3 bench/forward_baselines.py \
  --cases doc8k,doc16k,doc32k,doc64k,packed64k --methods fla --reps 10 --json $O/forward_baselines.json > /tmp/fla.txt 2>&1
grep -E "fla: " /tmp/fla.txt
s fla
