#!/usr/bin/env bash
# Session 19 call 4: python/tests/gpu_check.py with a wheel built from main's head (the S GEMM
# a task ahead), the checks only.
set -uo pipefail
python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/py/msa_ptx-*.whl > /tmp/pip.txt 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 120 python3 python/tests/gpu_check.py --bench '' --json $OUT/python-h200.json 2>&1 | tee $OUT/gpu_check.txt | grep -vE "^\[.*bench" | tail -n 60
echo "rc ${PIPESTATUS[0]}"
