#!/usr/bin/env bash
# The project's one test command (README, `.ci/run`): installs ptxas when it is missing,
# then checks formatting, lints and rustdoc (warnings are errors), runs every test (doc tests
# and the bounded proptest suite included), then builds the Python wheel and runs its CPU
# tests (scripts/test-python.sh). GPU tests skip without a GPU unless REQUIRE_GPU=1.
set -euo pipefail
cd "$(dirname "$0")/.."

# ptxas from NVIDIA's PyPI wheel, pinned, into a git-ignored project folder.
NVCC_WHEEL_VERSION=13.5.37
if [ -z "${PTXAS:-}" ]; then
  PTXAS="$PWD/.tools/nvcc/nvidia/cu13/bin/ptxas"
  if [ ! -x "$PTXAS" ]; then
    echo "installing ptxas (nvidia-cuda-nvcc==$NVCC_WHEEL_VERSION) into .tools/nvcc"
    python3 -m pip install --quiet --disable-pip-version-check --no-deps \
      --target .tools/nvcc "nvidia-cuda-nvcc==$NVCC_WHEEL_VERSION"
  fi
fi
export PTXAS
"$PTXAS" --version | tail -n 1

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
cargo test --workspace

# The Python package: build the wheel, import it, its CPU tests (no torch, no GPU needed).
# maturin is installed from PyPI into .tools/maturin when missing (MSA_PY_TOOLS overrides).
./scripts/test-python.sh
