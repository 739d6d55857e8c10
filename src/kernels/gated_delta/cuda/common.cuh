// Shared device helpers of the gated-delta family. Prepended to each of the family's
// translation units by the launcher (one NVRTC program per unit), so every identifier is
// prefixed tern_gdn_ and no macro is defined: a bare name could collide when units are
// combined. Compiled without fast-math: expf and logf are the precise library functions
// (the decay's error would compound along the sequence), and / and sqrtf are IEEE-rounded.

typedef unsigned int tern_gdn_u32;

// SiLU in the divisor form of the CPU twin, so that both round identically; for x -> -inf
// the divisor overflows to +inf and the result is -0, not NaN.
__device__ __forceinline__ float tern_gdn_silu(float x) { return x / (1.0f + expf(-x)); }

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

// The key head that value head h reads: grouped (Hugging Face) or tiled (GGUF).
__device__ __forceinline__ int tern_gdn_key_head(int h, int nk, int nv, int grouped) {
    return grouped ? h / (nv / nk) : h % nk;
}
