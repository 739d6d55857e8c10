#!/usr/bin/env python3
"""Throughput of `tern serve` under concurrent clients: embedding requests batched across
clients, and chat streams decoded together (one forward pass per round for all sequences).

    python scripts/bench_serve.py --tern target/release/tern --embed-model DIR --chat-model FILE.gguf \
        [--threads 2] [--embed-requests 128] [--gen-tokens 32]

Needs the `openai` client (the Python of scripts/test.sh's client environment). Prints one JSON
object per measurement: concurrency, requests/s, tokens/s, latency percentiles, and the mean
batch size the server reports in /metrics.
"""
import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request

from openai import AsyncOpenAI

WORDS = ("the tern is a seabird that migrates between polar regions every year covering more distance than any "
         "other animal researchers track flights with small geolocators").split()


def document(i, words):
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words))


def metrics(base):
    with urllib.request.urlopen(base + "/metrics") as r:
        out = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))]


async def run_embeddings(client, model, n, concurrency, words):
    sem = asyncio.Semaphore(concurrency)
    lat = []
    tokens = 0

    async def one(i):
        nonlocal tokens
        async with sem:
            t = time.perf_counter()
            r = await client.embeddings.create(model=model, input=document(i, words))
            lat.append(time.perf_counter() - t)
            tokens += r.usage.prompt_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(n)])
    wall = time.perf_counter() - t0
    return {"requests_per_s": n / wall, "tokens_per_s": tokens / wall, "p50_ms": pct(lat, .5) * 1e3, "p99_ms": pct(lat, .99) * 1e3}


async def run_streams(client, model, concurrency, gen_tokens):
    lat, produced = [], 0

    async def one(i):
        nonlocal produced
        t = time.perf_counter()
        s = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Tell me about terns, part {i}."}],
                                                 max_tokens=gen_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
        async for chunk in s:
            if chunk.usage is not None:
                produced += chunk.usage.completion_tokens
        lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(concurrency)])
    wall = time.perf_counter() - t0
    return {"generated_tokens": produced, "tokens_per_s": produced / wall, "per_stream_tokens_per_s": produced / wall / concurrency,
            "p50_s": pct(lat, .5)}


async def main_async(a, base):
    client = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    await run_embeddings(client, a.embed_model, 8, 4, a.doc_words)  # warm-up
    for c in (1, 16, 64):
        before = metrics(base)
        r = await run_embeddings(client, a.embed_model, a.embed_requests, c, a.doc_words)
        after = metrics(base)
        batches = after["tern_embedding_batch_sequences_count"] - before["tern_embedding_batch_sequences_count"]
        seqs = after["tern_embedding_batch_sequences_sum"] - before["tern_embedding_batch_sequences_sum"]
        print(json.dumps({"what": "embeddings", "concurrency": c, "requests": a.embed_requests, **{k: round(v, 2) for k, v in r.items()},
                          "mean_batch_sequences": round(seqs / max(batches, 1), 2)}), flush=True)
    await run_streams(client, a.chat_model, 1, 4)  # warm-up
    for c in (1, 4, 8):
        before = metrics(base)
        r = await run_streams(client, a.chat_model, c, a.gen_tokens)
        after = metrics(base)
        rounds = after["tern_decode_batch_sequences_count"] - before["tern_decode_batch_sequences_count"]
        seqs = after["tern_decode_batch_sequences_sum"] - before["tern_decode_batch_sequences_sum"]
        print(json.dumps({"what": "chat streams", "concurrency": c, "gen_tokens": a.gen_tokens, **{k: round(v, 2) for k, v in r.items()},
                          "mean_decode_batch": round(seqs / max(rounds, 1), 2)}), flush=True)
    await client.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tern", required=True)
    p.add_argument("--embed-model", required=True)
    p.add_argument("--chat-model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--embed-requests", type=int, default=128)
    p.add_argument("--doc-words", type=int, default=100)
    p.add_argument("--gen-tokens", type=int, default=32)
    a = p.parse_args()
    srv = subprocess.Popen([a.tern, "serve", "--port", "0", "--threads", str(a.threads), "--model", a.embed_model, "--model", a.chat_model,
                            "--max-concurrent-requests", "1024"], stderr=subprocess.PIPE, text=True)
    base = None
    for line in srv.stderr:
        sys.stderr.write(line)
        if "listening on " in line:
            base = line.split("listening on ")[1].split()[0]
        if line.strip().endswith("ready"):
            break
    try:
        asyncio.run(main_async(a, base))
    finally:
        srv.terminate()
        srv.wait(timeout=30)


if __name__ == "__main__":
    main()
