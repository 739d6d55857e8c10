#!/bin/sh
# Builds hostcuda's libraries into OUTDIR: the driver (libcuda.so.1, and libcuda.so, the first
# name cudarc tries), cuBLAS (libcublas.so.13, the soname tern probes, and libcublas.so) and
# NVRTC (libnvrtc.so, for TERN_NVRTC_LIB), with the kernel compiler NVRTC runs (translate.py
# and the kernel.h it prepends, copied beside it).
# The unversioned names are links to the versioned files, so that whichever name a loader
# opens, the process gets one copy of each library (one set of driver state).
#
#   tools/hostcuda/build.sh OUTDIR              build
#   tools/hostcuda/build.sh OUTDIR --selftest   build, then build and run driver_selftest.cpp
set -eu

if [ $# -lt 1 ]; then
    echo "usage: $0 OUTDIR [--selftest]" >&2
    exit 2
fi
OUT=$1
SRC=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CXX=${CXX:-g++}
FLAGS="-std=c++17 -O2 -fPIC -Wall -Wextra"
# The libraries' own internals are hidden: they export their C entry points (and the weak
# standard-library instantiations the C++ headers mark visible).
LIBFLAGS="$FLAGS -fvisibility=hidden -fvisibility-inlines-hidden"

"$CXX" $LIBFLAGS -shared -Wl,-soname,libcuda.so.1 -o "$OUT/libcuda.so.1" "$SRC/driver.cpp" -ldl -lpthread
ln -sf libcuda.so.1 "$OUT/libcuda.so"

# cuBLAS queues its products through the driver (hostcuda_stream_enqueue), so it links it; the
# RPATH finds it beside itself when it is loaded before the driver.
"$CXX" $LIBFLAGS -ffp-contract=off -shared -Wl,-soname,libcublas.so.13 -o "$OUT/libcublas.so.13" "$SRC/cublas.cpp" \
    -L"$OUT" -l:libcuda.so.1 -Wl,--disable-new-dtags,-rpath,'$ORIGIN'
ln -sf libcublas.so.13 "$OUT/libcublas.so"

# NVRTC exports every function of its C API file (no hidden visibility); it finds translate.py
# beside itself.
"$CXX" $FLAGS -shared -o "$OUT/libnvrtc.so" "$SRC/nvrtc.cpp" -ldl
cp "$SRC/translate.py" "$SRC/kernel.h" "$OUT/"

if [ "${2:-}" = "--selftest" ]; then
    "$CXX" $FLAGS -shared -DHOSTCUDA_SELFTEST_MODULE -o "$OUT/selftest_module.so" "$SRC/driver_selftest.cpp"
    "$CXX" $FLAGS -ffp-contract=off -o "$OUT/driver_selftest" "$SRC/driver_selftest.cpp" \
        -L"$OUT" -l:libcuda.so.1 -l:libcublas.so.13 -Wl,--disable-new-dtags,-rpath,"$OUT" -ldl
    "$OUT/driver_selftest" "$OUT/selftest_module.so"
fi
