#!/usr/bin/env bash
# Lays out what candle 0.11's CUDA build needs on a machine without a CUDA toolkit, in
# $1 (default .tools/cuda-candle): nvcc, cicc, the CUDA 13 headers and libcudart from
# NVIDIA's wheels, and link-time stubs of libcuda, libcublas, libcublasLt, libcurand and
# libnvrtc with CUDA 13's sonames (generated from the symbols cudarc binds), so that cudarc's
# `dynamic-linking` links. At run time the real libraries are used (the driver's libcuda,
# and e.g. PyTorch cu130's nvidia/* wheels for the others, through LD_LIBRARY_PATH).
# Prints the environment to build with.
set -euo pipefail
root=$(realpath -m "${1:-.tools/cuda-candle}")
# CUDA 13.0's compilers: candle's kernels are PTX that the driver JIT-compiles, and a driver
# rejects a newer PTX ISA than its own CUDA version (the H200's 580 driver is CUDA 13.0;
# nvcc 13.5's PTX failed there with CUDA_ERROR_UNSUPPORTED_PTX_VERSION).
ver=13.0.88
if [ ! -x "$root/nvidia/cu13/bin/nvcc" ]; then
    pip install --quiet --no-deps --target "$root" \
        "nvidia-cuda-nvcc==$ver" "nvidia-cuda-crt==$ver" "nvidia-cuda-runtime==$ver" \
        "nvidia-nvvm==$ver" "nvidia-cuda-cccl==13.0.85"
fi
cuda=$root/nvidia/cu13
ln -sf libcudart.so.13 "$cuda/lib/libcudart.so"
stubs=$cuda/lib/stubs
mkdir -p "$stubs"
src=$(cargo metadata --format-version 1 --manifest-path "$(dirname "$0")/Cargo.toml" |
    python3 -c 'import json,sys; m=json.load(sys.stdin); print(next(p["manifest_path"] for p in m["packages"] if p["name"]=="cudarc").rsplit("/",1)[0])')
# library, soname, cudarc module
for spec in cuda:libcuda.so.1:driver cublas:libcublas.so.13:cublas \
    cublasLt:libcublasLt.so.13:cublaslt curand:libcurand.so.10:curand \
    nvrtc:libnvrtc.so.13:nvrtc; do
    IFS=: read -r lib soname module <<<"$spec"
    grep -oh 'load::<_F>("[A-Za-z0-9_]*")' "$src/src/$module/sys/mod.rs" |
        sed 's/.*("\(.*\)")/void \1(void) {}/' | sort -u >"$stubs/$lib.c"
    cc -shared -fPIC -Wl,-soname,"$soname" -o "$stubs/lib$lib.so" "$stubs/$lib.c"
    rm "$stubs/$lib.c"
done
cat <<ENV
export PATH=$cuda/bin:\$PATH CUDA_PATH=$cuda CUDA_COMPUTE_CAP=90 CUDARC_CUDA_VERSION=13000
export NVCC_APPEND_FLAGS="-I$cuda/include/cccl"
ENV
