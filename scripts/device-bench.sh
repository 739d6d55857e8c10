#!/usr/bin/env bash
# The gated-delta CUDA benchmark and its fla peer, side by side in one call on a GPU machine:
#   scripts/device-bench.sh DIR
# DIR holds the gdn_bench example binary (cargo build --release --example gdn_bench) and, in
# DIR/whl, the fla-core wheel (installed into /tmp/site; torch and triton must be present).
set -euo pipefail
dir=${1:?usage: scripts/device-bench.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/device-env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
"$dir/gdn_bench"
if ls "$dir"/whl/*.whl >/dev/null 2>&1; then
  tern_python_packages "$dir"
  python3 "$here/bench_gdn_fla.py"
else
  echo "no fla wheel in $dir/whl: fla peer not run" >&2
fi
