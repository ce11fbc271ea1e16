#!/usr/bin/env bash
# Session 17 call 4: the msa_ptx wheel with the forward's `algorithm` (KV-parallel from Python):
# python/tests/gpu_check.py (every check, the forward with each algorithm) and its bench on
# doc64k (the backward against fla, the forward with each algorithm).
set -uo pipefail
O=$OUT
python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/py/msa_ptx-*.whl .gpu/py/fla_core-*.whl > $O/pip.txt 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 420 python3 python/tests/gpu_check.py \
  --json $O/python-h200.json --bench doc64k,packed64k --reps 10 > $O/gpu_check.txt 2>&1
echo "rc $?" >> $O/gpu_check.txt
