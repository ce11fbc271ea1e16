#!/usr/bin/env bash
# Session 17 call 5: the KV forward's task-order locality (FORWARD_KV_LOCALITY = 9,2, tuned in
# session 14 on older kernels) swept on the current kernels (the session-16 build), the
# default twice as a control.
set -uo pipefail
O=$OUT
python3 bench/msa_inputs.py --cases packed64k,doc64k,doc16k --write /tmp/msa_in > /tmp/inputs.txt 2>&1
timeout 400 .gpu/fkv/bench_forward_base /tmp/msa_in packed64k,doc64k,doc16k 10 \
  "9,2;8,2;10,2;9,1;9,3;8,1;10,3;9,2" > $O/bench.txt 2>&1
