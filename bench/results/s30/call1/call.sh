#!/usr/bin/env bash
# Session 30, call 1 (bundle .gpu/s28, built from main's PTX; generated/ unchanged since):
#  1. session 29's unrun probe (s29/call3/call.sh): do near-labelled reductions and reads
#     cross the L2 fabric less than far-labelled ones?
#  2. the KV forward alone (unpaired default), every length, median of 5 (doc1m of 3);
#  3. windows 2^11 / 2^12 / 2^13 with K/V evict_first at doc256k and doc1m.
#   BUDGET=<seconds> bash bench/results/s30/call1/call.sh   (run with carry [".gpu/s28"])
set -uo pipefail
R=$OUT
O=/tmp/s30; mkdir -p $O/probe
F=.gpu/s28
. bench/results/s28/lib.sh
s start
OUT=$O/probe timeout 200 bash bench/results/s29/call3/call.sh > $O/probe/stdout.txt 2>&1
s probe
timeout 150 $F/bench --cases doc8k,doc32k,packed64k,doc64k,doc128k,doc256k,doc1m --write-inputs /tmp/msa_in --inputs-only > $O/inputs.txt 2>&1
s inputs
left 60 && BENCH_KV_ONLY=1 timeout 120 $F/bench_forward /tmp/msa_in doc8k,doc32k,packed64k,doc64k,doc128k,doc256k 5 > $O/lengths.txt 2>&1
s lengths
left 40 && BENCH_KV_ONLY=1 timeout 60 $F/bench_forward /tmp/msa_in doc1m 3 > $O/doc1m.txt 2>&1
s doc1m
left 60 && BENCH_KV_ONLY=1 timeout 100 $F/bench_forward /tmp/msa_in doc256k,doc1m 3 "9,0,12/kv;9,0,13/kv" > $O/rules.txt 2>&1
s rules
tar czf $R/out.tgz -C /tmp s30
