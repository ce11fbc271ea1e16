#!/usr/bin/env bash
# Session 22 call 1: main's head (d8f32a4) on every issue length; fla-core 0.6.0 on
# the five main lengths and flex at packed64k in the same call; the forward_kv, forward and
# backward GPU tests (forward_kv and forward also on comb's build) and the sanitizers (the probe's PTX changed in c547956, untested on a GPU);
# main against half (half a walk per CTA, twice the CTAs) and comb (the combine: 8 lanes per
# row, two chunks each), alternating.
set -uo pipefail
O=$OUT
F=.gpu/fkv
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee $O/gpu.txt
C=doc8k,doc16k,doc32k,doc64k,packed64k,docs2k,docs4k,doc128k
python3 bench/msa_inputs.py --cases $C --write /tmp/msa_in > /tmp/inputs.txt 2>&1
s inputs
BENCH_KV_ONLY=1 timeout 80 $F/bench_forward_main /tmp/msa_in $C 10 > $O/bench_forward.txt 2>&1
grep -E "^\|" $O/bench_forward.txt
s bench
for v in main half comb main half comb; do
  echo "== $v" >> $O/ab.txt
  BENCH_KV_ONLY=1 timeout 60 $F/bench_forward_$v /tmp/msa_in packed64k,doc64k,doc8k 10 2>&1 | grep -E "^\| (doc|packed)|kv breakdown|rror" >> $O/ab.txt
done
grep -E "^==|^\|" $O/ab.txt | cut -c1-100
grep -E "^==|breakdown" $O/ab.txt | sed -E 's/.*(msa_forward_kv_f16_sm90 [0-9.]+).*/\1/'
s ab
python3 -m pip install -q --no-deps --no-index --target /tmp/site $F/fla_core-*.whl > /tmp/pip.txt 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 150 python3 bench/forward_baselines.py \
  --cases doc8k,doc16k,doc32k,doc64k,packed64k --methods fla,flex --flex-cases packed64k \
  --reps 10 --json $O/forward_baselines.json > $O/forward_baselines.txt 2>&1
grep -E "fla: |flex: " $O/forward_baselines.txt
s baselines
for t in forward_kv forward backward; do
  (REQUIRE_GPU=1 timeout 120 $F/$t --test-threads=1 > $O/test_$t.txt 2>&1; echo "rc $?" >> $O/test_$t.txt)
done
for t in forward_kv forward; do
  (REQUIRE_GPU=1 timeout 100 $F/${t}_comb --test-threads=1 > $O/test_${t}_comb.txt 2>&1; echo "rc $?" >> $O/test_${t}_comb.txt)
done
grep -E "test result|^rc|FAIL|panic" $O/test_*.txt
s tests
(timeout 120 scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1; echo "rc $?" >> $O/sanitize.txt)
grep -E "forward_kv|task_scan|fwd_kv|^rc" $O/sanitize.txt | head -24
grep -cE " 0 errors" $O/sanitize.txt
s sanitize
