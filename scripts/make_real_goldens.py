#!/usr/bin/env python3
"""Real-weights goldens: EmbeddingGemma 300M through sentence-transformers on real text.

    python scripts/make_real_goldens.py MODEL_DIR [OUT_DIR]   (default tests/fixtures/egemma300m-real)

The texts are real sentences and documents already on a Debian machine, chosen by fixed rules
(sorted file lists, no randomness), so the corpus is reproducible: translated interface messages
from the system's gettext catalogs (many languages and scripts), and paragraphs and long runs of
the license texts in /usr/share/common-licenses, a few longer than the model's 2048-token limit
so that truncation is exercised. Writes texts.jsonl and expected.json (token ids as
sentence-transformers feeds them to the model, and `encode` outputs) for: every text without a
prompt, every prompt name, and each Matryoshka size the model card lists (512, 256, 128).
"""
import gettext
import glob
import json
import os
import sys
import time

import torch
import transformers
import sentence_transformers
from sentence_transformers import SentenceTransformer

MODEL = sys.argv[1]
OUT = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "egemma300m-real")
LANGS = ["de", "fr", "es", "ru", "zh_CN", "ja", "ar", "hi", "ko", "pt_BR", "it", "pl", "tr", "uk", "vi", "el", "he", "th"]
CATALOGS = ["glib20.mo", "gdk-pixbuf.mo", "at-spi2-core.mo", "gsettings-desktop-schemas.mo"]
LICENSES = ["Apache-2.0", "GPL-3", "LGPL-2.1", "MPL-2.0", "GFDL-1.3", "Artistic", "GPL-2"]

torch.set_num_threads(2)
st = SentenceTransformer(MODEL, device="cpu", model_kwargs={"dtype": torch.float32})
st.eval()
tok = st.tokenizer
ntok = lambda t: len(tok(t)["input_ids"])


def messages(lang):
    """(msgid, msgstr) pairs of a language's catalogs, sorted, with real sentences only."""
    pairs = {}
    for cat in CATALOGS:
        path = f"/usr/share/locale/{lang}/LC_MESSAGES/{cat}"
        if not os.path.exists(path):
            continue
        with open(path, "rb") as f:
            tr = gettext.GNUTranslations(f)
        for k, v in tr._catalog.items():
            if isinstance(k, str) and k and isinstance(v, str) and "%" not in k and "\n" not in v:
                if len(k.split()) >= 4 and v != k:
                    pairs[k] = v
    return sorted(pairs.items())


texts = []
# Short: 8 translations per language and 30 English originals.
english = set()
for lang in LANGS:
    for k, v in messages(lang)[:: 7][:8]:
        texts.append(v)
        english.add(k)
texts += sorted(english)[:30]
texts += ["", "  \t  ", "ok 👍 — déjà vu, naïve café", "CO₂ ≥ 400 ppm; ΔT = 1.5 °C"]
n_short = len(texts)

# Medium: license paragraphs of 100-400 tokens, then translated catalogs run together.
paragraphs = []
for lic in LICENSES:
    body = open(f"/usr/share/common-licenses/{lic}", encoding="utf-8").read()
    paragraphs += [" ".join(p.split()) for p in body.split("\n\n") if p.strip()]
medium = [p for p in paragraphs if 100 <= ntok(p) <= 400]
texts += medium[:45]
for lang in LANGS[:10]:
    run, msgs = "", messages(lang)
    for _, v in msgs:
        if ntok(run + " " + v) > 300:
            break
        run = (run + " " + v).strip()
    texts.append(run)

# Long: consecutive license paragraphs joined up to 800-2000 tokens; then three whole licenses
# (several thousand tokens each) that the 2048-token limit cuts.
cur = ""
long_docs = []
for p in paragraphs:
    cur = (cur + "\n\n" + p).strip()
    n = ntok(cur)
    if n >= 800:
        if n <= 2000:
            long_docs.append(cur)
        cur = ""
texts += long_docs[::2][:15]
for lic in ["GPL-3", "GFDL-1.3", "Apache-2.0"]:
    texts.append(open(f"/usr/share/common-licenses/{lic}", encoding="utf-8").read())

counts = [ntok(t) for t in texts]
os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "texts.jsonl"), "w", encoding="utf-8") as f:
    for t in texts:
        f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")


def encode(indices, prompt_name=None, dims=None):
    batch = [texts[i] for i in indices]
    prompt = st.prompts[prompt_name] if prompt_name else ""
    features = st.tokenize([prompt + t for t in batch])
    ids = [[int(i) for i, m in zip(row, mask) if m] for row, mask in
           zip(features["input_ids"].tolist(), features["attention_mask"].tolist())]
    emb = st.encode(batch, prompt_name=prompt_name, truncate_dim=dims, normalize_embeddings=True,
                    batch_size=8, convert_to_numpy=True)
    return {"prompt_name": prompt_name, "dims": dims,
            "items": [{"index": i, "token_ids": t, "embedding": [float(f"{x:.8g}") for x in e]}
                      for i, t, e in zip(indices, ids, emb)]}


t0 = time.time()
short = list(range(n_short))
cases = [encode(list(range(len(texts))))]
for name in sorted(st.prompts):
    cases.append(encode(short[:: max(1, n_short // 5)][:5], prompt_name=name))
for d in (512, 256, 128):
    cases.append(encode(short[:10] + list(range(n_short, n_short + 10)), dims=d))
with open(os.path.join(OUT, "expected.json"), "w") as f:
    json.dump({"model": "embeddinggemma-300m", "max_seq_length": st.max_seq_length,
               "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                            "sentence_transformers": sentence_transformers.__version__},
               "cases": cases}, f)
print(f"{len(texts)} texts ({n_short} short, {len(medium[:45]) + 10} medium, "
      f"{len(long_docs[::2][:15])} long, 3 over the limit); tokens {min(counts)}..{max(counts)}; "
      f"{sum(len(c['items']) for c in cases)} embeddings in {time.time() - t0:.0f} s")
