// Helpers of the CUDA matmul: f32 -> bf16 rounding of a GEMM operand (fast mode) and the
// bias add after a GEMM. CPU twins: half::bf16::from_f32 and the row add in matmul/mod.rs.

extern "C" __global__ void tern_to_bf16(const float* __restrict__ x, size_t n, tern_bf16* __restrict__ y) {
    tern_await_prior_kernel();
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x)
        y[e] = tern_bf16_from_f32(x[e]);
}

extern "C" __global__ void tern_add_bias(float* __restrict__ y, const float* __restrict__ bias, int rows, int d) {
    tern_await_prior_kernel();
    const size_t n = (size_t)rows * d;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x)
        y[e] += bias[e % d];
}
