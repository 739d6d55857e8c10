// Embedding lookup × scale, CUDA form. CPU twin: embedding/mod.rs. The ids were checked against
// the vocabulary on the host before upload, so the kernel indexes without a bound check.

extern "C" __global__ void tern_embed_lookup(const float* __restrict__ table, const tern_u32* __restrict__ ids, int rows,
                                             int d, float scale, float* __restrict__ out) {
    tern_await_prior_kernel();
    const size_t n = (size_t)rows * d;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / d, i = e % d;
        out[e] = table[(size_t)ids[r] * d + i] * scale;
    }
}
