#!/usr/bin/env bash
# Session 20 call 5: main (3932943) against uni (e7eb9c5: the consumer index through
# redux.sync.min, so that ptxas keeps the S GEMM's Q descriptors on the uniform datapath),
# alternating; uni's forward_kv and forward GPU tests and the sanitizers; uni on every issue
# length; fla-core 0.6.0 on the five main ones.
set -uo pipefail
O=$OUT
F=.gpu/fkv
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
C=doc8k,doc16k,doc32k,doc64k,packed64k,docs2k,docs4k,doc128k
python3 bench/msa_inputs.py --cases $C --write /tmp/msa_in > /tmp/inputs.txt 2>&1
s inputs
for v in main uni main uni; do
  echo "== $v" >> $O/ab.txt
  BENCH_KV_ONLY=1 timeout 60 $F/bench_forward_$v /tmp/msa_in packed64k,doc64k,doc8k 10 2>&1 | grep -E "^\| (doc|packed)|kv breakdown|rror" >> $O/ab.txt
done
s ab
grep -E "^==|^\|" $O/ab.txt | cut -c1-100
grep -E "^==|breakdown" $O/ab.txt | sed -E 's/.*(fwd_kv_probe [0-9.]+; msa_forward_kv_f16_sm90 [0-9.]+; fwd_kv_combine_f16 [0-9.]+).*(span [0-9.]+).*/\1 \2/'
for t in forward_kv forward; do
  (REQUIRE_GPU=1 timeout 120 $F/$t --test-threads=1 > $O/test_$t.txt 2>&1; echo "rc $?" >> $O/test_$t.txt)
done
grep -E "test result|^rc|FAIL|panic" $O/test_*.txt
s tests
(timeout 140 scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1; echo "rc $?" >> $O/sanitize.txt)
grep -E "forward_kv|whole|^rc" $O/sanitize.txt | head -20
grep -cE " 0 errors" $O/sanitize.txt
s sanitize
BENCH_KV_ONLY=1 timeout 80 $F/bench_forward_uni /tmp/msa_in $C 10 > $O/bench_forward.txt 2>&1
grep -E "^\|" $O/bench_forward.txt
s bench
python3 -m pip install -q --no-deps --no-index --target /tmp/site $F/fla_core-*.whl > /tmp/pip.txt 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 100 python3 bench/forward_baselines.py \
  --cases doc8k,doc16k,doc32k,doc64k,packed64k --methods fla --reps 10 --json $O/forward_baselines.json > /tmp/fla.txt 2>&1
grep -E "fla: " /tmp/fla.txt
s fla
