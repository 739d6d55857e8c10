#!/usr/bin/env python3
"""Golden data for the Qwen3.5 hybrid LLMs: tiny random checkpoints, their GGUF conversions, and
greedy generations with the logits that chose each token.

For three tiny models,

- dense-untied: qwen3_5_text (Qwen3_5ForCausalLM), untied embeddings;
- dense-tied:   the same architecture with tie_word_embeddings;
- moe:          qwen3_5_moe_text (Qwen3_5MoeForCausalLM), 8 experts, top-2, a shared expert with
                its sigmoid gate;

all with 8 layers in the released 3:1 hybrid layout (Gated DeltaNet, GDN, linear attention; every
4th layer gated full attention), this script

1. trains a small byte-level BPE tokenizer in the Qwen style (Qwen3.5's pre-tokenizer regex, NFC,
   special tokens <|endoftext|>, <|im_start|>, <|im_end|> after the base vocabulary, a Qwen-style
   chat template) on a text embedded below, so the result does not depend on the machine;
2. builds each model with fixed seeds and randomises EVERY weight, norms included (so `1 + w`
   versus `w` matters), A_log, dt_bias and the conv kernels too, at scales that keep activations
   O(1) and the logits far from ties, and saves it with transformers' `save_pretrained`;
3. for each prompt length in PROMPT_LENGTHS runs greedy generation of N_NEW tokens in float32 on
   the CPU, twice: `model.generate(do_sample=False)` and a manual loop of cached forward calls,
   and checks that both agree (and agree with one uncached forward over the whole sequence);
   records prompt ids, generated ids and the N_NEW x vocab logits that chose each token;
4. converts each checkpoint with llama.cpp's own convert_hf_to_gguf.py (through
   ../shared/tools/hf-to-gguf.py) to F32, BF16 and Q8_0 GGUF files;
5. reads the GGUF files back with the `gguf` package and compares their tensors with the HF ones,
   to pin down the transforms a GGUF loader must undo (DESIGN.md section 4): ssm_a holds
   -exp(A_log), value heads reordered from grouped to tiled order, +1 baked into the RMSNorm
   weights except ssm_norm, attn_q keeping [query | gate] per head, and so on.

Layout under OUT (default tests/fixtures/qwen35):

    index.json                       configs, versions, tokenizer goldens, cases, stats, GGUF checks
    <model>/config.json, model.safetensors, generation_config.json,
            tokenizer.json, tokenizer_config.json          the HF checkpoint (save_pretrained)
    <model>/gguf/<model>-{f32,bf16,q8_0}.gguf             llama.cpp conversions
    <model>/goldens/L<n>.logits.npy                       float32 [N_NEW, vocab]: row i chose token i
    <model>/goldens/L65.prefill_logits.npy                float32 [65, vocab]: every prompt position
    <model>/goldens/L<n>.q8_0.logits.npy                  the same for the Q8_0 GGUF's weights,
                                                          dequantized, in f32 maths (own greedy ids
                                                          in index.json: Q8_0 changes the path)

index.json keys per model: config (as saved), cases[] (prompt_ids, generated_ids, logits file,
stats, q8_0), gguf[type] (file, sha256, tensor types, transform checks against the HF tensors,
round trip, metadata). Prompt ids exclude the special tokens; ids >= 600 are embedding rows past
the tokenizer (padding, like the released vocab_size 248320 > 248077 tokens) and never occur.

    python scripts/make_qwen35_goldens.py [OUT]

Needs the golden environment (../shared/tools/golden-env.sh: torch, transformers 5.24, gguf 0.19)
and llama.cpp's source (../shared/tools/llama-cpp-src.sh; LLAMA_CPP_DIR overrides). Deterministic:
fixed seeds, one CPU thread, weights rounded to values bf16 represents exactly (so the BF16 GGUF
holds the same numbers as the F32 one wherever the converter does no arithmetic).
"""
import hashlib
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys

import numpy as np
import torch

import tokenizers
import transformers
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import BPE
from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig)

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
SHARED_TOOLS = os.environ.get("TERN_SHARED_TOOLS", os.path.join(REPO, "..", "shared", "tools"))
OUT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "tests", "fixtures", "qwen35"))

PROMPT_LENGTHS = [1, 63, 64, 65, 300]  # around the 64-token chunk of the chunked GDN prefill
N_NEW = 16
PREFILL_LOGITS_LENGTH = 65  # all-position logits for one prompt: locates a divergence in prefill
GGUF_TYPES = ["f32", "bf16", "q8_0"]

# Qwen3.5's pre-tokenizer (transformers' tokenization_qwen3_5.py; differs from Qwen2's by \p{M}).
QWEN35_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
                            r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BASE_VOCAB = 597          # trained byte-level BPE tokens; the 3 specials follow: 600 in all
MODEL_VOCAB = 640         # embedding rows: padded past the tokenizer, as the released models are
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# --------------------------------------------------------------------------------------------
# Model configurations
# --------------------------------------------------------------------------------------------

COMMON = dict(
    vocab_size=MODEL_VOCAB,
    hidden_size=64,
    num_hidden_layers=8,
    # Layer i is full attention iff (i + 1) % 4 == 0: layers 3 and 7. layer_types is what
    # transformers uses; full_attention_interval is kept beside it, as released configs do, and is
    # what llama.cpp's converter reads.
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
    full_attention_interval=4,
    # Gated full attention: 4 query heads, 2 kv heads, head_dim 32; q_proj emits [query | gate]
    # per head (2 * 32 per head).
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    # GDN: 2 key heads < 4 value heads, so the grouped-vs-tiled value-head order matters.
    # Square 16 x 16 state per value head (the released models: 128 x 128); 16 rather than 32
    # keeps the fixtures small (every GDN projection scales with it).
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    # Partial NeoX RoPE over the first 32 * 0.25 = 8 dims, theta 1e7 as released. The MRoPE
    # section is scaled to the 4 rotary frequencies ([11, 11, 10] sums to the released 32); for
    # text all three position components are equal, so it reduces to plain RoPE either way.
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    max_position_embeddings=4096,
    attention_bias=False,
    use_cache=True,
)

MODELS = {
    "dense-untied": dict(cls=Qwen3_5ForCausalLM, cfg_cls=Qwen3_5TextConfig, seed=3501,
                         cfg=dict(COMMON, intermediate_size=96, tie_word_embeddings=False)),
    "dense-tied": dict(cls=Qwen3_5ForCausalLM, cfg_cls=Qwen3_5TextConfig, seed=3502,
                       cfg=dict(COMMON, intermediate_size=96, tie_word_embeddings=True)),
    # d_k = d_v = 32: the smallest state the CUDA scan takes (the others' 16 go through the
    # chunked form), so a whole-model decode on the GPU runs the fused recurrence.
    "dense-scan": dict(cls=Qwen3_5ForCausalLM, cfg_cls=Qwen3_5TextConfig, seed=3504,
                       cfg=dict(COMMON, intermediate_size=96, tie_word_embeddings=False,
                                linear_key_head_dim=32, linear_value_head_dim=32)),
    # Expert widths are multiples of 32 so every expert matrix row fills whole Q8_0 blocks.
    "moe": dict(cls=Qwen3_5MoeForCausalLM, cfg_cls=Qwen3_5MoeTextConfig, seed=3503,
                cfg=dict(COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, tie_word_embeddings=False)),
}

# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

# Training text: English prose, code, numbers, several scripts and emoji, so the ~340 merges
# cover words, indentation runs and multi-byte characters. Embedded (not read from the machine)
# so the tokenizer, and hence every id below, is the same wherever this runs.
CORPUS = r"""
The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly.
A language model reads a prompt, one token at a time, and writes the next token; the state it
keeps between tokens is a cache of keys and values for attention layers and a small recurrent
state for the linear attention layers. The model is hybrid: three linear layers, then one full
attention layer, repeated. Each linear layer keeps a matrix per head and updates it with the
delta rule, decayed by a gate that the input controls. Attention layers keep every key and value.
In the beginning the weights are random, and the output is noise; training makes it speech.
Once upon a time there was a small model that wanted to be large. It read books, and code, and
letters from far away, and it learned that the world is made of patterns that repeat and change.
We test the engine against the reference implementation: the same prompt, the same weights,
the same numbers out. If the numbers differ, the test names the layer, the head and the token.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 365 1024 2048 4096 65536 3.14159 2.71828 1e-6 1e7 -1 +1
Dates: 2026-01-15, 12:30:45, 31/12/1999. Prices: $9.99, 12.50 EUR, 100%. Email: user@example.com
def forward(self, hidden_states, cache=None):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    if self.layer_type == "linear_attention":
        hidden_states = self.linear_attn(hidden_states, cache=cache)
    else:
        hidden_states = self.self_attn(hidden_states, cache=cache)
    return residual + hidden_states

for i in range(10):
    print(f"step {i}: loss = {loss:.4f}")
	if (x > 0) {
		return x * 2;
	}
fn main() {
    let v: Vec<u32> = (0..10).map(|x| x * x).collect();
    println!("{:?}", v);
}
pub struct Model { layers: Vec<Layer>, norm: RmsNorm, lm_head: Linear }
impl Model { pub fn new() -> Self { unimplemented!() } }
SELECT name, count(*) FROM tokens WHERE id < 600 GROUP BY name ORDER BY 2 DESC;
<html><body><p class="note">Hello &amp; welcome</p></body></html>
{"role": "user", "content": "What is the capital of France?"} {"role": "assistant", "content": "Paris."}
我们今天学习语言模型。模型读入文字，然后预测下一个字。你好，世界！中文文本测试。
日本語のテキストです。こんにちは、世界。モデルは次のトークンを予測します。
한국어 텍스트입니다. 안녕하세요, 세계! 모델은 다음 토큰을 예측합니다.
Привет, мир! Модель читает текст и предсказывает следующий токен.
Γειά σου κόσμε. Καλημέρα. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया। สวัสดีชาวโลก
Café, naïve, résumé, façade, jalapeño, Straße, Ærø, Łódź, İstanbul, crème brûlée.
Emoji: 😀 😃 😄 🚀 ✨ 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵 ❤️ 🎉 🤖
Whitespace:    four spaces,		two tabs,
blank lines above and below

and a line with trailing spaces   
"""


def tokenizer_corpus():
    import codecs
    import contextlib
    import io
    # The Zen of Python, stored ROT13-encoded in the module `this` (which prints it on import):
    # the same text in every Python 3.
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401
    zen = codecs.decode(sys.modules["this"].s, "rot13")
    # Repeat so frequent pairs clearly outrank one-off pairs; order is fixed.
    return [CORPUS, zen] * 3


def build_tokenizer():
    """Byte-level BPE trained on the embedded corpus, with Qwen3.5's pipeline. The specials are
    added AFTER training so they get the last ids, as in the released vocabulary (248044..)."""
    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                        byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BASE_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    if tok.get_vocab_size() != BASE_VOCAB:
        raise SystemExit(f"tokenizer trained to {tok.get_vocab_size()} tokens, wanted {BASE_VOCAB}: corpus too small")
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def write_tokenizer(tok, model_dir, eos, pad):
    tok.save(os.path.join(model_dir, "tokenizer.json"), pretty=True)
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    cfg = {
        # TokenizersBackend: load tokenizer.json as written, rather than rebuilding a pipeline.
        "tokenizer_class": "TokenizersBackend",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")


TOKENIZER_STRINGS = [
    "", "Hello, world!", " hello  world ", "The model reads a prompt.", "def forward(self, x):\n    return x\n",
    "\tif (x > 0) {\n\t\treturn x * 2;\n\t}", "12345 3.14159 1e-6", "我们今天学习语言模型。", "こんにちは、世界。",
    "안녕하세요", "Привет, мир!", "Café naïve e\u0301", "😀 👨‍👩‍👧‍👦 🇯🇵", "   four spaces\n\n\nnewlines",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b", "<|im_start", "it's we'll THEY'RE",
    "xyzzy qwerty zxcvb", "ünïcödé ǅ ß", "trailing   ", "\r\n\r\n", "مرحبا", "नमस्ते", "∀x∈ℝ", "———",
]


def tokenizer_goldens(tok):
    return [{"text": s, "ids": tok.encode(s, add_special_tokens=False).ids} for s in TOKENIZER_STRINGS]


CHAT = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "def f(x):\n    return x"}]


def check_saved_tokenizer(model_dir, tok):
    """What transformers loads from the checkpoint must tokenize exactly like the trained
    tokenizer (the converter reads the vocabulary through AutoTokenizer too); returns the chat
    template rendered for a fixed conversation, with its ids."""
    from transformers import AutoTokenizer
    at = AutoTokenizer.from_pretrained(model_dir)
    for s in TOKENIZER_STRINGS:
        a = at.encode(s, add_special_tokens=False)
        b = tok.encode(s, add_special_tokens=False).ids
        if a != b:
            raise SystemExit(f"AutoTokenizer({model_dir}) differs on {s!r}: {a} != {b}")
    text = at.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return {"messages": CHAT, "add_generation_prompt": True, "text": text,
            "ids": tok.encode(text, add_special_tokens=False).ids}


# --------------------------------------------------------------------------------------------
# Random weights
# --------------------------------------------------------------------------------------------

def bf16_exact(t):
    """Round to the nearest bf16 value, kept in float32: the F32 and BF16 GGUF then carry the same
    numbers, so one set of goldens serves both at f32 tolerance."""
    return t.to(torch.bfloat16).to(torch.float32)


def grid(g, shape, lo, hi, step):
    """Uniform values on a grid of `step` in [lo, hi]. For norm weights: with step 2^-7, both w and
    1 + w (which the converter bakes in) are exact in bf16."""
    n_lo, n_hi = round(lo / step), round(hi / step)
    return torch.randint(n_lo, n_hi + 1, shape, generator=g, device=g.device).to(torch.float32) * step


def randomise(model, cfg, seed, n_tokens, device="cpu"):
    """Every parameter gets a value from one seeded generator, in named_parameters order.
    Scales: a linear layer's weights have std c / sqrt(fan_in), so an O(1) input gives an O(1)
    output; the residual stream stays O(1) (rms ~ 1..4 over 8 layers). `device` is where the
    generator runs (a CUDA generator draws other values from the same seed, in seconds where the
    CPU's takes minutes for a 35B model); the goldens use the CPU's."""
    g = torch.Generator(device=device).manual_seed(seed)
    H = cfg["hidden_size"]
    tied = cfg["tie_word_embeddings"]

    def normal(shape, std):
        return torch.randn(shape, generator=g, device=device) * std

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=g, device=device)

    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("embed_tokens.weight"):
            # Tied: the embedding is also the output head; logits = rms(h)(1+w) . e scale with
            # sqrt(H) * std, so std 0.4 gives logits of std ~3 like the untied head below.
            v = normal(shape, 0.4 if tied else 1.0)
        elif name == "lm_head.weight":
            v = normal(shape, 3.0 / math.sqrt(H))  # logits std ~3: top-2 gaps well above bf16/Q8_0 noise
        elif name.endswith("linear_attn.norm.weight"):
            # The GDN gated norm multiplies by w itself (no +1): keep it around 1, never near 0.
            v = grid(g, shape, 0.5, 1.5, 2 ** -7)
        elif name.endswith("norm.weight"):
            # Zero-centred (1 + w) norms: input/post-attention, q/k, final. |w| up to 0.375 makes
            # "w" instead of "1 + w" (or +1 applied twice) fail loudly.
            v = grid(g, shape, -0.375, 0.375, 2 ** -7)
        elif name.endswith("A_log"):
            # Decay g = -exp(A_log) * softplus(a + dt_bias): A from 0.02 (memory of ~100s of
            # tokens, so the state crosses the 64-token chunks) to 4 (forgets within a token).
            v = uniform(shape, math.log(0.02), math.log(4.0))
        elif name.endswith("dt_bias"):
            v = uniform(shape, -2.0, 1.0)
        elif name.endswith("conv1d.weight"):
            v = normal(shape, 0.5)  # 4 taps: output std ~1; mixed signs so tap order matters
        elif name.endswith("in_proj_a.weight"):
            v = normal(shape, 0.5 / math.sqrt(shape[1]))
        elif name.endswith("mlp.gate.weight"):
            # Router: std 2 logits keep the top-2 choice away from ties.
            v = normal(shape, 2.0 / math.sqrt(shape[1]))
        elif name.endswith("experts.gate_up_proj"):       # [E, 2 * I, H]
            v = normal(shape, 1.0 / math.sqrt(shape[2]))
        elif name.endswith("experts.down_proj"):          # [E, H, I]
            v = normal(shape, 1.0 / math.sqrt(shape[2]))
        elif name.endswith((".o_proj.weight", ".out_proj.weight", ".down_proj.weight")):
            v = normal(shape, 0.8 / math.sqrt(shape[1]))  # outputs into the residual stream
        elif p.ndim == 2:
            # q/k/v/qkv/z/b projections, MLP gate/up, shared expert, shared expert gate.
            v = normal(shape, 1.0 / math.sqrt(shape[1]))
        else:
            raise SystemExit(f"no initialisation rule for {name} {tuple(shape)}")
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            # Rows past the tokenizer (padding, as in the released 248320-row embeddings) stay
            # random but small, so greedy decoding never picks an id the tokenizer lacks.
            v[n_tokens:] *= 0.02
        with torch.no_grad():
            p.copy_(bf16_exact(v))
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------

def prompt_ids(model_name, length, n_tokens, special_ids):
    # Seeded by (model, length) so each case is independent of the others' order.
    seed = int(hashlib.sha256(f"{model_name}:{length}".encode()).hexdigest()[:8], 16)
    rng = random.Random(seed)
    allowed = [i for i in range(n_tokens) if i not in special_ids]
    return [rng.choice(allowed) for _ in range(length)]


@torch.no_grad()
def greedy_manual(model, ids):
    """Prefill once, then one cached forward per token: the loop an engine runs."""
    inp = torch.tensor([ids])
    out = model(input_ids=inp, use_cache=True)
    cache = out.cache
    logits, gen = [], []
    step_logits = out.logits[0, -1]
    for _ in range(N_NEW):
        tok = int(torch.argmax(step_logits))
        logits.append(step_logits.clone())
        gen.append(tok)
        out = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
        cache = out.cache
        step_logits = out.logits[0, -1]
    return gen, torch.stack(logits)


@torch.no_grad()
def greedy_generate(model, ids):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=N_NEW, min_new_tokens=0, eos_token_id=None,
                         pad_token_id=model.generation_config.pad_token_id, output_logits=True, return_dict_in_generate=True, top_k=None,
                         top_p=None, temperature=None)
    gen = out.sequences[0, len(ids):].tolist()
    return gen, torch.stack([l[0] for l in out.logits])


@torch.no_grad()
def full_forward_logits(model, ids, gen):
    """Logits of one uncached forward over prompt + generated tokens at the positions that chose
    each generated token: the chunked prefill path for everything, against the recurrent decode."""
    seq = torch.tensor([ids + gen])
    out = model(input_ids=seq, use_cache=False)
    return out.logits[0, len(ids) - 1:len(ids) - 1 + N_NEW]


def logit_stats(logits, gen):
    top2 = torch.topk(logits, 2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).numpy()
    runs, best = 1, 1
    for a, b in zip(gen, gen[1:]):
        runs = runs + 1 if a == b else 1
        best = max(best, runs)
    return {
        "logit_std_mean": float(logits.std(dim=-1).mean()),
        "logit_absmax": float(logits.abs().max()),
        "top2_gap_min": float(gaps.min()),
        "top2_gap_median": float(np.median(gaps)),
        "steps_gap_below_0.05": int((gaps < 0.05).sum()),
        "steps_gap_below_0.2": int((gaps < 0.2).sum()),
        "distinct_generated": len(set(gen)),
        "longest_repeat_run": best,
    }


# --------------------------------------------------------------------------------------------
# GGUF conversion and checks
# --------------------------------------------------------------------------------------------

def llama_cpp_dir():
    d = os.environ.get("LLAMA_CPP_DIR", os.path.expanduser("~/.cache/tern/llama.cpp"))
    if not os.path.isfile(os.path.join(d, "convert_hf_to_gguf.py")):
        d = subprocess.run(["bash", os.path.join(SHARED_TOOLS, "llama-cpp-src.sh")], check=True,
                           capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return d


def convert(model_dir, name, llama_dir):
    """llama.cpp's converter, unmodified in its tensor transforms. --pre qwen35: the tiny trained
    tokenizer cannot match the converter's hash table, so name the pre-tokenizer (Qwen3.5's
    regex, which this tokenizer uses). --no-mtp: the tiny models have no MTP block."""
    out_dir = os.path.join(model_dir, "gguf")
    os.makedirs(out_dir, exist_ok=True)
    files = {}
    for t in GGUF_TYPES:
        path = os.path.join(out_dir, f"{name}-{t}.gguf")
        cmd = [sys.executable, os.path.join(SHARED_TOOLS, "hf-to-gguf.py"), llama_dir, "--pre", "qwen35", model_dir,
               "--outtype", t, "--outfile", path, "--no-mtp", "--model-name", f"tern-qwen35-tiny-{name}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.stderr.write(r.stdout + r.stderr)
            raise SystemExit(f"conversion of {name} to {t} failed")
        files[t] = path
    return files


def gguf_tensors(path):
    """name -> (ggml type name, numpy shape in PyTorch order, float32 values)."""
    import gguf  # only the GGUF checks need it (a GPU machine may run randomise() alone)

    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        vals = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        out[t.name] = (t.tensor_type.name, shape, vals)
    return reader, out


def gguf_metadata(reader):
    """Every key with its value; the long token tables only by length (tokenizer.json has them)."""
    meta = {}
    for key, field in reader.fields.items():
        v = field.contents()
        if isinstance(v, list) and len(v) > 16:
            v = f"<array of {len(v)}>"
        elif isinstance(v, str) and len(v) > 200:
            v = v[:200] + "..."
        meta[key] = v
    return meta


def tiled(t, dim, nk, nv_per_k, head_dim):
    """Value heads from grouped order (HF: head h belongs to key head h // (nv/nk)) to tiled order
    (llama.cpp: value head j uses key head j % nk), written independently of the converter."""
    shape = list(t.shape)
    t = t.reshape(shape[:dim] + [nk, nv_per_k, head_dim] + shape[dim + 1:])
    t = t.transpose(dim, dim + 1)
    return t.reshape(shape)


def untiled(t, dim, nk, nv_per_k, head_dim):
    """Inverse of `tiled`: value heads from llama.cpp's tiled order back to HF's grouped order."""
    shape = list(t.shape)
    t = t.reshape(shape[:dim] + [nv_per_k, nk, head_dim] + shape[dim + 1:])
    t = t.transpose(dim, dim + 1)
    return t.reshape(shape)


def gguf_to_hf(g, cfg, model):
    """A GGUF file's tensors mapped back to the HF model's own parameter names, undoing every
    transform a GGUF loader must undo: -exp(A_log) -> A_log, tiled -> grouped value heads, -1 from
    the zero-centred norms, experts split into gate/up, conv kernel unsqueezed. Loading the result
    into the HF model and reproducing the goldens proves the mapping end to end."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r, kd = nv // nk, nk * dk
    T = lambda n: torch.from_numpy(g[n][2].copy())  # noqa: E731
    sd = {"model.embed_tokens.weight": T("token_embd.weight"), "model.norm.weight": T("output_norm.weight") - 1}
    sd["lm_head.weight"] = T("token_embd.weight") if cfg["tie_word_embeddings"] else T("output.weight")
    for i, kind in enumerate(cfg["layer_types"]):
        b, L = f"blk.{i}", f"model.layers.{i}"
        sd[f"{L}.input_layernorm.weight"] = T(f"{b}.attn_norm.weight") - 1
        sd[f"{L}.post_attention_layernorm.weight"] = T(f"{b}.post_attention_norm.weight") - 1
        if kind == "linear_attention":
            la = f"{L}.linear_attn"
            qkv = T(f"{b}.attn_qkv.weight")
            sd[f"{la}.in_proj_qkv.weight"] = torch.cat([qkv[:2 * kd], untiled(qkv[2 * kd:], 0, nk, r, dv)], 0)
            sd[f"{la}.in_proj_z.weight"] = untiled(T(f"{b}.attn_gate.weight"), 0, nk, r, dv)
            sd[f"{la}.in_proj_b.weight"] = untiled(T(f"{b}.ssm_beta.weight"), 0, nk, r, 1)
            sd[f"{la}.in_proj_a.weight"] = untiled(T(f"{b}.ssm_alpha.weight"), 0, nk, r, 1)
            sd[f"{la}.A_log"] = torch.log(-untiled(T(f"{b}.ssm_a")[:, None], 0, nk, r, 1)[:, 0])
            sd[f"{la}.dt_bias"] = untiled(T(f"{b}.ssm_dt.bias")[:, None], 0, nk, r, 1)[:, 0]
            conv = T(f"{b}.ssm_conv1d.weight")
            sd[f"{la}.conv1d.weight"] = torch.cat([conv[:2 * kd], untiled(conv[2 * kd:], 0, nk, r, dv)], 0)[:, None, :]
            sd[f"{la}.norm.weight"] = T(f"{b}.ssm_norm.weight")
            sd[f"{la}.out_proj.weight"] = untiled(T(f"{b}.ssm_out.weight"), 1, nk, r, dv)
        else:
            sa = f"{L}.self_attn"
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                sd[f"{sa}.{hf}.weight"] = T(f"{b}.{gg}.weight")
            sd[f"{sa}.q_norm.weight"] = T(f"{b}.attn_q_norm.weight") - 1
            sd[f"{sa}.k_norm.weight"] = T(f"{b}.attn_k_norm.weight") - 1
        m = f"{L}.mlp"
        if "num_experts" in cfg:
            sd[f"{m}.gate.weight"] = T(f"{b}.ffn_gate_inp.weight")
            sd[f"{m}.experts.gate_up_proj"] = torch.cat([T(f"{b}.ffn_gate_exps.weight"), T(f"{b}.ffn_up_exps.weight")], 1)
            sd[f"{m}.experts.down_proj"] = T(f"{b}.ffn_down_exps.weight")
            sd[f"{m}.shared_expert_gate.weight"] = T(f"{b}.ffn_gate_inp_shexp.weight")
            for w in ("gate", "up", "down"):
                sd[f"{m}.shared_expert.{w}_proj.weight"] = T(f"{b}.ffn_{w}_shexp.weight")
        else:
            for w in ("gate", "up", "down"):
                sd[f"{m}.{w}_proj.weight"] = T(f"{b}.ffn_{w}.weight")
    return sd


def check_gguf(cfg, hf_sd, path):
    """Compare each GGUF tensor with the HF tensor it comes from under the transform a loader
    must know. Returns per-check results: max |difference| and whether it is exact / within the
    format's rounding."""
    reader, g = gguf_tensors(path)
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r = nv // nk
    checks = {}

    def cmp(label, gname, expected, what):
        if gname not in g:
            checks[label] = {"tensor": gname, "present": False, "what": what}
            return
        gtype, shape, vals = g[gname]
        exp = expected.detach().to(torch.float32).numpy()
        ok_shape = tuple(exp.shape) == tuple(shape)
        diff = float(np.abs(vals - exp).max()) if ok_shape else None
        checks[label] = {"tensor": gname, "type": gtype, "shape": list(shape), "shape_ok": ok_shape,
                         "max_abs_diff": diff, "what": what}

    first_gdn = next(i for i, t in enumerate(cfg["layer_types"]) if t == "linear_attention")
    first_att = next(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    L, A = f"model.layers.{first_gdn}", f"model.layers.{first_att}"
    la = f"{L}.linear_attn"
    A_log = hf_sd[f"{la}.A_log"]
    cmp("ssm_a = -exp(A_log), tiled", f"blk.{first_gdn}.ssm_a", -torch.exp(tiled(A_log[:, None], 0, nk, r, 1)[:, 0]),
        "GGUF ssm_a holds -exp(A_log) (never exp it again), value heads in tiled order")
    cmp("ssm_a vs -exp(A_log), grouped (expected to differ)", f"blk.{first_gdn}.ssm_a", -torch.exp(A_log),
        "the same without reordering: differs when nk < nv")
    cmp("ssm_dt = dt_bias, tiled", f"blk.{first_gdn}.ssm_dt.bias", tiled(hf_sd[f"{la}.dt_bias"][:, None], 0, nk, r, 1)[:, 0],
        "dt_bias, value heads tiled")
    qkv = hf_sd[f"{la}.in_proj_qkv.weight"]
    kd = nk * dk
    qkv_t = torch.cat([qkv[:2 * kd], tiled(qkv[2 * kd:], 0, nk, r, dv)], 0)
    cmp("attn_qkv = in_proj_qkv, v rows tiled", f"blk.{first_gdn}.attn_qkv.weight", qkv_t,
        "q and k rows unchanged, v rows reordered to tiled value heads")
    cmp("attn_qkv vs in_proj_qkv unreordered (expected to differ)", f"blk.{first_gdn}.attn_qkv.weight", qkv,
        "differs when nk < nv")
    cmp("attn_gate = in_proj_z, tiled", f"blk.{first_gdn}.attn_gate.weight",
        tiled(hf_sd[f"{la}.in_proj_z.weight"], 0, nk, r, dv), "z rows, value heads tiled")
    cmp("ssm_beta = in_proj_b, tiled", f"blk.{first_gdn}.ssm_beta.weight",
        tiled(hf_sd[f"{la}.in_proj_b.weight"], 0, nk, r, 1), "b rows, tiled")
    cmp("ssm_alpha = in_proj_a, tiled", f"blk.{first_gdn}.ssm_alpha.weight",
        tiled(hf_sd[f"{la}.in_proj_a.weight"], 0, nk, r, 1), "a rows, tiled")
    conv = hf_sd[f"{la}.conv1d.weight"][:, 0, :]
    cmp("ssm_conv1d = conv1d squeezed, v channels tiled", f"blk.{first_gdn}.ssm_conv1d.weight",
        torch.cat([conv[:2 * kd], tiled(conv[2 * kd:], 0, nk, r, dv)], 0), "[channels, kernel], v channels tiled")
    cmp("ssm_out = out_proj, v columns tiled", f"blk.{first_gdn}.ssm_out.weight",
        tiled(hf_sd[f"{la}.out_proj.weight"], 1, nk, r, dv), "input columns in tiled value-head order")
    cmp("ssm_norm = linear_attn.norm (no +1)", f"blk.{first_gdn}.ssm_norm.weight", hf_sd[f"{la}.norm.weight"],
        "the GDN gated norm is plain w in HF and in GGUF: no +1, shared by all value heads")
    cmp("attn_norm = 1 + input_layernorm", f"blk.{first_gdn}.attn_norm.weight", 1 + hf_sd[f"{L}.input_layernorm.weight"],
        "+1 baked in")
    cmp("post_attention_norm = 1 + post_attention_layernorm", f"blk.{first_gdn}.post_attention_norm.weight",
        1 + hf_sd[f"{L}.post_attention_layernorm.weight"], "+1 baked in")
    cmp("output_norm = 1 + norm", "output_norm.weight", 1 + hf_sd["model.norm.weight"], "+1 baked in")
    sa = f"{A}.self_attn"
    cmp("attn_q = q_proj unchanged ([query | gate] per head)", f"blk.{first_att}.attn_q.weight", hf_sd[f"{sa}.q_proj.weight"],
        "rows per head h: query h (head_dim rows), then gate h (head_dim rows)")
    cmp("attn_q_norm = 1 + q_norm", f"blk.{first_att}.attn_q_norm.weight", 1 + hf_sd[f"{sa}.q_norm.weight"], "+1 baked in")
    cmp("attn_k_norm = 1 + k_norm", f"blk.{first_att}.attn_k_norm.weight", 1 + hf_sd[f"{sa}.k_norm.weight"], "+1 baked in")
    cmp("attn_k = k_proj", f"blk.{first_att}.attn_k.weight", hf_sd[f"{sa}.k_proj.weight"], "unchanged")
    cmp("attn_output = o_proj", f"blk.{first_att}.attn_output.weight", hf_sd[f"{sa}.o_proj.weight"], "unchanged")
    cmp("token_embd = embed_tokens", "token_embd.weight", hf_sd["model.embed_tokens.weight"], "unchanged")
    if cfg["tie_word_embeddings"]:
        checks["output.weight absent (tied)"] = {"present": "output.weight" in g,
                                                 "what": "tied models carry no output.weight: use token_embd"}
    else:
        cmp("output = lm_head", "output.weight", hf_sd["lm_head.weight"], "unchanged")
    if "num_experts" in cfg:
        m = f"{L}.mlp"
        E = cfg["num_experts"]
        gate_up = torch.stack([hf_sd[f"{m}.experts.{e}.gate_proj.weight"] for e in range(E)])
        up = torch.stack([hf_sd[f"{m}.experts.{e}.up_proj.weight"] for e in range(E)])
        down = torch.stack([hf_sd[f"{m}.experts.{e}.down_proj.weight"] for e in range(E)])
        cmp("ffn_gate_inp = router", f"blk.{first_gdn}.ffn_gate_inp.weight", hf_sd[f"{m}.gate.weight"], "[E, H]")
        cmp("ffn_gate_exps = stacked gate_proj", f"blk.{first_gdn}.ffn_gate_exps.weight", gate_up, "[E, I, H]")
        cmp("ffn_up_exps = stacked up_proj", f"blk.{first_gdn}.ffn_up_exps.weight", up, "[E, I, H]")
        cmp("ffn_down_exps = stacked down_proj", f"blk.{first_gdn}.ffn_down_exps.weight", down, "[E, H, I]")
        cmp("ffn_gate_inp_shexp = shared_expert_gate", f"blk.{first_gdn}.ffn_gate_inp_shexp.weight",
            hf_sd[f"{m}.shared_expert_gate.weight"], "sigmoid gate of the shared expert, [1, H]")
        cmp("ffn_up_shexp = shared_expert.up_proj", f"blk.{first_gdn}.ffn_up_shexp.weight",
            hf_sd[f"{m}.shared_expert.up_proj.weight"], "unchanged")
    else:
        cmp("ffn_gate = mlp.gate_proj", f"blk.{first_gdn}.ffn_gate.weight", hf_sd[f"{L}.mlp.gate_proj.weight"], "unchanged")
        cmp("ffn_down = mlp.down_proj", f"blk.{first_gdn}.ffn_down.weight", hf_sd[f"{L}.mlp.down_proj.weight"], "unchanged")
    types = {}
    for tname, (gtype, _, _) in g.items():
        types.setdefault(gtype, []).append(tname)
    return reader, g, checks, {k: sorted(v) for k, v in types.items()}


def roundtrip(name, spec, model_dir, g, gtype, cases):
    """Load the GGUF's (dequantized) tensors back into the HF model and rerun every case.

    f32 / bf16: must reproduce the HF goldens (same tokens, logits within float noise): this
    proves gguf_to_hf, i.e. the list of transforms a loader must undo, is complete and right.
    q8_0: the result is the golden for that file under "dequantize to f32, then f32 maths"
    (what an engine that dequantizes Q8_0 weights computes), saved next to the f32 goldens."""
    model = spec["cls"].from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    sd = gguf_to_hf(g, spec["cfg"], model)
    model.load_state_dict(sd, strict=True)
    if spec["cfg"]["tie_word_embeddings"]:
        model.tie_weights()
    out = []
    for case in cases:
        ids = case["prompt_ids"]
        gen, logits = greedy_manual(model, ids)
        ref = torch.from_numpy(np.load(os.path.join(OUT, case["logits"])))
        res = {"prompt_len": case["prompt_len"], "same_tokens": gen == case["generated_ids"]}
        # Logits compared while the token paths agree (after a divergence they see other inputs).
        n_same = next((i for i, (a, b) in enumerate(zip(gen, case["generated_ids"])) if a != b), N_NEW)
        res["steps_on_same_path"] = n_same + (1 if n_same < N_NEW else 0)
        res["max_abs_logit_diff"] = float((logits[:res["steps_on_same_path"]] - ref[:res["steps_on_same_path"]]).abs().max())
        if gtype == "q8_0":
            f = f"{name}/goldens/L{case['prompt_len']}.q8_0.logits.npy"
            np.save(os.path.join(OUT, f), logits.numpy().astype(np.float32))
            case["q8_0"] = {"generated_ids": gen, "logits": f, "stats": logit_stats(logits, gen)}
        elif not res["same_tokens"] or res["max_abs_logit_diff"] > 1e-4:
            raise SystemExit(f"{name} {gtype} L={case['prompt_len']}: GGUF round trip does not reproduce the goldens: {res}")
        out.append(res)
    return out


def all_tensors_accounted(g, hf_sd):
    """Every HF tensor maps to a GGUF tensor with the same number of values (experts stacked)."""
    n_gguf = sum(v.size for _, _, v in g.values())
    n_hf = sum(t.numel() for t in hf_sd.values())
    return {"gguf_tensors": len(g), "hf_tensors": len(hf_sd), "gguf_values": int(n_gguf), "hf_values": int(n_hf)}


# --------------------------------------------------------------------------------------------

def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_hf_state(model_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(model_dir, "model.safetensors"))


def main():
    import gguf  # for its version in the index; the GGUF checks import it where they run

    torch.manual_seed(0)
    torch.set_num_threads(1)  # fixed summation order: re-runs write identical logits
    torch.use_deterministic_algorithms(True)
    os.makedirs(OUT, exist_ok=True)

    tok = build_tokenizer()
    n_tokens = tok.get_vocab_size()
    special_ids = {tok.token_to_id(t) for t in SPECIAL_TOKENS}
    eos, pad = "<|im_end|>", "<|endoftext|>"
    print(f"tokenizer: {n_tokens} tokens ({BASE_VOCAB} BPE + specials {sorted(special_ids)}), "
          f"model vocab {MODEL_VOCAB}", flush=True)

    llama_dir = llama_cpp_dir()
    index = {
        "generator": "scripts/make_qwen35_goldens.py",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"), "numpy": np.__version__,
                     "llama_cpp_converter": _llama_version(llama_dir)},
        "prompt_lengths": PROMPT_LENGTHS,
        "n_new": N_NEW,
        "dtype": "float32, CPU, attn_implementation=eager",
        "tokenizer": {
            "n_tokens": n_tokens, "model_vocab": MODEL_VOCAB,
            "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
            "eos_token": eos, "pad_token": pad, "pretokenizer_regex": QWEN35_PRETOKENIZE_REGEX,
            "strings": tokenizer_goldens(tok),
        },
        "models": {},
    }

    for name, spec in MODELS.items():
        print(f"\n=== {name}", flush=True)
        model_dir = os.path.join(OUT, name)
        if os.path.isdir(model_dir):
            shutil.rmtree(model_dir)
        os.makedirs(model_dir)
        cfg_kwargs = dict(spec["cfg"], eos_token_id=tok.token_to_id(eos), pad_token_id=tok.token_to_id(pad),
                          bos_token_id=None)
        config = spec["cfg_cls"](**cfg_kwargs)
        config._attn_implementation = "eager"
        torch.manual_seed(spec["seed"])
        model = spec["cls"](config).to(torch.float32).eval()
        randomise(model, spec["cfg"], spec["seed"], n_tokens)
        # generation_config.json as a user's checkpoint has it: stop at <|im_end|>.
        model.generation_config.eos_token_id = tok.token_to_id(eos)
        model.generation_config.pad_token_id = tok.token_to_id(pad)
        model.save_pretrained(model_dir)
        write_tokenizer(tok, model_dir, eos, pad)
        index["tokenizer"]["chat_example"] = check_saved_tokenizer(model_dir, tok)
        with open(os.path.join(model_dir, "config.json")) as f:
            saved_cfg = json.load(f)

        # Reload what was saved: the goldens come from the checkpoint as a user loads it.
        model = spec["cls"].from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
        _check_reload_tied(model, spec["cfg"])
        # The goldens run exactly N_NEW steps, through any <|im_end|> the random model emits.
        model.generation_config.eos_token_id = None

        gold_dir = os.path.join(model_dir, "goldens")
        os.makedirs(gold_dir)
        cases = []
        for L in PROMPT_LENGTHS:
            ids = prompt_ids(name, L, n_tokens, special_ids)
            gen_m, log_m = greedy_manual(model, ids)
            gen_g, log_g = greedy_generate(model, ids)
            if gen_m != gen_g:
                raise SystemExit(f"{name} L={L}: generate {gen_g} != manual loop {gen_m}")
            d_gen = float((log_m - log_g).abs().max())
            full = full_forward_logits(model, ids, gen_m)
            d_full = float((full - log_m).abs().max())
            if d_gen > 1e-4 or d_full > 1e-3:
                raise SystemExit(f"{name} L={L}: logits disagree (generate {d_gen}, uncached {d_full})")
            logits_file = f"{name}/goldens/L{L}.logits.npy"
            np.save(os.path.join(OUT, logits_file), log_m.numpy().astype(np.float32))
            case = {"prompt_len": L, "prompt_ids": ids, "generated_ids": gen_m, "logits": logits_file,
                    "logits_shape": list(log_m.shape), "generate_vs_loop_max_abs": d_gen,
                    "uncached_vs_cached_max_abs": d_full, "stats": logit_stats(log_m, gen_m)}
            if L == PREFILL_LOGITS_LENGTH:
                with torch.no_grad():
                    pre = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
                pre_file = f"{name}/goldens/L{L}.prefill_logits.npy"
                np.save(os.path.join(OUT, pre_file), pre.numpy().astype(np.float32))
                case["prefill_logits"] = pre_file
                case["prefill_logits_shape"] = list(pre.shape)
            cases.append(case)
            s = case["stats"]
            print(f"L={L:3d} gen={gen_m} | std {s['logit_std_mean']:.2f} gap min {s['top2_gap_min']:.3f} "
                  f"med {s['top2_gap_median']:.3f} <0.05:{s['steps_gap_below_0.05']} <0.2:{s['steps_gap_below_0.2']} "
                  f"distinct {s['distinct_generated']} run {s['longest_repeat_run']} | d_gen {d_gen:.1e} d_full {d_full:.1e}",
                  flush=True)
            if s["distinct_generated"] == 1:
                raise SystemExit(f"{name} L={L}: greedy output is a single repeated token; adjust the scales")

        files = convert(model_dir, name, llama_dir)
        hf_sd = load_hf_state(model_dir)
        gguf_info = {}
        for t, path in files.items():
            reader, g, checks, types = check_gguf(spec["cfg"], hf_sd, path)
            info = {"file": os.path.relpath(path, OUT), "bytes": os.path.getsize(path), "sha256": sha256_file(path),
                    "tensor_types": types, "counts": all_tensors_accounted(g, hf_sd), "checks": checks}
            info["roundtrip"] = roundtrip(name, spec, model_dir, g, t, cases)
            if t == "f32":
                info["metadata"] = gguf_metadata(reader)
            gguf_info[t] = info
            print(f"gguf {t}: {info['bytes']} bytes, {len(g)} tensors, types { {k: len(v) for k, v in types.items()} }")
            print("  round trip: " + "; ".join(f"L={x['prompt_len']} same={x['same_tokens']} steps={x['steps_on_same_path']} "
                                                f"maxdiff={x['max_abs_logit_diff']:.2e}" for x in info["roundtrip"]))
            for label, c in checks.items():
                print(f"  [{t}] {label}: " + ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("what",)))

        index["models"][name] = {
            "hf_dir": name,
            "class": spec["cls"].__name__,
            "model_type": saved_cfg["model_type"],
            "seed": spec["seed"],
            "config": saved_cfg,
            "safetensors_sha256": sha256_file(os.path.join(model_dir, "model.safetensors")),
            "hf_tensor_names": sorted(hf_sd.keys()),
            "cases": cases,
            "gguf": gguf_info,
        }

    index["stats_summary"] = summary(index)
    print("\nstats summary: " + json.dumps(index["stats_summary"], indent=1))
    with open(os.path.join(OUT, "index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1, ensure_ascii=False)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fns in os.walk(OUT) for fn in fns)
    print(f"\nwrote {OUT}: {total / 1e6:.2f} MB")


def summary(index):
    """Per model: how well separated the greedy choices are, over all cases (f32 goldens), how
    often Q8_0 (dequantized) keeps the f32 tokens, and which special tokens were generated."""
    out = {}
    specials = set(index["tokenizer"]["special_tokens"].values())
    for name, m in index["models"].items():
        gaps = []
        for c in m["cases"]:
            logits = np.load(os.path.join(OUT, c["logits"]))
            top2 = np.sort(logits, axis=-1)[:, -2:]
            gaps += list(top2[:, 1] - top2[:, 0])
        gaps = np.array(gaps)
        q8_same = [next((i for i, (a, b) in enumerate(zip(c["q8_0"]["generated_ids"], c["generated_ids"])) if a != b), N_NEW)
                   for c in m["cases"]]
        out[name] = {
            "steps": int(gaps.size),
            "top2_gap_min": float(gaps.min()),
            "top2_gap_p10": float(np.percentile(gaps, 10)),
            "top2_gap_median": float(np.median(gaps)),
            "frac_gap_below_0.01": float((gaps < 0.01).mean()),
            "frac_gap_below_0.1": float((gaps < 0.1).mean()),
            "max_uncached_vs_cached": max(c["uncached_vs_cached_max_abs"] for c in m["cases"]),
            "max_generate_vs_loop": max(c["generate_vs_loop_max_abs"] for c in m["cases"]),
            "q8_0_tokens_matching_f32_before_first_divergence": q8_same,
            "special_tokens_generated": sorted({t for c in m["cases"] for t in c["generated_ids"] if t in specials}),
        }
    return out


def _check_reload_tied(model, cfg):
    if cfg["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "reloaded lm_head not tied"


def _dist_version(name):
    from importlib.metadata import version
    return version(name)


def _llama_version(d):
    """The converter's provenance: llama-cpp-src.sh pins llama-cpp-python 0.3.36's vendored tree;
    record a hash of the converter sources so a different tree shows up in the index."""
    h = hashlib.sha256()
    paths = [os.path.join(d, "convert_hf_to_gguf.py")] + sorted(
        os.path.join(d, "conversion", f) for f in os.listdir(os.path.join(d, "conversion")) if f.endswith(".py"))
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    return {"source": "llama-cpp-python 0.3.36 vendor/llama.cpp (../shared/tools/llama-cpp-src.sh)",
            "converter_sources_sha256": h.hexdigest()}


if __name__ == "__main__":
    main()
