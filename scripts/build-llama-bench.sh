#!/usr/bin/env bash
# llama.cpp's own benchmark, `llama-bench`, built for the H200 (sm_90, CUDA) on a machine with
# no GPU and no CUDA toolkit: the peer that scripts/device-bench-generate.sh runs beside tern
# (DIR/llama-bench.xz there).
#   scripts/build-llama-bench.sh [OUT]     (default ~/.cache/tern/llama-bench.xz)
# The source is ../shared/tools/llama-cpp-src.sh's (llama.cpp as vendored by llama-cpp-python
# 0.3.36). CUDA 13.0 comes from NVIDIA's PyPI wheels (nvcc, its front end and NVVM, the runtime,
# cuBLAS and CCCL's headers) installed into a folder that CMake takes as the toolkit. The wheels
# hold no libcuda (the driver), which ggml-cuda links for a few driver calls: a stub library
# with those entry points and the driver's soname stands in at link time only; on the GPU
# machine the driver's own libcuda.so.1 is what loads, and cuBLAS and the runtime are the
# machine's (device-env.sh). 20 to 40 minutes on 2 cores; the build folder is kept, so a rerun
# only relinks.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$HOME/.cache/tern/llama-bench.xz}
work=${TERN_LLAMA_BUILD:-$HOME/.cache/tern/llama-build}
src=$(bash "$here/../../shared/tools/llama-cpp-src.sh")
tk=$work/toolkit
cuda=$tk/nvidia/cu13
if [ ! -x "$cuda/bin/nvcc" ] || [ ! -x "$tk/bin/cmake" ]; then
  python3 -m pip install -q --disable-pip-version-check --target "$tk" \
    "nvidia-cuda-nvcc==13.0.88" "nvidia-cuda-crt==13.0.88" "nvidia-nvvm==13.0.88" \
    "nvidia-cuda-runtime==13.0.96" "nvidia-cublas==13.1.0.3" "nvidia-cuda-cccl==13.0.85" \
    "cmake==4.4.5" "ninja==1.13.2"
fi
# The wheels ship versioned libraries only; CMake's CUDA toolkit search wants the link names
# and a lib64 folder.
for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$cuda/lib/lib$l.so"; done
ln -sfn lib "$cuda/lib64"

# The driver stub: every cu* function ggml-cuda's sources call (none of them is renamed to a
# versioned symbol by cuda.h, checked below), as functions of no arguments: only their names
# matter to the linker.
stub=$work/driver-stub
mkdir -p "$stub"
calls=$(grep -ohE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' "$src"/ggml/src/ggml-cuda/*.cu "$src"/ggml/src/ggml-cuda/*.cuh |
  sed 's/[[:space:]]*($//' | sort -u)
for f in $calls; do
  if grep -qE "#define $f\b" "$cuda/include/cuda.h"; then
    echo "build-llama-bench: cuda.h renames $f; the stub would export the wrong symbol" >&2
    exit 1
  fi
  echo "int $f(void) { return 0; }"
done > "$stub/stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 "$stub/stub.c" -o "$stub/libcuda.so"

export PATH="$tk/bin:$cuda/bin:$PATH" PYTHONPATH="$tk${PYTHONPATH:+:$PYTHONPATH}"
CUDACXX="$cuda/bin/nvcc" cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DCUDAToolkit_ROOT="$cuda" -DCUDA_cuda_driver_LIBRARY="$stub/libcuda.so" >/dev/null
ninja -C "$work/build" -j "$(nproc)" llama-bench
mkdir -p "$(dirname "$out")"
strip -o "$work/llama-bench" "$work/build/bin/llama-bench"
xz -T0 -6 -c "$work/llama-bench" > "$out"
ls -l "$out" >&2
echo "$out"
