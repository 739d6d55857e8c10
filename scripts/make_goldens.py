#!/usr/bin/env python3
"""Golden fixtures for tern's embedding tests.

Makes tiny random-weight checkpoints of both EmbeddingGemma architectures with transformers'
`save_pretrained`, wraps each in a sentence-transformers pipeline exactly as the released models
are laid out (modules.json, prompts, Pooling, Dense, Normalize), saves it, reloads it from disk
the way a user would, and records what `SentenceTransformer.encode` returns.

    python scripts/make_goldens.py [OUT_DIR]      (default tests/fixtures)

Needs the environment of ../shared/tools/golden-env.sh (torch, transformers 5.24,
sentence-transformers 6.2). Deterministic: re-running rewrites identical files.
"""
import json
import os
import shutil
import sys

import torch
import transformers
import sentence_transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")

# Short sequences keep the fixtures small, so the window is small too: every case with more
# than 9 tokens crosses it, and the longest text crosses the tokenizer limit.
SLIDING_WINDOW = 8
MAX_SEQ_LENGTH = 48
PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "STS": "task: sentence similarity | query: ",
}

TEXTS = [
    "",
    "a",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Retrieval-augmented generation pairs a retriever with a generator.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "emoji 🦀🚀 and tabs\tand  double  spaces",
    "naïve café façade — “quoted” …",
    "x" * 70,
    " leading and trailing spaces ",
    ("This sentence is repeated to make a long document that runs past the limit. " * 8).strip(),
    "Linear attention keeps a fixed-size state; full attention keeps every key.",
    "1234567890 + 987654321 = 1111111110",
]

TOKENIZER_CORPUS_FILES = ["/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/GPL-3"]


def train_tokenizer(vocab_size=480):
    """A small BPE tokenizer with Gemma's pipeline: ' ' → '▁', byte fallback, <bos> … <eos>."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    corpus = []
    for path in TOKENIZER_CORPUS_FILES:
        with open(path, encoding="utf-8") as f:
            corpus.extend(line.strip() for line in f if line.strip())
    corpus.extend(TEXTS[2:9] * 3)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    spec = json.loads(tok.to_str())
    # Byte-fallback pieces <0x00>..<0xFF> are ordinary vocabulary entries right after the
    # specials, as in Gemma's vocabulary; re-number the trained pieces after them.
    trained = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in trained:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    spec["model"]["vocab"] = vocab
    for t in spec["added_tokens"]:
        t["id"] = vocab[t["content"]]
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", pair="<bos> $A <eos> <bos> $B <eos>",
        special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])],
    )
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, len(vocab)


def write_tokenizer(tok, model_dir):
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({
            "tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": True,
            "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
            "mask_token": "<mask>", "padding_side": "right", "model_max_length": MAX_SEQ_LENGTH,
        }, f, indent=1)


def perturb_(model, seed):
    """Random weights everywhere, norms included, so that `w` versus `1 + w` matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5))
            if "embed_tokens" in name:
                p.mul_(4.0)


def egemma2_model(vocab):
    from transformers import EmbeddingGemma2TextConfig, EmbeddingGemma2TextModel

    cfg = EmbeddingGemma2TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, sliding_window=SLIDING_WINDOW, hidden_size_per_layer_input=8,
        embedding_dim=48, max_position_embeddings=512,
    )
    cfg.architectures = ["EmbeddingGemma2TextModel"]
    torch.manual_seed(0)
    model = EmbeddingGemma2TextModel(cfg).eval()
    perturb_(model, 1)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for layer in model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g))
    return model, 48, None


def egemma300m_model(vocab):
    from transformers import Gemma3TextConfig, Gemma3TextModel

    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=SLIDING_WINDOW, use_bidirectional_attention=True, max_position_embeddings=512,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"],
        hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=None, final_logit_softcapping=None,
    )
    cfg.architectures = ["Gemma3TextModel"]
    torch.manual_seed(0)
    model = Gemma3TextModel(cfg).eval()
    perturb_(model, 3)
    return model, 64, (64, 256)


def build(name, make_model, dtype):
    out_dir = os.path.join(OUT, name)
    model_dir = os.path.join(out_dir, "model")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(model_dir)
    tok, vocab = train_tokenizer()
    model, width, dense = make_model(vocab)
    model.to(dtype).save_pretrained(model_dir)
    write_tokenizer(tok, model_dir)

    modules = [Transformer(model_dir, max_seq_length=MAX_SEQ_LENGTH, model_kwargs={"dtype": torch.float32})]
    pool_dim = width if dense is None else dense[0]
    modules.append(Pooling(pool_dim, pooling_mode="mean"))
    if dense is not None:
        g = torch.Generator().manual_seed(4)
        for i, o in [(dense[0], dense[1]), (dense[1], dense[0])]:
            d = Dense(i, o, bias=False, activation_function=torch.nn.Identity())
            with torch.no_grad():
                d.linear.weight.copy_(torch.randn(o, i, generator=g) / i ** 0.5)
            d.to(dtype)
            modules.append(d)
    modules.append(Normalize())
    st = SentenceTransformer(modules=modules, prompts=PROMPTS, device="cpu")
    st.save(model_dir)
    # The pipeline was assembled on an f32 copy; the stored weight file keeps the dtype under
    # test (the Dense modules were saved in it already). The generated model card goes.
    model.to(dtype).save_pretrained(model_dir)
    os.remove(os.path.join(model_dir, "README.md"))
    # Reload from disk as a user does; f32 maths on (possibly bf16) stored weights.
    st = SentenceTransformer(model_dir, device="cpu", model_kwargs={"dtype": torch.float32})
    st.eval()
    out_width = st.get_embedding_dimension()

    def encode(texts, prompt_name=None, dims=None, batch_size=32):
        features = st.tokenize([(st.prompts[prompt_name] if prompt_name else "") + t for t in texts])
        ids = [[int(i) for i, m in zip(row, mask) if m] for row, mask in
               zip(features["input_ids"].tolist(), features["attention_mask"].tolist())]
        emb = st.encode(texts, prompt_name=prompt_name, truncate_dim=dims, normalize_embeddings=True,
                        batch_size=batch_size, convert_to_numpy=True)
        return [{"text": t, "token_ids": i, "embedding": [float(x) for x in e]} for t, i, e in zip(texts, ids, emb)]

    cases = [{"kind": "alone", "prompt_name": None, "dims": None,
              "items": [x for t in TEXTS for x in encode([t], batch_size=1)]},
             {"kind": "batch", "prompt_name": None, "dims": None, "items": encode(TEXTS)}]
    for p in PROMPTS:
        cases.append({"kind": "prompt", "prompt_name": p, "dims": None, "items": encode(TEXTS[2:6], p)})
    for d in [out_width // 2, out_width // 4, out_width // 8]:
        cases.append({"kind": "dims", "prompt_name": None, "dims": d, "items": encode(TEXTS[2:6], dims=d)})
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump({"model": name, "dtype": str(dtype).removeprefix("torch."), "dim": out_width,
                   "max_seq_length": MAX_SEQ_LENGTH, "prompts": PROMPTS,
                   "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                                "sentence_transformers": sentence_transformers.__version__},
                   "cases": cases}, f)
    print(f"{name}: dim {out_width}, {sum(len(c['items']) for c in cases)} embeddings")


def build_composite(name="egemma2-tiny-composite"):
    """The `embedding_gemma2` composite layout (text weights under `language_model.`) that a
    full EmbeddingGemma 2 release uses. sentence-transformers cannot load it without the image
    and audio processors, so the reference here is transformers itself: the composite model's
    last hidden state, mean-pooled over each text's tokens and L2-normalised, which is what the
    sentence-transformers pipeline (Transformer, mean Pooling, Normalize) computes."""
    from transformers import EmbeddingGemma2Config, EmbeddingGemma2Model

    src = os.path.join(OUT, "egemma2-tiny-f32", "model")
    out_dir = os.path.join(OUT, name)
    model_dir = os.path.join(out_dir, "model")
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.copytree(src, model_dir)
    text = transformers.AutoModel.from_pretrained(src, dtype=torch.float32).eval()
    text_cfg = text.config.to_dict()
    for k in ("architectures", "transformers_version", "dtype"):
        text_cfg.pop(k, None)
    cfg = EmbeddingGemma2Config(text_config=text_cfg)
    model = EmbeddingGemma2Model(cfg).eval()
    model.language_model.load_state_dict(text.state_dict())
    model.save_pretrained(model_dir)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.enable_truncation(MAX_SEQ_LENGTH)
    items = []
    with torch.no_grad():
        for t in TEXTS:
            ids = tok.encode(t).ids
            h = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).last_hidden_state[0]
            e = torch.nn.functional.normalize(h.mean(0), dim=0)
            items.append({"text": t, "token_ids": ids, "embedding": [float(x) for x in e]})
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump({"model": name, "dtype": "float32", "dim": len(items[0]["embedding"]),
                   "max_seq_length": MAX_SEQ_LENGTH, "prompts": PROMPTS,
                   "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
                   "cases": [{"kind": "alone", "prompt_name": None, "dims": None, "items": items}]}, f)
    print(f"{name}: {len(items)} embeddings")


if __name__ == "__main__":
    torch.set_num_threads(2)
    for dtype in (torch.float32, torch.bfloat16):
        tag = "f32" if dtype == torch.float32 else "bf16"
        build(f"egemma2-tiny-{tag}", egemma2_model, dtype)
        build(f"egemma300m-tiny-{tag}", egemma300m_model, dtype)
    build_composite()
