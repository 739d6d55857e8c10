"""How much bf16 operand rounding moves the embeddings of a tiny test fixture, in PyTorch alone.

    python3 scripts/fixture_fast_sensitivity.py FIXTURE [seeds] [--test-seed S]

Loads tests/fixtures/FIXTURE/model with sentence-transformers (eager attention) on the CPU and
embeds random token ids of the device test's lengths (1, 7, 17, 33, 47, 48) twice: in f32, and
with both operands of every linear layer and of both attention products rounded to bf16 (f32
arithmetic otherwise), as tern's fast mode rounds its GEMM operands. Prints the distribution of
the smallest cosine per seed: the bound FAST_COSINE in src/kernels/cuda_tests.rs must sit
below its tail. With --test-seed, the ids are the ones cuda_embeddings_match_cpu_and_are_batch_invariant
draws for its first fixture under TERN_TEST_SEED=S (its LCG), and each sequence's cosine is printed.
(Environment: ../shared/tools/golden-env.sh.)
"""
import sys

import numpy as np
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer

LENGTHS = [1, 7, 17, 33, 47, 48]
args = [a for a in sys.argv[1:] if not a.startswith("--")]
fixture = args[0]
seeds = int(args[1]) if len(args) > 1 else 200
test_seed = int(sys.argv[sys.argv.index("--test-seed") + 1]) if "--test-seed" in sys.argv else None
model = SentenceTransformer(f"tests/fixtures/{fixture}/model", device="cpu", model_kwargs={"attn_implementation": "eager"}).eval()
vocab = model[0].auto_model.config.vocab_size
linear, matmul = F.linear, torch.matmul


def rounded(x):
    return x.bfloat16().float()


def embed(ids, fast):
    F.linear = (lambda x, w, b=None: linear(rounded(x), rounded(w), b)) if fast else linear
    torch.matmul = (lambda a, b, *r, **k: matmul(rounded(a), rounded(b), *r, **k)) if fast else matmul
    try:
        with torch.no_grad():
            t = torch.tensor([ids])
            return model({"input_ids": t, "attention_mask": torch.ones_like(t)})["sentence_embedding"][0].double()
    finally:
        F.linear, torch.matmul = linear, matmul


def cosine(ids):
    a, b = embed(ids, False), embed(ids, True)
    return float(a @ b / (a.norm() * b.norm()))


if test_seed is not None:
    state = test_seed

    def next_u32():
        global state
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        return state >> 32

    for n in LENGTHS:
        print(f"length {n}: cosine {cosine([2 + next_u32() % (vocab - 2) for _ in range(n)]):.6f}")
else:
    worst = []
    for s in range(seeds):
        rng = np.random.default_rng(s)
        worst.append(min(cosine((2 + rng.integers(0, vocab - 2, n)).tolist()) for n in LENGTHS))
    w = np.array(worst)
    q = np.quantile(w, [0.01, 0.05, 0.5])
    print(f"{fixture}: {seeds} seeds, smallest cosine per seed: min {w.min():.5f}, 1% {q[0]:.5f}, 5% {q[1]:.5f}, median {q[2]:.5f}")
