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

# Writes a variant of a kernel module for TERN_CUDA_SOURCE_DIR, from the repository's sources:
#   tern_source_variant DIR MODULE SED_SCRIPT FILE...
# DIR/MODULE.cu becomes the FILEs joined by newlines, as the module's KernelSource joins them
# (e.g. src/kernels/gated_delta/cuda/common.cuh then recurrence.cu for tern_gdn_recurrence;
# src/kernels/prelude.cuh then the family's .cu for the others), edited by sed's SED_SCRIPT.
# Fails (writing nothing) when a FILE cannot be read, sed fails, or the edit changes nothing, so
# that a stale pattern cannot time the default twice.
tern_source_variant() {
  local dir=$1 module=$2 script=$3 first=1 f
  shift 3
  for f in "$@"; do
    [ -r "$f" ] || { echo "tern_source_variant: cannot read $f" >&2; return 1; }
  done
  mkdir -p "$dir"
  for f in "$@"; do
    if [ $first = 0 ]; then printf '\n'; fi
    cat "$f"
    first=0
  done > "$dir/$module.cu.orig"
  if ! sed -e "$script" "$dir/$module.cu.orig" > "$dir/$module.cu"; then
    rm -f "$dir/$module.cu" "$dir/$module.cu.orig"
    return 1
  fi
  if cmp -s "$dir/$module.cu.orig" "$dir/$module.cu"; then
    echo "tern_source_variant: '$script' changes nothing in $module" >&2
    rm -f "$dir/$module.cu" "$dir/$module.cu.orig"
    return 1
  fi
  rm -f "$dir/$module.cu.orig"
}

# Nsight Compute's ncu (on PATH or under a CUDA toolkit) into $ncu, and the output folder ($OUT,
# or /tmp/tern-profile) into $out, created; fails with a message when there is no ncu.
tern_ncu() {
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1 || true)
  [ -n "$ncu" ] || { echo "$1: ncu (Nsight Compute) not found" >&2; return 1; }
  out=${OUT:-/tmp/tern-profile}
  mkdir -p "$out"
}
