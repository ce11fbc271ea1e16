#!/usr/bin/env bash
# The project's one test command (README, `.ci/run`): installs ptxas and nvdisasm when missing,
# then checks formatting, lints and rustdoc (warnings are errors), runs every test (doc tests
# and the bounded proptest suite included), then builds the Python wheel and runs its CPU
# tests (scripts/test-python.sh). GPU tests skip without a GPU unless REQUIRE_GPU=1.
set -euo pipefail
cd "$(dirname "$0")/.."

# ptxas, and nvdisasm for the test that reads the SASS of the clock-timed kernels, from
# NVIDIA's PyPI wheels (one pinned release) into git-ignored project folders, unless the
# variable names one: install_tool VAR WHEEL DIR BINARY.
NVCC_WHEEL_VERSION=13.5.37
install_tool() {
  local var=$1 wheel=$2 dir=$3 bin=$4
  if [ -z "${!var:-}" ]; then
    printf -v "$var" '%s' "$PWD/$dir/nvidia/cu13/bin/$bin"
    if [ ! -x "${!var}" ]; then
      echo "installing $bin ($wheel==$NVCC_WHEEL_VERSION) into $dir"
      python3 -m pip install --quiet --disable-pip-version-check --no-deps \
        --target "$dir" "$wheel==$NVCC_WHEEL_VERSION"
    fi
  fi
  export "${var?}"
}
install_tool PTXAS nvidia-cuda-nvcc .tools/nvcc ptxas
install_tool NVDISASM nvidia-cuda-nvdisasm .tools/nvdisasm nvdisasm

# Disk: session 25's CI run failed with "No space left on device". A full run's target/ took
# 4.8 GB on the 2-core machine, and 0.95 GB without incremental state and debug info (a panic
# still names its file and line). Each variable can be overridden.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-0}"
export CARGO_PROFILE_DEV_STRIP="${CARGO_PROFILE_DEV_STRIP:-debuginfo}"
"$PTXAS" --version | tail -n 1

# A downstream crate whose graph picks cudarc's linking mode and CUDA version, as candle 0.11
# does (`dynamic-linking`, `cuda-version-from-build-system`), must build against msa-runtime
# with `default-features = false` and pass candle's cudarc types to it. The throwaway crate is
# written under target/ (git-ignored); with the lock file copied from this workspace the
# check is offline once the crates are in cargo's cache, and fetches them otherwise.
downstream_check() {
  local dir="$PWD/target/downstream-check"
  mkdir -p "$dir/src"
  cat >"$dir/Cargo.toml" <<TOML
[package]
name = "msa-downstream-check"
version = "0.0.0"
edition = "2021"
publish = false

[workspace]

[dependencies]
msa-runtime = { path = "$PWD/runtime", default-features = false }
cudarc = { version = "0.19.8", default-features = false, features = ["std", "cublas", "cublaslt", "curand", "driver", "nvrtc", "f16", "dynamic-linking", "cuda-version-from-build-system"] }
half = "2"
TOML
  cat >"$dir/src/lib.rs" <<'RUST'
//! Compiles only: candle's cudarc (the same crate as msa-runtime's) reaches the runtime.
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use std::sync::Arc;

pub fn backward(
    stream: &Arc<CudaStream>,
    [q, k, v, d_o, o]: [&CudaSlice<bf16>; 5],
    lse: &CudaSlice<f32>,
    schedule: &msa_runtime::Schedule,
) -> Result<msa_runtime::Gradients, msa_runtime::RuntimeError> {
    msa_runtime::run_backward(
        stream, &q.as_view(), &k.as_view(), &v.as_view(), &d_o.as_view(), &lse.as_view(),
        &o.as_view(), schedule,
    )
}

/// # Safety
/// As `msa_runtime::run_backward_raw`.
pub unsafe fn backward_raw(
    stream: cudarc::driver::sys::CUstream,
    io: &msa_runtime::BackwardBuffers,
    schedule: &msa_runtime::Schedule,
) -> Result<(), msa_runtime::RuntimeError> {
    unsafe { msa_runtime::run_backward_raw(stream, io, schedule) }
}
RUST
  [ -f "$dir/Cargo.lock" ] || cp Cargo.lock "$dir/Cargo.lock"
  # No nvcc on CI: cudarc's documented override of `nvcc --version`.
  local run=(env CUDARC_CUDA_VERSION=12080 cargo check --quiet --manifest-path "$dir/Cargo.toml"
    --target-dir "$PWD/target/downstream-check/target")
  "${run[@]}" --offline 2>/dev/null || "${run[@]}"
  echo "downstream check: msa-runtime (default-features = false) + cudarc dynamic-linking builds"
}

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The context-parallel NCCL binding (feature `nccl`, off by default) and its H200 test.
cargo clippy -p msa-runtime -p msa-tests --all-targets --features msa-tests/nccl -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
python3 scripts/runtime-layers.py runtime/src
downstream_check
cargo test --workspace

# The Python package: build the wheel, import it, its CPU tests (no torch, no GPU needed).
# maturin is installed from PyPI into .tools/maturin when missing (MSA_PY_TOOLS overrides).
./scripts/test-python.sh
