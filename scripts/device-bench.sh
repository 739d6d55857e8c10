#!/usr/bin/env bash
# The gated-delta CUDA benchmark and its fla peer, side by side in one call on a GPU machine:
#   scripts/device-bench.sh DIR
# DIR holds the gdn_bench example binary (cargo build --release --example gdn_bench) and, in
# DIR/whl, the fla-core wheel (installed into /tmp/site; torch and triton must be present).
# Run from the repository root: after the built-in kernels, the decode step is timed again with
# the recurrence module rebuilt from the sources under the register bound below
# (TERN_CUDA_SOURCE_DIR), so that one call compares them with the default and with fla.
set -euo pipefail
dir=${1:?usage: scripts/device-bench.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/device-env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
"$dir/gdn_bench"
# The recurrence at d_k = 128 (Qwen3.5's) under the 64-register bound: the one-group forms in
# 8 blocks of 4 warps a multiprocessor (fla's occupancy; built in, 8x1 takes 72 registers, 7
# blocks), the fused form in 2 blocks of its size (96 built in, 1 block); 16 bytes of spill
# each (SASS).
variant_dir=/tmp/tern-gdn-bound-64
tern_source_variant "$variant_dir" tern_gdn_recurrence \
  's/^TERN_GDN_RECURRENCE_D(128, TERN_GDN_RECURRENCE, 1)/TERN_GDN_RECURRENCE_D(128, TERN_GDN_RECURRENCE_FULL, 2)/' \
  src/kernels/gated_delta/cuda/common.cuh src/kernels/gated_delta/cuda/recurrence.cu
echo '{"variant": "recurrence bound 64 registers"}'
TERN_CUDA_SOURCE_DIR=$variant_dir "$dir/gdn_bench" decode
if ls "$dir"/whl/*.whl >/dev/null 2>&1; then
  tern_python_packages "$dir"
  python3 "$here/bench_gdn_fla.py"
else
  echo "no fla wheel in $dir/whl: fla peer not run" >&2
fi
