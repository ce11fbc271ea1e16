#!/usr/bin/env bash
# Session 20 call 4: main (3932943) against lb (ba03122: each consumer warp's 16 row sums
# staged and added to l_pool by one bulk reduce-add beside O's, in place of 16 red.add),
# alternating; lb's forward_kv, forward and backward GPU tests and the sanitizers; lb on every
# issue length; fla-core 0.6.0 on the five main ones.
set -uo pipefail
O=$OUT
F=.gpu/fkv
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
C=doc8k,doc16k,doc32k,doc64k,packed64k,docs2k,docs4k,doc128k
python3 bench/msa_inputs.py --cases $C --write /tmp/msa_in > /tmp/inputs.txt 2>&1
s inputs
for v in main lb main lb; do
  echo "== $v" >> $O/ab.txt
  BENCH_KV_ONLY=1 timeout 60 $F/bench_forward_$v /tmp/msa_in packed64k,doc64k,doc8k 10 2>&1 | grep -E "^\| (doc|packed)|kv breakdown|rror" >> $O/ab.txt
done
s ab
grep -E "^==|^\|" $O/ab.txt | cut -c1-100
grep -E "^==|breakdown" $O/ab.txt | sed -E 's/.*(fwd_kv_probe [0-9.]+; msa_forward_kv_f16_sm90 [0-9.]+; fwd_kv_combine_f16 [0-9.]+).*(span [0-9.]+).*/\1 \2/'
for t in forward_kv forward backward; do
  (REQUIRE_GPU=1 timeout 120 $F/$t --test-threads=1 > $O/test_$t.txt 2>&1; echo "rc $?" >> $O/test_$t.txt)
done
grep -E "test result|^rc|FAIL|panic" $O/test_*.txt
s tests
(timeout 140 scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1; echo "rc $?" >> $O/sanitize.txt)
grep -E "fwd_kv|forward_kv|whole|^rc|error|hazard" $O/sanitize.txt | head -30
s sanitize
BENCH_KV_ONLY=1 timeout 80 $F/bench_forward_lb /tmp/msa_in $C 10 > $O/bench_forward.txt 2>&1
grep -E "^\|" $O/bench_forward.txt
s bench
python3 -m pip install -q --no-deps --no-index --target /tmp/site $F/fla_core-*.whl > /tmp/pip.txt 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 100 python3 bench/forward_baselines.py \
  --cases doc8k,doc16k,doc32k,doc64k,packed64k --methods fla --reps 10 --json $O/forward_baselines.json > /tmp/fla.txt 2>&1
grep -E "fla: " /tmp/fla.txt
s fla
