#!/usr/bin/env bash
# Builds, on a machine without a GPU, the three builds `bench/results/s23/call2/call.sh`
# compares into the git-ignored DIR (default .gpu/s23): DIR/bench (the input writer), and per
# build DIR/<build>/bench_forward and DIR/<build>/forward_kv, where <build> is
#   main     forward_kv_sm90::L2_HINTS as committed (no hints: main's PTX),
#   kvfirst  K/V TMA loads evict_first,
#   all      K/V evict_first, Q loads and o_pool reduce-adds evict_last.
# It edits L2_HINTS for each, regenerates generated/ and builds, then restores both (the work
# tree must have no changes to either). Then: the device tool's `run` with `carry: [DIR]` and
# `BUDGET=SECONDS bash bench/results/s23/call2/call.sh`.
#
#   scripts/forward-kv-hints-bundle.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu/s23}
src=codegen/src/kernels/forward_kv_sm90.rs
if ! git diff --quiet -- "$src" generated; then
  echo "$src or generated/ has uncommitted changes" >&2
  exit 1
fi
restore() { git checkout -q -- "$src" generated; }
trap restore EXIT
hints() {
  python3 - "$src" "$1" "$2" "$3" <<'PY'
import re, sys
path, kv, q, o = sys.argv[1:]
s = open(path).read()
new, n = re.subn(
    r"pub const L2_HINTS: L2Hints = L2Hints \{\n    kv: [^\n]*,\n    q: [^\n]*,\n    o: [^\n]*,\n\};",
    f"pub const L2_HINTS: L2Hints = L2Hints {{\n    kv: {kv},\n    q: {q},\n    o: {o},\n}};",
    s,
)
if n != 1:
    sys.exit("L2_HINTS not found")
open(path, "w").write(new)
PY
}
mkdir -p "$dir"
cargo build -q --release -p msa-runtime --example bench
cp target/release/examples/bench "$dir/"
first='Some(L2Evict::First)'
last='Some(L2Evict::Last)'
for build in main kvfirst all; do
  restore
  case $build in
    kvfirst) hints "$first" None None ;;
    all) hints "$first" "$last" "$last" ;;
  esac
  cargo run -q --release -p codegen > /dev/null
  cargo build -q --release -p msa-runtime --example bench_forward
  mkdir -p "$dir/$build"
  cp target/release/examples/bench_forward "$dir/$build/"
  exe=$(cargo test --release -p msa-tests --no-run --message-format=json --test forward_kv 2>/dev/null |
    jq -r 'select(.reason == "compiler-artifact" and .executable != null and .target.kind == ["test"]) | .executable')
  cp "$exe" "$dir/$build/forward_kv"
  echo "$build: $(grep -c 'L2::cache_hint' generated/msa_forward_kv_f16_sm90.sm_90a.ptx) hinted TMA instructions"
done
strip "$dir"/bench "$dir"/*/* 2>/dev/null || true
du -sh "$dir"
