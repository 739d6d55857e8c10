// The delta-rule recurrence, decode step and sequential scan in ONE kernel: a decode step is
// the scan over one-token segments, so n steps and a scan of n tokens run the same
// instructions on the same values and agree bit for bit. CPU twin: recurrence.rs.
//
// The state is TRANSPOSED, state[h*dv*DK + j*DK + i] = S_h[i][j]: row j of head h is DK
// contiguous floats and, per token, needs only this token's k, q, v[j], g and beta. One warp
// owns one (sequence, head, row): lane L holds the DK/32 CONTIGUOUS elements starting at
// L*DK/32 in registers (one 16-byte access per lane at DK = 128, the warp's 512 bytes
// coalesced), walks the segment's tokens, and writes the row back once. Per token:
//
//   row *= exp(g);  delta = (v[j] - row.k) * beta;  row += k * delta;  out[j] = row.q
//
// two warp sums and nothing else: no shared memory, no barrier. The state slot of each
// sequence comes from `slot`, so a batch can advance any subset of a pool of states.
//
// Optional fusion (l2qk): q and k arrive raw (e.g. straight from the conv output, with row
// strides) and are L2-normalised in registers, q also scaled, exactly as
// tern_gdn_normalize_qk would, so the normalised copies never touch device memory.

template <int DK>
__device__ __forceinline__ void tern_gdn_load_row(const float* __restrict__ p, float (&r)[DK / 32]) {
    constexpr int E = DK / 32;
    if constexpr (E % 4 == 0) {
#pragma unroll
        for (int e = 0; e < E; e += 4) {
            const float4 v = *reinterpret_cast<const float4*>(p + e);
            r[e] = v.x; r[e + 1] = v.y; r[e + 2] = v.z; r[e + 3] = v.w;
        }
    } else if constexpr (E % 2 == 0) {
#pragma unroll
        for (int e = 0; e < E; e += 2) {
            const float2 v = *reinterpret_cast<const float2*>(p + e);
            r[e] = v.x; r[e + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int e = 0; e < E; e++) r[e] = p[e];
    }
}

template <int DK>
__device__ __forceinline__ void tern_gdn_store_row(float* __restrict__ p, const float (&r)[DK / 32]) {
    constexpr int E = DK / 32;
    if constexpr (E % 4 == 0) {
#pragma unroll
        for (int e = 0; e < E; e += 4) *reinterpret_cast<float4*>(p + e) = make_float4(r[e], r[e + 1], r[e + 2], r[e + 3]);
    } else if constexpr (E % 2 == 0) {
#pragma unroll
        for (int e = 0; e < E; e += 2) *reinterpret_cast<float2*>(p + e) = make_float2(r[e], r[e + 1]);
    } else {
#pragma unroll
        for (int e = 0; e < E; e++) p[e] = r[e];
    }
}

// In registers, as tern_gdn_normalize_qk does in memory: x <- (x / sqrt(sum x^2 + eps)) * scale.
template <int DK>
__device__ __forceinline__ void tern_gdn_l2_regs(float (&x)[DK / 32], float eps, float scale) {
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < DK / 32; e++) ss += x[e] * x[e];
    const float inv = 1.0f / sqrtf(tern_gdn_warp_sum(ss) + eps);
#pragma unroll
    for (int e = 0; e < DK / 32; e++) x[e] = (x[e] * inv) * scale;
}

template <int DK>
__device__ void tern_gdn_recurrence_body(float* __restrict__ states, const float* __restrict__ q, long long q_stride,
                                         const float* __restrict__ k, long long k_stride, const float* __restrict__ v,
                                         long long v_stride, const float* __restrict__ g,
                                         const float* __restrict__ beta, float* __restrict__ out,
                                         const tern_gdn_u32* __restrict__ seg_start,
                                         const tern_gdn_u32* __restrict__ seg_len, const tern_gdn_u32* __restrict__ slot,
                                         int nk, int nv, int dv, int grouped, int l2qk, float eps, float q_scale) {
    constexpr int E = DK / 32;
    const int lane = threadIdx.x % 32;
    const long long pair = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;  // h * dv + j
    // Uniform per warp, so an early exit never splits a warp before its shuffles.
    if (pair >= (long long)nv * dv) return;
    const int s = blockIdx.y;
    const int h = (int)(pair / dv), j = (int)(pair % dv);
    const int kh = tern_gdn_key_head(h, nk, nv, grouped);
    float* row = states + ((size_t)slot[s] * nv * dv + pair) * DK + lane * E;

    float r[E];
    tern_gdn_load_row<DK>(row, r);
    const size_t start = seg_start[s], end = start + seg_len[s];
    for (size_t t = start; t < end; t++) {
        float kk[E], qq[E];
        tern_gdn_load_row<DK>(k + t * k_stride + (size_t)kh * DK + lane * E, kk);
        tern_gdn_load_row<DK>(q + t * q_stride + (size_t)kh * DK + lane * E, qq);
        if (l2qk) {
            tern_gdn_l2_regs<DK>(kk, eps, 1.0f);
            tern_gdn_l2_regs<DK>(qq, eps, q_scale);
        }
        const float decay = expf(g[t * nv + h]);
        const float b = beta[t * nv + h];
        const float vj = v[t * v_stride + (size_t)h * dv + j];
        float part = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) {
            r[e] *= decay;
            part += r[e] * kk[e];
        }
        const float delta = (vj - tern_gdn_warp_sum(part)) * b;
        float o = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) {
            r[e] += kk[e] * delta;
            o += r[e] * qq[e];
        }
        o = tern_gdn_warp_sum(o);
        if (lane == 0) out[(t * nv + h) * dv + j] = o;
    }
    tern_gdn_store_row<DK>(row, r);
}

#define TERN_GDN_RECURRENCE(D)                                                                             \
    extern "C" __global__ void __launch_bounds__(128) tern_gdn_recurrence_dk##D(                           \
        float* states, const float* q, long long q_stride, const float* k, long long k_stride, const float* v, \
        long long v_stride, const float* g, const float* beta, float* out, const tern_gdn_u32* seg_start,  \
        const tern_gdn_u32* seg_len, const tern_gdn_u32* slot, int nk, int nv, int dv, int grouped, int l2qk, \
        float eps, float q_scale) {                                                                        \
        tern_gdn_recurrence_body<D>(states, q, q_stride, k, k_stride, v, v_stride, g, beta, out, seg_start,  \
                                    seg_len, slot, nk, nv, dv, grouped, l2qk, eps, q_scale);              \
    }
TERN_GDN_RECURRENCE(32)
TERN_GDN_RECURRENCE(64)
TERN_GDN_RECURRENCE(128)
TERN_GDN_RECURRENCE(256)
#undef TERN_GDN_RECURRENCE
