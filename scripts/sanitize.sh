#!/usr/bin/env bash
# Runs compute-sanitizer's memcheck, racecheck and synccheck over the whole backward and the
# forward on the cases of tests/examples/sanitize_cases.rs (packed tiny documents with -1 holes, two
# documents of 700 + 1348 tokens, one 2048-token document), and prints one summary line per
# tool and kernel. Needs a GPU and compute-sanitizer (the CUDA toolkit).
#
#   scripts/sanitize.sh [HARNESS] [LOGDIR]
#
# HARNESS defaults to target/release/examples/sanitize_cases (build it with
# `cargo build -p msa-tests --release --example sanitize_cases`); LOGDIR (default
# target/sanitize) receives each tool's full report. The kernels are the `.entry` names of
# generated/*.<arch>.ptx for the GPU's architecture (sm_90a on a Hopper GPU, sm_100a on
# Blackwell). Exit status 1 when any tool reports an error or a case misses its tolerances.
#
# Reported PCs (kernel+0x...) are mapped to SASS by assembling that kernel's PTX with the
# toolkit's ptxas and reading `cuobjdump -sass`: the code the driver's JIT ran, when the
# toolkit's compiler is the build the driver's JIT uses (CUDA 13.0 on the H200 here; both
# versions are printed).
set -uo pipefail
cd "$(dirname "$0")/.."

harness=${1:-target/release/examples/sanitize_cases}
logdir=${2:-target/sanitize}
mkdir -p "$logdir"
sanitizer=$(command -v compute-sanitizer || ls -d /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | tail -n 1)
if [ -z "$sanitizer" ] || [ ! -x "$harness" ]; then
  echo "need compute-sanitizer (found: '${sanitizer}') and the harness '$harness'" >&2
  exit 2
fi

cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1)
case "$cc" in
  9.0) arch=sm_90a ;;
  10.0) arch=sm_100a ;;
  *) echo "no kernels for compute capability $cc" >&2; exit 2 ;;
esac
kernels=$(sed -n 's/^\.visible \.entry \([A-Za-z0-9_]*\)(.*/\1/p' generated/*."$arch".ptx | sort -u)

"$sanitizer" --version | tail -n 1
status=0
printf '%-10s %-22s %s\n' tool kernel result
for tool in memcheck racecheck synccheck; do
  log="$logdir/$tool.log"
  "$sanitizer" --tool "$tool" --print-limit 10000 "$harness" all >"$log" 2>&1
  rc=$?
  cases=$(grep -c '^case .*: ok$' "$log")
  failed=$(grep -c '^case .*: FAILED$' "$log")
  if [ "$rc" -ne 0 ] || [ "$failed" -ne 0 ]; then status=1; fi
  for k in $kernels; do
    if [ "$tool" = racecheck ]; then
      # "Race reported between Write access at K+0x... and Read access at K+0x..."
      n=$(grep -c "Race reported.* at $k+0x" "$log")
      hazards=$(grep "Race reported.* at $k+0x" "$log" | sed -n 's/.*\[\([0-9]*\) hazards.*/\1/p' |
        awk '{s += $1} END {print s + 0}')
      result="$n errors ($hazards hazards)"
    else
      # Each error record names its device frame as "at K+0x...".
      n=$(grep -cE "^=+ +at $k\+0x" "$log")
      result="$n errors"
    fi
    if [ "$n" -ne 0 ]; then status=1; fi
    printf '%-10s %-22s %s\n' "$tool" "$k" "$result"
  done
  summary=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1 | sed 's/^=* *//')
  printf '%-10s %-22s %s; %s cases ok, %s failed; exit %s\n' "$tool" "(whole run)" \
    "${summary:-no summary line}" "$cases" "$failed" "$rc"
  if ! grep -qE '(ERROR|RACECHECK) SUMMARY: 0 ' "$log"; then status=1; fi
done

# Map every reported PC to its SASS instruction.
pcs=$(cat "$logdir"/*.log | grep -oE '\b[A-Za-z_][A-Za-z0-9_]*\+0x[0-9a-f]+' | sort -u)
if [ -n "$pcs" ]; then
  ptxas=$(command -v ptxas || ls -d /usr/local/cuda*/bin/ptxas 2>/dev/null | tail -n 1)
  cuobjdump=$(command -v cuobjdump || ls -d /usr/local/cuda*/bin/cuobjdump 2>/dev/null | tail -n 1)
  if [ -n "$ptxas" ] && [ -n "$cuobjdump" ]; then
    echo "reported PCs, mapped with $("$ptxas" --version | tail -n 1) (driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)):"
    for k in $(echo "$pcs" | cut -d+ -f1 | sort -u); do
      [ -f "generated/$k.$arch.ptx" ] || continue
      "$ptxas" -arch="$arch" -O3 "generated/$k.$arch.ptx" -o "$logdir/$k.cubin" &&
        "$cuobjdump" -sass "$logdir/$k.cubin" >"$logdir/$k.sass"
    done
    for pc in $pcs; do
      k=${pc%%+*}
      off=$(printf '%04x' "$((${pc#*+}))")
      [ -f "$logdir/$k.sass" ] || continue
      printf '  %-28s %s\n' "$pc" "$(grep -m1 "/\*$off\*/" "$logdir/$k.sass" | sed 's/^ *\/\*[0-9a-f]*\*\/ *//; s/ *\/\*.*//')"
    done
  else
    echo "reported PCs (no ptxas/cuobjdump to map them): $(echo $pcs)"
  fi
fi
exit $status
