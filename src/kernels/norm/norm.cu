// RMS normalisation, CUDA form. CPU twin: norm/mod.rs (same products in the same order:
// ((x·pre)·inv)·w, the inverse RMS from a double sum rounded to f32 once), so results differ
// from the CPU only by the order of the double sum. One block per row; a row's values are
// re-read from L1 for the second pass rather than held in registers, so any width works.
// Every output may also be written as bf16 (`y16`, nullable), for a consumer that reads bf16
// rows (a fast-mode GEMM) without a conversion pass.

// The inverse RMS from each thread's partial sum of squares.
__device__ __forceinline__ float tern_rms_finish(double ss, int d, float eps, double* scratch) {
    return tern_inv_rms_of(tern_block_sum_d(ss, scratch), d, eps);
}

__device__ __forceinline__ float tern_inv_rms(const float* x, int d, float pre, float eps, double* scratch) {
    double ss = 0.0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const double v = (double)(x[i] * pre);
        ss += v * v;
    }
    return tern_rms_finish(ss, d, eps, scratch);
}

// y[r] = rms(pre·x[r])·w (w nullable: no weight).
extern "C" __global__ void tern_rms_norm(const float* __restrict__ x, const float* __restrict__ w, float pre, float eps,
                                         int d, float* __restrict__ y, tern_bf16* __restrict__ y16) {
    tern_await_prior_kernel();
    __shared__ double scratch[32];
    const size_t off = (size_t)blockIdx.x * d;
    const float inv = tern_inv_rms(x + off, d, pre, eps, scratch);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = (x[off + i] * pre) * inv;
        if (w) v = v * w[i];
        if (y) y[off + i] = v;
        if (y16) y16[off + i] = tern_bf16_from_f32(v);
    }
}

// h[r] = (h[r] + rms(y[r])·w)·post, then (w2 non-null) a[r] = rms(h[r])·w2.
extern "C" __global__ void tern_add_norm(float* __restrict__ h, const float* __restrict__ y, const float* __restrict__ w,
                                         float post, float eps, int d, const float* __restrict__ w2,
                                         float* __restrict__ a, tern_bf16* __restrict__ a16) {
    tern_await_prior_kernel();
    __shared__ double scratch[32];
    const size_t off = (size_t)blockIdx.x * d;
    const float inv = tern_inv_rms(y + off, d, 1.0f, eps, scratch);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = h[off + i] + (y[off + i] * inv) * w[i];
        if (post != 1.0f) v *= post;
        h[off + i] = v;
    }
    if (!w2) return;
    // Each thread re-reads only the entries it wrote itself, so no barrier is needed before
    // the sum (tern_block_sum_d has its own).
    const float inv2 = tern_inv_rms(h + off, d, 1.0f, eps, scratch);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = (h[off + i] * inv2) * w2[i];
        if (a) a[off + i] = v;
        if (a16) a16[off + i] = tern_bf16_from_f32(v);
    }
}

// The pre-norm residual step: x[r] += y[r], then a[r] = rms(x[r])·w. CPU twin: residual_norm.
extern "C" __global__ void tern_residual_norm(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
                                              float eps, int d, float* __restrict__ a, tern_bf16* __restrict__ a16) {
    tern_await_prior_kernel();
    __shared__ double scratch[32];
    const size_t off = (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) x[off + i] = x[off + i] + y[off + i];
    // Each thread re-reads only the entries it wrote itself (tern_block_sum_d has its barrier).
    const float inv = tern_inv_rms(x + off, d, 1.0f, eps, scratch);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = (x[off + i] * inv) * w[i];
        if (a) a[off + i] = v;
        if (a16) a16[off + i] = tern_bf16_from_f32(v);
    }
}

// tern_add_norm with the row held in registers (steps of at most 64 rows; TERN_NORM_REGS=0 off): for
// rows of at most TERN_NORM_SLOTS · blockDim.x values every operand (y, h, w, w2) is loaded
// before the first sum, so a row waits for memory once rather than once per pass (above: y,
// then h and w after the first sum, then h again and w2 after the second). Same products and
// sums in the same order as tern_add_norm: the same bits. A short query's sandwich-norm steps
// are launches of 8 blocks whose time is those waits (ncu, eg2, H200: 5.5 µs each, 72 a query).
#define TERN_NORM_SLOTS 4
// Σ v² in double over a thread's held values (column t + j·nt of a row of d), in the order
// tern_inv_rms adds them (pre = 1).
__device__ __forceinline__ double tern_held_sum_squares(const float (&v)[TERN_NORM_SLOTS], int t, int nt, int d) {
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < TERN_NORM_SLOTS; ++j)
        if (t + j * nt < d) {
            const double x = (double)(v[j] * 1.0f);
            ss += x * x;
        }
    return ss;
}
extern "C" __global__ void tern_add_norm_regs(float* __restrict__ h, const float* __restrict__ y, const float* __restrict__ w,
                                              float post, float eps, int d, const float* __restrict__ w2,
                                              float* __restrict__ a, tern_bf16* __restrict__ a16) {
    tern_await_prior_kernel();
    __shared__ double scratch[32];
    const size_t off = (size_t)blockIdx.x * d;
    const int t = threadIdx.x, nt = blockDim.x;
    float yv[TERN_NORM_SLOTS], hv[TERN_NORM_SLOTS], wv[TERN_NORM_SLOTS], w2v[TERN_NORM_SLOTS];
#pragma unroll
    for (int j = 0; j < TERN_NORM_SLOTS; ++j) {
        const int i = t + j * nt;
        const bool in = i < d;
        yv[j] = in ? y[off + i] : 0.f;
        hv[j] = in ? h[off + i] : 0.f;
        wv[j] = in ? w[i] : 0.f;
        w2v[j] = in && w2 ? w2[i] : 0.f;
    }
    const float inv = tern_rms_finish(tern_held_sum_squares(yv, t, nt, d), d, eps, scratch);
#pragma unroll
    for (int j = 0; j < TERN_NORM_SLOTS; ++j)
        if (t + j * nt < d) {
            float v = hv[j] + (yv[j] * inv) * wv[j];
            if (post != 1.0f) v *= post;
            hv[j] = v;
            h[off + t + j * nt] = v;
        }
    if (!w2) return;
    const float inv2 = tern_rms_finish(tern_held_sum_squares(hv, t, nt, d), d, eps, scratch);
#pragma unroll
    for (int j = 0; j < TERN_NORM_SLOTS; ++j)
        if (t + j * nt < d) {
            const float v = (hv[j] * inv2) * w2v[j];
            if (a) a[off + t + j * nt] = v;
            if (a16) a16[off + t + j * nt] = tern_bf16_from_f32(v);
        }
}
