// Fast mode of the chunked prefill: the algebra of chunked.cu (CPU twin chunked.rs, oracle the
// sequential scan), with every product on the tensor cores (mma.sync m16n8k16, bf16 operands,
// f32 accumulation; the inverse's, m16n8k8 in 3xTF32) and the state kept in f32 registers from
// chunk to chunk. Only the operands are rounded: q/k/v after their L2 norm, the UT-transform
// matrices, the per-chunk Delta and the copy of the state that the products read; every sum, G,
// T = (I + A)^-1 (to within 3xTF32's products) and the carried state stay f32 (G in f64).
//
// Two launches, as the f32 form, but the sequential one does only what depends on the state:
//
//  1. tern_gdn_tc_prepare_*: one block per (value head, chunk); the heads of a chunk are
//     neighbours in the grid, so the second head of a key head finds q and k in L2. Builds
//     KK^T and QK^T on tensor cores, A, T = (I + A)^-1 (16 x 16 diagonal blocks by f32
//     substitution, then the blocks below them in two levels of tensor-core products in
//     3xTF32, near f32), W = T diag(beta e^G) K and
//     U = T diag(beta) V on tensor cores, and writes W, U, the decayed read-out weights and
//     the decays (per value head) and the normalised bf16 q and k (per key head, by the first
//     value head that reads it).
//  2. tern_gdn_tc_state_*: one block per (value head, 32 state rows, sequence) (64 rows in the
//     warpgroup form's default, and a sequence in segments where the decay allows:
//     tern_gdn_tc_state_wg_body), walking the chunks in order with the next chunks' operands
//     in flight (cp.async, 2 or 3 stages). The
//     prepare pass stores those operands as the state pass keeps them in shared memory (in
//     8 x 8 blocks: tern_gdn_tc_tile_at; k transposed; U in slices of 32 columns), so they are
//     copied verbatim, in whole runs. Per
//     chunk: Delta = U - W S and P = Q S (one pass over S), o = e^G P + QKd Delta,
//     S = e^{G_L} S + K^T (e^{G_L - G_c} Delta). The state's 32 x d_k slice lives in the
//     accumulators of the update product; a bf16 copy in shared memory feeds the next chunk.
//
// Fragment layouts are those of the PTX ISA for mma.m16n8k16 (g = lane / 4, q = lane % 4):
// A a0 (g, 2q..2q+1) a1 (g+8, 2q..) a2 (g, 2q+8..) a3 (g+8, 2q+8..); B b0 (k 2q..2q+1, n g)
// b1 (k 2q+8.., n g); C c0,c1 (g, 2q..2q+1) c2,c3 (g+8, 2q..). ldmatrix.x4 fills them from
// shared memory (.trans where the operand is stored with n contiguous). Shared rows are padded
// by 8 bf16 (16 bytes), so the eight 16-byte rows of one 8 x 8 matrix fall on distinct banks.

constexpr int tern_gdn_tc_c = 64;     // tokens per chunk
constexpr int tern_gdn_tc_bv = 32;    // state rows (value columns) per state block
constexpr int tern_gdn_tc_ldc = 72;   // padded row of a [64][64] bf16 tile
constexpr int tern_gdn_tc_prep_threads = 256;  // a prepare block's (eight warps)

typedef unsigned short tern_gdn_bf16;

// The builtin rather than inline cvta: the compiler sees the conversion and folds the tile
// offsets into 32-bit shared addresses.
__device__ __forceinline__ unsigned tern_gdn_tc_saddr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void tern_gdn_tc_ldm(unsigned (&r)[4], const tern_gdn_bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(tern_gdn_tc_saddr(p)));
}

__device__ __forceinline__ void tern_gdn_tc_ldm_t(unsigned (&r)[4], const tern_gdn_bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(tern_gdn_tc_saddr(p)));
}

__device__ __forceinline__ void tern_gdn_tc_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Round to nearest even; `lo` goes to the lower half (the lower column index).
__device__ __forceinline__ unsigned tern_gdn_tc_pack(float lo, float hi) {
    unsigned d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ tern_gdn_bf16 tern_gdn_tc_bf16(float x) {
    tern_gdn_bf16 d;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(d) : "f"(x));
    return d;
}

// Element e (0: the low half) of two bf16 packed in a word, widened.
__device__ __forceinline__ float tern_gdn_tc_f32_of_pair(unsigned word, int e) {
    return __uint_as_float(e ? word & 0xffff0000u : word << 16);
}

__device__ __forceinline__ void tern_gdn_tc_cp16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(tern_gdn_tc_saddr(smem)), "l"(gmem) : "memory");
}

// A fragment of the 16 x 16 tile at (m0, k0) of a row-major [m][k] array.
__device__ __forceinline__ void tern_gdn_tc_frag_a(unsigned (&r)[4], const tern_gdn_bf16* x, int ld, int m0, int k0) {
    const int lane = threadIdx.x & 31;
    tern_gdn_tc_ldm(r, x + (m0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
}

// B fragments of two n8 tiles (n0 and n0 + 8) over k0 .. k0 + 16, from an array stored [n][k]
// (k contiguous): r[0], r[1] are b0, b1 of the first tile, r[2], r[3] of the second.
__device__ __forceinline__ void tern_gdn_tc_frag_b_nk(unsigned (&r)[4], const tern_gdn_bf16* x, int ld, int n0, int k0) {
    const int lane = threadIdx.x & 31;
    tern_gdn_tc_ldm(r, x + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + ((lane >> 3) & 1) * 8);
}

// The same from an array stored [k][n] (n contiguous), through the transposing load.
__device__ __forceinline__ void tern_gdn_tc_frag_b_kn(unsigned (&r)[4], const tern_gdn_bf16* x, int ld, int n0, int k0) {
    const int lane = threadIdx.x & 31;
    tern_gdn_tc_ldm_t(r, x + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}

// The tiles the prepare pass hands to the state pass (W, q and the read-out weights as [64][row],
// k transposed as [row][64]) are stored in 8 x 8 blocks: the eight 16-byte rows of a block
// contiguous (128 bytes), the blocks of a group of 8 rows one after another along the row, the
// groups after each other. Copied verbatim into shared memory (16-byte cp.async pieces, or
// whole runs as one bulk copy), every 8 x 8 matrix that ldmatrix reads is one block (its rows on
// eight distinct bank groups), and the tile is in the layout the warpgroup products read
// (../../wgmma.cuh: lbo 128 bytes, sbo 16 row bytes). Element (r, c):
__device__ __forceinline__ int tern_gdn_tc_tile_at(int r, int c, int row) {
    return (r >> 3) * (8 * row) + (c >> 3) * 64 + (r & 7) * 8 + (c & 7);
}

__device__ __forceinline__ void tern_gdn_tc_frag_a_tile(unsigned (&r)[4], const tern_gdn_bf16* x, int row, int m0, int k0) {
    const int lane = threadIdx.x & 31;
    tern_gdn_tc_ldm(r, x + tern_gdn_tc_tile_at(m0 + (lane & 15), k0 + (lane >> 4) * 8, row));
}

// B fragments as tern_gdn_tc_frag_b_nk's, from a tile stored [n][k] in blocks.
__device__ __forceinline__ void tern_gdn_tc_frag_b_nk_tile(unsigned (&r)[4], const tern_gdn_bf16* x, int row, int n0, int k0) {
    const int lane = threadIdx.x & 31;
    tern_gdn_tc_ldm(r, x + tern_gdn_tc_tile_at(n0 + (lane & 7) + (lane >> 4) * 8, k0 + ((lane >> 3) & 1) * 8, row));
}

// q, k, v are f32 or bf16 rows (the kernel's IN); strides count elements.
struct tern_gdn_tc_prep_args {
    const void* q; long long q_stride;
    const void* k; long long k_stride;
    const void* v; long long v_stride;
    const float* g; const float* beta;
    const tern_gdn_u32* chunk_t0; const tern_gdn_u32* chunk_len;
    tern_gdn_bf16* w_s; tern_gdn_bf16* u_s; tern_gdn_bf16* qk_s; float* dec_s;
    tern_gdn_bf16* qn_s; tern_gdn_bf16* kn_s;
    tern_gdn_u32* ctl;  // the state pass's segment words (tern_gdn_tc_state_wg_body), zeroed here; or null
    int nk, nv, grouped, l2qk;
    float eps, q_scale;
    int ctl_len;
};

// Rows of one operand of the chunk into bf16 shared memory, one warp per row (rows r0 + 8u,
// u < NR, for warp r0 % 8), L2-normalised (times `scale`) when asked, as tern_gdn_l2_rows_smem
// does but with each lane's squares summed over its own columns (so not its bits); rows past
// len are zeros. With `out`, the bf16 rows also go to global memory. Lane l holds columns
// E l .. E l + E - 1 (E = D / 32), fetched with one vector load a row. The fetch issues all NR
// rows' loads before any is used, so their latencies overlap, and keeps them as loaded: bf16
// rows (IN = tern_gdn_bf16) stay packed two to a register and are widened where they are used,
// so no conversion waits on a load while later rows are still to be requested. The
// row-to-warp assignment and the arithmetic depend neither on NR nor on IN (a bf16 value
// widens exactly): rows of bf16 values give the same bits either way.
template <int D, int NR, typename IN>
struct tern_gdn_tc_rows;

template <int D, int NR>
struct tern_gdn_tc_rows<D, NR, float> {
    static constexpr int E = D / 32;
    static_assert(E == 2 || E == 4, "rows of 64 or 128");
    float x[NR][E];
    __device__ __forceinline__ void fetch(const float* src, long long stride, size_t t0, int len, size_t col0, int r0) {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int u = 0; u < NR; u++) {
            const int r = r0 + 8 * u;
            const float* p = src + (t0 + r) * stride + col0 + E * lane;
            if constexpr (E == 4) {
                const float4 v = r < len ? *reinterpret_cast<const float4*>(p) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                x[u][0] = v.x, x[u][1] = v.y, x[u][2] = v.z, x[u][3] = v.w;
            } else {
                const float2 v = r < len ? *reinterpret_cast<const float2*>(p) : make_float2(0.0f, 0.0f);
                x[u][0] = v.x, x[u][1] = v.y;
            }
        }
    }
    __device__ __forceinline__ float at(int u, int e) const { return x[u][e]; }
};

template <int D, int NR>
struct tern_gdn_tc_rows<D, NR, tern_gdn_bf16> {
    static constexpr int E = D / 32, W = E / 2;
    static_assert(E == 2 || E == 4, "rows of 64 or 128");
    unsigned w[NR][W];  // element 2m in the low half of word m (little-endian)
    __device__ __forceinline__ void fetch(const tern_gdn_bf16* src, long long stride, size_t t0, int len, size_t col0, int r0) {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int u = 0; u < NR; u++) {
            const int r = r0 + 8 * u;
            const tern_gdn_bf16* p = src + (t0 + r) * stride + col0 + E * lane;
            if constexpr (W == 2) {
                const uint2 v = r < len ? *reinterpret_cast<const uint2*>(p) : make_uint2(0u, 0u);
                w[u][0] = v.x, w[u][1] = v.y;
            } else {
                w[u][0] = r < len ? *reinterpret_cast<const unsigned*>(p) : 0u;
            }
        }
    }
    __device__ __forceinline__ float at(int u, int e) const {
        return tern_gdn_tc_f32_of_pair(w[u][e >> 1], e & 1);
    }
};

template <int D, int NR, typename IN>
__device__ void tern_gdn_tc_put(tern_gdn_bf16* dst, const tern_gdn_tc_rows<D, NR, IN>& rows, int len, int r0, int norm, float eps, float scale, tern_gdn_bf16* out) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
    // The rows' sums of squares reduced side by side (tern_gdn_warp_sums): NR shuffle chains in
    // flight rather than one after another.
    float inv[NR];
    if (norm) {
#pragma unroll
        for (int u = 0; u < NR; u++) {
            inv[u] = 0.0f;
#pragma unroll
            for (int e = 0; e < E; e++) inv[u] += rows.at(u, e) * rows.at(u, e);
        }
        tern_gdn_warp_sums(inv);
        // Every lane holds the same sums: lane u takes row u's 1/sqrt (IEEE sqrt and divide,
        // each a branching sequence) and passes it on, where each lane took all NR of them. The
        // same operations on the same values: the same bits.
        float mine = inv[0];
#pragma unroll
        for (int u = 1; u < NR; u++)
            if (lane == u) mine = inv[u];
        mine = 1.0f / sqrtf(mine + eps);
#pragma unroll
        for (int u = 0; u < NR; u++) inv[u] = __shfl_sync(0xffffffffu, mine, u);
    }
#pragma unroll
    for (int u = 0; u < NR; u++) {
        const int r = r0 + 8 * u;
        float x[E];
#pragma unroll
        for (int e = 0; e < E; e++) x[e] = rows.at(u, e);
        if (norm && r < len) {
#pragma unroll
            for (int e = 0; e < E; e++) x[e] = (x[e] * inv[u]) * scale;
        }
        // E bf16 in one store: 8 bytes (E = 4) or 4 (E = 2); the E columns lie in one 16-byte
        // row of a block of the tile.
        unsigned packed[E / 2];
#pragma unroll
        for (int m = 0; m < E / 2; m++) packed[m] = tern_gdn_tc_pack(x[2 * m], x[2 * m + 1]);
        const auto store = [&](tern_gdn_bf16* at) {
            if constexpr (E == 4) *reinterpret_cast<uint2*>(at) = make_uint2(packed[0], packed[1]);
            else *reinterpret_cast<unsigned*>(at) = packed[0];
        };
        store(dst + r * (D + 8) + E * lane);
        if (out) store(out + tern_gdn_tc_tile_at(r, E * lane, D));
    }
}

template <int D, int NR, typename IN>
__device__ void tern_gdn_tc_load_rows(tern_gdn_bf16* dst, const IN* src, long long stride, size_t t0, int len, size_t col0,
                                      int norm, float eps, float scale, tern_gdn_bf16* out) {
    for (int r0 = threadIdx.x >> 5; r0 < tern_gdn_tc_c; r0 += 8 * NR) {
        tern_gdn_tc_rows<D, NR, IN> rows;
        rows.fetch(src, stride, t0, len, col0, r0);
        tern_gdn_tc_put<D, NR>(dst, rows, len, r0, norm, eps, scale, out);
    }
}

// A quad's four 4-byte words of one accumulator row, word n of quad lane q being columns
// 8n + 2q, 8n + 2q + 1 of n8 tile n, transposed: afterwards lane q holds words (q, 0..3), the 16
// contiguous bytes of tile q, so that the quad stores 64 contiguous bytes (whole sectors) in
// four 16-byte stores instead of sixteen 4-byte ones. In round s lane q receives word q of quad
// lane (q + s) & 3; the register picks are selects, as a run-time index would put the words in
// local memory. Moves bits only.
__device__ __forceinline__ uint4 tern_gdn_tc_quad_transpose(const unsigned (&w)[4]) {
    const int lane = threadIdx.x & 31, q = lane & 3;
    unsigned out[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int s = 0; s < 4; s++) {
        const int send = (q - s) & 3, from = (q + s) & 3;
        unsigned v = w[0];
#pragma unroll
        for (int n = 1; n < 4; n++)
            if (send == n) v = w[n];
        const unsigned got = s == 0 ? v : __shfl_sync(0xffffffffu, v, (lane & ~3) | from);
#pragma unroll
        for (int n = 0; n < 4; n++)
            if (from == n) out[n] = got;
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
}

// Where element (r, c) of a chunk's [64][N] result goes in global memory: W in blocks
// (tern_gdn_tc_tile_at), or U's columns in slices of the state pass's 32 rows, [N / 32][64][32],
// so that each state block's slice is one run of bytes.
template <int N, bool SLICED>
__device__ __forceinline__ int tern_gdn_tc_out_at(int r, int c) {
    if constexpr (SLICED) return (c >> 5) * (64 * tern_gdn_tc_bv) + r * tern_gdn_tc_bv + (c & 31);
    else return tern_gdn_tc_tile_at(r, c, N);
}

// out[r][n] = sum_c X[r][c] Y[c][n] for the chunk's 64 rows and N columns (X [64][64] lower
// triangular with the padded row, Y [64][N] row-major with row N + 8), to global bf16
// (tern_gdn_tc_out_at). A warp's k-steps end at its rows' diagonal block: those past it would
// add products of X's zeros (nothing to a sum). Eight warps: warp
// w owns rows 16 (w % 4).. and half of the columns, taken GROUP n8 tiles at a time (X's
// fragments loaded again for each group): all of them (NT) in one pass, or 4 (32 columns) with
// WIDE_STORES, which then fit the compact layout's 80 registers at N = 128 (in one pass the
// fragment addresses spill) and leave as 16-byte stores (tern_gdn_tc_quad_transpose). Each
// accumulator sums over the same k in the same order either way: the same bits.
template <int N, bool WIDE_STORES, bool SLICED>
__device__ void tern_gdn_tc_apply(const tern_gdn_bf16* X, const tern_gdn_bf16* Y, tern_gdn_bf16* out) {
    constexpr int NT = N / 16;  // n8 tiles per warp
    constexpr int GROUP = WIDE_STORES ? 4 : NT;
    static_assert(NT % GROUP == 0 && GROUP % 2 == 0, "whole groups of n8 tile pairs");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int m0 = 16 * (warp & 3);
    // Not unrolled: the scheduler would hoist the next group's loads into this one's registers.
#pragma unroll 1
    for (int grp = 0; grp < NT / GROUP; grp++) {
        const int nb = (warp >> 2) * (N / 2) + 8 * GROUP * grp;
        float acc[GROUP][4];
#pragma unroll
        for (int n = 0; n < GROUP; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[n][e] = 0.0f;
#pragma unroll
        for (int kt = 0; kt < 4; kt++) {
            if (16 * kt > m0) break;
            unsigned a[4];
            tern_gdn_tc_frag_a(a, X, tern_gdn_tc_ldc, m0, 16 * kt);
#pragma unroll
            for (int np = 0; np < GROUP / 2; np++) {
                unsigned b[4];
                tern_gdn_tc_frag_b_kn(b, Y, N + 8, nb + 16 * np, 16 * kt);
                tern_gdn_tc_mma(acc[2 * np], a, b[0], b[1]);
                tern_gdn_tc_mma(acc[2 * np + 1], a, b[2], b[3]);
            }
        }
        if constexpr (WIDE_STORES) {
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                unsigned w[4];
#pragma unroll
                for (int u = 0; u < 4; u++) w[u] = tern_gdn_tc_pack(acc[u][2 * hf], acc[u][2 * hf + 1]);
                *reinterpret_cast<uint4*>(out + tern_gdn_tc_out_at<N, SLICED>(m0 + g + 8 * hf, nb + 8 * q)) = tern_gdn_tc_quad_transpose(w);
            }
        } else {
#pragma unroll
            for (int n = 0; n < GROUP; n++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int r = m0 + g + 8 * hf, c = nb + 8 * n + 2 * q;
                    *reinterpret_cast<unsigned*>(out + tern_gdn_tc_out_at<N, SLICED>(r, c)) = tern_gdn_tc_pack(acc[n][2 * hf], acc[n][2 * hf + 1]);
                }
        }
    }
}

// Row stride of the f32 64 x 64 arrays A and T (and of the inverse's partials, which lie in
// A): a multiple of 4 floats, so that rows are 16-byte aligned for ldmatrix (the tf32 A
// fragments of tern_gdn_tc_inverse_blocks) and for 8-byte vector stores and reads, and 8 banks
// from one row to the next, so that the eight rows of an mma accumulator's 8-byte stores fall on
// distinct banks in each half warp, the tf32 B operand's 32 reads (four rows of eight) on 32
// banks, and the substitution's two 16 x 16 blocks a warp reads on different banks (at 65
// floats a row, under ncu on an H100, A's stores took 2.7 times their ideal wavefronts and the
// pass 7% longer with bf16 rows). An ldmatrix of eight such rows meets itself twice a bank
// (rows r and r + 4), the one conflict this stride leaves.
constexpr int tern_gdn_tc_lda = tern_gdn_tc_c + 8;

// Where tern_gdn_tc_prepare_body keeps its arrays in shared memory. Wide: every array apart
// (106 KB at d_k = d_v = 128, two blocks a multiprocessor). Compact: arrays whose lives do not
// meet share room (71 KB, three blocks a multiprocessor), in the body's phases
//   1. k, q, v rows in; KK^T and QK^T, A written     live: G, beta, e^G, K, V, Q, A
//   2. T's diagonal blocks, then the blocks below     live: G, beta, e^G, K, V, A, T
//   3. the two scaled bf16 copies of T                live: beta, e^G, K, V, T, Tw, Tu
//   4. W and U                                        live: K, V, Tw, Tu
// so Q (dead after phase 1) lies under T, and Tw, Tu (born in phase 3) under A (dead after
// phase 2). A barrier separates each phase from the next, so no read of an array's last phase
// meets a write of the array that takes its place. Same arithmetic in both layouts, so the
// same bits.
template <int DK, int DV, bool COMPACT>
struct tern_gdn_tc_prep_smem {
    static constexpr int C = tern_gdn_tc_c, LDA = tern_gdn_tc_lda, LDT = tern_gdn_tc_ldc;
    static constexpr int SCALARS = 8 * C + 4 * 2 * C;  // G (f64), beta, e^G
    static constexpr int MAT = 4 * C * LDA;            // A or T, f32
    static constexpr int KROWS = 2 * C * (DK + 8), VROWS = 2 * C * (DV + 8), TCOPY = 2 * C * LDT;
    static constexpr int QROOM = KROWS > MAT ? KROWS : MAT;          // compact: Q | T
    static constexpr int AROOM = MAT > 2 * TCOPY ? MAT : 2 * TCOPY;  // compact: A | Tw, Tu
    static constexpr int BYTES = COMPACT ? SCALARS + KROWS + VROWS + QROOM + AROOM
                                         : SCALARS + 2 * MAT + 2 * KROWS + VROWS + 2 * TCOPY;
    static_assert(SCALARS % 16 == 0 && KROWS % 16 == 0 && VROWS % 16 == 0 && QROOM % 16 == 0 && MAT % 16 == 0 &&
                      TCOPY % 16 == 0,
                  "every tile starts on 16 bytes (ldmatrix rows, A's and T's vector reads)");
    double* G;
    float *Bt, *Ex, *As, *Ts;
    tern_gdn_bf16 *Kb, *Qb, *Vb, *Tw, *Tu;
    __device__ explicit tern_gdn_tc_prep_smem(unsigned char* base) {
        G = reinterpret_cast<double*>(base);
        Bt = reinterpret_cast<float*>(G + C);
        Ex = Bt + C;
        unsigned char* at = base + SCALARS;
        auto take = [&at](int bytes) { unsigned char* p = at; at += bytes; return p; };
        if constexpr (COMPACT) {
            Kb = reinterpret_cast<tern_gdn_bf16*>(take(KROWS));
            Vb = reinterpret_cast<tern_gdn_bf16*>(take(VROWS));
            unsigned char* q_room = take(QROOM);
            unsigned char* a_room = take(AROOM);
            Qb = reinterpret_cast<tern_gdn_bf16*>(q_room);
            Ts = reinterpret_cast<float*>(q_room);
            As = reinterpret_cast<float*>(a_room);
            Tw = reinterpret_cast<tern_gdn_bf16*>(a_room);
            Tu = reinterpret_cast<tern_gdn_bf16*>(a_room + TCOPY);
        } else {
            As = reinterpret_cast<float*>(take(MAT));
            Ts = reinterpret_cast<float*>(take(MAT));
            Kb = reinterpret_cast<tern_gdn_bf16*>(take(KROWS));
            Qb = reinterpret_cast<tern_gdn_bf16*>(take(KROWS));
            Vb = reinterpret_cast<tern_gdn_bf16*>(take(VROWS));
            Tw = reinterpret_cast<tern_gdn_bf16*>(take(TCOPY));
            Tu = reinterpret_cast<tern_gdn_bf16*>(take(TCOPY));
        }
    }
};

// The host sizes the launch by the same sum (tc_prepare_smem in mod.rs; its test pins these).
static_assert(tern_gdn_tc_prep_smem<128, 128, false>::BYTES == 108544, "wide layout at 128 x 128: as mod.rs sizes it");
static_assert(tern_gdn_tc_prep_smem<128, 128, true>::BYTES == 72704, "compact layout at 128 x 128: as mod.rs sizes it");
static_assert(tern_gdn_tc_prep_smem<64, 64, true>::BYTES == 56320, "compact layout at 64 x 64: as mod.rs sizes it");

// tf32 tensor-core products for T's off-diagonal blocks (mma.sync m16n8k8: A a0 (g, q), a1 (g + 8,
// q), a2 (g, q + 4), a3 (g + 8, q + 4); B b0 (k q, n g), b1 (k q + 4, n g); C as m16n8k16's).
// Each f32 operand is split into a tf32 head and the tf32 rounding of its remainder, and a
// product takes the three terms that matter (head x head, head x tail, tail x head: 3xTF32), so
// its error is near f32's (about 2^-21 of each term) where a single tf32 product's would be 2^-11.
__device__ __forceinline__ unsigned tern_gdn_tc_tf32(float x) {
    unsigned d;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(d) : "f"(x));
    return d;
}

__device__ __forceinline__ void tern_gdn_tc_mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a b in 3xTF32, the two small terms first (they would vanish added after the large one).
__device__ __forceinline__ void tern_gdn_tc_mma_3xtf32(float (&c)[4], const float (&a)[4], float b0, float b1) {
    unsigned ah[4], al[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        ah[i] = tern_gdn_tc_tf32(a[i]);
        al[i] = tern_gdn_tc_tf32(a[i] - __uint_as_float(ah[i]));
    }
    const unsigned bh0 = tern_gdn_tc_tf32(b0), bh1 = tern_gdn_tc_tf32(b1);
    const unsigned bl0 = tern_gdn_tc_tf32(b0 - __uint_as_float(bh0)), bl1 = tern_gdn_tc_tf32(b1 - __uint_as_float(bh1));
    tern_gdn_tc_mma_tf32(c, al, bh0, bh1);
    tern_gdn_tc_mma_tf32(c, ah, bl0, bl1);
    tern_gdn_tc_mma_tf32(c, ah, bh0, bh1);
}

// The A fragment of the 16 x 8 block at (m0, k0) of a row-major f32 array (rows 16-byte
// aligned): ldmatrix moves 16-byte rows, four floats, and hands lane l word l % 4 of row l / 4 of
// each 8 x 4 piece, which is (g, q) of the pieces at rows m0, m0 + 8 and columns k0, k0 + 4.
__device__ __forceinline__ void tern_gdn_tc_frag_a_f32(float (&a)[4], const float* x, int ld, int m0, int k0) {
    const int lane = threadIdx.x & 31;
    unsigned r[4];
    tern_gdn_tc_ldm(r, reinterpret_cast<const tern_gdn_bf16*>(x + (m0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + k0 + (lane >> 4) * 4));
#pragma unroll
    for (int i = 0; i < 4; i++) a[i] = __uint_as_float(r[i]);
}

// c[j] += (the 16 x 8 k-step at rows m0, columns k0 of row-major X) (the 8 x 8 k-step at rows
// k0, columns n0 + 8j of row-major Y), j < NT: X's fragment loaded once for the NT tiles (an
// ldmatrix of eight rows 8 banks apart meets itself twice a bank: the dearer operand), Y's
// elements one a lane (at a row stride of 8 banks, the warp's 32 reads fall on 32 banks).
template <int NT>
__device__ __forceinline__ void tern_gdn_tc_kstep_f32(float (&c)[NT][4], const float* x, const float* y, int ld, int m0, int k0, int n0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    float a[4];
    tern_gdn_tc_frag_a_f32(a, x, ld, m0, k0);
#pragma unroll
    for (int j = 0; j < NT; j++) tern_gdn_tc_mma_3xtf32(c[j], a, y[(k0 + q) * ld + n0 + 8 * j + g], y[(k0 + q + 4) * ld + n0 + 8 * j + g]);
}

// A warp's 16 x 8 NT accumulator tiles to rows m0.., columns n0.. of a row-major f32 array,
// times s.
template <int NT>
__device__ __forceinline__ void tern_gdn_tc_store_f32(float* x, int ld, int m0, int n0, const float (&c)[NT][4], float s) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        *reinterpret_cast<float2*>(x + (m0 + g) * ld + n0 + 8 * j + 2 * q) = make_float2(s * c[j][0], s * c[j][1]);
        *reinterpret_cast<float2*>(x + (m0 + g + 8) * ld + n0 + 8 * j + 2 * q) = make_float2(s * c[j][2], s * c[j][3]);
    }
}

// The blocks of T = (I + A)^-1 below its diagonal 16 x 16 blocks (already in Ts), in two levels
// of the block-triangular inverse [[L0, 0], [B, L1]]^-1 = [[L0^-1, 0], [-L1^-1 B L0^-1, L1^-1]],
// on the tensor cores in 3xTF32. The f32 form before it, one multiply-add a thread an output,
// read A's and T's rows through shared memory again for every 128 outputs: 35-40% of the pass's
// wavefronts under ncu on an H100. This form took the pass 3-4% shorter there at 32k tokens
// (BENCHMARKS.md, thirty-seventh session), with the same errors to three digits.
//  1. the 32 x 32 diagonal blocks' lower-left blocks, T10 = -T11 (A10 T00) and T32 = -T33 (A32
//     T22): warp b of the first two computes block b (T10 or T32), its partial (the product in
//     brackets) staying with the warp;
//  2. the lower-left 32 x 32 block, -T[32:][32:] (A[32:][:32] T[:32][:32]): warp (m, n) of the
//     first four computes rows 16m.., columns 16n.. of the partial, then of the block, which
//     takes the partial's columns 16n.. from both row halves: the four meet at a barrier of
//     their own (bar.sync 1) between.
// Each warp takes whole 16-row A fragments across 16 columns (two n8 tiles): the fragment, the
// dearer operand, is loaded once for both. The partials go through shared memory from the
// accumulator layout to the B operand's, in A's first rows, which no later read needs (level
// 1's [2][16][16] in A[:16][:32]: the substitution, done, read A's diagonal blocks, and level 1
// reads A10 and A32, in other rows; level 2's [32][32] in A[:32][:32]: level 1 is done with its
// partials and A10 at the barrier before, and level 2 reads A[32:][:32]). T's blocks above its
// 16 x 16 block diagonal were never written (other arrays live there in the compact layout):
// the k-steps over them are skipped, never multiplied. The diagonal blocks' stored zeros above
// their diagonals are multiplied.
template <int LDA>
__device__ __forceinline__ void tern_gdn_tc_inverse_blocks(float* As, float* Ts) {
    static_assert(LDA % 4 == 0 && LDA % 32 == 8, "16-byte rows for ldmatrix; 8 banks a row for the B reads and the stores");
    const int warp = threadIdx.x >> 5;
    if (warp < 2) {
        const int o = 32 * warp;         // T[o + 16..][o..]
        float* const part = As + 16 * warp;  // [16][16], stride LDA
        float p[2][4] = {}, t[2][4] = {};
#pragma unroll
        for (int k0 = 0; k0 < 16; k0 += 8) tern_gdn_tc_kstep_f32(p, As + o * LDA + o, Ts + o * LDA + o, LDA, 16, k0, 0);
        tern_gdn_tc_store_f32(part, LDA, 0, 0, p, 1.0f);
        __syncwarp();
#pragma unroll
        for (int k0 = 0; k0 < 16; k0 += 8) tern_gdn_tc_kstep_f32(t, Ts + o * LDA + o + 16, part, LDA, 16, k0, 0);
        tern_gdn_tc_store_f32(Ts + (o + 16) * LDA + o, LDA, 0, 0, t, -1.0f);
    }
    __syncthreads();
    if (warp < 4) {
        const int m0 = 16 * (warp & 1), n0 = 16 * (warp >> 1);
        float p[2][4] = {}, t[2][4] = {};
#pragma unroll
        for (int k0 = 0; k0 < 32; k0 += 8) {
            if (k0 < n0) continue;  // T[:16][16:32]: above the block diagonal
            tern_gdn_tc_kstep_f32(p, As, Ts, LDA, 32 + m0, k0, n0);
        }
        // A[:32][:32] is read by neither product (level 1's partials there are spent).
        tern_gdn_tc_store_f32(As, LDA, m0, n0, p, 1.0f);
        asm volatile("bar.sync %0, %1;" ::"r"(1), "r"(128) : "memory");
#pragma unroll
        for (int k0 = 0; k0 < 32; k0 += 8) {
            if (m0 == 0 && k0 >= 16) continue;  // T[32:48][48:]: above the block diagonal
            tern_gdn_tc_kstep_f32(t, Ts + 32, As, LDA, 32 + m0, k0, n0);
        }
        // T[32:][:32] is read by neither product: written without a barrier before.
        tern_gdn_tc_store_f32(Ts, LDA, 32 + m0, n0, t, -1.0f);
    }
    __syncthreads();
}

// NR: rows of q, k and v a warp fetches at once (1 or 8; the results are the same bits). The
// wide layout with NR = 8 holds a warp's 8 rows of k and of q in registers together (100
// registers, two blocks a multiprocessor); the compact one fetches k's rows (the gates' loads
// waiting with them), then q's and v's, prefetched into L2 meanwhile (three blocks need <= 80
// registers).
//
// TILED (the launcher's default, FAST_VARIANT in mod.rs): the same bits with fewer shared-memory
// reads and global stores (measured under ncu on the H200, the untiled pass is bound by its
// shared-memory pipe, and a fifth of its global store sectors are partly filled):
//  - the decayed QK^T tile and W, U leave in whole 16-byte pieces (tern_gdn_tc_quad_transpose);
//  - the scaled bf16 copies of T are written two columns a store.
//
// IN: the element type of q, k and v (float, or tern_gdn_bf16 for bf16 rows: half the bytes
// read, the same arithmetic from the widened values). With 8 rows a fetch, bf16 rows of k, q
// and v are all requested at once (ALL_TOGETHER: 48 registers of packed rows, one wait for
// memory where f32 rows take three), and f32 rows of k and q together in the wide layout.
template <int DK, int DV, int NR, bool COMPACT, bool TILED, typename IN = float>
__device__ void tern_gdn_tc_prepare_body(const tern_gdn_tc_prep_args& a) {
    constexpr int C = tern_gdn_tc_c, LDA = tern_gdn_tc_lda, LDT = tern_gdn_tc_ldc;
    constexpr bool ALL_TOGETHER = NR == 8 && sizeof(IN) == 2;
    constexpr bool KQ_TOGETHER = NR == 8 && !COMPACT && !ALL_TOGETHER;
    const int h = blockIdx.x, chunk = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nk = a.nk, nv = a.nv;
    const int kh = tern_gdn_key_head(h, nk, nv, a.grouped);
    // The first value head of each key head writes the key head's normalised q and k.
    const bool writer = a.grouped ? h % (nv / nk) == 0 : h < nk;
    const size_t t0 = a.chunk_t0[chunk];
    const int len = (int)a.chunk_len[chunk];
    const size_t ch = (size_t)chunk * nv + h, chk = (size_t)chunk * nk + kh;
    const IN *qs = static_cast<const IN*>(a.q), *ks = static_cast<const IN*>(a.k), *vs = static_cast<const IN*>(a.v);
    // The state pass's tickets and flags start at zero: it is launched after this pass and
    // awaits its end (tern_await_prior_kernel), so no memset launch is needed.
    if (a.ctl && chunk == 0)
        for (int i = h * blockDim.x + tid; i < a.ctl_len; i += gridDim.x * blockDim.x) a.ctl[i] = 0u;

    extern __shared__ __align__(16) unsigned char tern_gdn_tc_smem[];
    const tern_gdn_tc_prep_smem<DK, DV, COMPACT> sm(tern_gdn_tc_smem);
    double* const G = sm.G;          // [C] cumulative log-decay
    float* const Bt = sm.Bt;         // [C] beta
    float* const Ex = sm.Ex;         // [C] exp(G_r)
    float* const As = sm.As;         // [C][LDA] A (strictly lower)
    float* const Ts = sm.Ts;         // [C][LDA] T (lower)
    tern_gdn_bf16* const Kb = sm.Kb; // [C][DK + 8]
    tern_gdn_bf16* const Qb = sm.Qb; // [C][DK + 8]
    tern_gdn_bf16* const Vb = sm.Vb; // [C][DV + 8]
    tern_gdn_bf16* const Tw = sm.Tw; // [C][LDT] T diag(beta e^G)
    tern_gdn_bf16* const Tu = sm.Tu; // [C][LDT] T diag(beta)

    tern_gdn_bf16* kn = writer ? a.kn_s + chk * C * DK : nullptr;
    tern_gdn_bf16* qn = writer ? a.qn_s + chk * C * DK : nullptr;
    // Rows held across the gates' loads (with 8 rows a fetch, k's always: the gates' loads
    // then wait together with them, not before them); a fetch of one row otherwise.
    constexpr int HELD = KQ_TOGETHER || ALL_TOGETHER ? NR : 1;
    tern_gdn_tc_rows<DK, NR == 8 ? NR : 1, IN> xk;
    tern_gdn_tc_rows<DK, HELD, IN> xq;
    tern_gdn_tc_rows<DV, ALL_TOGETHER ? NR : 1, IN> xv;
    if constexpr (NR == 8 && !ALL_TOGETHER) {
        // The rows fetched after k's (v's, and q's where they are not held with k's) requested
        // into L2 while k's come in, a request a 128-byte line.
        constexpr int LINE = 128 / (int)sizeof(IN), VL = DV / LINE, QL = KQ_TOGETHER ? 0 : DK / LINE;
        for (int idx = tid; idx < C * (VL + QL); idx += blockDim.x) {
            const int r = idx / (VL + QL), p = (idx % (VL + QL)) * LINE;
            const IN* line = p < DV ? vs + (t0 + r) * a.v_stride + (size_t)h * DV + p : qs + (t0 + r) * a.q_stride + (size_t)kh * DK + (p - DV);
            if (r < len) asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
        }
    }
    if constexpr (NR == 8) {
        // All of a warp's k rows requested at once (and q's and v's where they are held).
        xk.fetch(ks, a.k_stride, t0, len, (size_t)kh * DK, warp);
        if constexpr (KQ_TOGETHER || ALL_TOGETHER) xq.fetch(qs, a.q_stride, t0, len, (size_t)kh * DK, warp);
        if constexpr (ALL_TOGETHER) xv.fetch(vs, a.v_stride, t0, len, (size_t)h * DV, warp);
    }
    // G by a warp scan in f64 (differences of nearby prefix sums must keep the small terms);
    // past len g counts as 0, so G stays at G_{len-1}.
    if (warp == 0) {
        const double x0 = 2 * lane < len ? (double)a.g[(t0 + 2 * lane) * nv + h] : 0.0;
        const double x1 = 2 * lane + 1 < len ? (double)a.g[(t0 + 2 * lane + 1) * nv + h] : 0.0;
        double s = x0 + x1;
#pragma unroll
        for (int off = 1; off < 32; off *= 2) {
            const double y = __shfl_up_sync(0xffffffffu, s, off);
            if (lane >= off) s += y;
        }
        const double before = s - (x0 + x1);
        G[2 * lane] = before + x0;
        G[2 * lane + 1] = before + x0 + x1;
    } else if (warp == 1) {
        for (int r = lane; r < C; r += 32) Bt[r] = r < len ? a.beta[(t0 + r) * nv + h] : 0.0f;
    }
    if constexpr (NR == 8) tern_gdn_tc_put<DK, NR>(Kb, xk, len, warp, a.l2qk, a.eps, 1.0f, nullptr);
    else tern_gdn_tc_load_rows<DK, NR>(Kb, ks, a.k_stride, t0, len, (size_t)kh * DK, a.l2qk, a.eps, 1.0f, nullptr);
    if constexpr (KQ_TOGETHER || ALL_TOGETHER) tern_gdn_tc_put<DK, HELD>(Qb, xq, len, warp, a.l2qk, a.eps, a.q_scale, qn);
    else tern_gdn_tc_load_rows<DK, NR>(Qb, qs, a.q_stride, t0, len, (size_t)kh * DK, a.l2qk, a.eps, a.q_scale, qn);
    if constexpr (ALL_TOGETHER) tern_gdn_tc_put<DV, NR>(Vb, xv, len, warp, 0, 0.0f, 1.0f, nullptr);
    else tern_gdn_tc_load_rows<DV, NR>(Vb, vs, a.v_stride, t0, len, (size_t)h * DV, 0, 0.0f, 1.0f, nullptr);
    __syncthreads();
    // KK^T and QK^T: warp w owns rows 16 (w % 4).. and columns 32 (w / 4)..; tiles wholly
    // above the diagonal are not multiplied: the substitution never reads them, and their
    // read-out weights are zeros (the warpgroup state pass multiplies every k-step).
    {
        const int g = lane >> 2, q = lane & 3, m0 = 16 * (warp & 3), n0 = 32 * (warp >> 2);
        if (n0 <= m0 + 15) {
            float kk[4][4], qk[4][4];
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) kk[n][e] = qk[n][e] = 0.0f;
#pragma unroll
            for (int kt = 0; kt < DK / 16; kt++) {
                unsigned ak[4], aq[4];
                tern_gdn_tc_frag_a(ak, Kb, DK + 8, m0, 16 * kt);
                tern_gdn_tc_frag_a(aq, Qb, DK + 8, m0, 16 * kt);
#pragma unroll
                for (int np = 0; np < 2; np++) {
                    unsigned b[4];
                    tern_gdn_tc_frag_b_nk(b, Kb, DK + 8, n0 + 16 * np, 16 * kt);
                    tern_gdn_tc_mma(kk[2 * np], ak, b[0], b[1]);
                    tern_gdn_tc_mma(kk[2 * np + 1], ak, b[2], b[3]);
                    tern_gdn_tc_mma(qk[2 * np], aq, b[0], b[1]);
                    tern_gdn_tc_mma(qk[2 * np + 1], aq, b[2], b[3]);
                }
            }
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int r = m0 + g + 8 * hf;
                // G[r] and beta_r read once for the row's 8 elements (the stores to A between
                // them would otherwise make the compiler read them again).
                const double g_r = G[r];
                const float beta_r = Bt[r];
                unsigned words[4];
#pragma unroll
                for (int n = 0; n < 4; n++) {
                    const int c = n0 + 8 * n + 2 * q;
                    float dq[2], da[2];
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int cc = c + e;
                        const float decay = cc <= r && r < len ? expf((float)(g_r - G[cc])) : 0.0f;
                        da[e] = cc < r ? beta_r * kk[n][2 * hf + e] * decay : 0.0f;
                        dq[e] = qk[n][2 * hf + e] * decay;
                    }
                    *reinterpret_cast<float2*>(As + r * LDA + c) = make_float2(da[0], da[1]);
                    words[n] = tern_gdn_tc_pack(dq[0], dq[1]);
                    if constexpr (!TILED) *reinterpret_cast<unsigned*>(a.qk_s + ch * C * C + tern_gdn_tc_tile_at(r, c, C)) = words[n];
                }
                if constexpr (TILED)
                    *reinterpret_cast<uint4*>(a.qk_s + ch * C * C + tern_gdn_tc_tile_at(r, n0 + 8 * q, C)) = tern_gdn_tc_quad_transpose(words);
            }
        } else {
#pragma unroll
            for (int hf = 0; hf < 2; hf++)
                *reinterpret_cast<uint4*>(a.qk_s + ch * C * C + tern_gdn_tc_tile_at(m0 + g + 8 * hf, n0 + 8 * q, C)) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    __syncthreads();

    // T = (I + A)^-1. Diagonal 16 x 16 blocks first: thread (b, c) walks column c of block b,
    // T[r][c] = -sum_{m<r} A[r][m] T[m][c] with T[c][c] = 1 and zeros above.
    // Right-looking: once t[m] is final, every row below takes its term, so the rows' sums
    // advance together; each row still adds its terms in m order from zero (the dot form's
    // bits: the terms before column c are exact zeros), and without a branch on c the chains
    // interleave (the dot form waited on r of them one after another).
    if (tid < C) {
        const int b = tid >> 4, c = tid & 15, o = 16 * b;
        float t[16], s[16];
#pragma unroll
        for (int r = 0; r < 16; r++) s[r] = 0.0f;
#pragma unroll
        for (int m = 0; m < 16; m++) {
            t[m] = m < c ? 0.0f : m == c ? 1.0f : -s[m];
#pragma unroll
            for (int r = m + 1; r < 16; r++) s[r] += As[(o + r) * LDA + o + m] * t[m];
        }
#pragma unroll
        for (int r = 0; r < 16; r++) Ts[(o + r) * LDA + o + c] = t[r];
    } else {
        // Meanwhile the other threads: the decays (e^G kept for T's scaled copies) and k's
        // tile for the state pass, transposed ([DK][64]: the state update's operand is k^T),
        // in 16-byte rows of 8 chunk positions gathered from the rows in shared memory, lanes
        // along i (the reads of a row conflict-free, the stores whole blocks).
        const int id = tid - C;
        if (id < C) {
            const float e = id < len ? (float)exp(G[id]) : 0.0f;
            Ex[id] = e;
            a.dec_s[ch * 2 * C + id] = e;
            a.dec_s[ch * 2 * C + C + id] = id < len ? (float)exp(G[len - 1] - G[id]) : 0.0f;
        }
        if (kn)
            for (int p = id; p < DK * C / 8; p += blockDim.x - C) {
                const int i = p % DK, c0 = (p / DK) * 8;
                unsigned words[4];
#pragma unroll
                for (int m = 0; m < 4; m++)
                    words[m] = (unsigned)Kb[(c0 + 2 * m) * (DK + 8) + i] | (unsigned)Kb[(c0 + 2 * m + 1) * (DK + 8) + i] << 16;
                *reinterpret_cast<uint4*>(kn + tern_gdn_tc_tile_at(i, c0, C)) = make_uint4(words[0], words[1], words[2], words[3]);
            }
    }
    __syncthreads();
    tern_gdn_tc_inverse_blocks<LDA>(As, Ts);
    // The block's threads step through the elements by a multiple of the row, so each
    // thread's columns, and their beta and e^G, stay the same from row to row: read once (in the
    // loop, the stores to Tw and Tu between would make the compiler read them again).
    static_assert(tern_gdn_tc_prep_threads % C == 0, "a thread's columns stay fixed");
    if constexpr (TILED) {
        const int c = 2 * (tid & 31);
        const float2 bt = *reinterpret_cast<const float2*>(Bt + c), ex = *reinterpret_cast<const float2*>(Ex + c);
        for (int r = tid >> 5; r < C; r += tern_gdn_tc_prep_threads / 32) {
            // Both of T's elements in one 8-byte read (an element above the diagonal, zero or
            // never written, is replaced by zero, not multiplied).
            const float2 tt = *reinterpret_cast<const float2*>(Ts + r * LDA + c);
            const float t0 = c <= r ? tt.x : 0.0f, t1 = c + 1 <= r ? tt.y : 0.0f;
            *reinterpret_cast<unsigned*>(Tw + r * LDT + c) = tern_gdn_tc_pack(t0 * bt.x * ex.x, t1 * bt.y * ex.y);
            *reinterpret_cast<unsigned*>(Tu + r * LDT + c) = tern_gdn_tc_pack(t0 * bt.x, t1 * bt.y);
        }
    } else {
        const int c = tid & 63;
        const float bt = Bt[c], ex = Ex[c];
        for (int r = tid >> 6; r < C; r += tern_gdn_tc_prep_threads / C) {
            const float t = c <= r ? Ts[r * LDA + c] : 0.0f;
            Tw[r * LDT + c] = tern_gdn_tc_bf16(t * bt * ex);
            Tu[r * LDT + c] = tern_gdn_tc_bf16(t * bt);
        }
    }
    __syncthreads();
    // W = T diag(beta e^G) K and U = T diag(beta) V (rows past len come out 0: beta is 0 there).
    tern_gdn_tc_apply<DK, TILED, false>(Tw, Kb, a.w_s + ch * C * DK);
    tern_gdn_tc_apply<DV, TILED, true>(Tu, Vb, a.u_s + ch * C * DV);
}

struct tern_gdn_tc_state_args {
    float* states; void* out;  // out: f32, or bf16 (the kernel's OUT16)
    const tern_gdn_bf16* w_s; const tern_gdn_bf16* u_s; const tern_gdn_bf16* qk_s; const float* dec_s;
    const tern_gdn_bf16* qn_s; const tern_gdn_bf16* kn_s;
    const tern_gdn_u32* seg_chunk0; const tern_gdn_u32* seg_nchunks;
    const tern_gdn_u32* chunk_t0; const tern_gdn_u32* chunk_len; const tern_gdn_u32* slot;
    const unsigned long long* state_at;  // each sequence's own state buffer, or null: slot of the pool
    // Segments (tern_gdn_tc_state_wg_body): the state at the end of each segment but the last
    // ([sequence][segment][v head][d_v][d_k], f32), and the tickets and flags (zeroed by the
    // prepare pass). Unused with one segment.
    float* boundary; tern_gdn_u32* ctl;
    int nk, nv, dv, grouped, segments;
};

// One pipeline stage of the state pass: the chunk's operands, bf16 unless noted. US: U's
// slices of 32 state rows a block reads (2 in the transposed form).
template <int DK, int US = 1>
struct tern_gdn_tc_stage {
    tern_gdn_bf16 w[64 * DK];                // in blocks (tern_gdn_tc_tile_at), as stored
    tern_gdn_bf16 q[64 * DK];                // the same
    tern_gdn_bf16 k[DK * 64];                // the same, transposed: [DK][64]
    tern_gdn_bf16 qk[64 * 64];               // the same
    tern_gdn_bf16 u[US * 64 * tern_gdn_tc_bv];  // this block's slices, each [c][j]
    float dec[128];
};

template <int DK, int NS>
struct tern_gdn_tc_state_smem {
    tern_gdn_tc_stage<DK> st[NS];
    tern_gdn_bf16 s[tern_gdn_tc_bv * (DK + 8)];      // bf16 copy of the state slice, [j][i]
    tern_gdn_bf16 d[tern_gdn_tc_bv * tern_gdn_tc_ldc];   // Delta, [j][c]
    tern_gdn_bf16 dt[tern_gdn_tc_bv * tern_gdn_tc_ldc];  // e^{G_L - G_c} Delta, [j][c]
};

// The same with the stages' barriers of the cluster form (MC).
template <int DK, int NS>
struct tern_gdn_tc_state_smem_mc {
    tern_gdn_tc_state_smem<DK, NS> base;
    unsigned long long full[NS];   // the stage's bytes have landed (this block's arrival + bytes)
    unsigned long long empty[NS];  // every block of the cluster has left the stage's chunk
};

// The warpgroup form's (tern_gdn_tc_state_wg_body, US slices of 32 state rows): the state copy
// and Delta in blocks, as the products read them; then a segment's words.
template <int US = 1>
struct tern_gdn_tc_state_wg_smem {
    tern_gdn_tc_stage<128, US> st[3];
    tern_gdn_bf16 s[US * tern_gdn_tc_bv * 128];  // bf16 copy of the state slice, [j][i] in blocks
    tern_gdn_bf16 d[US * tern_gdn_tc_bv * 64];   // Delta, [j][c] in blocks
    tern_gdn_bf16 dt[US * tern_gdn_tc_bv * 64];  // e^{G_L - G_c} Delta, the same
    unsigned word[4];  // the block's ticket, and where its walk back found the past decayed
    float part[8];     // each warp's product of decays in that walk
};

// The host sizes the launch by the same sums (tc_state_smem in mod.rs; its test pins these).
static_assert(sizeof(tern_gdn_tc_stage<128>) == 61952 && sizeof(tern_gdn_tc_stage<128>) % 16 == 0, "a stage: whole 16-byte pieces");
static_assert(sizeof(tern_gdn_tc_state_smem<128, 3>) == 203776, "state pass at d_k 128, 3 stages: as mod.rs sizes it");
static_assert(sizeof(tern_gdn_tc_state_smem_mc<128, 3>) == 203824, "state pass in clusters at d_k 128: as mod.rs sizes it");
static_assert(sizeof(tern_gdn_tc_state_smem_mc<64, 3>) == 126000, "state pass in clusters at d_k 64: as mod.rs sizes it");
static_assert(sizeof(tern_gdn_tc_state_wg_smem<1>) == 202288, "warpgroup state pass: as mod.rs sizes it");
static_assert(sizeof(tern_gdn_tc_state_wg_smem<2>) == 230960, "warpgroup state pass of 64 rows: as mod.rs sizes it");
static_assert(3 * sizeof(tern_gdn_tc_stage<128, 2>) == 198144, "transposed state pass: as mod.rs sizes it");

template <int DK, int US = 1>
__device__ void tern_gdn_tc_issue(tern_gdn_tc_stage<DK, US>& st, const tern_gdn_tc_state_args& a, int chunk, int h, int kh, int j0) {
    constexpr int C = tern_gdn_tc_c, R = DK / 8;  // 16-byte pieces per row
    const size_t ch = (size_t)chunk * a.nv + h, chk = (size_t)chunk * a.nk + kh;
    const tern_gdn_bf16 *w = a.w_s + ch * C * DK, *q = a.qn_s + chk * C * DK, *k = a.kn_s + chk * C * DK;
    // Every tile verbatim: 16-byte pieces in the order stored.
    for (int idx = threadIdx.x; idx < C * R; idx += blockDim.x) {
        tern_gdn_tc_cp16(st.w + 8 * idx, w + 8 * idx);
        tern_gdn_tc_cp16(st.q + 8 * idx, q + 8 * idx);
        tern_gdn_tc_cp16(st.k + 8 * idx, k + 8 * idx);
    }
    for (int idx = threadIdx.x; idx < C * 8; idx += blockDim.x) tern_gdn_tc_cp16(st.qk + 8 * idx, a.qk_s + ch * C * C + 8 * idx);
    const tern_gdn_bf16* u = a.u_s + ch * C * a.dv + (size_t)j0 * C;  // the slice of rows j0..
    for (int idx = threadIdx.x; idx < C * 4 * US; idx += blockDim.x) tern_gdn_tc_cp16(st.u + 8 * idx, u + 8 * idx);
    if (threadIdx.x < 32) tern_gdn_tc_cp16(st.dec + 4 * threadIdx.x, a.dec_s + ch * 2 * C + 4 * threadIdx.x);
}

__device__ __forceinline__ void tern_gdn_tc_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// The state pass in clusters (MC below). The blocks of one value head and sequence (its
// d_v / 32 slices of state rows) read the same W, q, k and read-out tiles of every chunk: alone,
// each block fetches them from L2 (under ncu on an H100 the pass ran at 71% of the L2's
// throughput, four times its operands' bytes). In a cluster of 2 or 4 of those blocks each
// fetches only its share of the tiles' rows, one bulk copy a tile multicast into every block
// of the cluster, and its own U slice and decays with plain bulk copies; all land on the
// block's `full` barrier of the stage (transaction bytes). A stage is refilled only when every
// block of the cluster has left the chunk that read it (each block arrives on every block's
// `empty` barrier of the stage). Measured slower than the blocks alone (H100, 32k tokens: 1.27
// ms against 0.99 in clusters of 2, L2 at 50% of its throughput and 0.27 eligible warps a
// scheduler; clusters of 4 fit 30 at once, not the 32 heads of Qwen3.5-35B-A3B): the blocks of
// a cluster wait on each other every chunk. Kept opt-in (FastVariant::cluster) and tested bit
// for bit against the others. sm_90 and later; hostcuda (no clusters) never sees these
// instructions.
__device__ __forceinline__ void tern_gdn_tc_bar_init(unsigned long long* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(tern_gdn_tc_saddr(bar)), "r"(count) : "memory");
#endif
}

// Every block's barriers initialised and visible to the cluster before any block copies into
// another or arrives on its barriers; at the end, no block leaves while another may still.
__device__ __forceinline__ void tern_gdn_tc_cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\n\tbarrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// This block's rank in its cluster and the cluster's blocks.
__device__ __forceinline__ void tern_gdn_tc_cluster_place(unsigned& rank, unsigned& blocks) {
    rank = 0;
    blocks = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n\tmov.u32 %1, %%cluster_nctarank;" : "=r"(rank), "=r"(blocks));
#endif
}

// Spins until the barrier's phase of the given parity has completed (acquire at cluster scope:
// `empty` phases complete by other blocks' arrivals).
__device__ __forceinline__ void tern_gdn_tc_bar_wait(unsigned long long* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(tern_gdn_tc_saddr(bar)), "r"(parity) : "memory");
#endif
}

// This block's arrival that also announces the bytes its stage will receive.
__device__ __forceinline__ void tern_gdn_tc_bar_expect(unsigned long long* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(tern_gdn_tc_saddr(bar)), "r"(bytes) : "memory");
#endif
}

// An arrival on the barrier at the same place in block `rank` of the cluster.
__device__ __forceinline__ void tern_gdn_tc_bar_arrive_at(unsigned long long* bar, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(tern_gdn_tc_saddr(bar)), "r"(rank));
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
#endif
}

// `bytes` (a multiple of 16, both ends 16-byte aligned) from global memory to the same place in
// the shared memory of every block of `mask`, each copy completing on that block's barrier.
__device__ __forceinline__ void tern_gdn_tc_bulk_multicast(void* smem, const void* gmem, unsigned bytes, unsigned long long* bar, unsigned short mask) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
                 ::"r"(tern_gdn_tc_saddr(smem)), "l"(gmem), "r"(bytes), "r"(tern_gdn_tc_saddr(bar)), "h"(mask) : "memory");
#endif
}

__device__ __forceinline__ void tern_gdn_tc_bulk(void* smem, const void* gmem, unsigned bytes, unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(tern_gdn_tc_saddr(smem)), "l"(gmem), "r"(bytes), "r"(tern_gdn_tc_saddr(bar)) : "memory");
#endif
}

// Chunk `chunk`'s operands into stage `st` of every block of the cluster (this block's share of
// the shared tiles' rows: one run of bytes a tile, as the tiles are stored unpadded) and into
// this block's own (its U slice and the decays), all on the stage's barrier `full` of each
// block: six bulk copies, by lanes 0..5 of the calling warp. Every byte of the stage lands.
template <int DK>
__device__ void tern_gdn_tc_issue_cluster(tern_gdn_tc_stage<DK>& st, unsigned long long* full, const tern_gdn_tc_state_args& a, int chunk, int h, int kh, int j0,
                                          unsigned rank, unsigned blocks) {
    constexpr int C = tern_gdn_tc_c;
    const size_t ch = (size_t)chunk * a.nv + h, chk = (size_t)chunk * a.nk + kh;
    const int share = C / (int)blocks, r0 = (int)rank * share;
    const unsigned short everyone = (unsigned short)((1u << blocks) - 1u);
    // A cluster of one (launched without clusters) copies the whole tiles for itself alone.
    const auto tile = [&](tern_gdn_bf16* dst, const tern_gdn_bf16* src, unsigned bytes) {
        if (blocks == 1) tern_gdn_tc_bulk(dst, src, bytes, full);
        else tern_gdn_tc_bulk_multicast(dst, src, bytes, full, everyone);
    };
    switch (threadIdx.x & 31) {
        case 0: tile(st.w + r0 * DK, a.w_s + (ch * C + r0) * DK, share * DK * 2); break;
        case 1: tile(st.q + r0 * DK, a.qn_s + (chk * C + r0) * DK, share * DK * 2); break;
        case 2: tile(st.k + r0 * DK, a.kn_s + (chk * C + r0) * DK, share * DK * 2); break;
        case 3: tile(st.qk + r0 * C, a.qk_s + (ch * C + r0) * C, share * C * 2); break;
        case 4: tern_gdn_tc_bulk(st.u, a.u_s + ch * C * a.dv + (size_t)j0 * C, C * tern_gdn_tc_bv * 2, full); break;
        case 5: tern_gdn_tc_bulk(st.dec, a.dec_s + ch * 2 * C, 2 * C * 4, full); break;
        default: break;
    }
}

// NS: pipeline stages (2 or 3): chunk n + NS - 1 is requested while chunk n is computed. LATE:
// where chunk n's copies of chunk n + NS - 1 are issued: right after the barrier that opens
// chunk n (all 8 warps then spend ~15 cp.async and their addresses before the first mma), or
// after the Delta and P products, whose dependent mma chains leave issue slots free. MC: the
// blocks of a value head run as one cluster and share the chunks' tiles (bulk copies
// multicast, tern_gdn_tc_issue_cluster) instead of each copying them with cp.async; launched
// without clusters (a cluster of one), each block fetches its chunks with its own six bulk
// copies, issued where LATE issues cp.async and with no `empty` barriers (the block's own
// barrier at the top of each chunk frees the stage). OUT16: the output in bf16 (each f32
// result rounded to nearest even once). The results do not depend on NS, LATE or MC.
template <int DK, int NS, bool LATE, bool MC, bool OUT16 = false>
__device__ void tern_gdn_tc_state_body(const tern_gdn_tc_state_args& a) {
    constexpr int C = tern_gdn_tc_c, BV = tern_gdn_tc_bv, LDK = DK + 8, LDC = tern_gdn_tc_ldc, NI = DK / 32;
    const int h = blockIdx.x, j0 = blockIdx.y * BV, seq = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int nv = a.nv, dv = a.dv;
    const int kh = tern_gdn_key_head(h, a.nk, nv, a.grouped);
    extern __shared__ __align__(16) unsigned char tern_gdn_tc_smem[];
    tern_gdn_tc_state_smem<DK, NS>& sm = *reinterpret_cast<tern_gdn_tc_state_smem<DK, NS>*>(tern_gdn_tc_smem);
    tern_gdn_tc_state_smem_mc<DK, NS>& smc = *reinterpret_cast<tern_gdn_tc_state_smem_mc<DK, NS>*>(tern_gdn_tc_smem);
    unsigned rank = 0, blocks = 1;
    if constexpr (MC) {
        tern_gdn_tc_cluster_place(rank, blocks);
        if (threadIdx.x == 0)
            for (int p = 0; p < NS; p++) {
                tern_gdn_tc_bar_init(&smc.full[p], 1);
                tern_gdn_tc_bar_init(&smc.empty[p], blocks);
            }
        tern_gdn_tc_cluster_sync();
    }
    // Chunk m's operands into its stage: in a cluster, once every block has left chunk m - NS
    // (the stage's previous tenant), with this block's arrival on its own barrier announcing
    // the stage's bytes.
    const auto issue = [&](int m, int c) {
        tern_gdn_tc_stage<DK>& st = sm.st[m % NS];
        if constexpr (MC) {
            // Lanes 0..5 of warp 0 copy; they wait for the other blocks (this one left chunk
            // m - NS at the barrier of the chunk after it).
            if (threadIdx.x < 6) {
                if (m >= NS && blocks > 1) tern_gdn_tc_bar_wait(&smc.empty[m % NS], (unsigned)(m / NS - 1) & 1u);
                if (threadIdx.x == 0) tern_gdn_tc_bar_expect(&smc.full[m % NS], (unsigned)sizeof(tern_gdn_tc_stage<DK>));
                tern_gdn_tc_issue_cluster<DK>(st, &smc.full[m % NS], a, c, h, kh, j0, rank, blocks);
            }
        } else {
            tern_gdn_tc_issue<DK>(st, a, c, h, kh, j0);
        }
    };

    // The update's tiles: warp w owns state rows 16 (w % 2).. (j) and key columns ib.. (i).
    const int mj = 16 * (warp & 1), ib = (warp >> 1) * (DK / 4);
    // The [64][32] products: warp w owns chunk rows 16 (w / 2).. and value columns jn...
    const int mc = 16 * (warp >> 1), jn = 16 * (warp & 1);

    float* state = (a.state_at ? (float*)a.state_at[seq] : a.states + (size_t)a.slot[seq] * nv * dv * DK) + (size_t)h * dv * DK + (size_t)j0 * DK;
    float s[NI][4];
#pragma unroll
    for (int n = 0; n < NI; n++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int j = mj + g + 8 * hf, i = ib + 8 * n + 2 * q;
            const float2 v = *reinterpret_cast<const float2*>(state + (size_t)j * DK + i);
            s[n][2 * hf] = v.x;
            s[n][2 * hf + 1] = v.y;
            *reinterpret_cast<unsigned*>(sm.s + j * LDK + i) = tern_gdn_tc_pack(v.x, v.y);
        }

    const int c0 = (int)a.seg_chunk0[seq], nc = (int)a.seg_nchunks[seq];
    // One commit group per chunk slot, empty past the last chunk, so that "all but the newest
    // NS - 2 groups complete" always means "this chunk's operands are in".
    for (int p = 0; p < NS - 1; p++) {
        if (p < nc) issue(p, c0 + p);
        if constexpr (!MC) tern_gdn_tc_commit();
    }
    for (int n = 0; n < nc; n++) {
        const int chunk = c0 + n;
        tern_gdn_tc_stage<DK>& st = sm.st[n % NS];
        if constexpr (MC) tern_gdn_tc_bar_wait(&smc.full[n % NS], (unsigned)(n / NS) & 1u);
        else asm volatile("cp.async.wait_group %0;" ::"n"(NS - 2) : "memory");
        __syncthreads();  // this chunk's operands and the state copy are in; the stage of chunk n - 1 is free
        if constexpr (MC) {
            // ... in this block: tell every block of the cluster.
            if (n > 0 && threadIdx.x < blocks && blocks > 1) tern_gdn_tc_bar_arrive_at(&smc.empty[(n - 1) % NS], threadIdx.x);
        }
        // One commit group per chunk wherever it is issued, so the wait above keeps its meaning.
        const auto issue_ahead = [&]() {
            if (n + NS - 1 < nc) issue(n + NS - 1, chunk + NS - 1);
            if constexpr (!MC) tern_gdn_tc_commit();
        };
        if constexpr (!LATE && !MC) issue_ahead();
        const size_t t0 = a.chunk_t0[chunk];
        const int len = (int)a.chunk_len[chunk];

        // Every product below loads the fragments of its next k-step before it multiplies the
        // current one: with two warps a scheduler nothing else hides an ldmatrix's latency from
        // the mma that reads it (ncu: the mma waiting on shared loads was a quarter of the
        // pass's stalls). The same products in the same order, so the same bits.
        //
        // This warp's U values and decays, requested before the products they follow.
        unsigned uw[2][2];  // U at (c, j), (c, j + 1), two bf16 a word, by [t][hf]
        float eg[2], el[2];
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int c = mc + g + 8 * hf;
            eg[hf] = st.dec[c];
            el[hf] = st.dec[C + c];
#pragma unroll
            for (int t = 0; t < 2; t++) uw[t][hf] = *reinterpret_cast<const unsigned*>(st.u + c * BV + jn + 8 * t + 2 * q);
        }

        // Delta = U - W S and P = Q S, one pass over the state copy.
        float d[2][4], o[2][4];
#pragma unroll
        for (int t = 0; t < 2; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) d[t][e] = o[t][e] = 0.0f;
        {
            unsigned aw[2][4], aq[2][4], b[2][4];
            const auto frags = [&](int kt, int p) {
                tern_gdn_tc_frag_a_tile(aw[p], st.w, DK, mc, 16 * kt);
                tern_gdn_tc_frag_a_tile(aq[p], st.q, DK, mc, 16 * kt);
                tern_gdn_tc_frag_b_nk(b[p], sm.s, LDK, jn, 16 * kt);
            };
            frags(0, 0);
#pragma unroll
            for (int kt = 0; kt < DK / 16; kt++) {
                const int p = kt & 1;
                if (kt + 1 < DK / 16) frags(kt + 1, p ^ 1);
                tern_gdn_tc_mma(d[0], aw[p], b[p][0], b[p][1]);
                tern_gdn_tc_mma(d[1], aw[p], b[p][2], b[p][3]);
                tern_gdn_tc_mma(o[0], aq[p], b[p][0], b[p][1]);
                tern_gdn_tc_mma(o[1], aq[p], b[p][2], b[p][3]);
            }
        }
        // (A cluster of one needs no `empty` barriers: the barrier at the top of this chunk
        // freed the stage, as for cp.async; its copies leave here too.)
        if constexpr (LATE && !MC) issue_ahead();
        if constexpr (MC)
            if (blocks == 1) issue_ahead();
#pragma unroll
        for (int t = 0; t < 2; t++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int c = mc + g + 8 * hf, j = jn + 8 * t + 2 * q;
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float dl = tern_gdn_tc_f32_of_pair(uw[t][hf], e) - d[t][2 * hf + e];
                    sm.d[(j + e) * LDC + c] = tern_gdn_tc_bf16(dl);
                    sm.dt[(j + e) * LDC + c] = tern_gdn_tc_bf16(dl * el[hf]);
                    o[t][2 * hf + e] *= eg[hf];
                }
            }
        __syncthreads();  // Delta complete; every read of the state copy is done

        // o += QKd Delta (the weights are zero above the diagonal: tiles past it are skipped).
        {
            unsigned aw[2][4], b[2][4];
            const auto frags = [&](int kt, int p) {
                tern_gdn_tc_frag_a_tile(aw[p], st.qk, C, mc, 16 * kt);
                tern_gdn_tc_frag_b_nk(b[p], sm.d, LDC, jn, 16 * kt);
            };
            frags(0, 0);
#pragma unroll
            for (int kt = 0; kt < 4; kt++) {
                if (kt > (mc >> 4)) break;
                const int p = kt & 1;
                if (kt + 1 <= (mc >> 4)) frags(kt + 1, p ^ 1);
                tern_gdn_tc_mma(o[0], aw[p], b[p][0], b[p][1]);
                tern_gdn_tc_mma(o[1], aw[p], b[p][2], b[p][3]);
            }
        }
#pragma unroll
        for (int t = 0; t < 2; t++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int c = mc + g + 8 * hf, j = jn + 8 * t + 2 * q;
                if (c >= len) continue;
                const size_t at = ((t0 + c) * nv + h) * dv + j0 + j;
                if constexpr (OUT16) *reinterpret_cast<unsigned*>(static_cast<tern_gdn_bf16*>(a.out) + at) = tern_gdn_tc_pack(o[t][2 * hf], o[t][2 * hf + 1]);
                else *reinterpret_cast<float2*>(static_cast<float*>(a.out) + at) = make_float2(o[t][2 * hf], o[t][2 * hf + 1]);
            }

        // S = e^{G_L} S + sum_c (e^{G_L - G_c} Delta_c) k_c^T, as S^T[j][i] tiles.
        const float keep = st.dec[len - 1];
#pragma unroll
        for (int t = 0; t < NI; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[t][e] *= keep;
        {
            unsigned ad[2][4], b[2][NI / 2][4];
            const auto frags = [&](int kt, int p) {
                tern_gdn_tc_frag_a(ad[p], sm.dt, LDC, mj, 16 * kt);
#pragma unroll
                for (int np = 0; np < NI / 2; np++) tern_gdn_tc_frag_b_nk_tile(b[p][np], st.k, C, ib + 16 * np, 16 * kt);
            };
            frags(0, 0);
#pragma unroll
            for (int kt = 0; kt < 4; kt++) {
                const int p = kt & 1;
                if (kt + 1 < 4) frags(kt + 1, p ^ 1);
#pragma unroll
                for (int np = 0; np < NI / 2; np++) {
                    tern_gdn_tc_mma(s[2 * np], ad[p], b[p][np][0], b[p][np][1]);
                    tern_gdn_tc_mma(s[2 * np + 1], ad[p], b[p][np][2], b[p][np][3]);
                }
            }
        }
#pragma unroll
        for (int t = 0; t < NI; t++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int j = mj + g + 8 * hf, i = ib + 8 * t + 2 * q;
                *reinterpret_cast<unsigned*>(sm.s + j * LDK + i) = tern_gdn_tc_pack(s[t][2 * hf], s[t][2 * hf + 1]);
            }
        // In a cluster the copies of chunk n + NS - 1 leave last: their stage (chunk n - 1's)
        // was freed by every block at the top of this chunk, so the wait rarely waits, and a
        // chunk later their bytes are needed.
        if constexpr (MC)
            if (blocks > 1) issue_ahead();
    }
#pragma unroll
    for (int n = 0; n < NI; n++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int j = mj + g + 8 * hf, i = ib + 8 * n + 2 * q;
            *reinterpret_cast<float2*>(state + (size_t)j * DK + i) = make_float2(s[n][2 * hf], s[n][2 * hf + 1]);
        }
    if constexpr (MC) tern_gdn_tc_cluster_sync();  // no block leaves while another may arrive on its barriers
}

// Segments of a sequence's chunks walked side by side (tern_gdn_tc_state_wg_body with
// a.segments > 1). A block must start its segment from the state the chunks before it leave,
// which only the serial walk computes. But under the decay that state's past fades: with
// L2-normalised k and beta in [0, 1] (|| I - beta k k^T || <= 1) a token multiplies the state by
// e^g and a matrix of norm <= 1, so what the state held before a run of chunks reaches the
// end of the run scaled by at most their product of decays. A block whose chunks have such a
// run just before them, with product <= tern_gdn_tc_seg_fade, starts at the run's first chunk
// from zeros and walks it without writing outputs (its warm-up): the state it then has differs
// from the serial walk's by at most 2^-30 of the state's norm there, below f32's own rounding of
// it. Where the decays are weaker (none such run within tern_gdn_tc_seg_reach chunks back) the
// block waits for the segment before it to publish its final state and takes that: the serial
// walk's bits, at the serial walk's speed.
constexpr int tern_gdn_tc_seg_reach = 256;       // chunks a block may look back (one a thread)
constexpr float tern_gdn_tc_seg_fade = 9.3132257e-10f;  // 2^-30
// Fewest chunks a segment has (more segments than that leave a sequence's blocks nothing to
// gain); the launcher's STATE_SEGMENT_MIN_CHUNKS (mod.rs), held equal by a test.
constexpr int tern_gdn_tc_seg_min = 8;

// Waits (one thread) until another block has set a flag, then orders this thread's later reads
// after the writes the flag publishes.
__device__ __forceinline__ void tern_gdn_tc_await_flag(const tern_gdn_u32* flag) {
    while (*reinterpret_cast<const volatile tern_gdn_u32*>(flag) == 0u) __nanosleep(256);
    __threadfence();
}

// Publishes this block's writes before it (every thread's, through the barrier) by setting a
// flag to `value` (not 0).
__device__ __forceinline__ void tern_gdn_tc_set_flag(tern_gdn_u32* flag, tern_gdn_u32 value) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicExch(flag, value);
    }
}

// The state pass on the warpgroup tensor cores (wgmma, ../../wgmma.cuh; sm_90, d_k = 128, three
// stages, copies issued while the first products run). The same algebra and operands as
// tern_gdn_tc_state_body, with the block's two warpgroups splitting the work, for NJ = 32 or
// 64 state rows j of a value head (the products' N):
//   Delta = U - W S (group 0) and P = Q S (group 1), each 64 x NJ over i = 0..127, both reading
//     the state copy as their B operand ([j][i] in blocks);
//   group 0 stores Delta and e^{G_L - G_c} Delta ([j][c] in blocks), group 1 scales P by e^{G_c};
//   after the barrier, group 1 adds QKd Delta (every k-step: the weights above the diagonal are
//     zeros) and writes the output; both groups take the update S = e^{G_L} S + K^T (e^{G_L-G_c}
//     Delta) for their 64 key columns i, whose accumulators hold the state, [i][j] (k stored
//     transposed is the product's A operand as it stands).
// Each product reads its tiles once for its four warps, where the mma.sync form makes every
// warp load its own fragments: under ncu that form is bound by its shared-memory traffic.
// Products in flight leave the issue slots free: the next chunk's copies leave meanwhile.
// With 64 rows a block the stage's shared tiles (W, q, k, read-out weights) serve twice the
// rows, and a head takes half the blocks; with a.segments > 1 the blocks of a sequence walk
// segments of its chunks side by side (above).
template <bool OUT16, int NJ = tern_gdn_tc_bv>
__device__ void tern_gdn_tc_state_wg_body(const tern_gdn_tc_state_args& a) {
    constexpr int DK = 128, NS = 3, C = tern_gdn_tc_c, BV = tern_gdn_tc_bv, US = NJ / BV, NA = NJ / 2;
    static_assert(NJ == 32 || NJ == 64, "32 or 64 state rows a block");
    // Block strides (bytes between 8-row groups) of the operands: [64][128] tiles, [NJ][128]
    // state copy, [64][64] read-out weights, [NJ][64] Delta, k^T [128][64].
    constexpr unsigned ROW128 = 16 * DK, ROW64 = 16 * C, CORE = 128;
    // The group index taken from lane 0, so that the compiler sees it uniform across each warp:
    // a product in a branch it cannot prove uniform is serialised (ptxas C7520).
    const int group = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);
    const int w = (threadIdx.x >> 5) & 3, g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
    const int nv = a.nv, dv = a.dv, nseg = a.segments;
    extern __shared__ __align__(128) unsigned char tern_gdn_tc_smem[];
    tern_gdn_tc_state_wg_smem<US>& sm = *reinterpret_cast<tern_gdn_tc_state_wg_smem<US>*>(tern_gdn_tc_smem);
    // Accumulator e of this thread: row 16 w + g + 8 ((e >> 1) & 1), column 8 (e >> 2) + 2 q + (e & 1).
    const auto row_of = [&](int e) { return 16 * w + g + 8 * ((e >> 1) & 1); };
    const auto col_of = [&](int e) { return 8 * (e >> 2) + 2 * q + (e & 1); };

    // The block's place: (head, rows, sequence) by its index, or with segments by a ticket
    // taken as it starts, segment-major, so that a block waits only for blocks that started
    // before it (resident, so the wait ends).
    int h = blockIdx.x, slice = blockIdx.y, seq = blockIdx.z, seg = 0;
    if (nseg > 1) {
        if (threadIdx.x == 0) sm.word[0] = atomicAdd(a.ctl, 1u);
        __syncthreads();
        unsigned t = sm.word[0];
        h = (int)(t % gridDim.x), t /= gridDim.x;
        slice = (int)(t % gridDim.y), t /= gridDim.y;
        const unsigned seqs = gridDim.z / (unsigned)nseg;
        seq = (int)(t % seqs), seg = (int)(t / seqs);
    }
    const int j0 = slice * NJ, kh = tern_gdn_key_head(h, a.nk, nv, a.grouped);
    const int c0 = (int)a.seg_chunk0[seq], nc = (int)a.seg_nchunks[seq];
    // This block's chunks [begin, end), walked from `first` (earlier for a warm-up), and its
    // starting state: 0 the sequence's, 1 zeros, 2 the segment before's final state.
    int begin = c0, end = c0 + nc, first = c0, from = 0;
    const int nseg_here = nseg > 1 ? max(1, min(nseg, nc / tern_gdn_tc_seg_min)) : 1;
    if (seg >= nseg_here) return;  // a sequence too short for this many segments
    // Words: [0] tickets; then one a block (its segment's final state published, as 1 + the
    // start it took: a census for tests; the last segment's only that); then one a
    // (sequence, rows, head) (the first segment has read the sequence's state).
    const unsigned nblocks = gridDim.x * gridDim.y * gridDim.z;
    const auto published = [&](int s) { return a.ctl + 1 + (((size_t)seq * nseg + s) * gridDim.y + slice) * gridDim.x + h; };
    tern_gdn_u32* const read_flag = a.ctl + 1 + nblocks + ((size_t)seq * gridDim.y + slice) * gridDim.x + h;
    // Segment s's final state for this block's slice: [sequence][segment][v head][d_v][d_k].
    const size_t slice_at = ((size_t)h * dv + j0) * DK;  // the slice's place in a sequence's heads
    const auto boundary_of = [&](int s) { return a.boundary + ((size_t)seq * nseg + s) * nv * dv * DK + slice_at; };
    if (nseg_here > 1) {
        begin = c0 + (int)((long long)seg * nc / nseg_here);
        end = c0 + (int)((long long)(seg + 1) * nc / nseg_here);
        first = begin;
        if (seg > 0) {
            from = 2;
            // Thread t takes the decay of chunk begin - 1 - t; the products from chunk begin - 1
            // back, a scan within each warp then across warps; the first that fades sets the
            // warm-up.
            const int reach = min(tern_gdn_tc_seg_reach, begin - c0), t = threadIdx.x, lane = t & 31;
            float x = 1.0f;
            if (t < reach) {
                const int ch = begin - 1 - t;
                x = a.dec_s[((size_t)ch * nv + h) * 2 * C + (int)a.chunk_len[ch] - 1];
            }
#pragma unroll
            for (int off = 1; off < 32; off *= 2) {
                const float y = __shfl_up_sync(0xffffffffu, x, off);
                if (lane >= off) x *= y;
            }
            if (t == 0) sm.word[1] = 0x7fffffffu;
            if (lane == 31) sm.part[t >> 5] = x;
            __syncthreads();
            for (int u = 0; u < (t >> 5); u++) x *= sm.part[u];
            if (t < reach && x <= tern_gdn_tc_seg_fade) atomicMin(&sm.word[1], (unsigned)t);
            __syncthreads();
            if (sm.word[1] != 0x7fffffffu) first = begin - 1 - (int)sm.word[1], from = 1;
        }
    }

    float* state = (a.state_at ? (float*)a.state_at[seq] : a.states + (size_t)a.slot[seq] * nv * dv * DK) + (size_t)h * dv * DK + (size_t)j0 * DK;
    if (from == 2) {
        if (threadIdx.x == 0) tern_gdn_tc_await_flag(published(seg - 1));
        __syncthreads();
    }
    const float* before = from == 2 ? boundary_of(seg - 1) : nullptr;
    // This group's state, S[i][j] for key columns i = 64 group + row, state rows j = column.
    float s[NA];
#pragma unroll
    for (int e = 0; e < NA; e++) {
        const int i = 64 * group + row_of(e), j = col_of(e);
        s[e] = from == 0 ? state[(size_t)j * DK + i] : from == 1 ? 0.0f : __ldcg(before + (size_t)j * DK + i);
        sm.s[tern_gdn_tc_tile_at(j, i, DK)] = tern_gdn_tc_bf16(s[e]);
    }
    // The last segment writes the sequence's state: not before the first has read it.
    if (nseg_here > 1 && seg == 0) tern_gdn_tc_set_flag(read_flag, 1u);

    const int walk = end - first;
    for (int p = 0; p < NS - 1; p++) {
        if (p < walk) tern_gdn_tc_issue<DK, US>(sm.st[p], a, first + p, h, kh, j0);
        tern_gdn_tc_commit();
    }
    float acc[NA];
#pragma unroll
    for (int e = 0; e < NA; e++) acc[e] = 0.0f;
    for (int n = 0; n < walk; n++) {
        const int chunk = first + n;
        tern_gdn_tc_stage<DK, US>& st = sm.st[n % NS];
        asm volatile("cp.async.wait_group %0;" ::"n"(NS - 2) : "memory");
        tern_wgmma_fence_stores();  // this thread's copies and state-copy stores, to the products
        __syncthreads();            // this chunk's operands and the state copy are in; chunk n - 1's stage is free
        const size_t t0 = a.chunk_t0[chunk];
        const int len = (int)a.chunk_len[chunk];

        // Delta (group 0: W) or P (group 1: Q) = X S, eight k-steps over i.
        tern_wgmma_fence();
        {
            const tern_gdn_bf16* x = group == 0 ? st.w : st.q;
#pragma unroll
            for (int kt = 0; kt < DK / 16; kt++)
                tern_wgmma_m64k16(acc, tern_wgmma_desc(x + 128 * kt, CORE, ROW128), tern_wgmma_desc(sm.s + 128 * kt, CORE, ROW128), kt > 0);
        }
        tern_wgmma_commit();
        if (n + NS - 1 < walk) tern_gdn_tc_issue<DK, US>(sm.st[(n + NS - 1) % NS], a, chunk + NS - 1, h, kh, j0);
        tern_gdn_tc_commit();
        // This thread's decays and U values, read while the products run.
        float eg[2], el[2];
        unsigned uw[NJ / 8][2];  // U at (c, j), (c, j + 1) by [n8 tile][row half]
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int c = 16 * w + g + 8 * hf;
            eg[hf] = st.dec[c];
            el[hf] = st.dec[C + c];
            if (group == 0)
#pragma unroll
                for (int t = 0; t < NJ / 8; t++)
                    uw[t][hf] = *reinterpret_cast<const unsigned*>(st.u + (t >> 2) * C * BV + c * BV + 8 * (t & 3) + 2 * q);
        }
        tern_wgmma_wait<0>();
        if (group == 0) {
#pragma unroll
            for (int e = 0; e < NA; e++) {
                const int c = row_of(e), j = col_of(e), hf = (e >> 1) & 1;
                const float dl = tern_gdn_tc_f32_of_pair(uw[e >> 2][hf], e & 1) - acc[e];
                sm.d[tern_gdn_tc_tile_at(j, c, C)] = tern_gdn_tc_bf16(dl);
                sm.dt[tern_gdn_tc_tile_at(j, c, C)] = tern_gdn_tc_bf16(dl * el[hf]);
            }
            tern_wgmma_fence_stores();
        } else {
#pragma unroll
            for (int e = 0; e < NA; e++) acc[e] *= eg[(e >> 1) & 1];
        }
        __syncthreads();  // Delta complete; every read of the state copy is done

        // Group 1: o = e^G P + QKd Delta, four k-steps over the chunk's positions. Both groups:
        // S = e^{G_L} S + K^T Delta_t for their 64 key columns, four k-steps.
        const float keep = st.dec[len - 1];
#pragma unroll
        for (int e = 0; e < NA; e++) s[e] *= keep;
        tern_wgmma_fence();
        if (group == 1) {
#pragma unroll
            for (int kt = 0; kt < C / 16; kt++)
                tern_wgmma_m64k16(acc, tern_wgmma_desc(st.qk + 128 * kt, CORE, ROW64), tern_wgmma_desc(sm.d + 128 * kt, CORE, ROW64), 1);
        }
#pragma unroll
        for (int kt = 0; kt < C / 16; kt++)
            tern_wgmma_m64k16(s, tern_wgmma_desc(st.k + 64 * C * group + 128 * kt, CORE, ROW64), tern_wgmma_desc(sm.dt + 128 * kt, CORE, ROW64), 1);
        tern_wgmma_commit();
        tern_wgmma_wait<0>();
        if (group == 1 && chunk >= begin) {  // a warm-up chunk's outputs are another block's
#pragma unroll
            for (int e = 0; e < NA; e += 2) {
                const int c = row_of(e), j = col_of(e);
                if (c >= len) continue;
                const size_t at = ((t0 + c) * nv + h) * dv + j0 + j;
                if constexpr (OUT16) *reinterpret_cast<unsigned*>(static_cast<tern_gdn_bf16*>(a.out) + at) = tern_gdn_tc_pack(acc[e], acc[e + 1]);
                else *reinterpret_cast<float2*>(static_cast<float*>(a.out) + at) = make_float2(acc[e], acc[e + 1]);
            }
        }
        // The state copy for the next chunk's products (read after its first barrier).
#pragma unroll
        for (int e = 0; e < NA; e++) sm.s[tern_gdn_tc_tile_at(col_of(e), 64 * group + row_of(e), DK)] = tern_gdn_tc_bf16(s[e]);
    }
    // The final state: the last segment's to the sequence's state (once the first segment has
    // read it), any other's to the boundary scratch, published for the next segment.
    const bool last = seg == nseg_here - 1;
    if (last && seg > 0) {
        if (threadIdx.x == 0) {
            tern_gdn_tc_await_flag(read_flag);
            *published(seg) = 1u + (unsigned)from;
        }
        __syncthreads();
    }
    float* const dst = last ? state : boundary_of(seg);
#pragma unroll
    for (int e = 0; e < NA; e++) dst[(size_t)col_of(e) * DK + 64 * group + row_of(e)] = s[e];
    if (!last) tern_gdn_tc_set_flag(published(seg), 1u + (unsigned)from);
}

// The state pass transposed (sm_90, d_k = 128, three stages): one warpgroup a block, for 64
// state rows j of a value head and sequence, holds S^T ([j][i], 64 x 128) in the accumulators
// of its update, and every product takes its A operand from registers (the register form of
// ../../wgmma.cuh) and its B operand from the stage's tiles as the prepare pass stores them:
//   Delta^T = U^T - S^T W^T        A: S^T in bf16      B: W, [c][i]
//   P^T = S^T Q^T                  A: S^T              B: q, [c][i]
//   S^T = e^{G_L} S^T + Delta_t^T K   A: (e^{G_L - G_c} Delta)^T   B: k^T, [i][c]
//   o^T = e^{G_c} P^T + Delta^T QKd^T  A: Delta^T      B: the read-out weights, [c][c']
// An accumulator tile repacks into A fragments in place (the m64 accumulator and A layouts
// give each thread the same rows and columns), so no tile goes through shared memory between
// products and no barrier orders them: a chunk's chain is two rounds of products. The form of
// tern_gdn_tc_state_wg_body stores Delta and the state copy and meets two block barriers a
// chunk; both round the same operands (S, Delta, e^{G_L - G_c} Delta, in bf16) once (on an H100
// the same bits). Slower there (FastVariant::transposed in mod.rs says why): opt-in.
// Accumulator e of a 64 x N tile: row 16 w + g + 8 ((e >> 1) & 1), column 8 (e >> 2) + 2 q + (e & 1).
// The output is f32.
__device__ void tern_gdn_tc_state_t_body(const tern_gdn_tc_state_args& a) {
    constexpr int DK = 128, NS = 3, C = tern_gdn_tc_c, BV = tern_gdn_tc_bv;
    constexpr unsigned ROW128 = 16 * DK, ROW64 = 16 * C, CORE = 128;
    const int h = blockIdx.x, j0 = blockIdx.y * 2 * BV, seq = blockIdx.z;
    const int w = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
    const int nv = a.nv, dv = a.dv;
    const int kh = tern_gdn_key_head(h, a.nk, nv, a.grouped);
    extern __shared__ __align__(128) unsigned char tern_gdn_tc_smem[];
    tern_gdn_tc_stage<DK, 2>* const stages = reinterpret_cast<tern_gdn_tc_stage<DK, 2>*>(tern_gdn_tc_smem);
    const auto row_of = [&](int e) { return 16 * w + g + 8 * ((e >> 1) & 1); };
    const auto col_of = [&](int e) { return 8 * (e >> 2) + 2 * q + (e & 1); };
    // k-step kk's A fragment of a tile whose accumulators are x (registers 8 kk .. 8 kk + 7),
    // each column scaled: x[0], x[1] and x[2], x[3] are columns 16 kk + 2 q, + 1 (rows g, g + 8),
    // x[4] .. x[7] the same 8 columns on, so `col` holds the scales of those four columns.
    const auto repack = [](unsigned (&frag)[4], const float* x, const float (&col)[4]) {
        frag[0] = tern_gdn_tc_pack(x[0] * col[0], x[1] * col[1]);
        frag[1] = tern_gdn_tc_pack(x[2] * col[0], x[3] * col[1]);
        frag[2] = tern_gdn_tc_pack(x[4] * col[2], x[5] * col[3]);
        frag[3] = tern_gdn_tc_pack(x[6] * col[2], x[7] * col[3]);
    };
    const float unit[4] = {1.0f, 1.0f, 1.0f, 1.0f};

    float* state = (a.state_at ? (float*)a.state_at[seq] : a.states + (size_t)a.slot[seq] * nv * dv * DK) + (size_t)h * dv * DK + (size_t)j0 * DK;
    float s[64];  // S^T: element (j, i) = S[i][j]
#pragma unroll
    for (int e = 0; e < 64; e++) s[e] = state[(size_t)row_of(e) * DK + col_of(e)];
    unsigned sa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; kk++) repack(sa[kk], s + 8 * kk, unit);

    const int c0 = (int)a.seg_chunk0[seq], nc = (int)a.seg_nchunks[seq];
    for (int p = 0; p < NS - 1; p++) {
        if (p < nc) tern_gdn_tc_issue<DK, 2>(stages[p], a, c0 + p, h, kh, j0);
        tern_gdn_tc_commit();
    }
    float dl[32], pt[32];
#pragma unroll
    for (int e = 0; e < 32; e++) dl[e] = pt[e] = 0.0f;
    for (int n = 0; n < nc; n++) {
        const int chunk = c0 + n;
        tern_gdn_tc_stage<DK, 2>& st = stages[n % NS];
        asm volatile("cp.async.wait_group %0;" ::"n"(NS - 2) : "memory");
        __syncthreads();  // this chunk's operands are in; chunk n - 1's stage is free
        const size_t t0 = a.chunk_t0[chunk];
        const int len = (int)a.chunk_len[chunk];

        // W S and Q S, transposed: eight k-steps over i each.
        tern_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < DK / 16; kk++) tern_wgmma_m64n64k16_rs(dl, sa[kk], tern_wgmma_desc(st.w + 128 * kk, CORE, ROW128), kk > 0);
#pragma unroll
        for (int kk = 0; kk < DK / 16; kk++) tern_wgmma_m64n64k16_rs(pt, sa[kk], tern_wgmma_desc(st.q + 128 * kk, CORE, ROW128), kk > 0);
        tern_wgmma_commit();
        if (n + NS - 1 < nc) tern_gdn_tc_issue<DK, 2>(stages[(n + NS - 1) % NS], a, chunk + NS - 1, h, kh, j0);
        tern_gdn_tc_commit();
        tern_wgmma_wait<0>();

        // Delta^T = U^T - (W S)^T; its fragments as they are and scaled by e^{G_L - G_c}; P^T
        // scaled by e^{G_c} (both by column c).
        unsigned da[4][4], dta[4][4];
#pragma unroll
        for (int e = 0; e < 32; e++) {
            const int j = row_of(e), c = col_of(e);
            dl[e] = tern_gdn_tc_f32_of_pair((unsigned)st.u[(j >> 5) * C * BV + c * BV + (j & 31)], 0) - dl[e];
            pt[e] *= st.dec[c];
        }
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const int c = 16 * kk + 2 * q;
            const float decay[4] = {st.dec[C + c], st.dec[C + c + 1], st.dec[C + c + 8], st.dec[C + c + 9]};
            repack(da[kk], dl + 8 * kk, unit);
            repack(dta[kk], dl + 8 * kk, decay);
        }
        const float keep = st.dec[len - 1];
#pragma unroll
        for (int e = 0; e < 64; e++) s[e] *= keep;
        // The update and the read-out, four k-steps over the chunk's positions each.
        tern_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < C / 16; kk++) tern_wgmma_m64n128k16_rs(s, dta[kk], tern_wgmma_desc(st.k + 128 * kk, CORE, ROW64), 1);
#pragma unroll
        for (int kk = 0; kk < C / 16; kk++) tern_wgmma_m64n64k16_rs(pt, da[kk], tern_wgmma_desc(st.qk + 128 * kk, CORE, ROW64), 1);
        tern_wgmma_commit();
        tern_wgmma_wait<0>();
#pragma unroll
        for (int e = 0; e < 32; e++) {
            const int j = row_of(e), c = col_of(e);
            if (c >= len) continue;
            static_cast<float*>(a.out)[((t0 + c) * nv + h) * dv + j0 + j] = pt[e];
        }
#pragma unroll
        for (int kk = 0; kk < 8; kk++) repack(sa[kk], s + 8 * kk, unit);
    }
#pragma unroll
    for (int e = 0; e < 64; e++) state[(size_t)row_of(e) * DK + col_of(e)] = s[e];
}

// Prepare kernels by head sizes and fetch rows: _r{NR} in the wide layout (two blocks a
// multiprocessor), _r{NR}c in the compact one (three: <= 80 registers, 72 KB at 128 x 128),
// _r8ct the compact one TILED.
#define TERN_GDN_TC_PREPARE(DK, DV, NR)                                                                              \
    extern "C" __global__ void __launch_bounds__(tern_gdn_tc_prep_threads) tern_gdn_tc_prepare_dk##DK##_dv##DV##_r##NR(tern_gdn_tc_prep_args a) { \
        tern_await_prior_kernel();                                                                                     \
        tern_gdn_tc_prepare_body<DK, DV, NR, false, false>(a);                                                         \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(tern_gdn_tc_prep_threads, 3) tern_gdn_tc_prepare_dk##DK##_dv##DV##_r##NR##c(tern_gdn_tc_prep_args a) { \
        tern_await_prior_kernel();                                                                                     \
        tern_gdn_tc_prepare_body<DK, DV, NR, true, false>(a);                                                          \
    }
#define TERN_GDN_TC_PREPARE_TILED(DK, DV)                                                                            \
    extern "C" __global__ void __launch_bounds__(tern_gdn_tc_prep_threads, 3) tern_gdn_tc_prepare_dk##DK##_dv##DV##_r8ct(tern_gdn_tc_prep_args a) { \
        tern_await_prior_kernel();                                                                                     \
        tern_gdn_tc_prepare_body<DK, DV, 8, true, true>(a);                                                            \
    }
TERN_GDN_TC_PREPARE(64, 64, 1)
TERN_GDN_TC_PREPARE(64, 64, 8)
TERN_GDN_TC_PREPARE(64, 128, 1)
TERN_GDN_TC_PREPARE(64, 128, 8)
TERN_GDN_TC_PREPARE(128, 64, 1)
TERN_GDN_TC_PREPARE(128, 64, 8)
TERN_GDN_TC_PREPARE(128, 128, 1)
TERN_GDN_TC_PREPARE(128, 128, 8)
TERN_GDN_TC_PREPARE_TILED(64, 64)
TERN_GDN_TC_PREPARE_TILED(64, 128)
TERN_GDN_TC_PREPARE_TILED(128, 64)
TERN_GDN_TC_PREPARE_TILED(128, 128)
// The default form (compact, TILED) reading bf16 q, k, v rows: _r8ctb.
#define TERN_GDN_TC_PREPARE_BF16_IN(DK, DV)                                                                          \
    extern "C" __global__ void __launch_bounds__(tern_gdn_tc_prep_threads, 3) tern_gdn_tc_prepare_dk##DK##_dv##DV##_r8ctb(tern_gdn_tc_prep_args a) { \
        tern_await_prior_kernel();                                                                                     \
        tern_gdn_tc_prepare_body<DK, DV, 8, true, true, tern_gdn_bf16>(a);                                             \
    }
TERN_GDN_TC_PREPARE_BF16_IN(64, 64)
TERN_GDN_TC_PREPARE_BF16_IN(64, 128)
TERN_GDN_TC_PREPARE_BF16_IN(128, 64)
TERN_GDN_TC_PREPARE_BF16_IN(128, 128)
// State kernels by d_k and stages; _s3l issues the copies late (LATE above); _s3lm in clusters
// (MC above: sm_90 and later only, launched in clusters of 2 or 4 of a head's d_v / 32 blocks;
// LATE has no effect there, as a cluster's copies leave at the end of each chunk).
#define TERN_GDN_TC_STATE(DK, NS, LATE, SUFFIX)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) tern_gdn_tc_state_dk##DK##_s##NS##SUFFIX(tern_gdn_tc_state_args a) { \
        tern_await_prior_kernel();                                                                                     \
        tern_gdn_tc_state_body<DK, NS, LATE, false>(a);                                                                \
    }
#define TERN_GDN_TC_STATE_CLUSTER(DK, NS, LATE, SUFFIX)                                                              \
    extern "C" __global__ void __launch_bounds__(256) tern_gdn_tc_state_dk##DK##_s##NS##SUFFIX##m(tern_gdn_tc_state_args a) { \
        tern_await_prior_kernel();                                                                                     \
        tern_gdn_tc_state_body<DK, NS, LATE, true>(a);                                                                 \
    }
TERN_GDN_TC_STATE(64, 2, false, )
TERN_GDN_TC_STATE(64, 3, false, )
TERN_GDN_TC_STATE(64, 3, true, l)
TERN_GDN_TC_STATE(128, 2, false, )
TERN_GDN_TC_STATE(128, 3, false, )
TERN_GDN_TC_STATE(128, 3, true, l)
// The default form writing a bf16 output: _s3lb.
#define TERN_GDN_TC_STATE_BF16_OUT(DK)                                                                               \
    extern "C" __global__ void __launch_bounds__(256) tern_gdn_tc_state_dk##DK##_s3lb(tern_gdn_tc_state_args a) {   \
        tern_await_prior_kernel();                                                                                     \
        tern_gdn_tc_state_body<DK, 3, true, false, true>(a);                                                           \
    }
TERN_GDN_TC_STATE_BF16_OUT(64)
TERN_GDN_TC_STATE_BF16_OUT(128)
// The warpgroup form (d_k 128 only; an sm_90 device: Gpu compiles for sm_90a there): _s3lw
// (32 state rows a block) and _s3lw2 (64), each with a bf16 output (b).
#define TERN_GDN_TC_STATE_WG(SUFFIX, OUT16, NJ)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) tern_gdn_tc_state_dk128_##SUFFIX(tern_gdn_tc_state_args a) {  \
        tern_await_prior_kernel();                                                                                     \
        tern_gdn_tc_state_wg_body<OUT16, NJ>(a);                                                                       \
    }
TERN_GDN_TC_STATE_WG(s3lw, false, 32)
TERN_GDN_TC_STATE_WG(s3lwb, true, 32)
TERN_GDN_TC_STATE_WG(s3lw2, false, 64)
TERN_GDN_TC_STATE_WG(s3lw2b, true, 64)
// The transposed form (tern_gdn_tc_state_t_body; sm_90, d_k 128): _s3lt, one warpgroup a block.
extern "C" __global__ void __launch_bounds__(128, 1) tern_gdn_tc_state_dk128_s3lt(tern_gdn_tc_state_args a) {
    tern_await_prior_kernel();
    tern_gdn_tc_state_t_body(a);
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
TERN_GDN_TC_STATE_CLUSTER(64, 3, true, l)
TERN_GDN_TC_STATE_CLUSTER(128, 3, true, l)
#endif
