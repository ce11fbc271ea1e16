#!/usr/bin/env bash
# Session 29: session 28's two calls (s28/call1, s28/call2, on the bundle .gpu/s28 built from
# main's PTX) in one device call, since machines were scarce; each step still runs only while
# the shared BUDGET leaves room. Outputs go to one archive (the device returns at most 8 files).
#   BUDGET=<seconds, at most 570> bash bench/results/s29/call1/call.sh
set -uo pipefail
R=$OUT
T=$(date +%s)
mkdir -p /tmp/o1 /tmp/o2
OUT=/tmp/o1 bash bench/results/s28/call1/call.sh
rest=$(( T + ${BUDGET:-560} - $(date +%s) ))
echo "== call2 with $rest s left"
OUT=/tmp/o2 BUDGET=$rest bash bench/results/s28/call2/call.sh
tar czf $R/out.tgz -C /tmp o1 o2
