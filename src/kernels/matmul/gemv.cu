// Products of a few rows (decode) with weights read in their stored type, and the expansion
// of stored weights into a GEMM's operand type. CPU twin: matmul/mod.rs `linear_w` (bf16 and
// Q8_0 weights are formed exactly in f32 there too, so in f32 mode only summation order differs).
//
// Weight types: f32; bf16 bits; Q8_0 repacked at upload into quants [out][in] (i8) and one f16
// scale per 32 consecutive weights of a row ([out][in / 32], bits). d·q is exact in f32 (an
// 11-bit by 8-bit product), as on the CPU.
//
// A decode step is bound by the bytes of the weights: each warp owns one output feature and
// streams its row once, 8 weights per lane per step (16-byte loads of bf16, 8-byte of Q8_0),
// multiplying them into up to R rows of x (R a compile-time bound, rows <= R at run time) that
// every warp of the GPU reads and the L1/L2 caches hold. The row's partial sums meet in a
// butterfly warp sum (fixed order for a given input).

#define TERN_GEMV_WARPS 8

__device__ __forceinline__ float tern_f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

struct TernWeightsF32 {
    const float* w;
    __device__ __forceinline__ void load8(size_t at, float* v) const {
        const float4 a = *reinterpret_cast<const float4*>(w + at);
        const float4 b = *reinterpret_cast<const float4*>(w + at + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
};

struct TernWeightsBf16 {
    const tern_bf16* w;
    __device__ __forceinline__ void load8(size_t at, float* v) const {
        const uint4 u = *reinterpret_cast<const uint4*>(w + at);
        const unsigned p[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = __uint_as_float(p[i] << 16);
            v[2 * i + 1] = __uint_as_float(p[i] & 0xffff0000u);
        }
    }
};

struct TernWeightsQ8 {
    const signed char* q;
    const unsigned short* d;
    __device__ __forceinline__ void load8(size_t at, float* v) const {
        const uint2 u = *reinterpret_cast<const uint2*>(q + at);
        const float s = tern_f16_to_f32(d[at / 32]);
        const unsigned p[2] = {u.x, u.y};
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = s * (float)(signed char)((p[i / 4] >> (8 * (i % 4))) & 0xffu);
    }
};

// y[r][o] = Σ_c x[r][c]·W[o][c] for r < rows <= R; in % 8 == 0.
template <int R, typename W>
__device__ __forceinline__ void tern_gemv(W w, const float* __restrict__ x, int rows, int out, int in, float* __restrict__ y) {
    const int lane = threadIdx.x % 32;
    const int o = blockIdx.x * TERN_GEMV_WARPS + threadIdx.x / 32;
    if (o >= out) return;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    const size_t row = (size_t)o * in;
#pragma unroll 4
    for (int c = lane * 8; c < in; c += 256) {
        float v[8];
        w.load8(row + c, v);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < rows) {
                const float4 a = *reinterpret_cast<const float4*>(x + (size_t)r * in + c);
                const float4 b = *reinterpret_cast<const float4*>(x + (size_t)r * in + c + 4);
                float s = acc[r];
                s = fmaf(a.x, v[0], s); s = fmaf(a.y, v[1], s); s = fmaf(a.z, v[2], s); s = fmaf(a.w, v[3], s);
                s = fmaf(b.x, v[4], s); s = fmaf(b.y, v[5], s); s = fmaf(b.z, v[6], s); s = fmaf(b.w, v[7], s);
                acc[r] = s;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float s = tern_warp_sum(acc[r]);
        if (lane == 0 && r < rows) y[(size_t)r * out + o] = s;
    }
}

#define TERN_GEMV_KERNELS(R)                                                                                              \
    extern "C" __global__ void tern_gemv_f32_##R(const float* __restrict__ w, const float* __restrict__ x, int rows,      \
                                                 int out, int in, float* __restrict__ y) {                                \
        tern_gemv<R>(TernWeightsF32{w}, x, rows, out, in, y);                                                             \
    }                                                                                                                     \
    extern "C" __global__ void tern_gemv_bf16_##R(const tern_bf16* __restrict__ w, const float* __restrict__ x, int rows, \
                                                  int out, int in, float* __restrict__ y) {                               \
        tern_gemv<R>(TernWeightsBf16{w}, x, rows, out, in, y);                                                            \
    }                                                                                                                     \
    extern "C" __global__ void tern_gemv_q8_##R(const signed char* __restrict__ q, const unsigned short* __restrict__ d,  \
                                                const float* __restrict__ x, int rows, int out, int in,                   \
                                                float* __restrict__ y) {                                                  \
        tern_gemv<R>(TernWeightsQ8{q, d}, x, rows, out, in, y);                                                           \
    }

TERN_GEMV_KERNELS(1)
TERN_GEMV_KERNELS(2)
TERN_GEMV_KERNELS(4)
TERN_GEMV_KERNELS(8)

// Stored weights expanded to a GEMM operand (prefill): bf16 -> f32 (exact), Q8_0 -> f32
// (exact) or -> bf16 (d·q rounded to nearest even: the fast mode's operand rounding).
extern "C" __global__ void tern_expand_bf16_f32(const tern_bf16* __restrict__ w, size_t n, float* __restrict__ y) {
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x)
        y[e] = tern_bf16_to_f32(w[e]);
}

extern "C" __global__ void tern_expand_q8_f32(const signed char* __restrict__ q, const unsigned short* __restrict__ d,
                                              size_t n, float* __restrict__ y) {
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x)
        y[e] = tern_f16_to_f32(d[e / 32]) * (float)q[e];
}

extern "C" __global__ void tern_expand_q8_bf16(const signed char* __restrict__ q, const unsigned short* __restrict__ d,
                                               size_t n, tern_bf16* __restrict__ y) {
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x)
        y[e] = tern_bf16_from_f32(tern_f16_to_f32(d[e / 32]) * (float)q[e]);
}
