// Per-head RMS norm and rotate-half RoPE, CUDA form. CPU twin: rope/mod.rs (norm from a
// double sum, ((v·inv)·w), then the pair rotation a·c − b·s, b·c + a·s with the same f32
// cos/sin table, uploaded once). One warp per (row, head) of a strided view: head h of row r
// starts at x[off + r·ld + h·hd], so the q, k and v sections of one fused projection are each
// prepared in place. The normalised head is written back before the rotation reads its pairs:
// __syncwarp orders the lanes' global writes and reads within the warp.

extern "C" __global__ void tern_head_prep(float* __restrict__ x, long long off, long long ld, int rows, int heads, int hd,
                                          int norm, const float* __restrict__ w, float eps,
                                          const float* __restrict__ cos_t, const float* __restrict__ sin_t, int rot,
                                          const tern_u32* __restrict__ positions) {
    tern_await_prior_kernel();
    const int lane = threadIdx.x % 32;
    const size_t item = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (item >= (size_t)rows * heads) return;
    const size_t r = item / heads, h = item % heads;
    float* v = x + off + r * ld + h * hd;
    if (norm) {
        double ss = 0.0;
        for (int i = lane; i < hd; i += 32) ss += (double)v[i] * (double)v[i];
        ss = tern_warp_sum_d(ss);
        const float inv = (float)(1.0 / sqrt(ss / (double)hd + (double)eps));
        for (int i = lane; i < hd; i += 32) v[i] = w ? (v[i] * inv) * w[i] : v[i] * inv;
        __syncwarp();
    }
    if (rot > 0) {
        const int half = rot / 2;
        const size_t p = positions[r];
        const float* c = cos_t + p * half;
        const float* s = sin_t + p * half;
        for (int i = lane; i < half; i += 32) {
            const float a = v[i], b = v[i + half];
            v[i] = a * c[i] - b * s[i];
            v[i + half] = b * c[i] + a * s[i];
        }
    }
}
