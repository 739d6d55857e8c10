// Causal depthwise conv1d + SiLU over a packed batch, decode step and scan in ONE kernel
// (a decode step is the scan over one-token segments). CPU twin: conv.rs.
//
// One thread owns one (sequence, channel, chunk of `chunk` positions): its K taps and its K - 1
// history values live in registers (K is a template parameter so the tap loops unroll and the
// arrays are never indexed at run time), and the chunk's positions are walked in order. The
// first chunk takes its history from the sequence's state slot, a later one from the raw
// inputs just before it (chunk >= K - 1, so they lie in the same sequence): the same values the
// walk would carry, so every output is the one a single walk over the segment computes, bit for
// bit, while a prompt's thousands of positions spread over many threads instead of one walk
// per channel. Only the first chunk's thread touches the state: it reads it first and writes
// the segment's last K - 1 raw inputs back at its end. The state keeps the RAW inputs, not the
// activated outputs: the next position convolves inputs. The accumulation starts from the
// newest tap and walks the history oldest first, the CPU twin's order and rounding
// (tern_conv_newest, tern_conv_add_tap: conv_sum.cuh).

template <int K>
__device__ void tern_gdn_conv_body(const float* __restrict__ x, const float* __restrict__ weight,
                                   float* __restrict__ conv_states, float* __restrict__ out,
                                   const tern_gdn_u32* __restrict__ seg_start, const tern_gdn_u32* __restrict__ seg_len,
                                   const tern_gdn_u32* __restrict__ slot,
                                   const unsigned long long* __restrict__ state_at, int channels, int chunk) {
    constexpr int T = K - 1;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y;
    if (c >= channels) return;
    const size_t start = seg_start[s], end = start + seg_len[s];
    const size_t p0 = start + (size_t)blockIdx.z * chunk;
    if (p0 >= end) return;
    const size_t p1 = end - p0 < (size_t)chunk ? end : p0 + chunk;
    const bool first = blockIdx.z == 0;
    float w[K];
#pragma unroll
    for (int t = 0; t < K; t++) w[t] = weight[(size_t)c * K + t];
    float hist[T > 0 ? T : 1];
    // The sequence's own state buffer (state_at), or its slot of a pool.
    float* st = (state_at ? (float*)state_at[s] : conv_states + (size_t)slot[s] * channels * T) + (size_t)c * T;
#pragma unroll
    for (int t = 0; t < T; t++) hist[t] = first ? st[t] : x[(p0 - T + t) * channels + c];
    for (size_t p = p0; p < p1; p++) {
        const float xc = x[p * channels + c];
        float acc = tern_conv_newest(xc, w[T]);
#pragma unroll
        for (int t = 0; t < T; t++) acc = tern_conv_add_tap(acc, hist[t], w[t]);
        out[p * channels + c] = tern_gdn_silu(acc);
#pragma unroll
        for (int t = 0; t + 1 < T; t++) hist[t] = hist[t + 1];
        if (T > 0) hist[T > 0 ? T - 1 : 0] = xc;
    }
    if (first) {
        // This thread walked the whole segment, or the segment is longer than a chunk (so
        // longer than K - 1) and its last K - 1 inputs are all in x.
#pragma unroll
        for (int t = 0; t < T; t++) st[t] = p1 == end ? hist[t] : x[(end - T + t) * channels + c];
    }
}

#define TERN_GDN_CONV(KW)                                                                              \
    extern "C" __global__ void tern_gdn_conv_k##KW(const float* x, const float* weight, float* conv_states, \
                                                   float* out, const tern_gdn_u32* seg_start,           \
                                                   const tern_gdn_u32* seg_len, const tern_gdn_u32* slot, \
                                                   const unsigned long long* state_at, int channels, int chunk) { \
        tern_await_prior_kernel();                                                                     \
        tern_gdn_conv_body<KW>(x, weight, conv_states, out, seg_start, seg_len, slot, state_at, channels, chunk); \
    }
TERN_GDN_CONV(1)
TERN_GDN_CONV(2)
TERN_GDN_CONV(3)
TERN_GDN_CONV(4)
TERN_GDN_CONV(5)
TERN_GDN_CONV(6)
TERN_GDN_CONV(7)
TERN_GDN_CONV(8)
#undef TERN_GDN_CONV
