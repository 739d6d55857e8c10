// Chunked prefill of the delta rule (chunk 64, UT transform), f32 storage with the
// accumulator type a template parameter (float or double). CPU twin: chunked.rs, whose
// module docs derive the algebra; the sequential scan (recurrence.cu) is its oracle.
//
// Two launches per layer:
//
//  1. tern_gdn_chunk_prepare_*: one block per (chunk, value head), all in parallel. Builds,
//     from the chunk's k, q, v, g and beta alone: the cumulative log-decay G (summed in
//     double: differences G_r - G_c of nearby prefix sums must keep the small terms),
//     A = beta_r (k_r.k_c) exp(G_r - G_c) (strictly lower), T = (I + A)^-1 by forward
//     substitution, W = T diag(beta exp(G)) K, U = T diag(beta) V, and the read-out weights
//     (q_r.k_c) exp(G_r - G_c), c <= r. These go to a scratch buffer.
//  2. tern_gdn_chunk_state_*: one block per (sequence, value head, block of 8 or 16 state rows),
//     walking the sequence's chunks in order with its slice of the state in shared memory:
//     Delta = U - W S0, o_r = exp(G_r) S0^T q_r + sum_{c<=r} qk[r][c] Delta_c,
//     S = exp(G_{L-1}) S0 + sum_c exp(G_{L-1} - G_c) k_c Delta_c^T.
//
// Every exponent is G_r or a difference G_r - G_c with c <= r, never a lone -G_c: with g <= 0
// the factors lie in [0, 1], so strong decays underflow toward their true limit instead of
// overflowing. Shared-memory rows are padded by one float so that a warp reading one column
// across rows touches 32 different banks.

#define TERN_GDN_CHUNK 64

struct tern_gdn_chunk_args {
    const float* q; long long q_stride;
    const float* k; long long k_stride;
    const float* v; long long v_stride;
    const float* g; const float* beta;
    const tern_gdn_u32* chunk_t0; const tern_gdn_u32* chunk_len;
    float* w_s; float* u_s; float* qk_s; float* dec_s;
    int nk, nv, dk, dv, grouped, l2qk;
    float eps, q_scale;
};

// L2-normalise `rows` rows of `d` in shared memory (row stride ld), one warp per row, with the
// same arithmetic as tern_gdn_normalize_qk.
__device__ void tern_gdn_l2_rows_smem(float* x, int rows, int d, int ld, float eps, float scale) {
    const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (int r = threadIdx.x / 32; r < rows; r += warps) {
        float ss = 0.0f;
        for (int i = lane; i < d; i += 32) ss += x[r * ld + i] * x[r * ld + i];
        const float inv = 1.0f / sqrtf(tern_gdn_warp_sum(ss) + eps);
        for (int i = lane; i < d; i += 32) x[r * ld + i] = (x[r * ld + i] * inv) * scale;
    }
}

// Loads rows t0 .. t0 + len of a strided operand's head (d floats at col0) into shared memory,
// zeroing the rows past len so that a short last chunk computes with exact zeros. 16-byte
// global loads when d allows (the launcher checks that offsets and strides are multiples of 4
// floats), four of them issued before their shared-memory stores so their latencies overlap;
// the padded shared rows are not 16-byte aligned, so the stores stay scalar.
__device__ void tern_gdn_load_tile(float* dst, int ld, const float* src, long long stride, size_t t0, int len,
                                   size_t col0, int d) {
    if (d % 4 == 0 && col0 % 4 == 0) {
        const int q4 = d / 4, n = TERN_GDN_CHUNK * q4;
#pragma unroll 4
        for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
            const int r = idx / q4, i = (idx % q4) * 4;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (r < len) v = *reinterpret_cast<const float4*>(src + (t0 + r) * stride + col0 + i);
            float* o = dst + r * ld + i;
            o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
        }
    } else {
        for (int idx = threadIdx.x; idx < TERN_GDN_CHUNK * d; idx += blockDim.x) {
            const int r = idx / d, i = idx % d;
            dst[r * ld + i] = r < len ? src[(t0 + r) * stride + col0 + i] : 0.0f;
        }
    }
}

// out[r][i] = sum_{c <= r} (T[r][c] * f_c) * X[c][i] for the chunk's 64 rows and d columns,
// T unit lower triangular with its strictly lower part in As (zeros on and above the
// diagonal). Register tiles: a thread owns rows rg + 16m (m < 4) and columns cg + 16n
// (n < 8) of each 128-column block, so one T load serves 8 columns and one X load 4 rows.
template <typename Acc>
__device__ void tern_gdn_tri_apply(const float* As, const float* f1, const float* f2, const float* X, int ldx, int d,
                                   int len, float* out) {
    constexpr int C = TERN_GDN_CHUNK;
    const int rg = threadIdx.x / 16, cg = threadIdx.x % 16;
    for (int ib = 0; ib < d; ib += 128) {
        Acc acc[4][8];
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int n = 0; n < 8; n++) acc[m][n] = 0;
        const int cmax = min(rg + 48, len - 1);
        for (int c = 0; c <= cmax; c++) {
            const Acc f = f2 ? (Acc)f1[c] * (Acc)f2[c] : (Acc)f1[c];
            Acc t[4];
#pragma unroll
            for (int m = 0; m < 4; m++) {
                const int r = rg + 16 * m;
                t[m] = (c == r ? (Acc)1 : (Acc)As[r * (C + 1) + c]) * f;
            }
#pragma unroll
            for (int n = 0; n < 8; n++) {
                const int i = ib + cg + 16 * n;
                const Acc x = i < d ? (Acc)X[c * ldx + i] : (Acc)0;
#pragma unroll
                for (int m = 0; m < 4; m++) acc[m][n] += t[m] * x;
            }
        }
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const int r = rg + 16 * m;
#pragma unroll
            for (int n = 0; n < 8; n++) {
                const int i = ib + cg + 16 * n;
                // Rows past len have no c <= r with c < len... except c < len <= r: T[r][c] is 0
                // there (A was zeroed), so they come out exactly 0.
                if (i < d) out[(size_t)r * d + i] = (float)acc[m][n];
            }
        }
    }
}

template <typename Acc>
__device__ void tern_gdn_chunk_prepare_body(const tern_gdn_chunk_args& a) {
    constexpr int C = TERN_GDN_CHUNK;
    const int chunk = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int dk = a.dk, dv = a.dv, nv = a.nv;
    const int kh = tern_gdn_key_head(h, a.nk, nv, a.grouped);
    const size_t t0 = a.chunk_t0[chunk];
    const int len = (int)a.chunk_len[chunk];
    const int ldk = dk + 1, ldx = (dk > dv ? dk : dv) + 1;

    extern __shared__ double tern_gdn_smem_d[];
    double* G = tern_gdn_smem_d;                 // [C]
    float* Bt = (float*)(G + C);                 // [C] beta
    float* Ex = Bt + C;                          // [C] exp(G_r)
    float* As = Ex + C;                          // [C][C + 1]: A, then T
    float* Ks = As + C * (C + 1);                // [C][ldk]
    float* Xs = Ks + C * ldk;                    // [C][ldx]: Q, later V

    tern_gdn_load_tile(Ks, ldk, a.k, a.k_stride, t0, len, (size_t)kh * dk, dk);
    tern_gdn_load_tile(Xs, ldx, a.q, a.q_stride, t0, len, (size_t)kh * dk, dk);
    if (tid == 0) {
        double s = 0.0;
        for (int r = 0; r < C; r++) {
            if (r < len) s += (double)a.g[(t0 + r) * nv + h];
            G[r] = s;
        }
    }
    __syncthreads();
    if (a.l2qk) {
        tern_gdn_l2_rows_smem(Ks, len, dk, ldk, a.eps, 1.0f);
        tern_gdn_l2_rows_smem(Xs, len, dk, ldx, a.eps, a.q_scale);
    }
    const size_t ch = (size_t)chunk * nv + h;
    if (tid < C) {
        Bt[tid] = tid < len ? a.beta[(t0 + tid) * nv + h] : 0.0f;
        Ex[tid] = tid < len ? (float)exp(G[tid]) : 0.0f;
        // For the state pass: exp(G_r) and exp(G_{L-1} - G_c).
        a.dec_s[ch * 2 * C + tid] = tid < len ? (float)exp(G[tid]) : 0.0f;
        a.dec_s[ch * 2 * C + C + tid] = tid < len ? (float)exp(G[len - 1] - G[tid]) : 0.0f;
    }
    __syncthreads();

    // A (strictly lower) and the read-out weights (lower, diagonal included), in 4 x 4 register
    // tiles: a thread owns rows 4rb.. and columns 4cb.., so each k_c, k_r, q_r element it loads
    // serves four products. Tiles wholly above the diagonal only write zeros.
    {
        const int rb = tid / 16, cb = tid % 16;
        Acc kk[4][4], qk[4][4];
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int n = 0; n < 4; n++) kk[m][n] = qk[m][n] = 0;
        if (cb <= rb && 4 * rb < len) {
            for (int i = 0; i < dk; i++) {
                Acc kr[4], qr[4], kc[4];
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    kr[m] = (Acc)Ks[(4 * rb + m) * ldk + i];
                    qr[m] = (Acc)Xs[(4 * rb + m) * ldx + i];
                    kc[m] = (Acc)Ks[(4 * cb + m) * ldk + i];
                }
#pragma unroll
                for (int m = 0; m < 4; m++)
#pragma unroll
                    for (int n = 0; n < 4; n++) {
                        kk[m][n] += kr[m] * kc[n];
                        qk[m][n] += qr[m] * kc[n];
                    }
            }
        }
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int n = 0; n < 4; n++) {
                const int r = 4 * rb + m, c = 4 * cb + n;
                float av = 0.0f, qv = 0.0f;
                if (r < len && c <= r) {
                    const Acc decay = (Acc)exp(G[r] - G[c]);
                    if (c < r) av = (float)((Acc)Bt[r] * kk[m][n] * decay);
                    qv = (float)(qk[m][n] * decay);
                }
                As[r * (C + 1) + c] = av;
                a.qk_s[ch * C * C + r * C + c] = qv;
            }
    }
    __syncthreads();

    // T = (I + A)^-1, row by row: T[r][c] = -(A[r][c] + sum_{c<m<r} A[r][m] T[m][c]). Rows < r
    // are final; row r is read whole before any of it is overwritten.
    for (int r = 1; r < len; r++) {
        Acc s = 0;
        if (tid < r) {
            s = (Acc)As[r * (C + 1) + tid];
            for (int m = tid + 1; m < r; m++) s += (Acc)As[r * (C + 1) + m] * (Acc)As[m * (C + 1) + tid];
        }
        __syncthreads();
        if (tid < r) As[r * (C + 1) + tid] = (float)(-s);
        __syncthreads();
    }

    // W = T diag(beta exp(G)) K.
    tern_gdn_tri_apply<Acc>(As, Bt, Ex, Ks, ldk, dk, len, a.w_s + ch * C * dk);
    __syncthreads();  // Q is dead: V takes its place
    tern_gdn_load_tile(Xs, ldx, a.v, a.v_stride, t0, len, (size_t)h * dv, dv);
    __syncthreads();
    // U = T diag(beta) V.
    tern_gdn_tri_apply<Acc>(As, Bt, nullptr, Xs, ldx, dv, len, a.u_s + ch * C * dv);
}

struct tern_gdn_state_args {
    float* states;
    const float* q; long long q_stride;
    const float* k; long long k_stride;
    const float* w_s; const float* u_s; const float* qk_s; const float* dec_s;
    float* out;
    const tern_gdn_u32* seg_chunk0; const tern_gdn_u32* seg_nchunks;
    const tern_gdn_u32* chunk_t0; const tern_gdn_u32* chunk_len; const tern_gdn_u32* slot;
    const unsigned long long* state_at;  // each sequence's own state buffer, or null: slot of the pool
    int nk, nv, dk, dv, grouped, l2qk;
    float eps, q_scale;
};

// Thread layout of the state pass (256 threads, BV state rows per block): for the [64][BV]
// products (Delta, outputs) a thread owns column jc = tid % BV and chunk rows rg + RS*m
// (m < RM), so one load of a state element serves RM rows; for the [BV][dk] update it owns
// state row ju = tid / TPR and key columns cg + TPR*n (n < NC) of each 128-column block.
// BV only changes how the work is split over blocks, never the order of any sum.
template <typename Acc, int BV>
__device__ void tern_gdn_chunk_state_body(const tern_gdn_state_args& a) {
    constexpr int C = TERN_GDN_CHUNK;
    constexpr int RS = 256 / BV, RM = C / RS, TPR = 256 / BV, NC = 128 / TPR;
    const int h = blockIdx.x, j0 = blockIdx.y * BV, s = blockIdx.z, tid = threadIdx.x;
    const int dk = a.dk, dv = a.dv, nv = a.nv;
    const int kh = tern_gdn_key_head(h, a.nk, nv, a.grouped);
    const int ld = dk + 1;
    extern __shared__ float tern_gdn_smem_f[];
    float* Xs = tern_gdn_smem_f;    // [C][ld]: W, then Q, then K of the chunk
    float* Ss = Xs + C * ld;        // [BV][ld]: rows j0.. of the head's transposed state
    float* Ds = Ss + BV * ld;       // [C][BV + 1]: the chunk's Delta columns
    float* Qk = Ds + C * (BV + 1);  // [C][C + 1]: the read-out weights
    float* Dec = Qk + C * (C + 1);  // [2C]: exp(G_r), exp(G_{L-1} - G_c)

    float* state = (a.state_at ? (float*)a.state_at[s] : a.states + (size_t)a.slot[s] * nv * dv * dk) + (size_t)h * dv * dk;
    for (int idx = tid; idx < BV * dk; idx += blockDim.x) {
        const int jj = idx / dk, i = idx % dk;
        Ss[jj * ld + i] = j0 + jj < dv ? state[(size_t)(j0 + jj) * dk + i] : 0.0f;
    }
    const int jc = tid % BV, rg = tid / BV;    // [64][BV] products
    const int ju = tid / TPR, cg = tid % TPR;  // [BV][dk] update
    const int c0 = (int)a.seg_chunk0[s], nc = (int)a.seg_nchunks[s];
    for (int chunk = c0; chunk < c0 + nc; chunk++) {
        const size_t t0 = a.chunk_t0[chunk];
        const int len = (int)a.chunk_len[chunk];
        const size_t ch = (size_t)chunk * nv + h;
        tern_gdn_load_tile(Xs, ld, a.w_s + ch * C * dk, dk, 0, C, 0, dk);
        for (int idx = tid; idx < C * C; idx += blockDim.x) Qk[(idx / C) * (C + 1) + idx % C] = a.qk_s[ch * C * C + idx];
        if (tid < 2 * C) Dec[tid] = a.dec_s[ch * 2 * C + tid];
        __syncthreads();
        // Delta = U - W S0 (columns j0 .. j0 + BV).
        {
            Acc acc[RM];
#pragma unroll
            for (int m = 0; m < RM; m++) acc[m] = 0;
            for (int i = 0; i < dk; i++) {
                const Acc sv = (Acc)Ss[jc * ld + i];
#pragma unroll
                for (int m = 0; m < RM; m++) acc[m] += (Acc)Xs[(rg + RS * m) * ld + i] * sv;
            }
#pragma unroll
            for (int m = 0; m < RM; m++) {
                const int r = rg + RS * m;
                float d = 0.0f;
                if (r < len && j0 + jc < dv) d = (float)((Acc)a.u_s[(ch * C + r) * dv + j0 + jc] - acc[m]);
                Ds[r * (BV + 1) + jc] = d;
            }
        }
        __syncthreads();
        tern_gdn_load_tile(Xs, ld, a.q, a.q_stride, t0, len, (size_t)kh * dk, dk);
        __syncthreads();
        if (a.l2qk) {
            tern_gdn_l2_rows_smem(Xs, len, dk, ld, a.eps, a.q_scale);
            __syncthreads();
        }
        // o_r = exp(G_r) S0^T q_r + sum_{c<=r} qk[r][c] Delta_c, from the chunk's starting state
        // (the read-out weights are zero above the diagonal and past len).
        {
            Acc o[RM];
#pragma unroll
            for (int m = 0; m < RM; m++) o[m] = 0;
            for (int i = 0; i < dk; i++) {
                const Acc sv = (Acc)Ss[jc * ld + i];
#pragma unroll
                for (int m = 0; m < RM; m++) o[m] += (Acc)Xs[(rg + RS * m) * ld + i] * sv;
            }
#pragma unroll
            for (int m = 0; m < RM; m++) o[m] *= (Acc)Dec[rg + RS * m];
            const int cmax = min(rg + RS * (RM - 1), len - 1);
            for (int c = 0; c <= cmax; c++) {
                const Acc dc = (Acc)Ds[c * (BV + 1) + jc];
#pragma unroll
                for (int m = 0; m < RM; m++) o[m] += (Acc)Qk[(rg + RS * m) * (C + 1) + c] * dc;
            }
#pragma unroll
            for (int m = 0; m < RM; m++) {
                const int r = rg + RS * m;
                if (r < len && j0 + jc < dv) a.out[((t0 + r) * nv + h) * dv + j0 + jc] = (float)o[m];
            }
        }
        __syncthreads();
        tern_gdn_load_tile(Xs, ld, a.k, a.k_stride, t0, len, (size_t)kh * dk, dk);
        __syncthreads();
        if (a.l2qk) {
            tern_gdn_l2_rows_smem(Xs, len, dk, ld, a.eps, 1.0f);
            __syncthreads();
        }
        // S = exp(G_{L-1}) S0 + sum_c exp(G_{L-1} - G_c) k_c Delta_c^T.
        const Acc keep = (Acc)Dec[len - 1];
        for (int ib = 0; ib < dk; ib += 128) {
            Acc acc[NC];
#pragma unroll
            for (int n = 0; n < NC; n++) {
                const int i = ib + cg + TPR * n;
                acc[n] = i < dk ? keep * (Acc)Ss[ju * ld + i] : (Acc)0;
            }
            for (int c = 0; c < len; c++) {
                const Acc f = (Acc)Dec[C + c] * (Acc)Ds[c * (BV + 1) + ju];
#pragma unroll
                for (int n = 0; n < NC; n++) {
                    const int i = ib + cg + TPR * n;
                    if (i < dk) acc[n] += f * (Acc)Xs[c * ld + i];
                }
            }
            // Every thread has read Ss for this block before any writes it: the Delta and
            // output loops ended at the barriers above, and this block's reads are its own.
#pragma unroll
            for (int n = 0; n < NC; n++) {
                const int i = ib + cg + TPR * n;
                if (i < dk) Ss[ju * ld + i] = (float)acc[n];
            }
        }
        __syncthreads();
    }
    for (int idx = tid; idx < BV * dk; idx += blockDim.x) {
        const int jj = idx / dk, i = idx % dk;
        if (j0 + jj < dv) state[(size_t)(j0 + jj) * dk + i] = Ss[jj * ld + i];
    }
}

extern "C" __global__ void __launch_bounds__(256) tern_gdn_chunk_prepare_f32(tern_gdn_chunk_args a) {
    tern_await_prior_kernel();
    tern_gdn_chunk_prepare_body<float>(a);
}
extern "C" __global__ void __launch_bounds__(256) tern_gdn_chunk_prepare_f64(tern_gdn_chunk_args a) {
    tern_await_prior_kernel();
    tern_gdn_chunk_prepare_body<double>(a);
}
extern "C" __global__ void __launch_bounds__(256) tern_gdn_chunk_state_f32_bv16(tern_gdn_state_args a) {
    tern_await_prior_kernel();
    tern_gdn_chunk_state_body<float, 16>(a);
}
extern "C" __global__ void __launch_bounds__(256) tern_gdn_chunk_state_f64_bv16(tern_gdn_state_args a) {
    tern_await_prior_kernel();
    tern_gdn_chunk_state_body<double, 16>(a);
}
extern "C" __global__ void __launch_bounds__(256) tern_gdn_chunk_state_f32_bv8(tern_gdn_state_args a) {
    tern_await_prior_kernel();
    tern_gdn_chunk_state_body<float, 8>(a);
}
extern "C" __global__ void __launch_bounds__(256) tern_gdn_chunk_state_f64_bv8(tern_gdn_state_args a) {
    tern_await_prior_kernel();
    tern_gdn_chunk_state_body<double, 8>(a);
}
#undef TERN_GDN_CHUNK
