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
//
// A decode step is also a chain of small launches, so one launch does more than one product:
// - up to TERN_GEMV_PARTS matrices that read the same x (a layer's input projections), each
//   writing its own output, the grid's blocks split between them (tern_gemv_parts);
// - an FFN's fused gate|up product and its gated activation, act(gate)·up written directly
//   (TERN_Y_SILU, TERN_Y_GELU);
// - a mixture-of-experts layer's routed products, the expert of each (row, choice) read from
//   device memory (routed on the device), so that a decode step of a MoE model records as a
//   graph like a dense one (tern_gemv_routed).

#define TERN_GEMV_WARPS 8
#define TERN_GEMV_PARTS 4

// Mirrors GemvParts in matmul/cuda.rs field for field (C layout). Part i owns blocks
// block0[i] .. block0[i + 1] - 1 and output features 0 .. out[i] - 1 of its matrix.
struct tern_gemv_parts {
    unsigned long long w[TERN_GEMV_PARTS];       // weights (Q8_0: the quants)
    unsigned long long scales[TERN_GEMV_PARTS];  // Q8_0 scales, else unused
    unsigned long long y[TERN_GEMV_PARTS];       // outputs [rows][out]
    int out[TERN_GEMV_PARTS];
    int block0[TERN_GEMV_PARTS + 1];
    int n;
};

__device__ __forceinline__ float tern_f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

struct TernWeightsF32 {
    const float* w;
    __device__ TernWeightsF32(unsigned long long wp, unsigned long long) : w((const float*)wp) {}
    __device__ __forceinline__ void load8(size_t at, float* v) const {
        const float4 a = *reinterpret_cast<const float4*>(w + at);
        const float4 b = *reinterpret_cast<const float4*>(w + at + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
};

struct TernWeightsBf16 {
    const tern_bf16* w;
    __device__ TernWeightsBf16(unsigned long long wp, unsigned long long) : w((const tern_bf16*)wp) {}
    __device__ __forceinline__ void load8(size_t at, float* v) const {
        const uint4 u = *reinterpret_cast<const uint4*>(w + at);
        const unsigned q[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = __uint_as_float(q[i] << 16);
            v[2 * i + 1] = __uint_as_float(q[i] & 0xffff0000u);
        }
    }
};

struct TernWeightsQ8 {
    const signed char* q;
    const unsigned short* d;
    __device__ TernWeightsQ8(unsigned long long wp, unsigned long long sp)
        : q((const signed char*)wp), d((const unsigned short*)sp) {}
    __device__ __forceinline__ void load8(size_t at, float* v) const {
        const uint2 u = *reinterpret_cast<const uint2*>(q + at);
        const float s = tern_f16_to_f32(d[at / 32]);
        const unsigned p[2] = {u.x, u.y};
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = s * (float)(signed char)((p[i / 4] >> (8 * (i % 4))) & 0xffu);
    }
};

// What a GEMV writes: each output feature o of W (TERN_Y_PLAIN), or, for a matrix of 2·half
// rows stacking a gate [half][in] over an up [half][in] (an FFN's fused gate|up product),
// act(gate_o)·up_o for o < half (TERN_Y_SILU, TERN_Y_GELU; the activation kernels' own forms,
// prelude.cuh): one warp computes both rows of a pair and writes the gated value, so the
// activation costs nothing beyond the product and its input never goes to memory.
#define TERN_Y_PLAIN 0
#define TERN_Y_SILU 1
#define TERN_Y_GELU 2

// One warp's OPW consecutive output features o0 .. o0 + OPW - 1 (those below `out`: the
// matrix's rows, or `half` of them for a gated product) for rows r < rows <= R of x (rows of
// `in`), written to y[r·out + o]; in % 8 == 0. Each x value a lane loads serves every weight
// row the warp holds: with several rows of x (a batch of decode steps, a short query) the x
// reads, which come from L1, would otherwise outweigh the weights.
template <int R, int OPW, int OMODE, typename W>
__device__ __forceinline__ void tern_gemv_rows(const W& w, const float* __restrict__ x, int rows, int in, int o0, int out,
                                               float* __restrict__ y) {
    constexpr int NW = OMODE == TERN_Y_PLAIN ? OPW : 2 * OPW;  // weight rows held
    const int lane = threadIdx.x % 32;
    float acc[NW][R];
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[j][r] = 0.0f;
#pragma unroll 4
    for (int c = lane * 8; c < in; c += 256) {
        float v[NW][8];
#pragma unroll
        for (int j = 0; j < NW; ++j) {
            // Gated: rows o (gate) for j < OPW, then o + out (up).
            const int o = o0 + j % OPW;
            if (o < out) {
                w.load8((size_t)(j < OPW ? o : o + out) * in + c, v[j]);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) v[j][i] = 0.0f;
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < rows) {
                const float4 a = *reinterpret_cast<const float4*>(x + (size_t)r * in + c);
                const float4 b = *reinterpret_cast<const float4*>(x + (size_t)r * in + c + 4);
#pragma unroll
                for (int j = 0; j < NW; ++j) {
                    float s = acc[j][r];
                    s = fmaf(a.x, v[j][0], s); s = fmaf(a.y, v[j][1], s); s = fmaf(a.z, v[j][2], s); s = fmaf(a.w, v[j][3], s);
                    s = fmaf(b.x, v[j][4], s); s = fmaf(b.y, v[j][5], s); s = fmaf(b.z, v[j][6], s); s = fmaf(b.w, v[j][7], s);
                    acc[j][r] = s;
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < OPW; ++j)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float s = tern_warp_sum(acc[j][r]);
            if (OMODE != TERN_Y_PLAIN) {
                const float u = tern_warp_sum(acc[j + OPW][r]);
                s = (OMODE == TERN_Y_SILU ? tern_silu(s) : tern_gelu_tanh(s)) * u;
            }
            if (lane == 0 && r < rows && o0 + j < out) y[(size_t)r * out + o0 + j] = s;
        }
}

// y_part[r][o] for r < rows <= R, o < out[part] (see tern_gemv_rows); a block covers
// TERN_GEMV_WARPS · OPW output features of its part.
template <int R, int OPW, int OMODE, typename W>
__device__ __forceinline__ void tern_gemv(const tern_gemv_parts& p, const float* __restrict__ x, int rows, int in) {
    int part = 0;
    while (part + 1 < p.n && (int)blockIdx.x >= p.block0[part + 1]) ++part;
    const int o0 = (((int)blockIdx.x - p.block0[part]) * TERN_GEMV_WARPS + threadIdx.x / 32) * OPW;
    if (o0 >= p.out[part]) return;
    tern_gemv_rows<R, OPW, OMODE>(W(p.w[part], p.scales[part]), x, rows, in, o0, p.out[part], (float*)p.y[part]);
}

// Routed experts (a mixture-of-experts layer's few rows, routed on the device): slot s =
// blockIdx.y is row s / k's choice s % k, expert ids[s], whose matrix comes from the tables of
// every expert's weights (and Q8_0 scales). Its input is row s / x_div of x (x_div = k: the
// layer's input rows; 1: the slot's own row) and its output row s of y [slots][out] (`out`
// features, or gated values of a [gate | up] matrix, as tern_gemv_rows).
template <int OMODE, typename W>
__device__ __forceinline__ void tern_gemv_routed(const unsigned long long* __restrict__ w_table,
                                                 const unsigned long long* __restrict__ s_table,
                                                 const int* __restrict__ ids, int x_div, const float* __restrict__ x,
                                                 int in, int out, float* __restrict__ y) {
    const int slot = blockIdx.y, e = ids[slot];
    const int o = (int)blockIdx.x * TERN_GEMV_WARPS + threadIdx.x / 32;
    if (o >= out) return;
    tern_gemv_rows<1, 1, OMODE>(W(w_table[e], s_table[e]), x + (size_t)(slot / x_div) * in, 1, in, o, out,
                                y + (size_t)slot * out);
}

// OPW, output features per warp for R rows of x (plain, and gated products, whose warps hold
// two weight rows per feature): gemv_outputs_per_warp in matmul/cuda.rs.
#define TERN_GEMV_KERNEL(name, R, OPW, W, OMODE)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * TERN_GEMV_WARPS)                                            \
        name(const tern_gemv_parts p, const float* __restrict__ x, int rows, int in) {                            \
        tern_await_prior_kernel();                                                                                \
        tern_gemv<R, OPW, OMODE, W>(p, x, rows, in);                                                              \
    }
// SUFFIX names the variant: R (the wide form, OPW and OPW_GATED as given) or Rn (the narrow
// form, one output feature per warp, for matrices too small to fill the GPU otherwise).
#define TERN_GEMV_KERNELS(SUFFIX, R, OPW, OPW_GATED)                                                              \
    TERN_GEMV_KERNEL(tern_gemv_f32_##SUFFIX, R, OPW, TernWeightsF32, TERN_Y_PLAIN)                               \
    TERN_GEMV_KERNEL(tern_gemv_bf16_##SUFFIX, R, OPW, TernWeightsBf16, TERN_Y_PLAIN)                             \
    TERN_GEMV_KERNEL(tern_gemv_q8_##SUFFIX, R, OPW, TernWeightsQ8, TERN_Y_PLAIN)                                 \
    TERN_GEMV_KERNEL(tern_gemv_silu_f32_##SUFFIX, R, OPW_GATED, TernWeightsF32, TERN_Y_SILU)                     \
    TERN_GEMV_KERNEL(tern_gemv_silu_bf16_##SUFFIX, R, OPW_GATED, TernWeightsBf16, TERN_Y_SILU)                   \
    TERN_GEMV_KERNEL(tern_gemv_silu_q8_##SUFFIX, R, OPW_GATED, TernWeightsQ8, TERN_Y_SILU)                       \
    TERN_GEMV_KERNEL(tern_gemv_gelu_f32_##SUFFIX, R, OPW_GATED, TernWeightsF32, TERN_Y_GELU)                     \
    TERN_GEMV_KERNEL(tern_gemv_gelu_bf16_##SUFFIX, R, OPW_GATED, TernWeightsBf16, TERN_Y_GELU)                   \
    TERN_GEMV_KERNEL(tern_gemv_gelu_q8_##SUFFIX, R, OPW_GATED, TernWeightsQ8, TERN_Y_GELU)

TERN_GEMV_KERNELS(1, 1, 1, 1)
TERN_GEMV_KERNELS(2, 2, 2, 1)
TERN_GEMV_KERNELS(4, 4, 4, 2)
TERN_GEMV_KERNELS(8, 8, 4, 2)
TERN_GEMV_KERNELS(2n, 2, 1, 1)
TERN_GEMV_KERNELS(4n, 4, 1, 1)
TERN_GEMV_KERNELS(8n, 8, 1, 1)

#define TERN_GEMV_ROUTED_KERNEL(name, W, OMODE)                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * TERN_GEMV_WARPS)                                            \
        name(const unsigned long long* __restrict__ w_table, const unsigned long long* __restrict__ s_table,     \
             const int* __restrict__ ids, int x_div, const float* __restrict__ x, int in, int out,               \
             float* __restrict__ y) { tern_await_prior_kernel();                                                  \
        tern_gemv_routed<OMODE, W>(w_table, s_table, ids, x_div, x, in, out, y);                                  \
    }
TERN_GEMV_ROUTED_KERNEL(tern_gemv_routed_f32, TernWeightsF32, TERN_Y_PLAIN)
TERN_GEMV_ROUTED_KERNEL(tern_gemv_routed_bf16, TernWeightsBf16, TERN_Y_PLAIN)
TERN_GEMV_ROUTED_KERNEL(tern_gemv_routed_q8, TernWeightsQ8, TERN_Y_PLAIN)
TERN_GEMV_ROUTED_KERNEL(tern_gemv_routed_silu_f32, TernWeightsF32, TERN_Y_SILU)
TERN_GEMV_ROUTED_KERNEL(tern_gemv_routed_silu_bf16, TernWeightsBf16, TERN_Y_SILU)
TERN_GEMV_ROUTED_KERNEL(tern_gemv_routed_silu_q8, TernWeightsQ8, TERN_Y_SILU)

// Stored weights expanded to a GEMM operand (prefill): bf16 -> f32 (exact), Q8_0 -> f32
// (exact) or -> bf16 (d·q rounded to nearest even: the fast mode's operand rounding).
extern "C" __global__ void tern_expand_bf16_f32(const tern_bf16* __restrict__ w, size_t n, float* __restrict__ y) {
    tern_await_prior_kernel();
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x)
        y[e] = tern_bf16_to_f32(w[e]);
}

extern "C" __global__ void tern_expand_q8_f32(const signed char* __restrict__ q, const unsigned short* __restrict__ d,
                                              size_t n, float* __restrict__ y) {
    tern_await_prior_kernel();
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x)
        y[e] = tern_f16_to_f32(d[e / 32]) * (float)q[e];
}

extern "C" __global__ void tern_expand_q8_bf16(const signed char* __restrict__ q, const unsigned short* __restrict__ d,
                                               size_t n, tern_bf16* __restrict__ y) {
    tern_await_prior_kernel();
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x)
        y[e] = tern_bf16_from_f32(tern_f16_to_f32(d[e / 32]) * (float)q[e]);
}
