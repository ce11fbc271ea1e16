#!/usr/bin/env bash
# Session 20 call 6: python/tests/gpu_check.py with a wheel built from main's head (e7eb9c5,
# the consumer index through redux.sync.min), the checks only.
set -uo pipefail
python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/py/msa_ptx-*.whl > /tmp/pip.txt 2>&1
PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 120 python3 python/tests/gpu_check.py --bench '' --json $OUT/python-h200.json 2>&1 | tee $OUT/gpu_check.txt | grep -vE "^\[.*bench" | tail -n 40
echo "rc ${PIPESTATUS[0]}"
