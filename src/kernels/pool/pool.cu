// Mean pooling, CUDA form. CPU twin: pool/mod.rs. One thread per (sequence, column) sums the
// sequence's rows in order in double, exactly as the CPU does, so the result is bit-identical.
// The order is what makes the sum one long chain, so the loads run ahead of it: 16 rows are
// loaded before they are added (one load at a time took ~1 ms for 7 580 rows of 768). Blocks of
// one warp spread a long sequence's columns over as many multiprocessors as they fill.
#define TERN_POOL_AHEAD 16

extern "C" __global__ void tern_mean_pool(const float* __restrict__ h, int d, const tern_u32* __restrict__ seg_start,
                                          const tern_u32* __restrict__ seg_len, float* __restrict__ out) {
    tern_await_prior_kernel();
    const int s = blockIdx.y;
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= d) return;
    const size_t start = seg_start[s], len = seg_len[s];
    const float* p = h + start * d + col;
    double acc = 0.0;
    size_t r = 0;
    for (; r + TERN_POOL_AHEAD <= len; r += TERN_POOL_AHEAD) {
        float v[TERN_POOL_AHEAD];
#pragma unroll
        for (int i = 0; i < TERN_POOL_AHEAD; ++i) v[i] = p[(r + i) * d];
#pragma unroll
        for (int i = 0; i < TERN_POOL_AHEAD; ++i) acc += (double)v[i];
    }
    for (; r < len; ++r) acc += (double)p[r * d];
    out[(size_t)s * d + col] = (float)(acc / (double)len);
}
