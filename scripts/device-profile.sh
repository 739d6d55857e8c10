#!/usr/bin/env bash
# One launch of a kernel under Nsight Compute, on a machine with an NVIDIA GPU, with the
# sections that say where its time goes: speed of light, occupancy, launch statistics, warp
# states (stall reasons), scheduler, memory workload and the source lines that stall most.
#   scripts/device-profile.sh NAME KERNEL_REGEX SKIP COMMAND...
# profiles the launch after the first SKIP launches whose kernel name matches KERNEL_REGEX
# (an extended regex on the name, e.g. '^tern_gdn_tc_prepare_dk128_dv128_r8c$') while COMMAND
# runs, and writes NAME.txt (the sections as text) and NAME.ncu-rep (the report, for the
# Nsight Compute GUI) under $OUT, or /tmp/tern-profile where $OUT is not set. Clocks are left
# as the GPU runs them (--clock-control none: the times then compare with the benchmarks') and
# caches are flushed before the launch, as in a cold step. NAME-source.csv holds the stall
# samples by line: run with TERN_CUDA_LINEINFO=1 and summarise it with scripts/ncu_lines.py.
# Examples (DIR: the carried binaries):
#   scripts/device-profile.sh prepare-r8 '^tern_gdn_tc_prepare_dk128_dv128_r8$' 0 DIR/gdn_bench prefill tokens=32768
#   scripts/device-profile.sh state-s3 '^tern_gdn_tc_state_dk128_s3$' 0 DIR/gdn_bench prefill tokens=32768
set -euo pipefail
name=${1:?usage: scripts/device-profile.sh NAME KERNEL_REGEX SKIP COMMAND...}
regex=${2:?kernel regex}
skip=${3:?launches to skip}
shift 3
[ $# -gt 0 ] || { echo "device-profile.sh: no command to run" >&2; exit 2; }
. "$(dirname "$0")/device-env.sh"
tern_ncu device-profile.sh
"$ncu" --clock-control none --cache-control all --import-source yes \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
  -k "regex:$regex" -s "$skip" -c 1 -f -o "$out/$name" "$@" > "$out/$name.run.log" 2>&1 || {
  echo "device-profile.sh: ncu failed; the tail of its log:" >&2
  tail -20 "$out/$name.run.log" >&2
  exit 1
}
"$ncu" --import "$out/$name.ncu-rep" --page details > "$out/$name.txt"
# Stall samples by source line and SASS instruction (source lines where the kernels were
# compiled with TERN_CUDA_LINEINFO=1): scripts/ncu_lines.py summarises it.
"$ncu" --import "$out/$name.ncu-rep" --page source --csv --print-source cuda,sass > "$out/$name-source.csv" 2>/dev/null \
  || echo "device-profile.sh: no per-line export from this ncu" >&2
# The figures most often wanted, first.
grep -E '^  [a-zA-Z_]|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issue Slots Busy|Warp Cycles Per Issued Instruction' "$out/$name.txt" | head -40
echo "device-profile.sh: $out/$name.txt, $out/$name.ncu-rep, $out/$name-source.csv"
