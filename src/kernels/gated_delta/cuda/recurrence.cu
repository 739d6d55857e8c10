// The delta-rule recurrence, decode step and sequential scan in ONE kernel: a decode step is
// the scan over one-token segments, so n steps and a scan of n tokens run the same
// instructions on the same values and agree bit for bit. CPU twin: recurrence.rs.
//
// The state is TRANSPOSED, state[h*dv*DK + j*DK + i] = S_h[i][j]: row j of head h is DK
// contiguous floats and, per token, needs only this token's k, q, v[j], g and beta. One warp
// owns a group of rows of one (sequence, head) (below); for each row, lane L holds the DK/32 CONTIGUOUS elements starting at
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

// A warp advances ROWS consecutive rows of one head together: their loads are all in flight
// before the first use (the state stream needs many bytes in flight per multiprocessor to
// reach the memory bandwidth), and the token's k, q, g, beta and their normalisation are
// shared by the ROWS rows. With GPW > 1 the warp then takes the next row group, whose state it
// has already requested before the current group's tokens, so its loads overlap this group's
// arithmetic. Each row's arithmetic is exactly the one-row form's, so neither choice changes a
// bit of the result.
template <int DK, int ROWS, int GPW>
__device__ void tern_gdn_recurrence_body(float* __restrict__ states, const float* __restrict__ q, long long q_stride,
                                         const float* __restrict__ k, long long k_stride, const float* __restrict__ v,
                                         long long v_stride, const float* __restrict__ g,
                                         const float* __restrict__ beta, float* __restrict__ out,
                                         const tern_gdn_u32* __restrict__ seg_start,
                                         const tern_gdn_u32* __restrict__ seg_len, const tern_gdn_u32* __restrict__ slot,
                                         int nk, int nv, int dv, int grouped, int l2qk, float eps, float q_scale) {
    constexpr int E = DK / 32;
    const int lane = threadIdx.x % 32;
    const int groups = (dv + ROWS - 1) / ROWS;  // row groups per head
    const long long total = (long long)nv * groups;
    const long long first = ((long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * GPW;
    // Uniform per warp, so an early exit never splits a warp before its shuffles.
    if (first >= total) return;
    const int s = blockIdx.y;
    float* seq_state = states + (size_t)slot[s] * nv * dv * DK;
    const size_t start = seg_start[s], end = start + seg_len[s];

    float r[ROWS][E], next[ROWS][E];
    {
        const int h = (int)(first / groups), j0 = (int)(first % groups) * ROWS;
#pragma unroll
        for (int m = 0; m < ROWS; m++)
            if (j0 + m < dv) tern_gdn_load_row<DK>(seq_state + ((size_t)h * dv + j0 + m) * DK + lane * E, r[m]);
    }
#pragma unroll
    for (int p = 0; p < GPW; p++) {
        const long long grp = first + p;
        if (grp >= total) break;
        if (p + 1 < GPW && grp + 1 < total) {
            const int hn = (int)((grp + 1) / groups), jn = (int)((grp + 1) % groups) * ROWS;
#pragma unroll
            for (int m = 0; m < ROWS; m++)
                if (jn + m < dv) tern_gdn_load_row<DK>(seq_state + ((size_t)hn * dv + jn + m) * DK + lane * E, next[m]);
        }
        const int h = (int)(grp / groups), j0 = (int)(grp % groups) * ROWS;
        const int kh = tern_gdn_key_head(h, nk, nv, grouped);
        for (size_t t = start; t < end; t++) {
            float kk[E], qq[E];
            tern_gdn_load_row<DK>(k + t * k_stride + (size_t)kh * DK + lane * E, kk);
            tern_gdn_load_row<DK>(q + t * q_stride + (size_t)kh * DK + lane * E, qq);
            const float decay = expf(g[t * nv + h]);
            const float b = beta[t * nv + h];
            float vj[ROWS];
#pragma unroll
            for (int m = 0; m < ROWS; m++) vj[m] = j0 + m < dv ? v[t * v_stride + (size_t)h * dv + j0 + m] : 0.0f;
            if (l2qk) {
                tern_gdn_l2_regs<DK>(kk, eps, 1.0f);
                tern_gdn_l2_regs<DK>(qq, eps, q_scale);
            }
            float part[ROWS];
#pragma unroll
            for (int m = 0; m < ROWS; m++) {
                part[m] = 0.0f;
#pragma unroll
                for (int e = 0; e < E; e++) {
                    r[m][e] *= decay;
                    part[m] += r[m][e] * kk[e];
                }
            }
            float o[ROWS];
#pragma unroll
            for (int m = 0; m < ROWS; m++) {
                const float delta = (vj[m] - tern_gdn_warp_sum(part[m])) * b;
                o[m] = 0.0f;
#pragma unroll
                for (int e = 0; e < E; e++) {
                    r[m][e] += kk[e] * delta;
                    o[m] += r[m][e] * qq[e];
                }
            }
#pragma unroll
            for (int m = 0; m < ROWS; m++) {
                o[m] = tern_gdn_warp_sum(o[m]);
                if (lane == 0 && j0 + m < dv) out[(t * nv + h) * dv + j0 + m] = o[m];
            }
        }
#pragma unroll
        for (int m = 0; m < ROWS; m++) {
            if (j0 + m < dv) tern_gdn_store_row<DK>(seq_state + ((size_t)h * dv + j0 + m) * DK + lane * E, r[m]);
#pragma unroll
            for (int e = 0; e < E; e++) r[m][e] = next[m][e];
        }
    }
}

// One kernel per (d_k, rows per warp, row groups per warp). These only trade registers
// against bytes in flight; the launcher's default is RECURRENCE_VARIANT in mod.rs.
#define TERN_GDN_RECURRENCE(D, R, P)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) tern_gdn_recurrence_dk##D##_r##R##_g##P(              \
        float* states, const float* q, long long q_stride, const float* k, long long k_stride, const float* v, \
        long long v_stride, const float* g, const float* beta, float* out, const tern_gdn_u32* seg_start,  \
        const tern_gdn_u32* seg_len, const tern_gdn_u32* slot, int nk, int nv, int dv, int grouped, int l2qk, \
        float eps, float q_scale) { tern_await_prior_kernel();                                             \
        tern_gdn_recurrence_body<D, R, P>(states, q, q_stride, k, k_stride, v, v_stride, g, beta, out,     \
                                          seg_start, seg_len, slot, nk, nv, dv, grouped, l2qk, eps, q_scale); \
    }
#define TERN_GDN_RECURRENCE_D(D)                                                                          \
    TERN_GDN_RECURRENCE(D, 1, 1) TERN_GDN_RECURRENCE(D, 2, 1) TERN_GDN_RECURRENCE(D, 4, 1)              \
    TERN_GDN_RECURRENCE(D, 8, 1) TERN_GDN_RECURRENCE(D, 2, 2) TERN_GDN_RECURRENCE(D, 4, 2)              \
    TERN_GDN_RECURRENCE(D, 2, 4) TERN_GDN_RECURRENCE(D, 4, 4)
TERN_GDN_RECURRENCE_D(32)
TERN_GDN_RECURRENCE_D(64)
TERN_GDN_RECURRENCE_D(128)
TERN_GDN_RECURRENCE_D(256)
#undef TERN_GDN_RECURRENCE_D
#undef TERN_GDN_RECURRENCE
