#!/usr/bin/env bash
# Qwen3.5 generation on a CUDA GPU, in one call on the device machine:
#   scripts/device-bench-generate.sh DIR
# DIR holds the `tern` binary (or tern.xz) and DIR/whl with the transformers 5.24 wheel
# (../shared/tools/device-wheels.sh). Makes the random-weight Qwen3.5-0.8B checkpoint on the
# device (scripts/make_bench_qwen35.py --no-gguf: real shapes, bf16 safetensors), then runs
# `tern bench generate` on it in f32 and bf16: prefill of 512 and 4096 tokens, batch-1 decode,
# and decode rounds of 1, 8, 32 and 128 sequences, each with the rooflines measured in the run.
set -euo pipefail
dir=${1:?usage: scripts/device-bench-generate.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/device-env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$dir"/whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
bench=/tmp/tern-bench
mkdir -p $bench
tern="$dir/tern"
if [ ! -x "$tern" ]; then xz -dc "$dir/tern.xz" > $bench/tern && chmod +x $bench/tern && tern=$bench/tern; fi
python3 "$here/make_bench_qwen35.py" $bench --no-gguf 2>&1 | grep -v -e Warning || true
for dtype in f32 bf16; do
  for prompt in 512 4096; do
    "$tern" bench generate --model $bench/qwen35-0.8b --device cuda --dtype $dtype --prompt-tokens $prompt --gen-tokens 64 --iters 3 \
      $([ $prompt = 512 ] && echo --concurrent 1,8,32,128)
  done
done
