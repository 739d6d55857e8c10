"""Where a kernel's warps stall, by source line: reads the per-line CSV that
scripts/device-profile.sh exports (NAME-source.csv, from a run with TERN_CUDA_LINEINFO=1) and
prints the lines with the most stall samples, each with its top stall reasons and its text.

    python3 scripts/ncu_lines.py NAME-source.csv FILE... [--top N]

FILEs are the kernel module's sources in the order its KernelSource joins them (e.g.
src/kernels/gated_delta/cuda/common.cuh src/kernels/gated_delta/cuda/chunked_tc.cu); NVRTC
numbers lines of src/cuda/launch.cuh, a newline, then those files joined by newlines, and the
script rebuilds that text to show each line."""
import collections
import csv
import sys
from pathlib import Path

args = sys.argv[1:]
top = 25
if "--top" in args:
    i = args.index("--top")
    top = int(args[i + 1])
    del args[i:i + 2]
if len(args) < 2:
    sys.exit(__doc__)
root = Path(__file__).resolve().parent.parent
text = (root / "src/cuda/launch.cuh").read_text() + "\n" + "\n".join(Path(f).read_text() for f in args[1:])
lines = text.split("\n")

rows = list(csv.reader(open(args[0])))
header = next(i for i, r in enumerate(rows) if r and r[0] == "Line No")
col = {h: i for i, h in enumerate(rows[header])}
reasons = [h for h in rows[header] if h.startswith("stall_") and "Not Issued" not in h]
samples, by_reason, total_by_reason = collections.Counter(), collections.defaultdict(collections.Counter), collections.Counter()
for r in rows[header + 1:]:
    if not r or not r[0]:
        continue  # a SASS row under its source line
    line = int(r[0])
    samples[line] += int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
    for h in reasons:
        try:
            v = float(r[col[h]])
        except ValueError:
            continue
        by_reason[line][h] += v
        total_by_reason[h] += v
total = sum(samples.values()) or 1
print(f"{total} stall samples; by reason: " + ", ".join(f"{k[6:]} {v / total:.0%}" for k, v in total_by_reason.most_common(8)))
for line, n in samples.most_common(top):
    why = ", ".join(f"{k[6:]} {v / n:.0%}" for k, v in by_reason[line].most_common(3)) if n else ""
    src = lines[line - 1].strip() if 0 < line <= len(lines) else "?"
    print(f"{line:6d} {n / total:6.1%}  {why:44s} | {src[:100]}")
