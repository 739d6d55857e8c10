// Device helpers shared by the encoder-side kernel families (norm, activation, rope,
// attention, pool, embedding, matmul). Prepended to each translation unit by its launcher, one
// NVRTC program per unit, so every identifier is prefixed tern_ and no header is needed at run
// time (bf16 is handled as raw bits). Compiled without fast-math: expf, division and sqrt are
// the IEEE-rounded functions, so the f32 mode differs from the CPU only in summation order.

typedef unsigned int tern_u32;
typedef unsigned short tern_bf16;

// Butterfly warp sums: every lane ends with the same bits (a + b == b + a), so any lane may
// write the result and the order is fixed for a given input.
__device__ __forceinline__ float tern_warp_sum(float x) {
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}
__device__ __forceinline__ double tern_warp_sum_d(double x) {
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}
__device__ __forceinline__ float tern_warp_max(float x) {
    for (int m = 16; m > 0; m >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
    return x;
}

// The inverse RMS of a row of d values whose squares sum to ss (in double), rounded to f32 once:
// every RMS norm's factor (norm.cu, the GEMV's norm tail, the head preparation), one formula.
__device__ __forceinline__ float tern_inv_rms_of(double ss, int d, float eps) { return (float)(1.0 / sqrt(ss / (double)d + (double)eps)); }

// Σ v² in double over a thread's S held values of a row of d (value j at column t + j·nt), in
// the order a strided loop over the row adds them (the norms' sums, pre = 1): the register
// forms of norm.cu and the GEMV's norm tail.
template <int S>
__device__ __forceinline__ double tern_held_sum_squares(const float (&v)[S], int t, int nt, int d) {
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < S; ++j)
        if (t + j * nt < d) {
            const double x = (double)(v[j] * 1.0f);
            ss += x * x;
        }
    return ss;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024) in double, returned to every
// thread. `scratch` holds 32 doubles; the call ends with a barrier so it can be reused.
__device__ double tern_block_sum_d(double x, double* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    x = tern_warp_sum_d(x);
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    double total = 0.0;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    __syncthreads();
    return total;
}

// The gated activations, in their CPU twins' forms (activation/mod.rs): gelu_tanh as the
// divisor form x / (1 + exp(-2z)), silu as x / (1 + exp(-x)), precise expf.
__device__ __forceinline__ float tern_gelu_tanh(float x) {
    const float beta = 0.7978846f, kappa = 0.044715f;
    const float z = beta * (x + kappa * (x * x * x));
    return x / (1.0f + expf(-2.0f * z));
}
__device__ __forceinline__ float tern_silu(float x) { return x / (1.0f + expf(-x)); }

// +infinity without math.h (NVRTC has no INFINITY macro).
__device__ __forceinline__ float tern_inf() { return __int_as_float(0x7f800000); }

// f32 -> bf16 bits, round to nearest even (as torch and half::bf16::from_f32 do); NaN stays
// a quiet NaN instead of rounding into infinity.
__device__ __forceinline__ tern_bf16 tern_bf16_from_f32(float x) {
    tern_u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (tern_bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (tern_bf16)(u >> 16);
}
__device__ __forceinline__ float tern_bf16_to_f32(tern_bf16 b) { return __uint_as_float(((tern_u32)b) << 16); }
// Two values as two bf16 in one u32 (lo at the lower address), each rounded as
// tern_bf16_from_f32 rounds it: the packed stores of every bf16 copy. (tern_tc_pack below is the
// tensor cores' operand form: one cvt instruction, whose NaN is the canonical one.)
__device__ __forceinline__ tern_u32 tern_bf16_pair(float lo, float hi) {
    return (tern_u32)tern_bf16_from_f32(lo) | ((tern_u32)tern_bf16_from_f32(hi) << 16);
}

// The attention kernels' window argument: a distance >= 0 (|i - j| <= it), TERN_ATT_NO_WINDOW
// (the whole sequence, both directions) or TERN_ATT_CAUSAL (j <= i: a prompt from an empty cache).
#define TERN_ATT_NO_WINDOW (-1)
#define TERN_ATT_CAUSAL (-2)

// The keys [lo, hi) that a tile of queries q0 .. q1 - 1 of a sequence of `len` can see.
__device__ __forceinline__ void tern_att_band(int q0, int q1, int len, int max_distance, int& lo, int& hi) {
    lo = 0;
    hi = len;
    if (max_distance >= 0) {
        lo = max(0, q0 - max_distance);
        hi = min(len, q1 - 1 + max_distance + 1);
    }
    if (max_distance == TERN_ATT_CAUSAL) hi = q1;  // the tile's last query sees keys up to itself
}

// Whether query qi sees key kj, for a key below its tile's `hi`.
__device__ __forceinline__ bool tern_att_visible(int qi, int kj, int hi, int max_distance) {
    bool visible = kj < hi;
    if (max_distance >= 0) visible = visible && kj >= qi - max_distance && kj <= qi + max_distance;
    if (max_distance == TERN_ATT_CAUSAL) visible = visible && kj <= qi;
    return visible;
}

// Tensor cores (sm_80 and later): two f32 -> one u32 of two bf16 (RNE), lo in the low half (the
// lower address / column); and c += A·B, mma.sync m16n8k16 with bf16 operands and f32
// accumulation, fragments as the PTX ISA lays them out (g = lane / 4, t = lane % 4): A (16 x 16,
// row-major) a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..);
// B (16 x 8, by column) b0 = (2t..2t+1, g), b1 = (2t + 8.., g); C (16 x 8) c[0..1] = (g, 2t..2t+1),
// c[2..3] = (g + 8, 2t..2t+1).
__device__ __forceinline__ tern_u32 tern_tc_pack(float lo, float hi) {
    tern_u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ void tern_tc_mma(float* c, tern_u32 a0, tern_u32 a1, tern_u32 a2, tern_u32 a3, tern_u32 b0, tern_u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
