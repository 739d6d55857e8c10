#!/usr/bin/env python3
"""`tern serve` through the official `openai` client: every endpoint, streaming included, with
results equal to the CLI's for the same inputs; malformed requests get their 4xx and the server
keeps serving; a bounded load test (concurrent embedding requests and streams) where every
answer is checked, nothing is lost and memory returns to its baseline.

Run by tests/server.rs, which starts the servers and passes their addresses:

    python openai_client.py --base-url URL --busy-url URL --tern BIN --embed-model M --chat-model M
                            --server-pid PID [--report FILE]
"""
import argparse
import asyncio
import base64
import json
import math
import statistics
import struct
import subprocess
import time
import urllib.error
import urllib.request

import openai
from openai import AsyncOpenAI, OpenAI

TEXTS = ["The Arctic tern migrates from pole to pole.", "What do terns eat?", "", "Ünïcödé 我们 😀 text",
         "A longer document about seabirds and their colonies."]


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def max_abs(a, b):
    check(len(a) == len(b), f"lengths {len(a)} != {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b))


def cli(args, tern):
    out = subprocess.run([tern] + args, capture_output=True, text=True)
    check(out.returncode == 0, f"tern {' '.join(args)}: {out.stderr}")
    return out.stdout


def cli_embeddings(tern, model, texts, extra=()):
    lines = cli(["embed", "--model", model, *extra, "--", *texts], tern).splitlines()
    return [json.loads(l)["embedding"] for l in lines]


def cli_generate(tern, model, prompt, max_tokens, chat):
    args = ["generate", "--model", model, "--prompt", prompt, "--temperature", "0", "--max-tokens", str(max_tokens), "--json"]
    if chat:
        args.append("--chat-template")
    return json.loads(cli(args, tern))


def raw(base, method, path, body=None, content_type="application/json"):
    """A request outside the client: returns (status, parsed JSON or text)."""
    data = body if isinstance(body, (bytes, type(None))) else body.encode()
    req = urllib.request.Request(base + path, data=data, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def metric(base, name):
    _, text = raw(base, "GET", "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise SystemExit(f"FAILED: metric {name} missing")


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_endpoints(client, a):
    models = [m.id for m in client.models.list().data]
    check(a.embed_model in models and a.chat_model in models, f"models {models}")

    # Embeddings: the CLI's vectors, for a list, a single string, Matryoshka and a prompt name.
    want = cli_embeddings(a.tern, a.embed_model, TEXTS)
    r = client.embeddings.create(model=a.embed_model, input=TEXTS)
    check([d.index for d in r.data] == list(range(len(TEXTS))), "embedding indices")
    for d, w in zip(r.data, want):
        check(max_abs(d.embedding, w) <= 1e-6, f"embedding {d.index} differs from the CLI")
    check(r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens, "embedding usage")
    one = client.embeddings.create(model=a.embed_model, input=TEXTS[1])
    check(max_abs(one.data[0].embedding, want[1]) <= 1e-6, "single-string input differs from its batch")
    small = client.embeddings.create(model=a.embed_model, input=TEXTS, dimensions=16)
    want16 = cli_embeddings(a.tern, a.embed_model, TEXTS, ["--dimensions", "16"])
    for d, w in zip(small.data, want16):
        check(len(d.embedding) == 16 and max_abs(d.embedding, w) <= 1e-6, "dimensions=16")
        check(abs(math.sqrt(sum(x * x for x in d.embedding)) - 1) < 1e-5, "Matryoshka re-normalised")
    q = client.embeddings.create(model=a.embed_model, input=TEXTS[:2], extra_body={"prompt_name": "query"})
    wq = cli_embeddings(a.tern, a.embed_model, TEXTS[:2], ["--prompt-name", "query"])
    for d, w in zip(q.data, wq):
        check(max_abs(d.embedding, w) <= 1e-6, "prompt_name=query")
    # base64: little-endian f32, the same numbers. (The client decodes base64 itself unless
    # asked for it explicitly, so read the raw body.)
    status, body = raw(a.base_url, "POST", "/v1/embeddings", json.dumps({"model": a.embed_model, "input": TEXTS[:2], "encoding_format": "base64"}))
    check(status == 200, f"base64 status {status}")
    for d, w in zip(body["data"], want[:2]):
        raw_bytes = base64.b64decode(d["embedding"])
        v = list(struct.unpack(f"<{len(raw_bytes) // 4}f", raw_bytes))
        check(max_abs(v, w) <= 1e-6, "base64 embedding")
    ids = client.embeddings.create(model=a.embed_model, input=[[2, 100, 200, 1], [2, 5, 1]])
    ids2 = client.embeddings.create(model=a.embed_model, input=[2, 5, 1])
    check(ids.usage.prompt_tokens == 7 and max_abs(ids.data[1].embedding, ids2.data[0].embedding) <= 1e-6, "token-id inputs")

    # Chat: the CLI's greedy text; streaming gives the same text; usage when asked for.
    chat_want = cli_generate(a.tern, a.chat_model, "Hi there!", 12, chat=True)
    msgs = [{"role": "user", "content": "Hi there!"}]
    c = client.chat.completions.create(model=a.chat_model, messages=msgs, max_tokens=12, temperature=0)
    check(c.choices[0].message.content == chat_want["text"], f"chat text {c.choices[0].message.content!r} != {chat_want['text']!r}")
    check(c.choices[0].finish_reason == chat_want["finish_reason"], "chat finish_reason")
    check(c.usage.completion_tokens == len(chat_want["generated_ids"]) and c.usage.prompt_tokens == len(chat_want["prompt_ids"]), "chat usage")
    parts, usage, finish = [], None, None
    for chunk in client.chat.completions.create(model=a.chat_model, messages=msgs, max_tokens=12, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                parts.append(ch.delta.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    check("".join(parts) == chat_want["text"], "streamed chat text")
    check(finish == chat_want["finish_reason"] and usage is not None and usage.completion_tokens == c.usage.completion_tokens, "stream finish and usage")
    # Seeded sampling repeats; a stop string cuts.
    s1 = client.chat.completions.create(model=a.chat_model, messages=msgs, max_tokens=16, temperature=1.0, top_p=1.0, seed=5)
    s2 = client.chat.completions.create(model=a.chat_model, messages=msgs, max_tokens=16, temperature=1.0, top_p=1.0, seed=5)
    check(s1.choices[0].message.content == s2.choices[0].message.content, "seeded sampling")
    text = chat_want["text"]
    if len(text) > 6:
        stop = text[len(text) // 2:len(text) // 2 + 2]
        cut = client.chat.completions.create(model=a.chat_model, messages=msgs, max_tokens=12, temperature=0, stop=[stop])
        check(cut.choices[0].message.content == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop", "stop string")

    # Completions: raw prompt, the CLI's text, streamed and not.
    comp_want = cli_generate(a.tern, a.chat_model, "The model reads a prompt.", 10, chat=False)
    t = client.completions.create(model=a.chat_model, prompt="The model reads a prompt.", max_tokens=10, temperature=0)
    check(t.choices[0].text == comp_want["text"] and t.choices[0].finish_reason == comp_want["finish_reason"], "completion text")
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=a.chat_model, prompt="The model reads a prompt.", max_tokens=10, temperature=0, stream=True) if ch.choices)
    check(streamed == comp_want["text"], "streamed completion")
    print("endpoints: ok (embeddings float/base64/dimensions/prompt_name/ids, chat and completions, streamed, seeded, stop)")


def test_malformed(a):
    base = a.base_url
    cases = [
        ("truncated JSON", "/v1/embeddings", '{"model": "x", "input": ["a"', 400, "invalid_json"),
        ("not JSON", "/v1/chat/completions", "hello", 400, "invalid_json"),
        ("JSON array body", "/v1/embeddings", "[1, 2]", 400, "invalid_json"),
        ("invalid UTF-8", "/v1/embeddings", b'{"model": "\xff\xfe", "input": "a"}', 400, "invalid_utf8"),
        ("input of wrong type", "/v1/embeddings", json.dumps({"model": a.embed_model, "input": 5}), 400, "invalid_input"),
        ("mixed input list", "/v1/embeddings", json.dumps({"model": a.embed_model, "input": ["a", 3]}), 400, "invalid_input"),
        ("empty input list", "/v1/embeddings", json.dumps({"model": a.embed_model, "input": []}), 400, "invalid_input"),
        ("bad dimensions", "/v1/embeddings", json.dumps({"model": a.embed_model, "input": "a", "dimensions": -3}), 400, "invalid_value"),
        ("too many dimensions", "/v1/embeddings", json.dumps({"model": a.embed_model, "input": "a", "dimensions": 100000}), 400, "invalid_value"),
        ("bad encoding", "/v1/embeddings", json.dumps({"model": a.embed_model, "input": "a", "encoding_format": "hex"}), 400, "invalid_value"),
        ("id out of vocabulary", "/v1/embeddings", json.dumps({"model": a.embed_model, "input": [[2, 99999999]]}), 400, "invalid_input"),
        ("model missing", "/v1/embeddings", json.dumps({"input": "a"}), 400, "missing_field"),
        ("model of wrong type", "/v1/embeddings", json.dumps({"model": 7, "input": "a"}), 400, "invalid_type"),
        ("unknown model", "/v1/embeddings", json.dumps({"model": "nope/nope", "input": "a"}), 404, "model_not_found"),
        ("chat model for embeddings", "/v1/embeddings", json.dumps({"model": a.chat_model, "input": "a"}), 400, "wrong_model_kind"),
        ("messages of wrong type", "/v1/chat/completions", json.dumps({"model": a.chat_model, "messages": "hi"}), 400, "invalid_type"),
        ("message without role", "/v1/chat/completions", json.dumps({"model": a.chat_model, "messages": [{"content": "x"}]}), 400, "invalid_input"),
        ("negative max_tokens", "/v1/chat/completions", json.dumps({"model": a.chat_model, "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}), 400, "invalid_value"),
        ("temperature as a string", "/v1/chat/completions", json.dumps({"model": a.chat_model, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), 400, "invalid_type"),
        ("top_p out of range", "/v1/completions", json.dumps({"model": a.chat_model, "prompt": "x", "top_p": 7}), 400, "invalid_value"),
        ("ignore_eos of wrong type", "/v1/completions", json.dumps({"model": a.chat_model, "prompt": "x", "ignore_eos": "yes"}), 400, "invalid_type"),
        ("n > 1", "/v1/completions", json.dumps({"model": a.chat_model, "prompt": "x", "n": 3}), 400, "invalid_value"),
        ("prompt id out of vocabulary", "/v1/completions", json.dumps({"model": a.chat_model, "prompt": [1, 10 ** 6]}), 400, "invalid_input"),
        ("prompt over the context", "/v1/completions", json.dumps({"model": a.chat_model, "prompt": [5] * 5000}), 400, "invalid_input"),
        ("huge string", "/v1/embeddings", json.dumps({"model": a.embed_model, "input": "x" * (9 << 20)}), 413, "request_too_large"),
        ("unknown endpoint", "/v1/nothing", "{}", 404, "unknown_endpoint"),
    ]
    for what, path, body, status, code in cases:
        got, answer = raw(base, "POST", path, body)
        check(got == status, f"{what}: status {got}, expected {status}: {answer}")
        check(isinstance(answer, dict) and set(answer.get("error", {})) >= {"message", "type", "code"}, f"{what}: error body {answer}")
        check(answer["error"]["code"] == code, f"{what}: code {answer['error']['code']}, expected {code}")
        status_h, _ = raw(base, "GET", "/health")
        check(status_h == 200, f"after {what}: /health {status_h}")
    print(f"malformed requests: {len(cases)} cases, each its 4xx, server still healthy")


def test_backpressure_and_disconnect(a):
    """The busy server allows one request at a time: a stream holds the slot, so another request
    gets 429 at once; closing the stream frees the slot and its sequence."""
    client = OpenAI(base_url=a.busy_url + "/v1", api_key="none", max_retries=0)
    # ignore_eos: the tiny random model may sample an end of turn within a few tokens, which
    # would free the slot before the second request arrives.
    stream = client.chat.completions.create(model=a.chat_model, messages=[{"role": "user", "content": "go"}], max_tokens=3000,
                                            temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    next(it)
    t = time.time()
    try:
        client.embeddings.create(model=a.embed_model, input="a")
        raise SystemExit("FAILED: a request beyond --max-concurrent-requests was served")
    except openai.RateLimitError as e:
        check(e.status_code == 429 and e.body["code"] == "server_busy", f"429 body {e.body}")
    check(time.time() - t < 2.0, "the 429 came at once")
    stream.close()
    deadline = time.time() + 10
    while metric(a.busy_url, "tern_requests_in_flight") != 0:
        check(time.time() < deadline, "the closed stream still holds its slot")
        time.sleep(0.05)
    # The round under way when the client left may still finish and count its one token (the
    # slot is freed by the request's end, the sequence at the scheduler's next round); a
    # scheduler that kept decoding would count a token every few milliseconds.
    before = metric(a.busy_url, "tern_completion_tokens_total")
    time.sleep(0.5)
    after = metric(a.busy_url, "tern_completion_tokens_total")
    check(after - before <= 1, f"the scheduler kept decoding for a gone client ({after - before} tokens in 0.5 s)")
    r = client.embeddings.create(model=a.embed_model, input="a")
    check(len(r.data) == 1, "served after the slot was freed")
    print("backpressure: 429 at the limit at once; a closed stream frees its slot and sequence")


async def load_test(a, report):
    """500 concurrent embedding requests and 50 concurrent chat streams, every answer checked."""
    client = AsyncOpenAI(base_url=a.base_url + "/v1", api_key="none", max_retries=30)
    sync = OpenAI(base_url=a.base_url + "/v1", api_key="none")
    reference = [d.embedding for d in sync.embeddings.create(model=a.embed_model, input=TEXTS).data]
    msgs = [{"role": "user", "content": "Tell me about terns."}]
    chat_ref = sync.chat.completions.create(model=a.chat_model, messages=msgs, max_tokens=16, temperature=0).choices[0].message.content
    baseline = rss_bytes(a.server_pid)
    rejected_before = metric(a.base_url, "tern_requests_rejected_busy_total")
    lat_embed, lat_stream = [], []

    async def one_embedding(i):
        pick = [(i + k) % len(TEXTS) for k in range(1 + i % 3)]
        t = time.perf_counter()
        r = await client.embeddings.create(model=a.embed_model, input=[TEXTS[p] for p in pick])
        lat_embed.append(time.perf_counter() - t)
        for d, p in zip(r.data, pick):
            # Batched with other clients' inputs, the same vector.
            if max_abs(d.embedding, reference[p]) > 1e-6:
                raise SystemExit(f"FAILED: embedding of text {p} changed under load")
        return len(pick)

    async def one_stream(i):
        t = time.perf_counter()
        parts = []
        s = await client.chat.completions.create(model=a.chat_model, messages=msgs, max_tokens=16, temperature=0, stream=True)
        async for chunk in s:
            for ch in chunk.choices:
                if ch.delta.content:
                    parts.append(ch.delta.content)
        lat_stream.append(time.perf_counter() - t)
        if "".join(parts) != chat_ref:
            raise SystemExit(f"FAILED: stream {i} text changed under load")
        return 1

    t0 = time.perf_counter()
    results = await asyncio.wait_for(asyncio.gather(*[one_embedding(i) for i in range(500)], *[one_stream(i) for i in range(50)]), timeout=600)
    wall = time.perf_counter() - t0
    check(len(results) == 550, "every request answered")
    await client.close()
    time.sleep(0.5)
    after = rss_bytes(a.server_pid)
    rejected = metric(a.base_url, "tern_requests_rejected_busy_total") - rejected_before
    check(metric(a.base_url, "tern_requests_in_flight") == 0, "requests still in flight after the load")
    q = lambda v, p: sorted(v)[min(len(v) - 1, int(p * len(v)))]
    rep = {
        "embedding_requests": 500, "embedded_texts": sum(results[:500]), "chat_streams": 50, "wall_s": round(wall, 3),
        "requests_per_s": round(550 / wall, 1),
        "embedding_latency_ms": {"p50": round(q(lat_embed, .5) * 1e3, 1), "p90": round(q(lat_embed, .9) * 1e3, 1), "p99": round(q(lat_embed, .99) * 1e3, 1)},
        "stream_latency_ms": {"p50": round(q(lat_stream, .5) * 1e3, 1), "p90": round(q(lat_stream, .9) * 1e3, 1), "p99": round(q(lat_stream, .99) * 1e3, 1)},
        "rejected_429_then_retried": int(rejected), "rss_before_mb": round(baseline / 2 ** 20, 1), "rss_after_mb": round(after / 2 ** 20, 1),
    }
    print("load test:", json.dumps(rep))
    if report:
        with open(report, "w") as f:
            json.dump(rep, f, indent=1)
    # Back to the baseline: what a load leaves behind is allocator slack, not growth per request.
    check(after <= baseline + 64 * 2 ** 20, f"RSS {after / 2**20:.1f} MB after the load, {baseline / 2**20:.1f} MB before")


def main():
    p = argparse.ArgumentParser()
    for k in ["--base-url", "--busy-url", "--tern", "--embed-model", "--chat-model"]:
        p.add_argument(k, required=True)
    p.add_argument("--server-pid", type=int, required=True)
    p.add_argument("--report")
    a = p.parse_args()
    client = OpenAI(base_url=a.base_url + "/v1", api_key="none", max_retries=0)
    test_endpoints(client, a)
    test_malformed(a)
    test_backpressure_and_disconnect(a)
    asyncio.run(load_test(a, a.report))
    print(f"openai {openai.__version__}: all server checks passed")


if __name__ == "__main__":
    main()
