#!/usr/bin/env bash
# Session 24 call 2, run on call 1's machine while it was still held (the same bundle, .gpu/s24,
# and call 1's inputs in /tmp/msa_in). The command as run:
O=$OUT; F=.gpu/s24; ls /tmp/msa_in | head -3; BENCH_KV_ONLY=1 timeout 150 $F/bench_forward /tmp/msa_in doc256k,doc1m 5 "9,1/kv;9,2,12/kv;9,2,12/kv,q,o;9,1/kv,q,o;9,0,12/q,o" > $O/sweep2.txt 2>&1; echo rc $?; grep -E "^\| " $O/sweep2.txt | cut -c1-90; BENCH_KV_WALK_SPLIT=4 BENCH_KV_ONLY=1 timeout 60 $F/bench_forward /tmp/msa_in doc1m 3 "9,0,12/kv,q,o" > $O/split4.txt 2>&1; grep -E "^\| " $O/split4.txt | cut -c1-90; for i in 1 2; do BENCH_KV_ONLY=1 timeout 40 $F/bench_forward /tmp/msa_in packed64k,doc64k 10 "9,2/kv;9,2/kv,q,o;9,2,12" >> $O/short.txt 2>&1; done; grep -E "^\| " $O/short.txt | cut -c1-90
