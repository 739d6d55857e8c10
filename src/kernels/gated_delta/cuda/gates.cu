// The per-token gates, fused into one pass over the projection outputs: the log-decay
// g = a * softplus(alpha + dt) and beta = sigmoid(b). CPU twins: gates.rs (decay_gate,
// beta_gate); the hazards of softplus are documented there and repeated where they bite.

// log(1 + e^v). Guard at 20: exp overflows f32 above ~88.7, which would make g = -inf and
// wipe the head's state; above 20, softplus(v) - v < 2.1e-9, below an ulp of v. For
// x = e^v <= 1 the odd series of 2*atanh(x / (2 + x)) is free of the cancellation in
// log(1 + x) that would bias the chunked prefill's cumulative sums of g toward zero.
__device__ __forceinline__ float tern_gdn_softplus(float v) {
    if (v > 20.0f) return v;
    float x = expf(v);
    if (x > 1.0f) return logf(1.0f + x);
    float s = x / (2.0f + x);
    float s2 = s * s;
    float poly = 1.0f / 15.0f;
    poly = poly * s2 + 1.0f / 13.0f;
    poly = poly * s2 + 1.0f / 11.0f;
    poly = poly * s2 + 1.0f / 9.0f;
    poly = poly * s2 + 1.0f / 7.0f;
    poly = poly * s2 + 1.0f / 5.0f;
    poly = poly * s2 + 1.0f / 3.0f;
    poly = poly * s2 + 1.0f;
    return 2.0f * s * poly;
}

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
