#!/usr/bin/env bash
# Session 21 call 1: main (96bee78) against new2 (the row sums as a balanced tree, the pool
# addresses outside the head-lane predicate, the f16 staging's stmatrix addresses hoisted out
# of the task loop, the consumer's slot through redux.sync.min; 4401a64), k2 and k4 (new2
# with 2 or 4 consecutive walks per CTA of the pass; k4 built, not run) and z (new2 with o_pool zeroed by the
# task scans' spare CTAs instead of the probe), alternating; z's forward_kv, forward and
# backward GPU tests and the sanitizers; z on every issue length; fla-core 0.6.0 on the five
# main ones.
set -uo pipefail
O=$OUT
F=.gpu/fkv
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
C=doc8k,doc16k,doc32k,doc64k,packed64k,docs2k,docs4k,doc128k
python3 bench/msa_inputs.py --cases $C --write /tmp/msa_in > /tmp/inputs.txt 2>&1
s inputs
for v in main z new2 k2 main z new2 k2; do
  echo "== $v" >> $O/ab.txt
  BENCH_KV_ONLY=1 timeout 60 $F/bench_forward_$v /tmp/msa_in packed64k,doc64k,doc8k 10 2>&1 | grep -E "^\| (doc|packed)|kv breakdown|rror" >> $O/ab.txt
done
s ab
# The sum pass at packed64k (each run's first breakdown line), mean per variant.
awk '/^== /{v=$2; first=1; next} /kv breakdown/ && first {match($0, /msa_forward_kv_f16_sm90 [0-9.]+/); t=substr($0, RSTART+24, RLENGTH-24); s[v]+=t; n[v]++; first=0} END {for (v in s) printf "%s %.4f\n", v, s[v]/n[v]}' $O/ab.txt | sort -k2 -n | tee $O/sum_pass_means.txt
grep -E "^==|^\|" $O/ab.txt | cut -c1-100
grep -E "^==|breakdown" $O/ab.txt | sed -E 's/.*(task_scan_work [0-9.]+).*(task_scan_bins [0-9.]+).*(fwd_kv_probe [0-9.]+; msa_forward_kv_f16_sm90 [0-9.]+; fwd_kv_combine_f16 [0-9.]+).*(span [0-9.]+).*/\1 \2 \3 \4/'
BENCH_KV_ONLY=1 timeout 80 $F/bench_forward_z /tmp/msa_in $C 10 > $O/bench_forward.txt 2>&1
grep -E "^\|" $O/bench_forward.txt
s bench
python3 -m pip install -q --no-deps --no-index --target /tmp/site $F/fla_core-*.whl > /tmp/pip.txt 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 100 python3 bench/forward_baselines.py \
  --cases doc8k,doc16k,doc32k,doc64k,packed64k --methods fla --reps 10 --json $O/forward_baselines.json > /tmp/fla.txt 2>&1
grep -E "fla: " /tmp/fla.txt
s fla
for t in forward_kv forward backward; do
  (REQUIRE_GPU=1 timeout 150 $F/$t --test-threads=1 > $O/test_$t.txt 2>&1; echo "rc $?" >> $O/test_$t.txt)
done
grep -E "test result|^rc|FAIL|panic" $O/test_*.txt
s tests
(timeout 150 scripts/sanitize.sh $F/sanitize_cases /tmp/san > $O/sanitize.txt 2>&1; echo "rc $?" >> $O/sanitize.txt)
grep -E "forward_kv|task_scan|^rc" $O/sanitize.txt | head -24
grep -cE " 0 errors" $O/sanitize.txt
s sanitize
