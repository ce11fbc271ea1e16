#!/usr/bin/env bash
# Session 22 call 2: one build (main + the walk split, `MsaForwardKv::with_walk_split`; the
# combine with two chunks per lane), the split chosen per process by BENCH_KV_WALK_SPLIT:
# 1 (whole walks, main's pass), 2, 4 and 8, alternating, twice, on packed64k / doc64k /
# doc8k; splits 2 and 4 on every issue length; fla-core 0.6.0 on the five main lengths in
# the same call; the forward_kv (every split), forward and backward GPU tests; the sanitizers.
set -uo pipefail
O=$OUT
F=.gpu/fkv
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee $O/gpu.txt
C=doc8k,doc16k,doc32k,doc64k,packed64k,docs2k,docs4k,doc128k
python3 bench/msa_inputs.py --cases $C --write /tmp/msa_in > /tmp/inputs.txt 2>&1
s inputs
for v in 1 2 4 8 1 2 4 8; do
  echo "== split $v" >> $O/ab.txt
  BENCH_KV_ONLY=1 BENCH_KV_WALK_SPLIT=$v timeout 45 $F/bench_forward /tmp/msa_in packed64k,doc64k,doc8k 10 2>&1 | grep -E "^\| (doc|packed)|kv breakdown|rror" >> $O/ab.txt
done
grep -E "^==|^\|" $O/ab.txt | cut -c1-100
grep -E "^==|breakdown" $O/ab.txt | sed -E 's/.*(fwd_kv_probe [0-9.]+; msa_forward_kv_f16_sm90 [0-9.]+; fwd_kv_combine_f16 [0-9.]+).*(span [0-9.]+).*/\1 \2/'
s ab
for v in 2 4; do
  BENCH_KV_ONLY=1 BENCH_KV_WALK_SPLIT=$v timeout 60 $F/bench_forward /tmp/msa_in $C 10 > $O/bench_forward_split$v.txt 2>&1
  grep -E "^\|" $O/bench_forward_split$v.txt
done
s bench
python3 -m pip install -q --no-deps --no-index --target /tmp/site $F/fla_core-*.whl > /tmp/pip.txt 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 90 python3 bench/forward_baselines.py \
  --cases doc8k,doc16k,doc32k,doc64k,packed64k --methods fla \
  --reps 10 --json $O/forward_baselines.json > $O/forward_baselines.txt 2>&1
grep -E "fla: " $O/forward_baselines.txt
s baselines
for t in forward_kv forward backward; do
  (REQUIRE_GPU=1 timeout 90 $F/$t --test-threads=1 > $O/test_$t.txt 2>&1; echo "rc $?" >> $O/test_$t.txt)
done
grep -E "test result|^rc|FAIL|panic" $O/test_*.txt
s tests
(timeout 100 scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1; echo "rc $?" >> $O/sanitize.txt)
grep -E "forward_kv|task_scan|fwd_kv|^rc" $O/sanitize.txt | head -40
grep -cE " 0 errors" $O/sanitize.txt
s sanitize
