#!/usr/bin/env bash
# Session 23 call 1, on main's head (3ec695e; the PTX of every kernel identical to session 22
# call 2's build): the KV forward at doc64k, doc256k and doc1m (never timed past 128K before);
# packed64k in 6 separate processes for its run-to-run spread; the GPU tests.
# Inputs come from `bench --write-inputs` (the Rust form of bench/msa_inputs.py's recipe, bit
# for bit; numpy's form needs 64 GiB per index head at 1M tokens).
set -uo pipefail
O=$OUT
F=.gpu/s23
s() { echo "$(date +%s) $*" | tee -a $O/times.txt; }
s start
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total --format=csv,noheader | tee $O/gpu.txt
timeout 60 $F/bench --cases packed64k,doc64k,doc256k,doc1m --write-inputs /tmp/msa_in --inputs-only > $O/inputs.txt 2>&1
cat $O/inputs.txt
s inputs
for i in 1 2 3 4 5 6; do
  echo "== run $i" >> $O/packed.txt
  BENCH_KV_ONLY=1 timeout 40 $F/bench_forward /tmp/msa_in packed64k 10 >> $O/packed.txt 2>&1
done
grep -E "^==|^\| packed|rror" $O/packed.txt | cut -c1-110
s packed
BENCH_KV_ONLY=1 timeout 200 $F/bench_forward /tmp/msa_in doc64k,doc256k,doc1m 5 > $O/long.txt 2>&1
echo "rc $?" >> $O/long.txt
grep -E "^\| doc|rc|rror" $O/long.txt | cut -c1-120
s long
nvidia-smi --query-gpu=memory.used --format=csv,noheader
for t in forward_kv forward backward; do
  (REQUIRE_GPU=1 timeout 100 $F/$t --test-threads=1 > /tmp/test_$t.txt 2>&1; echo "rc $?" >> /tmp/test_$t.txt)
  echo "== $t" >> $O/tests.txt; cat /tmp/test_$t.txt >> $O/tests.txt
done
grep -E "^==|test result|^rc|FAIL|panic" $O/tests.txt
s tests
