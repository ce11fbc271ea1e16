#!/usr/bin/env bash
# One H200 device call for the experimental KV-parallel forward (issue 11), from the bundle
# of `scripts/forward-kv-bundle.sh`:
#
#   scripts/forward-kv-h200.sh DIR OUT
#
# CASES (default doc8k,doc32k,packed64k) names the benchmark cases, METHODS (default fla,flex)
# the baselines, NCU_KERNEL (default msa_forward_kv_sm90) the kernel ncu profiles; SANITIZE=0
# skips step 5 (for a call whose PTX the sanitizers have already seen).
#
# 1. `bench_forward` on doc8k, doc32k, packed64k: msa_forward_sm90, run_forward and
#    MsaForwardKv::run_on on the same schedule, with the KV forward's breakdown;
# 2. fla-core 0.6.0 `parallel_nsa_fwd` and FlexAttention on the same selections
#    (`bench/forward_baselines.py --methods fla,flex`), when a fla wheel lies in DIR;
# 3. the GPU tests `forward_kv`, `forward`, `backward` (REQUIRE_GPU=1);
# 4. ncu SpeedOfLight and the tensor pipe of msa_forward_kv_sm90 at packed64k;
# 5. scripts/sanitize.sh over sanitize_cases (which now runs the KV forward too).
# Everything goes to OUT; each step runs even when one before it failed.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=$1
out=$2
cases=${CASES:-doc8k,doc32k,packed64k}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 bench/msa_inputs.py --cases "$cases" --write /tmp/msa_in >"$out/inputs.txt" 2>&1
"$dir/bench_forward" /tmp/msa_in "$cases" 20 2>&1 | tee "$out/bench_forward.txt"
if ls "$dir"/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/site "$dir"/fla_core-*.whl
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 1200 python3 bench/forward_baselines.py \
    --cases "$cases" --methods "${METHODS:-fla,flex}" --reps 10 \
    --json "$out/forward_baselines.json" 2>&1 | tee "$out/forward_baselines.txt"
fi
for t in forward_kv forward backward; do
  REQUIRE_GPU=1 "$dir/$t" --test-threads 1 --nocapture 2>&1 | tail -n 40 | tee "$out/test_$t.txt"
done
ncu --clock-control none --kernel-name "${NCU_KERNEL:-msa_forward_kv_sm90}" --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight \
  --metrics sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum \
  "$dir/bench_forward" /tmp/msa_in packed64k 1 >"$out/ncu_packed64k.txt" 2>&1
[ "${SANITIZE:-1}" = 0 ] ||
  scripts/sanitize.sh "$dir/sanitize_cases" "$out/sanitize" 2>&1 | tail -n 80 | tee "$out/sanitize.txt"
