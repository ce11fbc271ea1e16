#!/usr/bin/env bash
# Ours and fla-core 0.6.0 `parallel_nsa` on the same selections at every length issue 19 names,
# in one GPU session (about 6-8 minutes on an H200: fla autotunes for ~60 s at doc8k, the
# 1M-token cases take 1-2 minutes each). Last run: results/h200-2026-12-01-long-fla.md (388 s).
#
#   bench/long_fla.sh BENCH FLA_WHEELS [OUTDIR]
#
# BENCH: the release binary of `cargo build --release -p msa-runtime --example bench`;
# FLA_WHEELS: a folder with the fla-core wheel (installed with --no-deps, offline);
# OUTDIR (default $OUT or .): ours.json/.log and fla.json/.log. `--write-inputs` makes the Rust
# bench dump each case's selection, which `baselines.py --q2k-from` reads, so both time the
# same q2k (the numpy recipe would need 64 GB per head at 1M tokens).
set -o pipefail
cd "$(dirname "$0")/.."
bench=${1:?bench binary}; wheels=${2:?fla wheel folder}; out=${3:-${OUT:-.}}
export PYTHONUNBUFFERED=1
cases=doc8k,doc32k,packed64k,doc128k,doc256k,doc1m,packed1m
"$bench" --cases $cases --reps 3 --warmup 1 --host-schedule-only --write-inputs /tmp/q2k \
  --json "$out/ours.json" 2>&1 | tee "$out/ours.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla-site \
  "$wheels"/*.whl && export PYTHONPATH=/tmp/fla-site
python3 bench/baselines.py --methods fla --cases $cases --q2k-from /tmp/q2k --inputs-dir '' \
  --fla-tune-once --reps 3 --warmup 1 --no-xcheck --json "$out/fla.json" 2>&1 | tee "$out/fla.log"
