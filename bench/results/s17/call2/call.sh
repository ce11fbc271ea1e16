#!/usr/bin/env bash
# Session 17 call 2: the consumers' ping-pong (turn barriers) against the base build, GPU tests,
# and ncu source counters of the new sum pass.
set -uo pipefail
O=$OUT
python3 bench/msa_inputs.py --cases packed64k,doc64k,doc8k --write /tmp/msa_in > /tmp/inputs.txt 2>&1
REQUIRE_GPU=1 timeout 120 .gpu/fkv/forward_kv --test-threads 1 2>&1 | tail -n 8 > $O/tests.txt
timeout 100 .gpu/fkv/bench_forward_base /tmp/msa_in packed64k,doc64k 10 > $O/bench_base.txt 2>&1
timeout 100 .gpu/fkv/bench_forward /tmp/msa_in packed64k,doc64k,doc8k 10 > $O/bench_new.txt 2>&1
timeout 100 .gpu/fkv/bench_forward_q3 /tmp/msa_in packed64k,doc64k 10 > $O/bench_q3.txt 2>&1
k=msa_forward_kv_f16_sm90
timeout 100 ncu --clock-control none --kernel-name $k --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters \
  -o /tmp/$k .gpu/fkv/bench_forward /tmp/msa_in packed64k 1 > /tmp/$k.log 2>&1
ncu -i /tmp/$k.ncu-rep > $O/ncu_$k.txt 2>&1
ncu -i /tmp/$k.ncu-rep --page source --csv --print-source sass > /tmp/$k.csv 2>&1
gzip -c /tmp/$k.csv > $O/src_$k.csv.gz
