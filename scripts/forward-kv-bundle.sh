#!/usr/bin/env bash
# Builds, on a machine without a GPU, what one H200 device call for the experimental
# KV-parallel forward needs (`scripts/forward-kv-h200.sh`), stripped, into the git-ignored
# DIR (default .gpu/fkv), and copies the fla-core wheel from WHEEL (optional; e.g.
# `pip download --no-deps -d .whl fla-core==0.6.0`, .whl is git-ignored) beside them.
#
#   scripts/forward-kv-bundle.sh [DIR] [WHEEL]
#
# Then: the device tool's `run` with `carry: [DIR]` and the command
# `scripts/forward-kv-h200.sh DIR $OUT`.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu/fkv}
wheel=${2:-}
mkdir -p "$dir"
cargo build --release -p msa-runtime --example bench_forward
cargo build --release -p msa-tests --example sanitize_cases
cp target/release/examples/bench_forward target/release/examples/sanitize_cases "$dir/"
# The GPU test binaries: cargo names them <test>-<hash>; copy them as <test>.
cargo test --release -p msa-tests --no-run --message-format=json \
  --test forward_kv --test forward --test backward 2>/dev/null |
  jq -r 'select(.reason == "compiler-artifact" and .executable != null and .target.kind == ["test"])
         | "\(.target.name) \(.executable)"' |
  while read -r name exe; do cp "$exe" "$dir/$name"; done
strip "$dir"/* 2>/dev/null || true
if [ -n "$wheel" ]; then cp "$wheel" "$dir/"; fi
ls -la "$dir"
