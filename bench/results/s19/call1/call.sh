#!/usr/bin/env bash
# Session 19 call 1: main (34e7e6e), two K/V stages (kv2, b705070) and kv2 with the consumer
# warpgroups staggered once (st, a named barrier at the first task; not merged), each binary
# in its own process, alternating; the forward_kv and forward GPU tests of kv2 and st; the
# sanitizers on st; ncu of the three sum passes at packed64k.
set -uo pipefail
O=$OUT
F=.gpu/fkv
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $O/gpu.txt
python3 bench/msa_inputs.py --cases packed64k,doc64k,doc8k --write /tmp/msa_in > /tmp/inputs.txt 2>&1
for v in main kv2 st main kv2 st; do
  b=$F/bench_forward; [ $v != main ] && b=$F/bench_forward_$v
  echo "== $v" >> $O/ab.txt
  BENCH_KV_ONLY=1 timeout 60 $b /tmp/msa_in packed64k,doc64k,doc8k 10 2>&1 | grep -E "^\| (doc|packed)|kv breakdown|rror" >> $O/ab.txt
done
s ab
grep -E "^==|^\|" $O/ab.txt
for v in kv2 st; do
  (REQUIRE_GPU=1 timeout 90 $F/forward_kv_$v --test-threads=1 > $O/test_forward_kv_$v.txt 2>&1; echo "rc $?" >> $O/test_forward_kv_$v.txt)
  f=$F/forward_$v; [ $v = kv2 ] && f=$F/forward_kv2
  (REQUIRE_GPU=1 timeout 90 $f --test-threads=1 > $O/test_forward_$v.txt 2>&1; echo "rc $?" >> $O/test_forward_$v.txt)
  tail -n 2 $O/test_forward_kv_$v.txt $O/test_forward_$v.txt
done
s tests
(timeout 150 scripts/sanitize.sh $F/sanitize_cases_st /tmp/san > $O/sanitize.txt 2>&1; echo "rc $?" >> $O/sanitize.txt)
grep -E "forward_kv|whole|^rc" $O/sanitize.txt
s sanitize
for v in main kv2 st; do
  b=$F/bench_forward; [ $v != main ] && b=$F/bench_forward_$v
  BENCH_KV_ONLY=1 timeout 60 ncu --clock-control none --kernel-name msa_forward_kv_f16_sm90 --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats \
    --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum,sm__cycles_elapsed.avg.per_second \
    $b /tmp/msa_in packed64k 1 > $O/ncu_$v.txt 2>&1
  grep -E "gmma|pipe_xu|per_second|Duration|Compute \(SM\)" $O/ncu_$v.txt | sed "s/^/$v /"
done
s ncu
