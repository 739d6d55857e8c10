#!/usr/bin/env python3
"""tern against sentence-transformers (torch CPU) on the same texts, threads and machine, in one run.

    python scripts/bench_embed_peers.py MODEL_DIR [--threads 2] [--iters 3]

Documents: 32 texts of ~128 tokens, built deterministically from the license texts on the machine
(the same file is handed to both engines). Query: one short query. Reports tokens/s for the batch,
the median single-query latency, and the ratios. Needs the environment of golden-env.sh and a
release build of tern (target/release/tern, or $TERN_BIN).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--iters", type=int, default=3)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--doc-tokens", type=int, default=128)
args = ap.parse_args()

import torch
from sentence_transformers import SentenceTransformer

torch.set_num_threads(args.threads)
st = SentenceTransformer(args.model, device="cpu", model_kwargs={"dtype": torch.float32})
tok = st.tokenizer

words = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read().split()
docs, i = [], 0
while len(docs) < args.batch:
    n = args.doc_tokens * 2 // 3
    while True:
        text = " ".join(words[i:i + n])
        if len(tok(text)["input_ids"]) >= args.doc_tokens or i + n >= len(words):
            break
        n += 4
    docs.append(text)
    i += n
query = "what do terns eat?"
n_tokens = sum(len(tok(d)["input_ids"]) for d in docs)

def best_of(fn, iters):
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return statistics.median(times)

st_batch = best_of(lambda: st.encode(docs, batch_size=args.batch, normalize_embeddings=True), args.iters)
st_query = best_of(lambda: st.encode([query], normalize_embeddings=True), args.iters * 10)

with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
    f.write("\n".join(docs) + "\n")
    docs_path = f.name
tern = os.environ.get("TERN_BIN") or os.path.join(os.path.dirname(__file__), "..", "target", "release", "tern")
out = subprocess.run([tern, "bench", "embed", "--model", args.model, "--threads", str(args.threads),
                      "--batch", str(args.batch), "--iters", str(args.iters), "--input", docs_path],
                     check=True, capture_output=True, text=True).stdout
os.unlink(docs_path)
t = json.loads(out.strip().splitlines()[-1])
assert t["batch_tokens"] == n_tokens, (t["batch_tokens"], n_tokens)

report = {
    "machine": {"cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
                "cores": os.cpu_count()},
    "threads": args.threads, "batch": args.batch, "batch_tokens": n_tokens,
    "st_tokens_per_s": n_tokens / st_batch, "tern_tokens_per_s": t["tokens_per_s"],
    "batch_ratio": t["tokens_per_s"] / (n_tokens / st_batch),
    "st_query_ms": st_query * 1e3, "tern_query_ms": t["query_latency_ms"],
    "query_ratio": st_query * 1e3 / t["query_latency_ms"],
    "tern_peak_rss_over_weights": t["peak_rss_over_weights"],
    "versions": {"torch": torch.__version__, "sentence_transformers": sys.modules["sentence_transformers"].__version__},
}
print(json.dumps(report, indent=1))
