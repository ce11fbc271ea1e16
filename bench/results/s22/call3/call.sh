#!/usr/bin/env bash
# Session 22 call 3 (the same H200, warm): synccheck alone over the sanitizer harness, which
# call 2's scripts/sanitize.sh did not reach before its 100 s limit (memcheck and racecheck
# had finished).
S=$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer | tail -n 1)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 $S --tool synccheck --print-limit 10000 .gpu/fkv/sanitize_cases all > $OUT/synccheck.log 2>&1
echo "rc $?"
grep -E "^case|ERROR SUMMARY" $OUT/synccheck.log | tail -8
