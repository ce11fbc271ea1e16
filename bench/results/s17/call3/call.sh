#!/usr/bin/env bash
# Session 17 call 3: base vs the pool reductions after the staging fence (p0), plus every 4th
# (p4) or 2nd (p2) exponential by polynomial on the FMA pipe. Each binary in its own process.
set -uo pipefail
O=$OUT
python3 bench/msa_inputs.py --cases packed64k,doc64k --write /tmp/msa_in > /tmp/inputs.txt 2>&1
for v in base p0 p4 p2 base p4; do
  echo "== $v" >> $O/bench.txt
  timeout 60 .gpu/fkv/bench_forward_$v /tmp/msa_in packed64k,doc64k 10 2>&1 | grep -v "bound\|exact max" >> $O/bench.txt
done
