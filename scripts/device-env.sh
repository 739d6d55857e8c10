# Sourced by the device scripts: finds NVRTC 13 on a GPU machine (the CUDA toolkit's, or an
# installed nvidia-cuda-nvrtc wheel's) unless TERN_NVRTC_LIB names it, and puts the kernel
# cache in /tmp.
if [ -z "${TERN_NVRTC_LIB:-}" ]; then
  for cand in /usr/local/cuda/lib64/libnvrtc.so.13 \
      $(python3 -c 'import glob,site; print(" ".join(glob.glob(site.getsitepackages()[0]+"/nvidia/cu13/lib/libnvrtc.so.13")))' 2>/dev/null) \
      $(ls /usr/local/cuda*/lib64/libnvrtc.so.13 /usr/local/cuda*/targets/*/lib/libnvrtc.so.13 2>/dev/null); do
    if [ -f "$cand" ]; then export TERN_NVRTC_LIB="$cand"; break; fi
  done
fi
echo "NVRTC: ${TERN_NVRTC_LIB:-not found}"
export LD_LIBRARY_PATH="$(dirname "${TERN_NVRTC_LIB:-/x}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# cuBLAS 13 (the encoder's GEMMs): the toolkit's, or the nvidia-cublas wheel's.
if [ -z "${TERN_CUBLAS_LIB:-}" ]; then
  for cand in /usr/local/cuda/lib64/libcublas.so.13 \
      $(python3 -c 'import glob,site; print(" ".join(glob.glob(site.getsitepackages()[0]+"/nvidia/cu13/lib/libcublas.so.13")+glob.glob(site.getsitepackages()[0]+"/nvidia/cublas/lib/libcublas.so.13")))' 2>/dev/null) \
      $(ls /usr/local/cuda*/lib64/libcublas.so.13 /usr/local/cuda*/targets/*/lib/libcublas.so.13 2>/dev/null); do
    if [ -f "$cand" ]; then export TERN_CUBLAS_LIB="$cand"; break; fi
  done
fi
echo "cuBLAS: ${TERN_CUBLAS_LIB:-not found}"
export LD_LIBRARY_PATH="$(dirname "${TERN_CUBLAS_LIB:-/x}"):$LD_LIBRARY_PATH"
export TERN_CUDA_CACHE="${TERN_CUDA_CACHE:-/tmp/tern-cuda-cache}"

# Runs "$@" once per variant of TERN_BENCH_VARIANTS (space-separated; a variant is a
# comma-separated list of VAR=VALUE set for that run, `-` for none; default one run as is), each
# run preceded by a line {"variant": "..."} so that reports of the same call can be told apart.
tern_variants() {
  local v
  for v in ${TERN_BENCH_VARIANTS:--}; do
    echo "{\"variant\": \"$v\"}"
    if [ "$v" = - ]; then "$@"; else env ${v//,/ } "$@"; fi
  done
}

# Installs DIR/whl/*.whl into /tmp/site, unpacks DIR/whl/*.tar.xz there (packages already
# unpacked: a wheel cut down to the modules these scripts use, where the whole wheel does not
# fit beside the other carried files), and puts /tmp/site on PYTHONPATH.
tern_python_packages() {
  local dir=$1 t
  if ls "$dir"/whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$dir"/whl/*.whl
  fi
  for t in "$dir"/whl/*.tar.xz; do
    if [ -e "$t" ]; then mkdir -p /tmp/site && tar xJf "$t" -C /tmp/site; fi
  done
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
}
