#!/usr/bin/env bash
# The Python package's CPU tests (python/README.md), run by scripts/test.sh: builds the wheel
# with maturin (pinned, from PyPI into a git-ignored folder), installs it into a scratch
# folder, and runs python/tests/test_cpu.py against the installed wheel. Needs neither torch
# nor a GPU: the tests use stand-in tensors.
set -euo pipefail
cd "$(dirname "$0")/.."

MATURIN_VERSION=1.16.0
TOOLS="${MSA_PY_TOOLS:-.tools/maturin}"
if [ ! -x "$TOOLS/bin/maturin" ] || [ "$("$TOOLS/bin/maturin" --version)" != "maturin $MATURIN_VERSION" ]; then
  echo "installing maturin==$MATURIN_VERSION into $TOOLS"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
    --target "$TOOLS" "maturin==$MATURIN_VERSION"
fi

rm -rf target/wheels/msa_ptx-*.whl target/py-site
"$TOOLS/bin/maturin" build --quiet -m python/Cargo.toml --out target/wheels
WHEEL=$(ls target/wheels/msa_ptx-*.whl)
echo "built $WHEEL"
python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
  --target target/py-site "$WHEEL"
# Run from a folder without python/msa_ptx on the path, so that the installed wheel is tested.
SITE="$PWD/target/py-site"
cd python/tests
PYTHONPATH="$SITE" python3 -m unittest -v test_cpu
