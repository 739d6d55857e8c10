// The routed experts' combine and the shared expert's gate, CUDA form. CPU twins: moe/mod.rs
// (`out[t] += y·w`, experts in index order) and the backend's add_sigmoid_gated. The product is
// rounded before the add (__fmul_rn keeps the compiler from fusing them into one FMA), as on
// the CPU, so each addition rounds the same way there and here.

// out[rows[r]] += y[r]·weights[r] for r < n, rows of d. Within one launch the rows are
// distinct (an expert sees a token once), so no two threads add to the same element.
extern "C" __global__ void tern_scatter_add_rows(float* __restrict__ out, const float* __restrict__ y,
                                                 const tern_u32* __restrict__ rows, const float* __restrict__ weights,
                                                 int n, int d) {
    const size_t total = (size_t)n * d;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / d, i = e % d;
        float* o = out + (size_t)rows[r] * d + i;
        *o = *o + __fmul_rn(y[e], weights[r]);
    }
}

// out[r] += sigmoid(gate[r])·y[r], rows of d.
extern "C" __global__ void tern_add_sigmoid_gated(float* __restrict__ out, const float* __restrict__ y,
                                                  const float* __restrict__ gate, int n, int d) {
    const size_t total = (size_t)n * d;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        const float s = 1.0f / (1.0f + expf(-gate[e / d]));
        out[e] = out[e] + __fmul_rn(s, y[e]);
    }
}
