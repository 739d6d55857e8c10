// Bidirectional flash attention over packed variable-length sequences on bf16 tensor cores
// (fast mode). Same operands, visibility rule and output as attention.cu; the numerics differ
// by design: Q, K and V are rounded to bf16 (RNE), S = Q·Kᵀ and O = P·V run on
// mma.sync m16n8k16 with f32 accumulation, the online softmax is f32 and P is rounded to bf16
// before P·V. The row sum l adds the ROUNDED p, so the weights that multiply V sum to one.
//
// One block of 8 warps per (tile of BQ queries of one sequence, query head). Warps come in
// groups of DSPLIT that share 16 query rows:
//  - HD <= 256: DSPLIT 1, BQ 128; a warp owns 16 rows x HD output columns (HD/2 f32 a lane);
//  - HD == 512: DSPLIT 2, BQ 64; the 16 x 512 accumulator does not fit one warp's registers,
//    so each warp of a pair owns 256 output columns. For S the pair splits the key columns of
//    the tile instead (each computes 16 rows x BK/2 keys over the whole head), exchanges the
//    row maxima through shared memory (a 64-thread named barrier) so that both keep the
//    same running max bit for bit, and writes its p to the shared P tile that both read for
//    P·V. Each warp keeps the partial row sum of its keys; the pair adds them at the end.
// K and V arrive as bf16, packed once per call by tern_attention_tc_pack_kv into
// [rows][kv_heads][HD] with zero columns past hd: every block of a sequence reads all of its
// keys, so rounding them once halves the bytes those reads move and leaves the blocks no
// conversion to do. K/V tiles of BK keys go straight from global memory into their
// shared tiles by cp.async, each copy overlapping tensor-core work (V of this tile while S is
// formed, K of the next tile while P·V runs), two barriers a tile. Rows past the visible band
// are zero-filled by cp.async (src-size 0), so tail tiles contribute exact zeros; masked
// scores are -inf before the max.
// With 8 warps an SM (the accumulator takes most of the registers) the kernel is bound by its
// shared-memory instructions and their latency (ncu, H200: MIO throttle and short scoreboard
// lead the stalls, the tensor pipe is a quarter busy), so the tile loop keeps everything else
// down: tiles of BK = 64 keys halve the per-key cost of the barriers, the softmax bookkeeping
// and the accumulator's rescale (with the other changes here, 32-key tiles took 2.98 ms against
// 2.51 for 8192 tokens of a 512-wide head, 0.520 against 0.490 ms for 64 x 512 of a
// 256-wide); a tile that every row of a warp sees whole skips the visibility tests; the
// rescale is skipped when no row of the warp has a new maximum (a multiply by exactly one);
// each thread's cp.async addresses are fixed offsets worked out once. S of a 512-wide head is
// summed in two interleaved partial accumulators, so that its chains of dependent mma are half
// as long.
// The Q, K and V tiles are swizzled rather than padded: rows of whole 128-byte lines, the
// 16-byte chunk c of row r stored at chunk c ^ (r & 7), so that the eight row reads of an
// ldmatrix phase (8 rows, one chunk) fall in distinct bank groups and a warp's cp.async fills
// whole lines (rows padded by 16 bytes cost the copies 2.5 times the shared wavefronts and 1.5
// times the L2 sectors of aligned ones). The P tile, written by 4-byte stores, keeps rows
// padded by 8 elements (16 bytes).
// The softmax works in base 2: the scores are scaled by scale·log2(e) and exponentiated with
// exp2f, one multiply-add and one exp2 per score.
// The launcher checks hd % 4 == 0, hd <= 512, 16-byte alignment of every offset and stride.

#define TERN_TC_WARPS 8

__device__ __forceinline__ tern_u32 tern_tc_smem(const void* p) {
    tern_u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void tern_tc_ldsm4(tern_u32 addr, tern_u32& r0, tern_u32& r1, tern_u32& r2, tern_u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}
__device__ __forceinline__ void tern_tc_ldsm4t(tern_u32 addr, tern_u32& r0, tern_u32& r1, tern_u32& r2, tern_u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}
// 16 bytes global -> shared, asynchronously; bytes == 0 writes zeros and reads nothing.
__device__ __forceinline__ void tern_tc_cp16(tern_u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tern_tc_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void tern_tc_cp_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Element offset, within its row, of 16-byte chunk c of swizzled row r.
__device__ __forceinline__ int tern_tc_swz(int r, int c) { return (c ^ (r & 7)) * 8; }
// Byte offset of chunk `even` + hb of a row whose r & 7 is r7, with x = hb ^ r7 (hb: 0 or 1):
// as `even` is even, even + hb = even ^ hb, so only x is per lane and `even` may be a constant.
__device__ __forceinline__ tern_u32 tern_tc_swz_bytes(int even, int x) { return 16 * ((even & ~7) + ((even & 7) ^ x)); }

template <int HD, int BK>
__device__ void tern_attention_tc_tile(const float* __restrict__ q, long long q_off, long long q_ld,
                                       const tern_bf16* __restrict__ k, const tern_bf16* __restrict__ v, int kv_heads,
                                       float* __restrict__ out, long long out_ld, tern_bf16* __restrict__ out16,
                                       const tern_u32* __restrict__ seg_start, const tern_u32* __restrict__ seg_len,
                                       const tern_u32* __restrict__ tile_seg, const tern_u32* __restrict__ tile_q0,
                                       int group, int hd, float scale, int max_distance) {
    constexpr int DSPLIT = HD > 256 ? 2 : 1;
    constexpr int DC = HD / DSPLIT;             // output columns of a warp
    constexpr int BQ = 16 * (TERN_TC_WARPS / DSPLIT);
    constexpr int NK = BK / DSPLIT;             // key columns of S a warp forms
    constexpr int NT = NK / 8;                  // their 8-key mma tiles
    constexpr int SP = (HD >= 512 && NT <= 4) ? 2 : 1;  // partial sums of S (shorter mma chains)
    constexpr int LD = HD;                      // bf16 row stride of the Q, K, V tiles (swizzled)
    constexpr int PLD = BK + 8;                 // bf16 row stride of the P tile
    constexpr int C4 = HD / 4;
    constexpr int THREADS = 32 * TERN_TC_WARPS;
    extern __shared__ float4 tern_tc_smem4[];
    tern_bf16* qs = (tern_bf16*)tern_tc_smem4;               // [BQ][LD]
    tern_bf16* ks = qs + BQ * LD;                            // [BK][LD]
    tern_bf16* vs = ks + BK * LD;                            // [BK][LD]
    tern_bf16* ps = vs + BK * LD;                            // [BQ][PLD]
    float* xch = (float*)(ps + BQ * PLD);                    // [warps][16] row maxima, then sums

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rg = warp / DSPLIT, wd = warp % DSPLIT;
    const int g = lane >> 2, tig = lane & 3;
    const int head = blockIdx.y, kv_head = head / group;
    const long long start = seg_start[tile_seg[blockIdx.x]];
    const int len = (int)seg_len[tile_seg[blockIdx.x]];
    const int q0 = (int)tile_q0[blockIdx.x];
    const int q1 = min(q0 + BQ, len);
    int lo, hi;
    tern_att_band(q0, q1, len, max_distance, lo, hi);
    // Packed rows of kv_heads · HD bf16 (tern_attention_tc_pack_kv).
    const long long kv_ld = (long long)kv_heads * HD;
    const tern_bf16* kbase = k + start * kv_ld + (long long)kv_head * HD;
    const tern_bf16* vbase = v + start * kv_ld + (long long)kv_head * HD;

    // Rows k0 .. k0+BK of K or V into a tile, 16 bytes (8 values) a copy; zeros past hi. A
    // thread copies column chunk lc of rows lr, lr + RSTEP, ...: fixed offsets from one base.
    constexpr int C8 = HD / 8;
    constexpr int RSTEP = THREADS / C8;
    static_assert(THREADS % C8 == 0 && BK % RSTEP == 0, "whole passes over a tile");
    const int lr = tid / C8, lc = (tid % C8) * 8;
    // Rows lr + i·RSTEP: r & 7 is lr's, or lr + 4's when RSTEP is 4 and i odd.
    const int sw_even = tern_tc_swz(lr, lc / 8), sw_odd = tern_tc_swz(lr + 4, lc / 8);
    const tern_u32 ks_mine = tern_tc_smem(ks) + 2 * lr * LD, vs_mine = tern_tc_smem(vs) + 2 * lr * LD;
    auto load_tile = [&](tern_u32 dst, const tern_bf16* base, int k0) {
        const tern_bf16* src = base + (long long)(k0 + lr) * kv_ld + lc;
#pragma unroll
        for (int i = 0; i < BK / RSTEP; ++i) {
            const bool ok = k0 + lr + i * RSTEP < hi;
            const int sw = ((i * RSTEP) & 7) ? sw_odd : sw_even;
            tern_tc_cp16(dst + 2 * (i * RSTEP * LD + sw), ok ? src + (long long)i * RSTEP * kv_ld : base, ok ? 16 : 0);
        }
        tern_tc_cp_commit();
    };

    load_tile(ks_mine, kbase, lo);
    // Q tile; rows past the sequence are zero (their results are never written).
    for (int e = tid; e < BQ * C4; e += THREADS) {
        const int r = e / C4, c = (e % C4) * 4;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (q0 + r < len && c < hd) x = *(const float4*)(q + q_off + (start + q0 + r) * q_ld + (long long)head * hd + c);
        uint2 u;
        u.x = tern_tc_pack(x.x, x.y);
        u.y = tern_tc_pack(x.z, x.w);
        *(uint2*)(qs + r * LD + tern_tc_swz(r, c / 8) + c % 8) = u;
    }

    // ldmatrix row addresses of this lane. A operands (Q, P; row-major 16x16): lanes 0-15 give
    // rows 0-15 at column 0, lanes 16-31 rows 0-15 at column 8. K as B of S (keys x d, no
    // transpose): matrices (keys 0-7, d 0), (keys 0-7, d 8), (keys 8-15, d 0), (keys 8-15, d 8)
    // = b0 b1 of two 8-key tiles. V as B of P·V (keys x d, transposed): (keys 0-7, d 0),
    // (keys 8-15, d 0), (keys 0-7, d 8), (keys 8-15, d 8) = b0 b1 of two 8-column tiles.
    // In the swizzled tiles each lane's row has r & 7 = lane & 7 (the rest of the row index is
    // a multiple of 8), so a lane's chunk offsets follow from one XOR key per operand.
    const int r7 = lane & 7;
    const tern_u32 a_q = tern_tc_smem(qs) + 2 * (16 * rg + (lane & 15)) * LD;
    const int xq = (lane >> 4) ^ r7;
    const tern_u32 a_p = tern_tc_smem(ps) + 2 * ((16 * rg + (lane & 15)) * PLD + (lane >> 4) * 8);
    const tern_u32 b_k = tern_tc_smem(ks) + 2 * (wd * NK + r7 + ((lane >> 4) << 3)) * LD;
    const int xk = ((lane >> 3) & 1) ^ r7;
    const tern_u32 b_v = tern_tc_smem(vs) + 2 * ((r7 + ((lane >> 3) & 1) * 8) * LD + wd * DC);
    const int xv = (lane >> 4) ^ r7;

    float acc[DC / 8][4];
#pragma unroll
    for (int n = 0; n < DC / 8; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[n][j] = 0.f;
    // This lane's rows: g and g + 8 of the warp's 16 (the C-fragment layout).
    const int qlo = q0 + 16 * rg + g, qhi = qlo + 8;
    float m_lo = -tern_inf(), m_hi = -tern_inf(), l_lo = 0.f, l_hi = 0.f;

    // Scores in base 2: s · scale · log2(e), so that p = exp2(s2 - m2) = exp(scale·s - m).
    const float scale2 = scale * 1.4426950408889634f;
    for (int k0 = lo; k0 < hi; k0 += BK) {
        tern_tc_cp_wait();
        __syncthreads();  // K in ks (and Q in qs); every warp is done with vs and ps of the previous tile
        load_tile(vs_mine, vbase, k0);

        float sp[SP][NT][4];
#pragma unroll
        for (int u = 0; u < SP; ++u)
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int j = 0; j < 4; ++j) sp[u][t][j] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            tern_u32 a0, a1, a2, a3;
            tern_tc_ldsm4(a_q + tern_tc_swz_bytes(2 * kk, xq), a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < NK / 16; ++np) {
                tern_u32 b0, b1, b2, b3;
                tern_tc_ldsm4(b_k + 2 * (np * 16 * LD) + tern_tc_swz_bytes(2 * kk, xk), b0, b1, b2, b3);
                tern_tc_mma(sp[kk % SP][2 * np], a0, a1, a2, a3, b0, b1);
                tern_tc_mma(sp[kk % SP][2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        float s[NT][4];
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int j = 0; j < 4; ++j) s[t][j] = SP > 1 ? sp[0][t][j] + sp[SP - 1][t][j] : sp[0][t][j];
        // Whether every row of this warp sees every key of the tile: then no visibility tests.
        const int wq0 = q0 + 16 * rg;
        bool whole = k0 + BK <= hi;
        if (max_distance >= 0) whole = whole && k0 >= wq0 + 15 - max_distance && k0 + BK - 1 <= wq0 + max_distance;
        if (max_distance == TERN_ATT_CAUSAL) whole = whole && k0 + BK - 1 <= wq0;
        float mx_lo = -tern_inf(), mx_hi = -tern_inf();
        if (whole) {
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    s[t][j] *= scale2;
                    s[t][2 + j] *= scale2;
                    mx_lo = fmaxf(mx_lo, s[t][j]);
                    mx_hi = fmaxf(mx_hi, s[t][2 + j]);
                }
        } else {
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int kj = k0 + wd * NK + 8 * t + 2 * tig + j;
                    const bool vlo = tern_att_visible(qlo, kj, hi, max_distance);
                    const bool vhi = tern_att_visible(qhi, kj, hi, max_distance);
                    s[t][j] = vlo ? s[t][j] * scale2 : -tern_inf();
                    s[t][2 + j] = vhi ? s[t][2 + j] * scale2 : -tern_inf();
                    mx_lo = fmaxf(mx_lo, s[t][j]);
                    mx_hi = fmaxf(mx_hi, s[t][2 + j]);
                }
        }
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
        if (DSPLIT > 1) {
            if (tig == 0) {
                xch[warp * 16 + g] = mx_lo;
                xch[warp * 16 + g + 8] = mx_hi;
            }
            asm volatile("bar.sync %0, %1;" ::"r"(1 + rg), "r"(32 * DSPLIT) : "memory");
            // Every warp of the group folds the same values in the same order: equal maxima.
            mx_lo = -tern_inf();
            mx_hi = -tern_inf();
#pragma unroll
            for (int o = 0; o < DSPLIT; ++o) {
                mx_lo = fmaxf(mx_lo, xch[(rg * DSPLIT + o) * 16 + g]);
                mx_hi = fmaxf(mx_hi, xch[(rg * DSPLIT + o) * 16 + g + 8]);
            }
        }
        const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
        // A row with no visible key yet (window not started, or past the sequence end) keeps
        // its state: no exp(-inf - -inf).
        const bool none_lo = mn_lo == -tern_inf(), none_hi = mn_hi == -tern_inf();
        const float al_lo = none_lo ? 1.f : exp2f(m_lo - mn_lo), al_hi = none_hi ? 1.f : exp2f(m_hi - mn_hi);
        m_lo = mn_lo;
        m_hi = mn_hi;
        l_lo *= al_lo;
        l_hi *= al_hi;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const tern_u32 plo = tern_tc_pack(none_lo ? 0.f : exp2f(s[t][0] - mn_lo), none_lo ? 0.f : exp2f(s[t][1] - mn_lo));
            const tern_u32 phi = tern_tc_pack(none_hi ? 0.f : exp2f(s[t][2] - mn_hi), none_hi ? 0.f : exp2f(s[t][3] - mn_hi));
            l_lo += __uint_as_float(plo << 16) + __uint_as_float(plo & 0xffff0000u);
            l_hi += __uint_as_float(phi << 16) + __uint_as_float(phi & 0xffff0000u);
            const int col = wd * NK + 8 * t + 2 * tig;
            *(tern_u32*)(ps + (16 * rg + g) * PLD + col) = plo;
            *(tern_u32*)(ps + (16 * rg + g + 8) * PLD + col) = phi;
        }
        // Once the maxima settle most tiles move none of them: al is exactly one for every row.
        if (__any_sync(0xffffffffu, al_lo != 1.f || al_hi != 1.f)) {
#pragma unroll
            for (int n = 0; n < DC / 8; ++n) {
                acc[n][0] *= al_lo;
                acc[n][1] *= al_lo;
                acc[n][2] *= al_hi;
                acc[n][3] *= al_hi;
            }
        }

        tern_tc_cp_wait();
        __syncthreads();  // V in vs; every warp is done with ks and has written its p
        if (k0 + BK < hi) load_tile(ks_mine, kbase, k0 + BK);

#pragma unroll
        for (int kc = 0; kc < BK / 16; ++kc) {
            tern_u32 a0, a1, a2, a3;
            tern_tc_ldsm4(a_p + kc * 32, a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < DC / 16; ++np) {
                tern_u32 b0, b1, b2, b3;
                tern_tc_ldsm4t(b_v + 2 * kc * 16 * LD + tern_tc_swz_bytes(2 * np, xv), b0, b1, b2, b3);
                tern_tc_mma(acc[2 * np], a0, a1, a2, a3, b0, b1);
                tern_tc_mma(acc[2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }
    }

    // Row sums: the lane partials over the quad, then over the warps of the group (the
    // maxima of the last tile were read before its second barrier, so xch is free).
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    if (DSPLIT > 1) {
        if (tig == 0) {
            xch[warp * 16 + g] = l_lo;
            xch[warp * 16 + g + 8] = l_hi;
        }
        asm volatile("bar.sync %0, %1;" ::"r"(1 + rg), "r"(32 * DSPLIT) : "memory");
        l_lo = 0.f;
        l_hi = 0.f;
#pragma unroll
        for (int o = 0; o < DSPLIT; ++o) {
            l_lo += xch[(rg * DSPLIT + o) * 16 + g];
            l_hi += xch[(rg * DSPLIT + o) * 16 + g + 8];
        }
    }
    const float inv_lo = 1.0f / l_lo, inv_hi = 1.0f / l_hi;
#pragma unroll
    for (int n = 0; n < DC / 8; ++n) {
        const int col = wd * DC + 8 * n + 2 * tig;
        if (col >= hd) continue;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int qi = half ? qhi : qlo;
            if (qi >= len) continue;
            const float inv = half ? inv_hi : inv_lo;
            const float o0 = acc[n][2 * half] * inv, o1 = acc[n][2 * half + 1] * inv;
            const long long at = (start + qi) * out_ld + (long long)head * hd + col;
            if (out) *(float2*)(out + at) = make_float2(o0, o1);
            if (out16) *(tern_u32*)(out16 + at) = tern_bf16_pair(o0, o1);
        }
    }
}

#define TERN_ATTENTION_TC_ENTRY(HD, BK)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * TERN_TC_WARPS, 1) tern_attention_tc_hd##HD##_bk##BK(              \
        const float* q, long long q_off, long long q_ld, const tern_bf16* k, const tern_bf16* v, int kv_heads,           \
        float* out, long long out_ld, tern_bf16* out16, const tern_u32* seg_start, const tern_u32* seg_len,              \
        const tern_u32* tile_seg, const tern_u32* tile_q0, int group, int hd, float scale, int max_distance) {           \
        tern_await_prior_kernel();                                                                                       \
        tern_attention_tc_tile<HD, BK>(q, q_off, q_ld, k, v, kv_heads, out, out_ld, out16, seg_start, seg_len, tile_seg, \
                                       tile_q0, group, hd, scale, max_distance);                                         \
    }
TERN_ATTENTION_TC_ENTRY(64, 64)
TERN_ATTENTION_TC_ENTRY(128, 64)
TERN_ATTENTION_TC_ENTRY(256, 64)
TERN_ATTENTION_TC_ENTRY(512, 64)

// K and V of `rows` rows (views with rows of kv_heads · hd f32) rounded to bf16 (RNE) into
// kb, vb = [rows][kv_heads][hdp], columns hd .. hdp - 1 zero: the operands of the kernels
// above, made once per call. Four values a thread (hd % 4 == 0, so a group never straddles hd).
extern "C" __global__ void tern_attention_tc_pack_kv(const float* __restrict__ k, long long k_off, long long k_ld,
                                                     const float* __restrict__ v, long long v_off, long long v_ld,
                                                     int rows, int kv_heads, int hd, int hdp, tern_bf16* __restrict__ kb,
                                                     tern_bf16* __restrict__ vb) {
    tern_await_prior_kernel();
    const int g4 = hdp / 4;
    const size_t groups = (size_t)rows * kv_heads * g4;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < groups; e += (size_t)gridDim.x * blockDim.x) {
        const int c = (int)(e % g4) * 4, h = (int)(e / g4 % kv_heads);
        const long long r = (long long)(e / g4 / kv_heads);
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f), y = x;
        if (c < hd) {
            x = *(const float4*)(k + k_off + r * k_ld + (long long)h * hd + c);
            y = *(const float4*)(v + v_off + r * v_ld + (long long)h * hd + c);
        }
        uint2 a, b;
        a.x = tern_tc_pack(x.x, x.y); a.y = tern_tc_pack(x.z, x.w);
        b.x = tern_tc_pack(y.x, y.y); b.y = tern_tc_pack(y.z, y.w);
        *(uint2*)(kb + 4 * e) = a;
        *(uint2*)(vb + 4 * e) = b;
    }
}
