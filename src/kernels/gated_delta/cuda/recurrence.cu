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
// two warp sums and nothing else: no shared memory, no barrier (but in the fused form below).
// Each sequence's state is its own buffer (`state_at`) or a slot of a pool (`slot`), so a
// batch can advance any set of sequences.
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

// A state row read by global-space loads. The row's address comes from memory (state_at), so
// the compiler cannot tell that it is global and would issue generic loads, which resolve the
// address space per access; the assumption lets it issue plain global ones.
template <int DK>
__device__ __forceinline__ void tern_gdn_load_state_row(const float* __restrict__ p, float (&r)[DK / 32]) {
    __builtin_assume(__isGlobal(p));
    tern_gdn_load_row<DK>(p, r);
}

// A state row written back: with 16-byte stores streaming (st.global.cs, evict-first), as the
// row is not read again in this launch. Measured on the H200 (gdn_bench decode, 8x1 rows):
// 68 -> 74% of copy at 16 sequences, 82 -> 88% at 64, 89 -> 90% at 256; the same hint on the
// loads measured no better. Same values, so the same bits.
template <int DK>
__device__ __forceinline__ void tern_gdn_store_state_row(float* __restrict__ p, const float (&r)[DK / 32]) {
    constexpr int E = DK / 32;
    if constexpr (E % 4 == 0) {
#pragma unroll
        for (int e = 0; e < E; e += 4) __stcs(reinterpret_cast<float4*>(p + e), make_float4(r[e], r[e + 1], r[e + 2], r[e + 3]));
    } else {
        tern_gdn_store_row<DK>(p, r);
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

// The recurrence's arguments, mirrored field for field by RecurrenceArgs in mod.rs (C layout).
// A sequence's state is state_at[s] when state_at is set (each sequence its own buffer: no
// copies into a pool and back for a batch), else slot slot[s] of the pool `states`.
struct tern_gdn_recurrence_args {
    float* states;
    const tern_gdn_u32* slot;
    const unsigned long long* state_at;
    const float* q;
    long long q_stride;
    const float* k;
    long long k_stride;
    const float* v;
    long long v_stride;
    // [tokens][nv]: the log-decay g and beta, or (fused) the raw projections alpha and b.
    const float* g;
    const float* beta;
    float* out;
    const tern_gdn_u32* seg_start;
    const tern_gdn_u32* seg_len;
    // Fused form only: the gates' dt_bias and a [nv], the output gate z (rows of z_stride,
    // head h at h * dv) and the gated norm's weight [dv] and epsilon.
    const float* dt_bias;
    const float* a;
    const float* z;
    long long z_stride;
    const float* norm_w;
    float norm_eps;
    int nk, nv, dv, grouped, l2qk;
    float eps, q_scale;
    // What the batch lets the kernel compute instead of load (DIRECT_* in mod.rs): bit 0, the
    // slots are consecutive from slot_base (pool states only); bit 1, sequence s is the one
    // token of row s. Then a decode step's first loads wait for no table. Bit 2 (EARLY_STATE):
    // no kernel that may still run as this one starts writes a state it reads (Gpu::state_reads_may_lead),
    // so the first state rows are requested before awaiting the kernel before
    // (tern_gdn_early_state).
    unsigned slot_base;
    int direct;
};

// The sums over the warp of ROWS values a lane holds, one per row, as tern_gdn_warp_sum forms
// each (butterfly levels 16, 8, 4, 2, 1), but at each of the first log2(ROWS) levels a lane
// keeps half of its rows (the upper half where its bit of that level is set) and sends the
// other half to its partner: ROWS - 1 + 5 - log2(ROWS) shuffles (9 for 8 rows) where ROWS
// butterflies take 5 ROWS (40). Each pairwise sum is the butterfly's own (the lane's value
// plus its partner's for the same row), so the sum a lane ends with has the butterfly's bits.
// Lane L ends with row L >> (5 - log2(ROWS)).
template <int ROWS>
struct tern_gdn_rows_log2 {
    static constexpr int value = ROWS == 1 ? 0 : ROWS == 2 ? 1 : ROWS == 4 ? 2 : 3;
    static_assert(ROWS == 1 << value, "rows a power of two up to 8");
};

template <int ROWS>
__device__ __forceinline__ float tern_gdn_rows_sum(const float (&x)[ROWS]) {
    constexpr int LOG = tern_gdn_rows_log2<ROWS>::value;
    const int lane = threadIdx.x & 31;
    float v[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; i++) v[i] = x[i];
#pragma unroll
    for (int level = 0; level < LOG; level++) {
        const int o = 16 >> level, half = (ROWS >> level) / 2;
        const bool upper = (lane & o) != 0;
#pragma unroll
        for (int i = 0; i < half; i++) {
            const float send = upper ? v[i] : v[i + half], keep = upper ? v[i + half] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
    }
#pragma unroll
    for (int o = 16 >> LOG; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    return v[0];
}

// One token's update of ROWS state rows held by a warp (normalised k and q, the rows' v, the
// decay exp(g) and beta), returning row m's output in lane m (m < ROWS). Row m's v is held by
// lane m alone (v_lane) and reaches the warp by shuffle: one register rather than ROWS, which
// keeps the 8-row forms inside 64 registers (a full multiprocessor of warps, the bytes in
// flight that the state stream needs). Every form of the recurrence (rows and groups per
// warp, fused or not) advances its rows through this one function, so they all agree bit for
// bit. SCATTER: the rows' sums by tern_gdn_rows_sum, each delta then broadcast from a lane
// that holds its row's sum (28 shuffles a token for 8 rows where the butterflies take 88); the
// same operations on every value, so the same bits.
template <int DK, int ROWS, bool SCATTER>
__device__ __forceinline__ float tern_gdn_rows_token(float (&r)[ROWS][DK / 32], const float (&kk)[DK / 32], const float (&qq)[DK / 32],
                                                     float v_lane, float decay, float b) {
    constexpr int E = DK / 32;
    const int lane = threadIdx.x & 31;
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
    // SCATTER: lane L holds the sums of row L >> SHIFT.
    constexpr int SHIFT = 5 - tern_gdn_rows_log2<ROWS>::value;
    float delta_mine = 0.0f;
    if constexpr (SCATTER) delta_mine = (__shfl_sync(0xffffffffu, v_lane, lane >> SHIFT) - tern_gdn_rows_sum<ROWS>(part)) * b;
    float o[ROWS];
#pragma unroll
    for (int m = 0; m < ROWS; m++) {
        const float delta = SCATTER ? __shfl_sync(0xffffffffu, delta_mine, m << SHIFT)
                                    : (__shfl_sync(0xffffffffu, v_lane, m) - tern_gdn_warp_sum(part[m])) * b;
        o[m] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) {
            r[m][e] += kk[e] * delta;
            o[m] += r[m][e] * qq[e];
        }
    }
    if constexpr (SCATTER) return __shfl_sync(0xffffffffu, tern_gdn_rows_sum<ROWS>(o), (lane % ROWS) << SHIFT);
#pragma unroll
    for (int m = 0; m < ROWS; m++) o[m] = tern_gdn_warp_sum(o[m]);
    // Every lane has every row's output; lane m keeps row m's, selected without indexing o at
    // run time (which would put it in local memory).
    float o_lane = 0.0f;
#pragma unroll
    for (int m = 0; m < ROWS; m++)
        if (lane == m) o_lane = o[m];
    return o_lane;
}

// Value heads of at most this many rows take the fused form (one block per head, 8 rows per
// warp, at most 16 warps).
#define TERN_GDN_FUSED_MAX_DV 128

// A warp advances ROWS consecutive rows of one head together: their loads are all in flight
// before the first use (the state stream needs many bytes in flight per multiprocessor to
// reach the memory bandwidth), and the token's k, q, g, beta and their normalisation are
// shared by the ROWS rows. With GPW > 1 the warp then takes the next row group, whose state it
// has already requested before the current group's tokens, so its loads overlap this group's
// arithmetic. Each row's arithmetic is exactly the one-row form's, so neither choice changes a
// bit of the result.
//
// FUSED (GPW = 1, one block of dv / ROWS warps per (sequence, head)): the gates are formed
// from the raw projections as tern_gdn_gates forms them, and each token's output row of the
// head goes through the gated RMS norm of tern_gdn_gated_rms_norm before it is written (the
// block meets in shared memory once per token; the sum of squares runs in that kernel's
// order), so a decode step's gates, recurrence and norm are one launch with the same bits as
// three.
// Whether the kernel requests its first state rows before it awaits the prior kernel
// (EARLY_STATE): it then awaits it in tern_gdn_recurrence_body, after those loads and before it
// reads anything else a kernel writes (the batch's tables are copies from the host).
__device__ __forceinline__ bool tern_gdn_early_state(const tern_gdn_recurrence_args& a) { return (a.direct & 4) != 0; }

template <int DK, int ROWS, int GPW, bool FUSED, bool SCATTER>
__device__ void tern_gdn_recurrence_body(const tern_gdn_recurrence_args& a, float* o_smem) {
    constexpr int E = DK / 32;
    const int lane = threadIdx.x % 32;
    const int nv = a.nv, dv = a.dv;
    // Row groups per head and in all; the launcher's grid (at most 2^31 warps' worth of groups
    // per sequence, as nv * dv fits an int) keeps these 32-bit, so no 64-bit division.
    const int groups = (dv + ROWS - 1) / ROWS;
    const int total = nv * groups;
    const int first = (int)(blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * GPW;
    // Uniform per warp, so an early exit never splits a warp before its shuffles (and in the
    // fused form every warp of a block is inside its head, so none leaves its barriers).
    if (first >= total) return;
    const int s = blockIdx.y;
    const unsigned slot = (a.direct & 1) ? a.slot_base + (unsigned)s : a.slot[s];
    float* seq_state = a.state_at ? (float*)a.state_at[s] : a.states + (size_t)slot * nv * dv * DK;
    const size_t start = (a.direct & 2) ? (size_t)s : a.seg_start[s], end = start + ((a.direct & 2) ? 1 : a.seg_len[s]);

    float r[ROWS][E], next[ROWS][E];
    {
        const int h = first / groups, j0 = first % groups * ROWS;
#pragma unroll
        for (int m = 0; m < ROWS; m++)
            if (j0 + m < dv) tern_gdn_load_state_row<DK>(seq_state + ((size_t)h * dv + j0 + m) * DK + lane * E, r[m]);
    }
    if (tern_gdn_early_state(a)) tern_await_prior_kernel();
#pragma unroll
    for (int p = 0; p < GPW; p++) {
        const int grp = first + p;
        if (grp >= total) break;
        if (p + 1 < GPW && grp + 1 < total) {
            const int hn = (grp + 1) / groups, jn = (grp + 1) % groups * ROWS;
#pragma unroll
            for (int m = 0; m < ROWS; m++)
                if (jn + m < dv) tern_gdn_load_state_row<DK>(seq_state + ((size_t)hn * dv + jn + m) * DK + lane * E, next[m]);
        }
        const int h = grp / groups, j0 = grp % groups * ROWS;
        const int kh = tern_gdn_key_head(h, a.nk, nv, a.grouped);
        // Lane m writes row j0 + m's output (m < ROWS), so it also holds what that row's
        // output takes beside the state (fused: the norm weight, and per token z), loaded with
        // the token's other operands rather than after the norm's barrier.
        const bool row_lane = lane < ROWS && j0 + lane < dv;
        float nw_lane = 0.0f;
        if constexpr (FUSED) {
            if (row_lane) nw_lane = a.norm_w[j0 + lane];
        }
        for (size_t t = start; t < end; t++) {
            float kk[E], qq[E];
            tern_gdn_load_row<DK>(a.k + t * a.k_stride + (size_t)kh * DK + lane * E, kk);
            tern_gdn_load_row<DK>(a.q + t * a.q_stride + (size_t)kh * DK + lane * E, qq);
            float decay, b;
            if constexpr (FUSED) {
                decay = expf(a.a[h] * tern_gdn_softplus(a.g[t * nv + h] + a.dt_bias[h]));
                b = 1.0f / (1.0f + expf(-a.beta[t * nv + h]));
            } else {
                decay = expf(a.g[t * nv + h]);
                b = a.beta[t * nv + h];
            }
            const float v_lane = row_lane ? a.v[t * a.v_stride + (size_t)h * dv + j0 + lane] : 0.0f;
            float z_lane = 0.0f;
            if constexpr (FUSED) {
                if (row_lane) z_lane = a.z[t * a.z_stride + (size_t)h * dv + j0 + lane];
            }
            if (a.l2qk) {
                tern_gdn_l2_regs<DK>(kk, a.eps, 1.0f);
                tern_gdn_l2_regs<DK>(qq, a.eps, a.q_scale);
            }
            const float o_lane = tern_gdn_rows_token<DK, ROWS, SCATTER>(r, kk, qq, v_lane, decay, b);
            float* row_out = a.out + (t * nv + h) * dv;
            if constexpr (FUSED) {
                // Two buffers by token parity: a warp writing token t + 1's row never meets one
                // still reading token t's, which passed this barrier before it could.
                float* head = o_smem + (t & 1) * TERN_GDN_FUSED_MAX_DV;
                if (row_lane) head[j0 + lane] = o_lane;
                __syncthreads();
                float ss = 0.0f;
                for (int i = lane; i < dv; i += 32) ss += head[i] * head[i];
                const float inv = 1.0f / sqrtf(tern_gdn_warp_sum(ss) / (float)dv + a.norm_eps);
                if (row_lane) row_out[j0 + lane] = ((o_lane * inv) * nw_lane) * tern_gdn_silu(z_lane);
            } else {
                if (row_lane) row_out[j0 + lane] = o_lane;
            }
        }
#pragma unroll
        for (int m = 0; m < ROWS; m++) {
            if (j0 + m < dv) tern_gdn_store_state_row<DK>(seq_state + ((size_t)h * dv + j0 + m) * DK + lane * E, r[m]);
#pragma unroll
            for (int e = 0; e < E; e++) r[m][e] = next[m][e];
        }
    }
}

// One kernel per (d_k, rows per warp, row groups per warp). These only trade registers
// against bytes in flight; the launcher's defaults are RECURRENCE_VARIANT and, for a decode
// step of many sequences, RECURRENCE_VARIANT_MANY in mod.rs.
//
// The register bound of the one-group and fused forms is chosen per d_k below. ONE_GROUP =
// TERN_GDN_RECURRENCE_FULL with FUSED_MIN_BLOCKS = 2 would hold them to 64 registers, so that a
// multiprocessor runs 32 warps of them. fla's recurrence, 8 rows per 64-register warp, runs at
// that occupancy and moves its state at 0.975 of copy (ncu, H200, 256 sequences; this file's
// 8x2 default: 25% occupancy, 0.93). At d_k = 128 that bound costs 16 bytes of spill (8 rows and
// the fused form; scripts/device-bench.sh times it); at 256 it would spill hundreds. Not yet
// timed, so every d_k keeps the registers its forms need.
//
// SCATTER (kernels _s: the 8-row forms and the fused one): the rows' sums by
// tern_gdn_rows_sum; the same bits, fewer shuffles. The launcher's default (faster or equal at
// 1-256 sequences on an H100; TERN_GDN_SCATTER=0 takes the butterflies).
// With them the one-group 8-row form fits 64 registers without spilling at d_k <= 128 (the
// butterflies' form spills 16 bytes there): _s64, bounded to 8 blocks a multiprocessor (32
// warps, the occupancy of fla's recurrence), TERN_GDN_SCATTER=64.
#define TERN_GDN_RECURRENCE_KERNEL(D, R, P, BOUNDS, SCATTER, SUFFIX)                                     \
    extern "C" __global__ void BOUNDS tern_gdn_recurrence_dk##D##_r##R##_g##P##SUFFIX(const tern_gdn_recurrence_args a) { \
        tern_await_prior_kernel_unless(tern_gdn_early_state(a));                                         \
        tern_gdn_recurrence_body<D, R, P, false, SCATTER>(a, nullptr);                                   \
    }
#define TERN_GDN_RECURRENCE(D, R, P) TERN_GDN_RECURRENCE_KERNEL(D, R, P, __launch_bounds__(128), false, )
#define TERN_GDN_RECURRENCE_S(D, R, P) TERN_GDN_RECURRENCE_KERNEL(D, R, P, __launch_bounds__(128), true, _s)
#define TERN_GDN_RECURRENCE_FULL(D, R, P) TERN_GDN_RECURRENCE_KERNEL(D, R, P, __launch_bounds__(128, 8), false, )
// The fused form: 8 rows per warp, a block of dv / 8 warps per (sequence, head).
#define TERN_GDN_RECURRENCE_FUSED(D, MIN_BLOCKS, SCATTER, SUFFIX)                                        \
    extern "C" __global__ void __launch_bounds__(32 * TERN_GDN_FUSED_MAX_DV / 8, MIN_BLOCKS)             \
        tern_gdn_recurrence_fused_dk##D##SUFFIX(const tern_gdn_recurrence_args a) {                      \
        tern_await_prior_kernel_unless(tern_gdn_early_state(a));                                         \
        __shared__ float o_smem[2 * TERN_GDN_FUSED_MAX_DV];                                              \
        tern_gdn_recurrence_body<D, 8, 1, true, SCATTER>(a, o_smem);                                     \
    }
#define TERN_GDN_RECURRENCE_D(D, ONE_GROUP, FUSED_MIN_BLOCKS)                                             \
    ONE_GROUP(D, 1, 1) ONE_GROUP(D, 2, 1) ONE_GROUP(D, 4, 1) ONE_GROUP(D, 8, 1)                          \
    TERN_GDN_RECURRENCE(D, 2, 2) TERN_GDN_RECURRENCE(D, 4, 2) TERN_GDN_RECURRENCE(D, 8, 2)              \
    TERN_GDN_RECURRENCE(D, 2, 4) TERN_GDN_RECURRENCE(D, 4, 4) TERN_GDN_RECURRENCE_FUSED(D, FUSED_MIN_BLOCKS, false, ) \
    TERN_GDN_RECURRENCE_S(D, 8, 1) TERN_GDN_RECURRENCE_S(D, 8, 2) TERN_GDN_RECURRENCE_FUSED(D, FUSED_MIN_BLOCKS, true, _s)
// The forms bounded to 64 registers: _s64 (above), and the fused form bounded to two blocks a
// multiprocessor (64 registers at the 512 threads of d_v = 128), with the butterflies (_b64:
// 16 bytes of spill at d_k = 128) and with the scatter sums (_s_b64: 32 bytes). The launcher's
// default (TERN_GDN_FUSED_BOUND=0 takes the unbounded form): the unbounded fused form holds one
// block a multiprocessor (96 or 90 registers), which at many sequences (a server's decode
// rounds) runs at 0.68 of copy. Timed on an H100 with the scatter sums (BENCHMARKS.md,
// eighteenth session): 530 -> 382 µs at 256 sequences, 33.2 -> 30.3 at 16, 7.28 -> 7.20 at one,
// for 16 or 32 bytes of spill.
#define TERN_GDN_RECURRENCE_64(D)                                              \
    TERN_GDN_RECURRENCE_KERNEL(D, 8, 1, __launch_bounds__(128, 8), true, _s64) \
    TERN_GDN_RECURRENCE_FUSED(D, 2, false, _b64) TERN_GDN_RECURRENCE_FUSED(D, 2, true, _s_b64)
TERN_GDN_RECURRENCE_D(32, TERN_GDN_RECURRENCE, 1)
TERN_GDN_RECURRENCE_D(64, TERN_GDN_RECURRENCE, 1)
TERN_GDN_RECURRENCE_D(128, TERN_GDN_RECURRENCE, 1)
TERN_GDN_RECURRENCE_D(256, TERN_GDN_RECURRENCE, 1)
TERN_GDN_RECURRENCE_64(32)
TERN_GDN_RECURRENCE_64(64)
TERN_GDN_RECURRENCE_64(128)
#undef TERN_GDN_RECURRENCE_D
#undef TERN_GDN_RECURRENCE_FUSED
#undef TERN_GDN_RECURRENCE_FULL
#undef TERN_GDN_RECURRENCE
#undef TERN_GDN_RECURRENCE_S
#undef TERN_GDN_RECURRENCE_64
#undef TERN_GDN_RECURRENCE_KERNEL
