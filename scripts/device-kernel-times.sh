#!/usr/bin/env bash
# The device time of every kernel in a window of a run, by kernel name, on a machine with an
# NVIDIA GPU (Nsight Compute's `ncu`): where a decode step's time goes without the event nodes
# of TERN_CUDA_PROFILE=graph, and, set against the step's wall time, how much of it lies between
# kernels (launch gaps, ramps and tails) rather than in them.
#   scripts/device-kernel-times.sh NAME SKIP COUNT COMMAND...
# times launches SKIP .. SKIP + COUNT - 1 of COMMAND (every kernel, each alone, caches kept
# warm and clocks as the GPU runs them: the durations of a replayed step, not of a cold one) and
# writes NAME.csv (one row per launch) and NAME.txt (per kernel: launches, total and mean µs,
# share; then the sum) under $OUT, or /tmp/tern-profile where $OUT is not set. Example, the
# decode steps of Qwen3.5-0.8B after a 16-token prompt (DIR: the carried binaries):
#   scripts/device-kernel-times.sh decode-0.8b 3000 2000 DIR/tern bench generate --model M \
#     --device cuda --dtype bf16 --prompt-tokens 16 --gen-tokens 64 --iters 1
set -euo pipefail
name=${1:?usage: scripts/device-kernel-times.sh NAME SKIP COUNT COMMAND...}
skip=${2:?launches to skip}
count=${3:?launches to time}
shift 3
[ $# -gt 0 ] || { echo "device-kernel-times.sh: no command to run" >&2; exit 2; }
. "$(dirname "$0")/device-env.sh"
tern_ncu device-kernel-times.sh
"$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
  -s "$skip" -c "$count" --csv --page raw "$@" > "$out/$name.raw" 2> "$out/$name.run.log" || {
  echo "device-kernel-times.sh: ncu failed; the tail of its log:" >&2
  tail -20 "$out/$name.run.log" >&2
  exit 1
}
python3 - "$out/$name.raw" "$out/$name.csv" "$out/$name.txt" <<'EOF'
import csv, sys
from collections import defaultdict
raw, csv_out, txt_out = sys.argv[1:4]
# ncu's CSV comes after the program's own output: from its header line on.
lines = open(raw, encoding="utf-8", errors="replace").read().splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
if start is None:
    sys.exit("device-kernel-times.sh: no ncu table in the output (no kernel in the window?)")
rows = list(csv.DictReader(lines[start:]))
# The second line of a raw page holds the units.
unit = rows[0].get("gpu__time_duration.sum", "") if rows else ""
rows = [r for r in rows if r.get("ID", "").strip().isdigit()]
scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit.strip(), 1e-3)
per = defaultdict(lambda: [0, 0.0])
with open(csv_out, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["id", "kernel", "us"])
    for r in rows:
        us = float(r["gpu__time_duration.sum"].replace(",", "")) * scale
        name = r.get("Kernel Name", "?")
        w.writerow([r["ID"], name, f"{us:.3f}"])
        per[name][0] += 1
        per[name][1] += us
total = sum(v[1] for v in per.values())
with open(txt_out, "w") as f:
    f.write(f"{'kernel':<48} {'launches':>8} {'total us':>10} {'mean us':>9} {'share':>6}\n")
    for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        f.write(f"{name[:48]:<48} {n:>8} {us:>10.1f} {us / n:>9.2f} {us / total:>6.1%}\n")
    f.write(f"{'all':<48} {sum(v[0] for v in per.values()):>8} {total:>10.1f}\n")
print(open(txt_out).read())
EOF
echo "device-kernel-times.sh: $out/$name.txt, $out/$name.csv"
