"""How much bf16 alone moves the embeddings of a random-weight full-size model, in transformers.

    python3 scripts/bf16_sensitivity.py [tokens] [docs]

Builds EmbeddingGemma 2 as scripts/make_bench_egemma.py does (transformers' default config,
random init, seed 0) on the CPU and embeds
random token ids twice with transformers itself: f32 weights and activations, then the same
model cast to bf16. Prints the smallest cosine between the two (mean-pooled, normalised): the
sensitivity of the checkpoint to bf16 rounding, to read beside `tern bench embed --compare-f32`.
"""
import sys

import torch

from transformers import EmbeddingGemma2TextConfig, EmbeddingGemma2TextModel

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 512
docs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
torch.manual_seed(0)
model = EmbeddingGemma2TextModel(EmbeddingGemma2TextConfig()).eval()
ids = torch.randint(256, 262144, (docs, tokens))
mask = torch.ones_like(ids)


def embed(m, dtype):
    with torch.inference_mode():
        h = m.to(dtype)(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    return torch.nn.functional.normalize(h.mean(1), dim=-1)


a = embed(model, torch.float32)
b = embed(model, torch.bfloat16)
cos = (a * b).sum(-1)
print(f"eg2: transformers bf16 vs f32, {docs} x {tokens} random ids: min cosine {cos.min().item():.6f}")
