// Gated GELU and SiLU, CUDA form. CPU twin: activation/mod.rs (the same divisor form
// x / (1 + exp(-2z)), precise expf). The operands are strided views so that the gate and
// up halves of one fused projection, or one layer's slice of the per-layer inputs, are read in
// place: out[r][i] = gelu_tanh(g[g_off + r·g_ld + i]) · u[u_off + r·u_ld + i].

// tern_gelu_tanh and tern_silu live in prelude.cuh (the matmul's gated GEMV uses them too).

#define TERN_GATED_ACTIVATION(name, act)                                                                          \
    extern "C" __global__ void name(const float* __restrict__ g, long long g_off, long long g_ld,                  \
                                    const float* __restrict__ u, long long u_off, long long u_ld, int rows,        \
                                    int width, float* __restrict__ out, tern_bf16* __restrict__ out16) { tern_await_prior_kernel(); \
        const size_t n = (size_t)rows * width;                                                                     \
        for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) { \
            const size_t r = e / width, i = e % width;                                                             \
            const float v = act(g[g_off + r * g_ld + i]) * u[u_off + r * u_ld + i];                                \
            if (out) out[e] = v;                                                                                   \
            if (out16) out16[e] = tern_bf16_from_f32(v);                                                           \
        }                                                                                                          \
    }

TERN_GATED_ACTIVATION(tern_gelu_tanh_mul, tern_gelu_tanh)
TERN_GATED_ACTIVATION(tern_silu_mul, tern_silu)
