#!/usr/bin/env bash
# Session 29, call 2 (on call 1's warm H100, its inputs still in /tmp/msa_in): where the
# paired pass's reduction sectors come from, paired pool (BENCH_KV_PAIRED=1) against unpaired.
F=.gpu/s28
M=lts__t_sectors_op_red.sum,lts__t_sectors_srcunit_tex_op_red.sum,lts__t_sectors_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_op_atom.sum,lts__t_sectors_srcunit_tex_op_atom.sum,lts__t_sectors.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_srcunit_tex_lookup_miss.sum,gpu__time_duration.sum
for v in 1 0; do
  BENCH_KV_PAIRED=$v BENCH_KV_ONLY=1 timeout 60 ncu --clock-control none --kernel-name regex:msa_forward_kv_f16p?_sm90 \
    --launch-skip 0 --launch-count 1 --metrics $M $F/bench_forward /tmp/msa_in doc64k 1 > $OUT/ncu2_$v.txt 2>&1
  echo "== $v"; grep -E "lts__|gpu__" $OUT/ncu2_$v.txt
done
