#!/usr/bin/env bash
# Session 27, call 2, on main's PTX (bundle .gpu/s25b, still valid: generated/ unchanged since
# e3e75a9). Asked for an H200 (the machine; KINDS.md records 60 MB of L2 there against
# the H100's 50). On an H200: the KV forward at every length with its defaults, then doc256k and
# doc1m under 2^12-query windows (rule 9,2,12/kv), then ncu's L2 breakdown at doc256k. On an
# H100: only ncu's L2 throughput breakdown (which L2 sub-unit is at its peak) at doc64k,
# doc256k and doc256k under 9,2,12/kv, whose L2 stood at 86 % in call 1 while its pass was slower.
# Run as BUDGET=<seconds> bash bench/results/s27/call2/call.sh
set -uo pipefail
O=$OUT
F=.gpu/s25b
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
T0=$(date +%s)
left() { [ $(( T0 + ${BUDGET:-200} - $(date +%s) )) -ge $1 ]; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
python3 -c "import torch; p = torch.cuda.get_device_properties(0); print('L2 bytes', p.L2_cache_size, 'SMs', p.multi_processor_count)" 2>&1 | tee -a $O/gpu.txt
timeout 60 $F/bench --cases doc8k,doc16k,doc32k,packed64k,doc64k,doc128k,doc256k,doc1m --write-inputs /tmp/msa_in --inputs-only > /dev/null 2>&1
s inputs
ncu_case() { # name case skip [rule]
  BENCH_KV_ONLY=1 timeout 90 ncu --clock-control none --kernel-name msa_forward_kv_f16_sm90 --launch-skip $3 --launch-count 1 \
    --section SpeedOfLight --print-details all $F/bench_forward /tmp/msa_in $2 1 ${4:-} > $O/ncu_$1.txt 2>&1
  echo "rc $?" >> $O/ncu_$1.txt
  grep -E "lts__|Duration|L2 Cache Throughput|DRAM Throughput|^rc" $O/ncu_$1.txt | head -30
  s ncu $1
}
if grep -q H200 $O/gpu.txt; then
  for c in doc1m doc256k,doc128k,doc64k doc8k,doc16k,doc32k,packed64k; do
    left 60 || break
    BENCH_KV_ONLY=1 timeout 55 $F/bench_forward /tmp/msa_in $c 3 >> $O/sweep.txt 2>&1
    echo "rc $?" >> $O/sweep.txt
    s sweep $c
  done
  grep -E "^\| [dp]|^rc|rror" $O/sweep.txt | cut -c1-96
  for c in doc256k doc1m; do
    left 70 || break
    BENCH_KV_ONLY=1 timeout 65 $F/bench_forward /tmp/msa_in $c 3 "9,2,12/kv" >> $O/rule12.txt 2>&1
    echo "rc $?" >> $O/rule12.txt
    s rule12 $c
  done
  grep -E "^\| [dp]|^rc|rror|rule" $O/rule12.txt | cut -c1-110
  left 40 && ncu_case doc256k doc256k 0
else
  left 40 && ncu_case doc64k doc64k 0
  left 40 && ncu_case doc256k doc256k 0
  left 60 && ncu_case doc256k_w12 doc256k 20 '9,2,12/kv'
fi
s end
