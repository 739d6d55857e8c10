"""The GPU embedding peers on the inputs of `tern bench embed`, in the same device call.

    python3 scripts/bench_embed_gpu_peers.py BENCH_DIR [EGEMMA2_BIN]

First writes BENCH_DIR/inputs/{docs,long}.txt: 64 documents of exactly 512 tokens and one of
8192 (counted with the model's tokenizer.json, specials included), made of common words, so tern
(`--input`), transformers (the same ids) and the egemma2 binary (the same texts) see the same
work. Then times, per model in BENCH_DIR/{eg2,eg300m}: transformers (bf16 weights, sdpa, mean
pooling, the Dense modules, L2 normalisation, vectors copied to the host) and, for eg2, the
egemma2 binary (f32 and bf16) through its Python client. One JSON line per measurement.
"""
import json
import os
import statistics
import sys
import time

import torch
from tokenizers import Tokenizer

bench = sys.argv[1]
egemma2_bin = sys.argv[2] if len(sys.argv) > 2 else None
WORDS = ("the tern is a seabird that migrates between polar regions every year covering more distance "
         "than any other animal researchers track flights with small geolocators data shows routes over "
         "oceans and coasts feeding on fish near surface colonies nest in summer light").split()
QUERY = "what do terns eat?"


def text_of(tok, n_tokens, seed):
    """Words appended until the tokenization has exactly n_tokens ids (specials included)."""
    words, state = [], seed
    while True:
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        words.append(WORDS[(state >> 33) % len(WORDS)])
        n = len(tok.encode(" ".join(words)).ids)
        if n >= n_tokens:
            while len(tok.encode(" ".join(words)).ids) > n_tokens:
                words.pop()
            return " ".join(words)


def inputs(tok_path):
    tok = Tokenizer.from_file(tok_path)
    d = os.path.join(bench, "inputs")
    os.makedirs(d, exist_ok=True)
    docs = [text_of(tok, 512, 1000 + i) for i in range(64)]
    long = [text_of(tok, 8192, 7)]
    for name, texts in [("docs", docs), ("long", long)]:
        with open(os.path.join(d, name + ".txt"), "w") as f:
            f.write("\n".join(texts) + "\n")
    counts = [len(tok.encode(t).ids) for t in docs + long]
    print(json.dumps({"inputs": d, "doc_tokens": sorted(set(counts[:-1])), "long_tokens": counts[-1]}), flush=True)
    return tok, {"query": [QUERY], "docs": docs, "long": long}


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def transformers_peer(name, tok, sets):
    import transformers
    from safetensors.torch import load_file
    d = os.path.join(bench, name)
    model = transformers.AutoModel.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    dense = []
    for sub in ("2_Dense", "3_Dense"):
        p = os.path.join(d, sub, "model.safetensors")
        if os.path.exists(p):
            dense.append(load_file(p)["linear.weight"].to("cuda", torch.bfloat16))

    def embed(texts):
        enc = [tok.encode(t).ids for t in texts]
        n = max(map(len, enc))
        ids = torch.zeros(len(enc), n, dtype=torch.long)
        mask = torch.zeros(len(enc), n, dtype=torch.long)
        for i, e in enumerate(enc):
            ids[i, :len(e)] = torch.tensor(e)
            mask[i, :len(e)] = 1
        ids, mask = ids.cuda(), mask.cuda()
        with torch.inference_mode():
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(h.dtype)
            x = (h * m).sum(1) / m.sum(1)
            for w in dense:
                x = x @ w.T
            x = torch.nn.functional.normalize(x.float(), dim=-1)
        return x.cpu()

    for kind, texts in sets.items():
        if kind == "long" and name == "eg300m":
            continue  # beyond the 300M model's 2048 positions
        reps = 50 if kind == "query" else 5
        s = timed(lambda: embed(texts), reps)
        tokens = sum(len(tok.encode(t).ids) for t in texts)
        print(json.dumps({"peer": "transformers-bf16-sdpa", "version": transformers.__version__, "model": name,
                          "workload": kind, "seconds": s, "tokens_per_s": tokens / s}), flush=True)
    del model
    torch.cuda.empty_cache()


def egemma2_peer(tok, sets):
    from egemma2 import Egemma2
    for precision in (None, "bf16"):
        try:
            with Egemma2(exe=egemma2_bin, model_dir=os.path.join(bench, "eg2"), device="cuda", precision=precision) as m:
                for kind, texts in sets.items():
                    reps = 50 if kind == "query" else 5
                    s = timed(lambda: m.embed(texts), reps)
                    tokens = sum(len(tok.encode(t).ids) for t in texts)
                    print(json.dumps({"peer": "egemma2-0.3.2", "precision": precision or "f32", "model": "eg2",
                                      "workload": kind, "seconds": s, "tokens_per_s": tokens / s}), flush=True)
        except Exception as e:  # a peer that cannot run is reported, not hidden
            print(json.dumps({"peer": "egemma2-0.3.2", "precision": precision or "f32", "error": str(e)[:500]}), flush=True)


tok, sets = inputs(os.path.join(bench, "eg2", "tokenizer.json"))
for name in ("eg300m", "eg2"):
    transformers_peer(name, tok, sets)
if egemma2_bin:
    egemma2_peer(tok, sets)
