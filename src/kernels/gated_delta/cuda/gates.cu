// The per-token gates, fused into one pass over the projection outputs: the log-decay
// g = a * softplus(alpha + dt) and beta = sigmoid(b). CPU twins: gates.rs (decay_gate,
// beta_gate); the hazards of softplus are documented there and at tern_gdn_softplus
// (common.cuh: the fused recurrence forms the same gates).

// One thread per (row, head). a is the checkpoint's -exp(A_log), never exponentiated here.
extern "C" __global__ void tern_gdn_gates(const float* __restrict__ alpha, const float* __restrict__ b,
                                          const float* __restrict__ dt_bias, const float* __restrict__ a,
                                          float* __restrict__ g, float* __restrict__ beta,
                                          int n_heads, long long total) {
    tern_await_prior_kernel();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    int h = (int)(i % n_heads);
    g[i] = a[h] * tern_gdn_softplus(alpha[i] + dt_bias[h]);
    // For b -> -inf the divisor overflows to +inf and beta is 0, as on the CPU.
    beta[i] = 1.0f / (1.0f + expf(-b[i]));
}
