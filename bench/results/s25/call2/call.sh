#!/usr/bin/env bash
# Session 25 call 2, chained after call 1 on the same machine: branch s24-multi-cta-scan's KV
# forward at every other bench length, defaults against the old rule "9,2", then ncu of the sum
# pass (msa_forward_kv_f16_sm90) at doc256k and doc64k. Bundle .gpu/s25 (call 1's).
# Ran as: (timeout 170 bash scripts/sanitize.sh .gpu/s25/sanitize_cases /tmp/san > $OUT/sanitize.txt 2>&1;
#   echo "rc $?" >> $OUT/sanitize.txt); BUDGET=250 bash bench/results/s25/call2/call.sh
# (call 1 had no time left for the sanitizers). Its ncu took --launch-skip 1, the second
# launch: the empty recompute pass (ncu_*_recompute_launch.txt); call 3 repeats it.
set -uo pipefail
O=$OUT
F=.gpu/s25
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
left() { [ $(( T0 + ${BUDGET:-400} - $(date +%s) )) -ge $1 ]; }
s start
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt
[ -f /tmp/msa_in/doc256k.q2k.i32 ] || timeout 90 $F/bench --cases doc8k,doc16k,doc32k,packed64k,doc64k,doc128k,doc256k --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
s inputs
for c in doc256k doc64k,doc128k doc8k,doc16k,doc32k,packed64k; do
  left 60 || break
  BENCH_KV_ONLY=1 timeout 55 $F/bench_forward /tmp/msa_in $c 5 "9,2" >> $O/sweep.txt 2>&1
  echo "rc $?" >> $O/sweep.txt
  s sweep $c
done
grep -E "^\| [dp]|^rc|rror" $O/sweep.txt | cut -c1-96
for c in doc256k doc64k; do
  left 70 || break
  BENCH_KV_ONLY=1 timeout 60 ncu --clock-control none --kernel-name msa_forward_kv_f16_sm90 --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,lts__t_bytes.sum,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active \
    $F/bench_forward /tmp/msa_in $c 1 > $O/ncu_$c.txt 2>&1
  echo "rc $?" >> $O/ncu_$c.txt
  grep -E "dram__|lts__|pipe_shared|Duration|Throughput|^rc" $O/ncu_$c.txt | head -14
  s ncu $c
done
