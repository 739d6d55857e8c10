// Helpers of the CUDA matmul: f32 -> bf16 rounding of a GEMM operand (fast mode) and the
// bias add after a GEMM. CPU twins: half::bf16::from_f32 and the row add in matmul/mod.rs.

// Eight values a step: two 16-byte loads and one 16-byte store (one 2-byte store a value ran at
// under half the copy rate); the launcher passes whole allocations, so x and y start 16-byte
// aligned. The last n % 8 values one a thread.
extern "C" __global__ void tern_to_bf16(const float* __restrict__ x, size_t n, tern_bf16* __restrict__ y) {
    tern_await_prior_kernel();
    const size_t n8 = n / 8, stride = (size_t)gridDim.x * blockDim.x, first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (size_t e = first; e < n8; e += stride) {
        const float4 a = ((const float4*)x)[2 * e], b = ((const float4*)x)[2 * e + 1];
        ((uint4*)y)[e] = make_uint4(tern_bf16_pair(a.x, a.y), tern_bf16_pair(a.z, a.w), tern_bf16_pair(b.x, b.y), tern_bf16_pair(b.z, b.w));
    }
    for (size_t e = 8 * n8 + first; e < n; e += stride) y[e] = tern_bf16_from_f32(x[e]);
}

extern "C" __global__ void tern_add_bias(float* __restrict__ y, const float* __restrict__ bias, int rows, int d) {
    tern_await_prior_kernel();
    const size_t n = (size_t)rows * d;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x)
        y[e] += bias[e % d];
}
