#!/usr/bin/env bash
# Builds, on a machine without a GPU, what one H200 device call for the experimental
# KV-parallel forward needs (`scripts/forward-kv-h200.sh`), stripped, into the git-ignored
# DIR (default .gpu/fkv): `bench` (which writes the inputs), `bench_forward`,
# `sanitize_cases` and the GPU test binaries. It copies the fla-core wheel from WHEEL
# (optional; e.g. `pip download --no-deps -d .whl fla-core==0.6.0`, .whl is git-ignored)
# and an earlier build's `bench_forward` from PREV (optional) as `bench_forward_prev`, for an
# A/B in one call.
#
#   scripts/forward-kv-bundle.sh [DIR] [WHEEL] [PREV]
#
# Then: the device tool's `run` with `carry: [DIR]` and the command
# `scripts/forward-kv-h200.sh DIR $OUT`.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu/fkv}
wheel=${2:-}
prev=${3:-}
mkdir -p "$dir"
cargo build --release -p msa-runtime --example bench_forward --example bench
cargo build --release -p msa-tests --example sanitize_cases
cp target/release/examples/bench_forward target/release/examples/bench \
  target/release/examples/sanitize_cases "$dir/"
if [ -n "$prev" ]; then cp "$prev" "$dir/bench_forward_prev"; fi
# The GPU test binaries: cargo names them <test>-<hash>; copy them as <test>.
cargo test --release -p msa-tests --no-run --message-format=json \
  --test forward_kv --test forward --test backward 2>/dev/null |
  jq -r 'select(.reason == "compiler-artifact" and .executable != null and .target.kind == ["test"])
         | "\(.target.name) \(.executable)"' |
  while read -r name exe; do cp "$exe" "$dir/$name"; done
strip "$dir"/* 2>/dev/null || true
if [ -n "$wheel" ]; then cp "$wheel" "$dir/"; fi
ls -la "$dir"
