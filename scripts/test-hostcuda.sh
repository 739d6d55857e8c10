#!/usr/bin/env bash
# The CUDA device tests without a GPU: every CUDA op against its CPU twin, whole embeddings and
# Qwen3.5 models against the CPU path, graph replays and batch invariance, run on hostcuda
# (tools/hostcuda: the driver, NVRTC and cuBLAS entry points tern calls, executed on the CPU with
# the kernels' own sources; kernel.h says what it models and what it does not).
#   scripts/test-hostcuda.sh [TEST FILTER...]
# Builds hostcuda into target/hostcuda (or $TERN_HOSTCUDA_DIR) with g++ and runs its own self-test
# (the driver and cuBLAS on a hand-written module), then runs the ignored
# device tests under it. The largest cases of a few tests are left to the GPU (each test says
# which on stderr); scripts/device-test.sh runs all of them on a GPU. TERN_HOSTCUDA_ORDER=reverse
# runs a block's threads highest first (a missing barrier shows in one order or the other);
# TERN_HOSTCUDA_DEBUG=1 prints every launch; TERN_HOSTCUDA_KEEP=1 and
# TERN_HOSTCUDA_CFLAGS="-O0 -g" keep a kernel's translated source and module for gdb.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${TERN_HOSTCUDA_DIR:-$PWD/target/hostcuda}"
# hostcuda and the kernels it compiles are C++: g++ (Debian's, installed when missing).
if ! command -v "${CXX:-g++}" >/dev/null; then
  echo "installing g++ for hostcuda" >&2
  apt-get install -y -q g++ >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q g++ >/dev/null; }
fi
bash tools/hostcuda/build.sh "$out" --selftest
export LD_LIBRARY_PATH="$out${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TERN_NVRTC_LIB="$out/libnvrtc.so"
# Host images never share a cache folder with real CUBINs (their NVRTC version differs too). The
# cache's key does not cover hostcuda's own sources, so each run starts it afresh.
export TERN_CUDA_CACHE="$out/kernel-cache"
rm -rf "$TERN_CUDA_CACHE"
if [ $# -eq 0 ]; then
  set -- kernels::gated_delta::cuda kernels::cuda_tests models::qwen35_cuda_tests
fi
cargo test --release --lib -- --ignored --test-threads=1 "$@"
