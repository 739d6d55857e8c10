// Fast mode's products of many rows through Q8_0 weights (Blas::linear past the tensor-core
// GEMV's row tiles), reading the quants as stored: y[r][o] = sum_k bf16(x[r][k]) · bf16(d·q)[o][k]
// with f32 accumulation, the values cuBLAS multiplies after tern_expand_q8_bf16 (CPU twin: the
// product of the bf16-rounded operands). The expansion writes the whole matrix as bf16 (twice
// its quants' bytes) for the GEMM to read back, at every product of a prompt or a decode round.
// Opt-in (TERN_GEMM_Q8_ROWS): this form measured slower than the expansion and cuBLAS on an
// H100 (BENCHMARKS.md, twenty-sixth session), so it is a start for a faster one, not the path.
//
// A block is 64 features (four warps of 16) by 64 rows. The rows' bf16 values come through
// shared memory in stages of 128 weights (cp.async, three stages in flight); each warp reads its
// own 16 weight rows straight from memory, eight consecutive quants a lane as the GEMV reads
// them (tern_weights_bf16x8), one chunk ahead in registers. The GEMV's permuted k order fits
// (gemv.cu, tern_gemv_mma_steps): lane (g, t) holds weights 8t .. 8t + 7 of a 32-weight step for
// features g and g + 8, and takes x's row g at the same 8 positions from shared memory (one
// 16-byte load per n8 tile), so A and B see the same permutation and only the summation order
// differs from the plain one.
//
// Products of few output features (a 1024-feature projection: 16 blocks of features) split k
// over blockIdx.z (whole stages, in order): split z writes its partial sums to part z of y,
// and tern_gemm_q8_sum adds the parts in split order, so the bits depend on the shape and the
// split count only, never on timing. Rows past `rows` are staged as zeros and never written;
// features past `out` read the last feature's weights and are never written. in % 32 == 0.
#define TERN_GEMM_Q8_BM 64                         // features a block (four warps of 16)
#define TERN_GEMM_Q8_BN 64                         // rows a block (eight n8 tiles)
#define TERN_GEMM_Q8_KC 128                        // weights of k a stage
#define TERN_GEMM_Q8_LD (TERN_GEMM_Q8_KC + 32)     // a staged row: 320 bytes, so that the two
                                                   // rows a quarter-warp reads fall on other banks
#define TERN_GEMM_Q8_STAGES 3

__device__ __forceinline__ void tern_gemm_q8_cp16(tern_bf16* smem, const tern_bf16* gmem, bool ok) {
    // src-size 0: the 16 bytes are zero-filled and nothing is read.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((unsigned)__cvta_generic_to_shared(smem)), "l"(gmem),
                 "r"(ok ? 16 : 0)
                 : "memory");
}

// Stage chunk `ch` of the block's rows (weights ch·KC .. ch·KC + KC - 1 of each) into `dst`.
__device__ __forceinline__ void tern_gemm_q8_stage(tern_bf16* dst, const tern_bf16* __restrict__ x, int r0, int rows, int in, int ch) {
    constexpr int PIECES = TERN_GEMM_Q8_KC / 8;  // 16-byte pieces of a staged row
    const int k0 = ch * TERN_GEMM_Q8_KC;
    for (int i = threadIdx.x; i < TERN_GEMM_Q8_BN * PIECES; i += blockDim.x) {
        const int r = i / PIECES, k = k0 + 8 * (i % PIECES);
        const bool ok = r0 + r < rows && k < in;
        tern_gemm_q8_cp16(dst + r * TERN_GEMM_Q8_LD + 8 * (i % PIECES), ok ? x + (size_t)(r0 + r) * in + k : x, ok);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// The lane's weights of chunk `ch`: four 32-weight steps, features g and g + 8 (zeros past in).
__device__ __forceinline__ void tern_gemm_q8_weights(uint4 (&a)[4][2], const TernWeightsQ8& w, const size_t (&wr)[2], int in, int ch) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const int k = ch * TERN_GEMM_Q8_KC + 32 * s;
#pragma unroll
        for (int h = 0; h < 2; ++h) a[s][h] = k < in ? tern_weights_bf16x8(w, wr[h] + k + 8 * t) : make_uint4(0u, 0u, 0u, 0u);
    }
}

extern "C" __global__ void __launch_bounds__(128) tern_gemm_q8(const signed char* __restrict__ q, const unsigned short* __restrict__ d,
                                                              const tern_bf16* __restrict__ x, float* __restrict__ y, int rows,
                                                              int out, int in, int splits) {
    tern_await_prior_kernel();
    extern __shared__ __align__(16) tern_bf16 tern_gemm_q8_xs[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int o0 = (int)blockIdx.x * TERN_GEMM_Q8_BM + 16 * warp, r0 = (int)blockIdx.y * TERN_GEMM_Q8_BN;
    const int chunks = (in + TERN_GEMM_Q8_KC - 1) / TERN_GEMM_Q8_KC;
    const int c0 = (int)((long long)chunks * blockIdx.z / splits), c1 = (int)((long long)chunks * (blockIdx.z + 1) / splits);
    const TernWeightsQ8 w((unsigned long long)q, (unsigned long long)d);
    size_t wr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) wr[h] = (size_t)min(o0 + g + 8 * h, out - 1) * in;
    float c[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;

    constexpr int STAGE = TERN_GEMM_Q8_BN * TERN_GEMM_Q8_LD;
    // Stages c0 .. c0 + STAGES - 2 in flight (an empty group where the split has fewer chunks,
    // so that the wait below counts the same groups in every iteration).
#pragma unroll
    for (int s = 0; s < TERN_GEMM_Q8_STAGES - 1; ++s) {
        if (c0 + s < c1) tern_gemm_q8_stage(tern_gemm_q8_xs + ((c0 + s) % TERN_GEMM_Q8_STAGES) * STAGE, x, r0, rows, in, c0 + s);
        else asm volatile("cp.async.commit_group;" ::: "memory");
    }
    uint4 a[4][2];
    if (c0 < c1) tern_gemm_q8_weights(a, w, wr, in, c0);
    for (int ch = c0; ch < c1; ++ch) {
        // Chunk ch has landed (the newer STAGES - 2 groups may still fly); the barrier also
        // tells every warp that the others are done with the stage the next copy overwrites
        // (chunk ch - 1's).
        asm volatile("cp.async.wait_group %0;" ::"n"(TERN_GEMM_Q8_STAGES - 2) : "memory");
        __syncthreads();
        const int next = ch + TERN_GEMM_Q8_STAGES - 1;
        if (next < c1) tern_gemm_q8_stage(tern_gemm_q8_xs + (next % TERN_GEMM_Q8_STAGES) * STAGE, x, r0, rows, in, next);
        else asm volatile("cp.async.commit_group;" ::: "memory");
        uint4 an[4][2];
        if (ch + 1 < c1) tern_gemm_q8_weights(an, w, wr, in, ch + 1);
        const tern_bf16* xs = tern_gemm_q8_xs + (ch % TERN_GEMM_Q8_STAGES) * STAGE;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            if (ch * TERN_GEMM_Q8_KC + 32 * s >= in) break;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                const uint4 b = *reinterpret_cast<const uint4*>(xs + (8 * n + g) * TERN_GEMM_Q8_LD + 32 * s + 8 * t);
                tern_tc_mma(c[n], a[s][0].x, a[s][1].x, a[s][0].y, a[s][1].y, b.x, b.y);
                tern_tc_mma(c[n], a[s][0].z, a[s][1].z, a[s][0].w, a[s][1].w, b.z, b.w);
            }
        }
        if (ch + 1 < c1) {
#pragma unroll
            for (int s = 0; s < 4; ++s) a[s][0] = an[s][0], a[s][1] = an[s][1];
        }
    }
    asm volatile("cp.async.wait_group %0;" ::"n"(0) : "memory");
    // c[n][2h + e]: feature o0 + g + 8h, row r0 + 8n + 2t + e.
    float* part = y + (size_t)blockIdx.z * rows * out;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int o = o0 + g + 8 * h, r = r0 + 8 * n + 2 * t + e;
                if (o < out && r < rows) part[(size_t)r * out + o] = c[n][2 * h + e];
            }
}

// y[i] = parts[0][i] + parts[1][i] + ... in split order (n values a part, parts laid end to end).
extern "C" __global__ void tern_gemm_q8_sum(const float* __restrict__ parts, int splits, size_t n, float* __restrict__ y) {
    tern_await_prior_kernel();
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float s = parts[i];
        for (int z = 1; z < splits; ++z) s += parts[(size_t)z * n + i];
        y[i] = s;
    }
}
