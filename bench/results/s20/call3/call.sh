#!/usr/bin/env bash
# Session 20 call 3 (diagnostic, timing only; these builds give wrong results): main
# (3932943) against nofence (no fence.proxy.async before the O staging's TMA reduce), nol (no
# l_pool red.add) and noo (no O staging, fence or TMA reduce), alternating.
set -uo pipefail
O=$OUT
F=.gpu/fkv
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
s start
python3 bench/msa_inputs.py --cases packed64k,doc8k --write /tmp/msa_in > /tmp/inputs.txt 2>&1
s inputs
for v in main nofence nol noo main nofence nol noo; do
  echo "== $v" >> $O/ab.txt
  BENCH_KV_ONLY=1 timeout 60 $F/bench_forward_$v /tmp/msa_in packed64k,doc8k 10 2>&1 | grep -E "kv breakdown|rror" >> $O/ab.txt
done
s ab
grep -E "^==|breakdown" $O/ab.txt | sed -E 's/.*(msa_forward_kv_f16_sm90 [0-9.]+);.*/\1/' | paste -sd' ' | sed 's/== /\n/g'
