// The family's per-head normalisations, one warp per row. CPU twin: norm.rs (which sums
// squares in f64; here the sum is f32 in a fixed butterfly order, a summation-order
// difference within the f32 contract).

// In place, per row of d: x <- (x / sqrt(sum x^2 + eps)) * scale, eps added to the SUM of
// squares (fla's and transformers' l2norm). rows covers q (scale 1/sqrt(d_k)) and k (scale 1)
// in one launch: blockIdx.y picks the buffer.
extern "C" __global__ void tern_gdn_normalize_qk(float* __restrict__ q, float* __restrict__ k, long long rows,
                                                 int d, float eps, float q_scale) {
    tern_await_prior_kernel();
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    float* x = (blockIdx.y == 0 ? q : k) + (size_t)row * d;
    const float scale = blockIdx.y == 0 ? q_scale : 1.0f;
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(tern_gdn_warp_sum(ss) + eps);
    for (int i = lane; i < d; i += 32) x[i] = (x[i] * inv) * scale;
}

// out = rms(y) * w * silu(z) per row of d = w's length, the ONE weight shared by every head
// (indexing it per head would read past it), eps inside the root of the MEAN of squares, no
// +1 on w. out may alias y: each lane reads its elements before it writes them, and the
// scale is known before any write.
extern "C" __global__ void tern_gdn_gated_rms_norm(const float* y, const float* __restrict__ z,
                                                   const float* __restrict__ w, float* out, long long rows,
                                                   int d, float eps) {
    tern_await_prior_kernel();
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const size_t base = (size_t)row * d;
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) ss += y[base + i] * y[base + i];
    const float inv = 1.0f / sqrtf(tern_gdn_warp_sum(ss) / (float)d + eps);
    for (int i = lane; i < d; i += 32) out[base + i] = ((y[base + i] * inv) * w[i]) * tern_gdn_silu(z[base + i]);
}
