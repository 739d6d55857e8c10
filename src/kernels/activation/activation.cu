// Gated GELU and SiLU, CUDA form. CPU twin: activation/mod.rs (the same divisor form
// x / (1 + exp(-2z)), precise expf). The operands are strided views so that the gate and
// up halves of one fused projection, or one layer's slice of the per-layer inputs, are read in
// place: out[r][i] = gelu_tanh(g[g_off + r·g_ld + i]) · u[u_off + r·u_ld + i].

// tern_gelu_tanh and tern_silu live in prelude.cuh (the matmul's gated GEMV uses them too).

// The general form: any widths, offsets and strides, one element a step (64-bit index
// arithmetic: the fallback for views the quad form below cannot read).
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

// The quad form: four consecutive elements of a row a step, read and written as one 16-byte
// (8-byte for bf16) access, the row found by one 32-bit division a quad. The general form spent
// most of its time on the 64-bit division and modulo of every element (emulated, dozens of
// instructions) and moved 4 bytes an access. The launcher takes it when the width, both views'
// offsets and strides are multiples of 4 (so every access is aligned; buffers start aligned)
// and rows * width / 4 < 2^31 (so the quad index and its grid stride stay 32-bit). Each
// element's arithmetic is the general form's, so the same bits.
#define TERN_GATED_ACTIVATION_QUADS(name, act)                                                                    \
    extern "C" __global__ void name(const float* __restrict__ g, long long g_off, long long g_ld,                  \
                                    const float* __restrict__ u, long long u_off, long long u_ld, int rows,        \
                                    int width, float* __restrict__ out, tern_bf16* __restrict__ out16) { tern_await_prior_kernel(); \
        const unsigned wq = (unsigned)width / 4, nq = (unsigned)rows * wq;                                         \
        for (unsigned q = blockIdx.x * blockDim.x + threadIdx.x; q < nq; q += gridDim.x * blockDim.x) {            \
            const unsigned r = q / wq, i = (q - r * wq) * 4;                                                       \
            const float4 a = *reinterpret_cast<const float4*>(g + g_off + (long long)r * g_ld + i);                \
            const float4 b = *reinterpret_cast<const float4*>(u + u_off + (long long)r * u_ld + i);                \
            const float4 v = make_float4(act(a.x) * b.x, act(a.y) * b.y, act(a.z) * b.z, act(a.w) * b.w);          \
            const size_t e = (size_t)q * 4;                                                                        \
            if (out) *reinterpret_cast<float4*>(out + e) = v;                                                      \
            if (out16) *reinterpret_cast<uint2*>(out16 + e) = make_uint2(tern_bf16_pair(v.x, v.y), tern_bf16_pair(v.z, v.w)); \
        }                                                                                                          \
    }

TERN_GATED_ACTIVATION(tern_gelu_tanh_mul, tern_gelu_tanh)
TERN_GATED_ACTIVATION(tern_silu_mul, tern_silu)
TERN_GATED_ACTIVATION_QUADS(tern_gelu_tanh_mul_quads, tern_gelu_tanh)
TERN_GATED_ACTIVATION_QUADS(tern_silu_mul_quads, tern_silu)
