// Mean pooling, CUDA form. CPU twin: pool/mod.rs. One thread per (sequence, column) sums the
// sequence's rows in order in double, exactly as the CPU does, so the result is bit-identical.

extern "C" __global__ void tern_mean_pool(const float* __restrict__ h, int d, const tern_u32* __restrict__ seg_start,
                                          const tern_u32* __restrict__ seg_len, float* __restrict__ out) {
    tern_await_prior_kernel();
    const int s = blockIdx.y;
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= d) return;
    const size_t start = seg_start[s], len = seg_len[s];
    double acc = 0.0;
    for (size_t r = 0; r < len; ++r) acc += (double)h[(start + r) * d + col];
    out[(size_t)s * d + col] = (float)(acc / (double)len);
}
