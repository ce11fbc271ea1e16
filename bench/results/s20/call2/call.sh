#!/usr/bin/env bash
# Session 20 call 2: main (3932943) against r (0e695fa: the row sums' red.add after the O
# staging's proxy fence) and rc (7ef7d1b: r with P·V issued k16 step by step), each binary in
# its own process, alternating; r's forward_kv GPU tests; ncu of r's sum pass with stall
# sampling, at packed64k.
set -uo pipefail
O=$OUT
F=.gpu/fkv
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
python3 bench/msa_inputs.py --cases packed64k,doc64k,doc8k --write /tmp/msa_in > /tmp/inputs.txt 2>&1
s inputs
for v in main r rc main r rc; do
  echo "== $v" >> $O/ab.txt
  BENCH_KV_ONLY=1 timeout 60 $F/bench_forward_$v /tmp/msa_in packed64k,doc64k,doc8k 10 2>&1 | grep -E "^\| (doc|packed)|kv breakdown|rror" >> $O/ab.txt
done
s ab
grep -E "^==|^\|" $O/ab.txt | cut -c1-110
grep -E "^==|breakdown" $O/ab.txt | sed -E 's/.*(fwd_kv_probe [0-9.]+; msa_forward_kv_f16_sm90 [0-9.]+; fwd_kv_combine_f16 [0-9.]+).*(span [0-9.]+).*/\1 \2/'
(REQUIRE_GPU=1 timeout 80 $F/forward_kv --test-threads=1 > $O/test_forward_kv.txt 2>&1; echo "rc $?" >> $O/test_forward_kv.txt)
grep -E "test result|^rc|FAIL|panic" $O/test_forward_kv.txt
s tests
BENCH_KV_ONLY=1 timeout 150 ncu --clock-control none --kernel-name msa_forward_kv_f16_sm90 --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters \
  --metrics sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,lts__t_bytes.sum,sm__cycles_elapsed.avg.per_second \
  -o /tmp/rep_r $F/bench_forward_r /tmp/msa_in packed64k 1 > /tmp/ncu_run.txt 2>&1
tail -2 /tmp/ncu_run.txt
ncu -i /tmp/rep_r.ncu-rep --page details > $O/ncu_r.txt 2>&1
grep -E "Duration|Elapsed Cycles|Compute \(SM\)|L2 Cache Th|Warp Cycles Per Issued|pipe_xu|per_second|lts__t_bytes" $O/ncu_r.txt
ncu -i /tmp/rep_r.ncu-rep --page source --csv --print-source sass > $O/src_r.csv 2>&1
s ncu
