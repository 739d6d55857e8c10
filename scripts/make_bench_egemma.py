"""Random-weight EmbeddingGemma checkpoints at the released shapes, for the GPU benchmark.

    python3 scripts/make_bench_egemma.py OUT TOKENIZER_JSON [eg2,eg300m]

Writes OUT/eg2 (EmbeddingGemma 2: transformers' default EmbeddingGemma2Config, saved with
save_pretrained as the composite `embedding_gemma2` checkpoint) and OUT/eg300m (EmbeddingGemma
300M's config with its sentence-transformers modules: mean Pooling, Dense 768->3072->768,
Normalize), both f32 (or those named), each with the given tokenizer.json (the 262144-entry
Gemma vocabulary of EmbeddingGemma 300M). Runs on the GPU machine with transformers >= 5.24
(eg300m alone needs only Gemma3TextModel) and no network.
"""
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

out, tokenizer = sys.argv[1], sys.argv[2]

EG300M = {
    "architectures": ["Gemma3TextModel"], "model_type": "gemma3_text", "attention_bias": False,
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 768, "intermediate_size": 1152,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 4,
    "max_position_embeddings": 2048, "num_attention_heads": 3, "num_hidden_layers": 24,
    "num_key_value_heads": 1, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "sliding_window": 512,
    "use_bidirectional_attention": True, "vocab_size": 262144,
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
}


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))


def finish(model_dir, max_seq_length):
    shutil.copy(tokenizer, os.path.join(model_dir, "tokenizer.json"))
    write_json(os.path.join(model_dir, "sentence_bert_config.json"), {"max_seq_length": max_seq_length})


def eg2():
    from transformers import EmbeddingGemma2Config, EmbeddingGemma2Model
    d = os.path.join(out, "eg2")
    shutil.rmtree(d, ignore_errors=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = EmbeddingGemma2Model(EmbeddingGemma2Config()).eval()
    model.save_pretrained(d)
    finish(d, 8192)
    write_json(os.path.join(d, "config_sentence_transformers.json"), {
        "prompts": {"query": "task: search result | query: ", "document": "title: none | text: "},
        "default_prompt_name": None, "similarity_fn_name": "cosine"})
    # The egemma2 binary reads the multimodal processor settings even for text; these are
    # transformers' defaults for the model's processors (what save_pretrained would write).
    try:
        from transformers import EmbeddingGemma2VideoProcessor, Gemma4AudioFeatureExtractor, Gemma4ImageProcessor
        write_json(os.path.join(d, "processor_config.json"), {
            "feature_extractor": Gemma4AudioFeatureExtractor().to_dict(),
            "image_processor": Gemma4ImageProcessor().to_dict(),
            "video_processor": EmbeddingGemma2VideoProcessor().to_dict(),
        })
    except Exception as e:  # the egemma2 peer then reports its own error
        print("eg2: no processor_config.json:", e)
    print("eg2:", sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")


def eg300m():
    from transformers import Gemma3TextConfig, Gemma3TextModel
    d = os.path.join(out, "eg300m")
    shutil.rmtree(d, ignore_errors=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Gemma3TextModel(Gemma3TextConfig(**EG300M)).eval()
    model.save_pretrained(d)
    write_json(os.path.join(d, "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"}])
    write_json(os.path.join(d, "1_Pooling", "config.json"),
               {"word_embedding_dimension": 768, "pooling_mode_mean_tokens": True, "include_prompt": True})
    g = torch.Generator().manual_seed(1)
    for sub, (i, o) in [("2_Dense", (768, 3072)), ("3_Dense", (3072, 768))]:
        write_json(os.path.join(d, sub, "config.json"), {"in_features": i, "out_features": o, "bias": False,
                   "activation_function": "torch.nn.modules.linear.Identity"})
        save_file({"linear.weight": torch.randn(o, i, generator=g) / i ** 0.5}, os.path.join(d, sub, "model.safetensors"))
    os.makedirs(os.path.join(d, "4_Normalize"), exist_ok=True)
    finish(d, 2048)
    print("eg300m:", sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")


for name in (sys.argv[3] if len(sys.argv) > 3 else "eg2,eg300m").split(","):
    {"eg2": eg2, "eg300m": eg300m}[name]()
