// RMS normalisation, CUDA form. CPU twin: norm/mod.rs (same products in the same order:
// ((x·pre)·inv)·w, the inverse RMS from a double sum rounded to f32 once), so results differ
// from the CPU only by the order of the double sum. One block per row; a row's values are
// re-read from L1 for the second pass rather than held in registers, so any width works.
// Every output may also be written as bf16 (`y16`, nullable): the fast mode's GEMMs read it,
// which saves a conversion pass over each normalised activation.

__device__ __forceinline__ float tern_inv_rms(const float* x, int d, float pre, float eps, double* scratch) {
    double ss = 0.0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const double v = (double)(x[i] * pre);
        ss += v * v;
    }
    ss = tern_block_sum_d(ss, scratch);
    return (float)(1.0 / sqrt(ss / (double)d + (double)eps));
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
