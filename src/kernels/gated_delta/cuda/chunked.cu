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
//  2. tern_gdn_chunk_state_*: one block per (sequence, value head, block of 16 state rows),
//     walking the sequence's chunks in order with its slice of the state in shared memory:
//     Delta = U - W S0, o_r = exp(G_r) S0^T q_r + sum_{c<=r} qk[r][c] Delta_c,
//     S = exp(G_{L-1}) S0 + sum_c exp(G_{L-1} - G_c) k_c Delta_c^T.
//
// Every exponent is G_r or a difference G_r - G_c with c <= r, never a lone -G_c: with g <= 0
// the factors lie in [0, 1], so strong decays underflow toward their true limit instead of
// overflowing. Shared-memory rows are padded by one float so that a warp reading one column
// across rows touches 32 different banks.

#define TERN_GDN_CHUNK 64
#define TERN_GDN_BV 16

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
// zeroing the rows past len so that a short last chunk computes with exact zeros.
__device__ void tern_gdn_load_tile(float* dst, int ld, const float* src, long long stride, size_t t0, int len,
                                   size_t col0, int d) {
    for (int idx = threadIdx.x; idx < TERN_GDN_CHUNK * d; idx += blockDim.x) {
        const int r = idx / d, i = idx % d;
        dst[r * ld + i] = r < len ? src[(t0 + r) * stride + col0 + i] : 0.0f;
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

    // A (strictly lower) and the read-out weights (lower, diagonal included).
    for (int idx = tid; idx < C * C; idx += blockDim.x) {
        const int r = idx / C, c = idx % C;
        float av = 0.0f, qv = 0.0f;
        if (r < len && c <= r) {
            Acc kk = 0, qk = 0;
            for (int i = 0; i < dk; i++) {
                kk += (Acc)Ks[r * ldk + i] * (Acc)Ks[c * ldk + i];
                qk += (Acc)Xs[r * ldx + i] * (Acc)Ks[c * ldk + i];
            }
            const Acc decay = (Acc)exp(G[r] - G[c]);
            if (c < r) av = (float)((Acc)Bt[r] * kk * decay);
            qv = (float)(qk * decay);
        }
        As[r * (C + 1) + c] = av;
        a.qk_s[ch * C * C + idx] = qv;
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
    for (int idx = tid; idx < C * dk; idx += blockDim.x) {
        const int r = idx / dk, i = idx % dk;
        Acc s = 0;
        for (int c = 0; c <= r && c < len; c++) {
            const Acc t = c == r ? (Acc)1 : (Acc)As[r * (C + 1) + c];
            s += t * (Acc)Bt[c] * (Acc)Ex[c] * (Acc)Ks[c * ldk + i];
        }
        a.w_s[(ch * C + r) * dk + i] = (float)s;
    }
    __syncthreads();  // Q is dead: V takes its place
    tern_gdn_load_tile(Xs, ldx, a.v, a.v_stride, t0, len, (size_t)h * dv, dv);
    __syncthreads();
    // U = T diag(beta) V.
    for (int idx = tid; idx < C * dv; idx += blockDim.x) {
        const int r = idx / dv, j = idx % dv;
        Acc s = 0;
        for (int c = 0; c <= r && c < len; c++) {
            const Acc t = c == r ? (Acc)1 : (Acc)As[r * (C + 1) + c];
            s += t * (Acc)Bt[c] * (Acc)Xs[c * ldx + j];
        }
        a.u_s[(ch * C + r) * dv + j] = (float)s;
    }
}

struct tern_gdn_state_args {
    float* states;
    const float* q; long long q_stride;
    const float* k; long long k_stride;
    const float* w_s; const float* u_s; const float* qk_s; const float* dec_s;
    float* out;
    const tern_gdn_u32* seg_chunk0; const tern_gdn_u32* seg_nchunks;
    const tern_gdn_u32* chunk_t0; const tern_gdn_u32* chunk_len; const tern_gdn_u32* slot;
    int nk, nv, dk, dv, grouped, l2qk;
    float eps, q_scale;
};

template <typename Acc>
__device__ void tern_gdn_chunk_state_body(const tern_gdn_state_args& a) {
    constexpr int C = TERN_GDN_CHUNK, BV = TERN_GDN_BV;
    const int h = blockIdx.x, j0 = blockIdx.y * BV, s = blockIdx.z, tid = threadIdx.x;
    const int dk = a.dk, dv = a.dv, nv = a.nv;
    const int kh = tern_gdn_key_head(h, a.nk, nv, a.grouped);
    const int ld = dk + 1;
    extern __shared__ float tern_gdn_smem_f[];
    float* Xs = tern_gdn_smem_f;   // [C][ld]: W, then Q, then K of the chunk
    float* Ss = Xs + C * ld;       // [BV][ld]: rows j0.. of the head's transposed state
    float* Ds = Ss + BV * ld;      // [C][BV + 1]: the chunk's Delta columns
    float* Dec = Ds + C * (BV + 1); // [2C]

    float* state = a.states + ((size_t)a.slot[s] * nv + h) * dv * dk;
    for (int idx = tid; idx < BV * dk; idx += blockDim.x) {
        const int jj = idx / dk, i = idx % dk;
        Ss[jj * ld + i] = j0 + jj < dv ? state[(size_t)(j0 + jj) * dk + i] : 0.0f;
    }
    const int c0 = (int)a.seg_chunk0[s], nc = (int)a.seg_nchunks[s];
    for (int chunk = c0; chunk < c0 + nc; chunk++) {
        const size_t t0 = a.chunk_t0[chunk];
        const int len = (int)a.chunk_len[chunk];
        const size_t ch = (size_t)chunk * nv + h;
        for (int idx = tid; idx < C * dk; idx += blockDim.x) {
            const int r = idx / dk, i = idx % dk;
            Xs[r * ld + i] = a.w_s[(ch * C + r) * dk + i];
        }
        if (tid < 2 * C) Dec[tid] = a.dec_s[ch * 2 * C + tid];
        __syncthreads();
        // Delta = U - W S0 (columns j0 .. j0 + BV).
        for (int idx = tid; idx < C * BV; idx += blockDim.x) {
            const int r = idx / BV, jj = idx % BV;
            float d = 0.0f;
            if (r < len && j0 + jj < dv) {
                Acc acc = 0;
                for (int i = 0; i < dk; i++) acc += (Acc)Xs[r * ld + i] * (Acc)Ss[jj * ld + i];
                d = (float)((Acc)a.u_s[(ch * C + r) * dv + j0 + jj] - acc);
            }
            Ds[r * (BV + 1) + jj] = d;
        }
        __syncthreads();
        tern_gdn_load_tile(Xs, ld, a.q, a.q_stride, t0, len, (size_t)kh * dk, dk);
        __syncthreads();
        if (a.l2qk) {
            tern_gdn_l2_rows_smem(Xs, len, dk, ld, a.eps, a.q_scale);
            __syncthreads();
        }
        // o_r = exp(G_r) S0^T q_r + sum_{c<=r} qk[r][c] Delta_c, from the chunk's starting state.
        for (int idx = tid; idx < C * BV; idx += blockDim.x) {
            const int r = idx / BV, jj = idx % BV;
            if (r < len && j0 + jj < dv) {
                Acc o = 0;
                for (int i = 0; i < dk; i++) o += (Acc)Xs[r * ld + i] * (Acc)Ss[jj * ld + i];
                o *= (Acc)Dec[r];
                const float* qk = a.qk_s + ch * C * C + (size_t)r * C;
                for (int c = 0; c <= r; c++) o += (Acc)qk[c] * (Acc)Ds[c * (BV + 1) + jj];
                a.out[((t0 + r) * nv + h) * dv + j0 + jj] = (float)o;
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
        for (int idx = tid; idx < BV * dk; idx += blockDim.x) {
            const int jj = idx / dk, i = idx % dk;
            Acc acc = keep * (Acc)Ss[jj * ld + i];
            for (int c = 0; c < len; c++) acc += ((Acc)Dec[C + c] * (Acc)Ds[c * (BV + 1) + jj]) * (Acc)Xs[c * ld + i];
            Ss[jj * ld + i] = (float)acc;
        }
        __syncthreads();
    }
    for (int idx = tid; idx < BV * dk; idx += blockDim.x) {
        const int jj = idx / dk, i = idx % dk;
        if (j0 + jj < dv) state[(size_t)(j0 + jj) * dk + i] = Ss[jj * ld + i];
    }
}

extern "C" __global__ void __launch_bounds__(256) tern_gdn_chunk_prepare_f32(tern_gdn_chunk_args a) { tern_gdn_chunk_prepare_body<float>(a); }
extern "C" __global__ void __launch_bounds__(256) tern_gdn_chunk_prepare_f64(tern_gdn_chunk_args a) { tern_gdn_chunk_prepare_body<double>(a); }
extern "C" __global__ void __launch_bounds__(256) tern_gdn_chunk_state_f32(tern_gdn_state_args a) { tern_gdn_chunk_state_body<float>(a); }
extern "C" __global__ void __launch_bounds__(256) tern_gdn_chunk_state_f64(tern_gdn_state_args a) { tern_gdn_chunk_state_body<double>(a); }
#undef TERN_GDN_CHUNK
#undef TERN_GDN_BV
