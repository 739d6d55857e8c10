#!/usr/bin/env bash
# The CUDA embedding benchmark and its peers, side by side in one call on a GPU machine:
#   scripts/device-bench-embed.sh DIR
# DIR holds the `tern` binary (or tern.xz), tokenizer.json.xz (EmbeddingGemma 300M's, the Gemma vocabulary)
# and DIR/whl with the transformers 5.24, huggingface-hub and egemma2 wheels
# (../shared/tools/device-wheels.sh). Makes random full-size checkpoints on the device, then runs
# tern (f32 and bf16) and the peers on the same inputs.
set -euo pipefail
dir=${1:?usage: scripts/device-bench-embed.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/device-env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
tern_python_packages "$dir"
bench=/tmp/tern-bench
mkdir -p $bench
xz -dc "$dir/tokenizer.json.xz" > $bench/tokenizer.json
tern="$dir/tern"
if [ ! -x "$tern" ]; then xz -dc "$dir/tern.xz" > $bench/tern && chmod +x $bench/tern && tern=$bench/tern; fi
# TERN_BENCH_EMBED_MODELS picks the checkpoints (default both); TERN_BENCH_PEERS=0 runs tern
# alone on its own generated documents (no transformers or egemma2 timings);
# TERN_BENCH_VARIANTS (device-env.sh) repeats each tern run under several settings.
models=${TERN_BENCH_EMBED_MODELS:-eg300m eg2}
python3 "$here/make_bench_egemma.py" $bench $bench/tokenizer.json "$(echo $models | tr ' ' ,)"
docs=()
if [ "${TERN_BENCH_PEERS:-1}" != 0 ]; then
  python3 "$here/bench_embed_gpu_peers.py" $bench /tmp/site/bin/egemma2 2>&1 | grep -v -e Warning -e "Loading weights" || true
  docs=(--input $bench/inputs/docs.txt)
fi
for model in $models; do
  for dtype in f32 bf16; do
    tern_variants "$tern" bench embed --model $bench/$model --device cuda --dtype $dtype "${docs[@]}" --batch 64 --iters 5 $([ $dtype = bf16 ] && echo --compare-f32)
    if [ $model = eg2 ] && [ ${#docs[@]} -gt 0 ]; then
      tern_variants "$tern" bench embed --model $bench/$model --device cuda --dtype $dtype --input $bench/inputs/long.txt --batch 1 --iters 5
    fi
  done
done
