#!/usr/bin/env bash
# The CUDA device tests (every kernel against its CPU twin, whole embeddings and Qwen3.5 models against the CPU), on a machine with an NVIDIA GPU and
# no Rust toolchain: runs test binaries built elsewhere with `cargo test --release --no-run`.
#   scripts/device-test.sh DIR [memcheck]
# DIR holds the library's unit-test binary (tern-*). With `memcheck`, the same tests run once
# more under compute-sanitizer's memcheck. NVRTC is taken from the CUDA toolkit or from any
# installed nvidia-cuda-nvrtc wheel; TERN_NVRTC_LIB overrides.
set -euo pipefail
dir=${1:?usage: scripts/device-test.sh DIR [memcheck]}
mode=${2:-}
bin=$(ls "$dir"/tern-* | head -1)
. "$(dirname "$0")/device-env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$bin" --ignored --test-threads=1 --nocapture kernels::gated_delta::cuda kernels::cuda_tests models::qwen35_cuda_tests
if [ "$mode" = memcheck ]; then
  compute-sanitizer --tool memcheck --error-exitcode 1 "$bin" --ignored --test-threads=1 kernels::gated_delta::cuda kernels::cuda_tests models::qwen35_cuda_tests
fi
