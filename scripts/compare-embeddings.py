#!/usr/bin/env python3
"""Compares two `tern embed` JSONL outputs vector by vector and fails below a cosine bound.

    compare-embeddings.py WANT.jsonl GOT.jsonl MIN_COSINE LABEL

Prints the worst cosine and largest |difference|; exits 1 when the files hold different counts
or dimensions, or a pair's cosine is under MIN_COSINE.
"""

import json
import math
import sys


def load(path):
    with open(path) as f:
        return [json.loads(line)["embedding"] for line in f if line.strip()]


def main():
    if len(sys.argv) != 5:
        sys.exit("usage: compare-embeddings.py WANT.jsonl GOT.jsonl MIN_COSINE LABEL")
    want, got, bound, label = load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    if not want or len(want) != len(got) or any(len(a) != len(b) for a, b in zip(want, got)):
        sys.exit(f"{label}: {len(got)} vectors against {len(want)}, or dimensions differ")
    worst, diff = 1.0, 0.0
    for a, b in zip(want, got):
        dot = sum(x * y for x, y in zip(a, b))
        worst = min(worst, dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b)))
        diff = max(diff, max(abs(x - y) for x, y in zip(a, b)))
    print(f"{label}: {len(got)} vectors, worst cosine {worst:.9f} (bound {bound}), max |diff| {diff:.2e}")
    if not worst >= bound:
        sys.exit(1)


if __name__ == "__main__":
    main()
