#!/usr/bin/env bash
# Qwen3.5 generation on a CUDA GPU, tern beside llama.cpp's CUDA build, in one call on the
# device machine:
#   scripts/device-bench-generate.sh DIR
# DIR holds the `tern` binary (or tern.xz) and, where the machine's transformers lacks Qwen3.5,
# DIR/whl with the transformers 5.24 wheel (../shared/tools/device-wheels.sh); optionally DIR/llama-convert.tgz (llama.cpp's converter:
# convert_hf_to_gguf.py, conversion/ and gguf-py/ from ../shared/tools/llama-cpp-src.sh, plus
# ../shared/tools/hf-to-gguf.py) and DIR/llama-bench.xz (llama.cpp's own benchmark, built for
# sm_90 with GGML_CUDA=ON by scripts/build-llama-bench.sh). Makes the random-weight Qwen3.5-0.8B on the device
# (scripts/make_bench_qwen35.py: real shapes, bf16 safetensors) and, with the converter, its
# BF16 and Q8_0 GGUFs; then runs `tern bench generate` on each file in f32 and bf16 (prefill of
# 4096 tokens and of the shorter prompts of TERN_BENCH_PREFILL_ALSO (default 16,128,512), batch-1
# decode from an empty context and after a prompt of TERN_BENCH_DEPTH tokens (default 4096),
# decode rounds of 1, 8, 32 and 128 sequences, each with the rooflines measured in the run) and
# llama-bench on the GGUFs (pp16, pp128, pp512, pp4096, tg128, and tg128 @ d4096), plus one profiled
# run per precision (TERN_CUDA_PROFILE; TERN_BENCH_PROFILE=0 skips it). TERN_BENCH_DTYPES (default "f32 bf16"), TERN_BENCH_MODELS, TERN_BENCH_CONCURRENT and
# TERN_BENCH_VARIANTS (device-env.sh) narrow or repeat the tern runs. TERN_BENCH_35B=1 also makes
# Qwen3.5-35B-A3B's random-weight GGUFs (its checkpoint in /dev/shm, removed after the conversion;
# about 70 GB of memory, 107 GB of disk: a machine of the x2 kind or larger) and runs them after
# the 0.8B files; TERN_BENCH_35B_LAYERS=N keeps its first N layers (N a multiple of 4: the same
# layers, fewer of them, where a machine's disk or time cannot hold the whole model). Its weights
# are drawn on the GPU (--init-device=cuda); TERN_BENCH_35B_CHECKPOINTS names the checkpoint's
# folder instead of /dev/shm (a container's /dev/shm may be small). Every JSON report also goes to $OUT/generate.jsonl
# (profiles to $OUT/profile.jsonl) when $OUT is set.
set -euo pipefail
dir=$(cd "${1:?usage: scripts/device-bench-generate.sh DIR}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
. "$here/device-env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
tern_python_packages "$dir"
bench=/tmp/tern-bench
mkdir -p $bench
report=${OUT:-$bench}/generate.jsonl
tern="$dir/tern"
if [ ! -x "$tern" ]; then xz -dc "$dir/tern.xz" > $bench/tern && chmod +x $bench/tern && tern=$bench/tern; fi

gguf_args=(--no-gguf)
if [ -f "$dir/llama-convert.tgz" ]; then
  mkdir -p $bench/llama.cpp && tar xzf "$dir/llama-convert.tgz" -C $bench/llama.cpp
  export LLAMA_CPP_DIR=$bench/llama.cpp TERN_SHARED_TOOLS=$bench/llama.cpp
  gguf_args=(--gguf-types=bf16,q8_0)
fi
# A machine kept from an earlier call still has the files (same recipe and seed).
if [ ! -e $bench/qwen35-0.8b/config.json ] || { [ "${gguf_args[0]}" != --no-gguf ] && [ ! -e $bench/qwen35-0.8b-q8_0.gguf ]; }; then
  python3 "$here/make_bench_qwen35.py" $bench "${gguf_args[@]}" 2>&1 | grep -v -e Warning || true
fi

big=qwen35-35b-a3b${TERN_BENCH_35B_LAYERS:+-l$TERN_BENCH_35B_LAYERS}
big_root=${TERN_BENCH_35B_CHECKPOINTS:-/dev/shm}
if [ "${TERN_BENCH_35B:-0}" = 1 ] && [ "${gguf_args[0]}" != --no-gguf ]; then
  # Resumable: a call that runs out of time keeps what it finished (on a machine kept warm
  # between calls), and the next call goes on from there.
  if [ ! -e $bench/$big-bf16.gguf ] || [ ! -e $bench/$big-q8_0.gguf ]; then
    python3 "$here/make_bench_qwen35.py" $bench --model=35b-a3b ${TERN_BENCH_35B_LAYERS:+--layers=$TERN_BENCH_35B_LAYERS} \
      --init-device=cuda --checkpoint-root=$big_root "${gguf_args[@]}" 2>&1 | grep -v -e Warning || true
  fi
  # The checkpoint holds up to 70 GB (of memory, in /dev/shm); once both files exist it is not needed.
  if [ -e $bench/$big-bf16.gguf ] && [ -e $bench/$big-q8_0.gguf ]; then rm -rf "${big_root:?}/$big"; fi
fi
default_models="$bench/qwen35-0.8b-bf16.gguf $bench/qwen35-0.8b-q8_0.gguf"
[ "${TERN_BENCH_35B:-0}" = 1 ] && default_models="$default_models $bench/$big-bf16.gguf $bench/$big-q8_0.gguf"
models=(${TERN_BENCH_MODELS:-$default_models})
[ -e $bench/qwen35-0.8b-bf16.gguf ] || models=($bench/qwen35-0.8b)
for model in "${models[@]}"; do
  [ -e "$model" ] || continue
  for dtype in ${TERN_BENCH_DTYPES:-f32 bf16}; do
    tern_variants "$tern" bench generate --model "$model" --device cuda --dtype $dtype --prompt-tokens 4096 --gen-tokens 64 --iters 3 \
      --prefill-also ${TERN_BENCH_PREFILL_ALSO:-16,128,512} --decode-depth ${TERN_BENCH_DEPTH:-4096} \
      --concurrent ${TERN_BENCH_CONCURRENT:-1,8,32,128} | tee -a "$report"
  done
done

# Where the device time goes, op by op (TERN_CUDA_PROFILE: every op drained and timed, no
# graphs), for the BF16 GGUF (the bf16 safetensors where no converter came) in the precisions
# of TERN_BENCH_DTYPES.
profiled=$bench/qwen35-0.8b-bf16.gguf
[ -e $profiled ] || profiled=$bench/qwen35-0.8b
for dtype in ${TERN_BENCH_DTYPES:-f32 bf16}; do
  [ -e $profiled ] && [ "${TERN_BENCH_PROFILE:-1}" != 0 ] || continue
  TERN_CUDA_PROFILE=1 "$tern" bench generate --model $profiled --device cuda --dtype $dtype \
    --prompt-tokens 4096 --gen-tokens 32 --iters 1 --concurrent 8 | tee -a "${OUT:-$bench}/profile.jsonl"
  # The same decode inside its recorded graphs (event nodes around each op; prefill untimed).
  TERN_CUDA_PROFILE=graph "$tern" bench generate --model $profiled --device cuda --dtype $dtype \
    --prompt-tokens 16 --gen-tokens 64 --iters 1 --concurrent 1,8 | tee -a "${OUT:-$bench}/profile-graph.jsonl"
done

llama=""
if [ -f "$dir/llama-bench.xz" ]; then xz -dc "$dir/llama-bench.xz" > $bench/llama-bench && chmod +x $bench/llama-bench && llama=$bench/llama-bench; fi
if [ -n "$llama" ]; then
  for model in "${models[@]}"; do
    [ -e "$model" ] && [ "${model%.gguf}" != "$model" ] || continue
    "$llama" -m "$model" -p 16,128,512,4096 -n 128 -r 3 -o json | tee -a "${OUT:-$bench}/llama-bench.json"
    "$llama" -m "$model" -p 0 -n 128 -d ${TERN_BENCH_DEPTH:-4096} -r 3 -o json | tee -a "${OUT:-$bench}/llama-bench.json" ||
      echo "llama-bench tg @ d${TERN_BENCH_DEPTH:-4096} failed on $model" >&2
  done
fi
