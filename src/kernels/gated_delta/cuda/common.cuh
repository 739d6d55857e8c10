// Shared device helpers of the gated-delta family. Prepended to each of the family's
// translation units by the launcher (one NVRTC program per unit), so every identifier is
// prefixed tern_gdn_ and no macro is defined: a bare name could collide when units are
// combined. Compiled without fast-math: expf and logf are the precise library functions
// (the decay's error would compound along the sequence), and / and sqrtf are IEEE-rounded.

typedef unsigned int tern_gdn_u32;

// SiLU in the divisor form of the CPU twin, so that both round identically; for x -> -inf
// the divisor overflows to +inf and the result is -0, not NaN.
__device__ __forceinline__ float tern_gdn_silu(float x) { return x / (1.0f + expf(-x)); }

// log(1 + e^v). Guard at 20: exp overflows f32 above ~88.7, which would make g = -inf and
// wipe the head's state; above 20, softplus(v) - v < 2.1e-9, below an ulp of v. For
// x = e^v <= 1 the odd series of 2*atanh(x / (2 + x)) is free of the cancellation in
// log(1 + x) that would bias the chunked prefill's cumulative sums of g toward zero.
__device__ __forceinline__ float tern_gdn_softplus(float v) {
    if (v > 20.0f) return v;
    float x = expf(v);
    if (x > 1.0f) return logf(1.0f + x);
    float s = x / (2.0f + x);
    float s2 = s * s;
    float poly = 1.0f / 15.0f;
    poly = poly * s2 + 1.0f / 13.0f;
    poly = poly * s2 + 1.0f / 11.0f;
    poly = poly * s2 + 1.0f / 9.0f;
    poly = poly * s2 + 1.0f / 7.0f;
    poly = poly * s2 + 1.0f / 5.0f;
    poly = poly * s2 + 1.0f / 3.0f;
    poly = poly * s2 + 1.0f;
    return 2.0f * s * poly;
}

// The full-warp sum by butterfly exchange: after step m each lane holds the sum of its
// 2^m-lane group, and since a + b == b + a in IEEE arithmetic every lane ends with the SAME
// bits, so any lane may write the result and the order is fixed for a given input.
__device__ __forceinline__ float tern_gdn_warp_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 16);
    x += __shfl_xor_sync(0xffffffffu, x, 8);
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x;
}

// tern_gdn_warp_sum of N values, each exchange taken by all N together so that their N chains
// of shuffles are in flight at once: the same exchanges in the same order, so each value gets
// the bits tern_gdn_warp_sum gives it. (Not the one-value form's body: written as a loop,
// it moves the registers of kernels that call it.)
template <int N>
__device__ __forceinline__ void tern_gdn_warp_sums(float (&x)[N]) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
#pragma unroll
        for (int u = 0; u < N; u++) x[u] += __shfl_xor_sync(0xffffffffu, x[u], off);
}

// The key head that value head h reads: grouped (Hugging Face) or tiled (GGUF).
__device__ __forceinline__ int tern_gdn_key_head(int h, int nk, int nv, int grouped) {
    return grouped ? h / (nv / nk) : h % nk;
}
