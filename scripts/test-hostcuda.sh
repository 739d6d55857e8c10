#!/usr/bin/env bash
# The CUDA device tests without a GPU: every CUDA op against its CPU twin, whole embeddings and
# Qwen3.5 models against the CPU path, graph replays and batch invariance, and EmbeddingGemma
# 300M's real weights through the CUDA path against the CPU path, run on hostcuda
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
if [ $# -gt 0 ]; then
  exec cargo test --release --lib -- --ignored --test-threads=1 "$@"
fi
cargo test --release --lib -- --ignored --test-threads=1 kernels::gated_delta::cuda kernels::cuda_tests models::qwen35_cuda_tests

# EmbeddingGemma 300M's real weights end to end on the device path against the CPU path (the
# model scripts/test.sh fetches for the real-weights test): f32 mode within the f32 bound, bf16
# mode within the fast-mode bound.
model="${TERN_EGEMMA300M_DIR:-$HOME/.cache/tern/models/embeddinggemma-300m}"
if [ ! -f "$model/model.safetensors" ]; then
  echo "EmbeddingGemma 300M is not at $model (set TERN_EGEMMA300M_DIR or run scripts/test.sh, which fetches it)" >&2
  exit 1
fi
cargo build --release --quiet --bin tern --example gemv_chain_bench
# The persistent product chain (examples/gemv_chain.cu): one cooperative launch whose blocks
# meet at a grid barrier between stages, every stage checked against the CPU (the program fails
# otherwise); hostcuda runs the blocks' threads together, in both thread orders.
target/release/examples/gemv_chain_bench layers=1 forms=16x24 reps=0
TERN_HOSTCUDA_ORDER=reverse target/release/examples/gemv_chain_bench layers=1 forms=8x16 reps=0
tmp=$(mktemp -d)
texts=("Which seabird migrates the farthest?" "Arctic terns fly from pole to pole." "a")
target/release/tern embed --model "$model" --device cpu --prompt-name query "${texts[@]}" > "$tmp/cpu.jsonl"
target/release/tern embed --model "$model" --device cuda --prompt-name query "${texts[@]}" > "$tmp/f32.jsonl"
target/release/tern embed --model "$model" --device cuda --dtype bf16 --prompt-name query "${texts[@]}" > "$tmp/bf16.jsonl"
python3 scripts/compare-embeddings.py "$tmp/cpu.jsonl" "$tmp/f32.jsonl" 0.99999 "EmbeddingGemma 300M, CUDA f32 vs CPU"
python3 scripts/compare-embeddings.py "$tmp/f32.jsonl" "$tmp/bf16.jsonl" 0.9999 "EmbeddingGemma 300M, CUDA bf16 vs f32"
rm -rf "$tmp"
