#!/usr/bin/env bash
# NOT RUN in session 30. The call after call1/call.sh, on the same bundle .gpu/s30 (carry it):
#   BUDGET=<seconds, at most 570> bash bench/results/s30/call2/call.sh
#  1. scripts/sanitize.sh over sanitize_cases (fwd_kv_homes and the paired pass changed);
#  2. GPU test forward (MsaAttention, forward then backward);
#  3. doc1m: paired pool + K/V, paired pool and unpaired, one process each (3 reps);
#  4. every length of the unpaired default with fla-core 0.6.0 and FlexAttention in the same
#     call (scripts/forward-kv-h200.sh's baselines step), if time is left.
set -uo pipefail
R=$OUT
O=/tmp/s30c2; mkdir -p $O
F=.gpu/s30
. bench/results/s28/lib.sh
AB_VARIANTS="pairedkv paired unpaired"
AB_REPS=3
s start
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
if left 200; then
  timeout 190 bash scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1
  echo "rc $?" >> $O/sanitize.txt
  grep -E "whole run|rc |errors \([1-9]|[1-9][0-9]* errors|fwd_kv_homes|f16p" $O/sanitize.txt | head -24
  s sanitize
fi
left 100 && test_bin forward 95
timeout 60 $F/bench --cases doc1m --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
left 150 && ab doc1m 45 && show | tail -6
if left 150 && ls $F/fla_core-*.whl > /dev/null 2>&1; then
  C=doc8k,doc32k,packed64k,doc64k,doc128k
  timeout 60 $F/bench --cases $C --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
  BENCH_KV_ONLY=1 timeout 60 $F/bench_forward /tmp/msa_in $C 5 > $O/lengths.txt 2>&1
  python3 -m pip install -q --no-deps --no-index --target /tmp/site $F/fla_core-*.whl
  rest=$(( T0 + BUDGET - $(date +%s) - 10 ))
  PYTHONPATH=/tmp/site timeout $rest python3 bench/forward_baselines.py --cases $C --methods fla \
    --reps 5 --json $O/fla.json > $O/fla.txt 2>&1
  grep -E "^\| " $O/lengths.txt | cut -c1-90; tail -8 $O/fla.txt
  s lengths
fi
s end
tar czf $R/out.tgz -C /tmp s30c2
