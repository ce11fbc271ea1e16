#!/usr/bin/env bash
# Session 17 call 6 (planning experiment, timing only): the max pass with half its S GEMM's K
# steps (4 of 8 wgmma k16; wrong maxima, so the flow recomputes rows), the tensor time an fp8 S
# would take, against the base build in the same call.
set -uo pipefail
O=$OUT
python3 bench/msa_inputs.py --cases packed64k,doc64k --write /tmp/msa_in > /tmp/inputs.txt 2>&1
for v in base halfk base; do
  echo "== $v" >> $O/bench.txt
  timeout 80 .gpu/fkv/bench_forward_$v /tmp/msa_in packed64k,doc64k 5 2>&1 | grep -E "^\||kv breakdown" >> $O/bench.txt
done
