// RMS normalisation, CUDA form. CPU twin: norm/mod.rs (same products in the same order:
// ((x·pre)·inv)·w, the inverse RMS from a double sum rounded to f32 once), so results differ
// from the CPU only by the order of the double sum. One block per row; a row's values are
// re-read from L1 for the second pass rather than held in registers, so any width works.
// Every output may also be written as bf16 (`y16`, nullable), for a consumer that reads bf16
// rows (a fast-mode GEMM) without a conversion pass.

// The inverse RMS from each thread's partial sum of squares.
__device__ __forceinline__ float tern_rms_finish(double ss, int d, float eps, double* scratch) {
    return tern_inv_rms_of(tern_block_sum_d(ss, scratch), d, eps);
}

__device__ __forceinline__ float tern_inv_rms(const float* x, int d, float pre, float eps, double* scratch) {
    double ss = 0.0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const double v = (double)(x[i] * pre);
        ss += v * v;
    }
    return tern_rms_finish(ss, d, eps, scratch);
}

// y[r] = rms(pre·x[r])·w (w nullable: no weight).
extern "C" __global__ void tern_rms_norm(const float* __restrict__ x, const float* __restrict__ w, float pre, float eps,
                                         int d, float* __restrict__ y, tern_bf16* __restrict__ y16) {
    tern_await_prior_kernel();
    __shared__ double scratch[32];
    const size_t off = (size_t)blockIdx.x * d;
    const float inv = tern_inv_rms(x + off, d, pre, eps, scratch);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = (x[off + i] * pre) * inv;
        if (w) v = v * w[i];
        if (y) y[off + i] = v;
        if (y16) y16[off + i] = tern_bf16_from_f32(v);
    }
}

// h[r] = (h[r] + rms(y[r])·w)·post, then (w2 non-null) a[r] = rms(h[r])·w2.
extern "C" __global__ void tern_add_norm(float* __restrict__ h, const float* __restrict__ y, const float* __restrict__ w,
                                         float post, float eps, int d, const float* __restrict__ w2,
                                         float* __restrict__ a, tern_bf16* __restrict__ a16) {
    tern_await_prior_kernel();
    __shared__ double scratch[32];
    const size_t off = (size_t)blockIdx.x * d;
    const float inv = tern_inv_rms(y + off, d, 1.0f, eps, scratch);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = h[off + i] + (y[off + i] * inv) * w[i];
        if (post != 1.0f) v *= post;
        h[off + i] = v;
    }
    if (!w2) return;
    // Each thread re-reads only the entries it wrote itself, so no barrier is needed before
    // the sum (tern_block_sum_d has its own).
    const float inv2 = tern_inv_rms(h + off, d, 1.0f, eps, scratch);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = (h[off + i] * inv2) * w2[i];
        if (a) a[off + i] = v;
        if (a16) a16[off + i] = tern_bf16_from_f32(v);
    }
}

// The pre-norm residual step: x[r] += y[r], then a[r] = rms(x[r])·w. CPU twin: residual_norm.
extern "C" __global__ void tern_residual_norm(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
                                              float eps, int d, float* __restrict__ a, tern_bf16* __restrict__ a16) {
    tern_await_prior_kernel();
    __shared__ double scratch[32];
    const size_t off = (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) x[off + i] = x[off + i] + y[off + i];
    // Each thread re-reads only the entries it wrote itself (tern_block_sum_d has its barrier).
    const float inv = tern_inv_rms(x + off, d, 1.0f, eps, scratch);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = (x[off + i] * inv) * w[i];
        if (a) a[off + i] = v;
        if (a16) a16[off + i] = tern_bf16_from_f32(v);
    }
}

// tern_add_norm with the row held in registers (steps of at most 64 rows; TERN_NORM_REGS=0 off): for
// rows of at most TERN_NORM_SLOTS · blockDim.x values every operand (y, h, w, w2) is loaded
// before the first sum, so a row waits for memory once rather than once per pass (above: y,
// then h and w after the first sum, then h again and w2 after the second). Same products and
// sums in the same order as tern_add_norm: the same bits. A short query's sandwich-norm steps
// are launches of 8 blocks whose time is those waits (ncu, eg2, H200: 5.5 µs each, 72 a query).
#define TERN_NORM_SLOTS 4
extern "C" __global__ void tern_add_norm_regs(float* __restrict__ h, const float* __restrict__ y, const float* __restrict__ w,
                                              float post, float eps, int d, const float* __restrict__ w2,
                                              float* __restrict__ a, tern_bf16* __restrict__ a16) {
    tern_await_prior_kernel();
    __shared__ double scratch[32];
    const size_t off = (size_t)blockIdx.x * d;
    const int t = threadIdx.x, nt = blockDim.x;
    float yv[TERN_NORM_SLOTS], hv[TERN_NORM_SLOTS], wv[TERN_NORM_SLOTS], w2v[TERN_NORM_SLOTS];
#pragma unroll
    for (int j = 0; j < TERN_NORM_SLOTS; ++j) {
        const int i = t + j * nt;
        const bool in = i < d;
        yv[j] = in ? y[off + i] : 0.f;
        hv[j] = in ? h[off + i] : 0.f;
        wv[j] = in ? w[i] : 0.f;
        w2v[j] = in && w2 ? w2[i] : 0.f;
    }
    const float inv = tern_rms_finish(tern_held_sum_squares(yv, t, nt, d), d, eps, scratch);
#pragma unroll
    for (int j = 0; j < TERN_NORM_SLOTS; ++j)
        if (t + j * nt < d) {
            float v = hv[j] + (yv[j] * inv) * wv[j];
            if (post != 1.0f) v *= post;
            hv[j] = v;
            h[off + t + j * nt] = v;
        }
    if (!w2) return;
    const float inv2 = tern_rms_finish(tern_held_sum_squares(hv, t, nt, d), d, eps, scratch);
#pragma unroll
    for (int j = 0; j < TERN_NORM_SLOTS; ++j)
        if (t + j * nt < d) {
            const float v = (hv[j] * inv2) * w2v[j];
            if (a) a[off + t + j * nt] = v;
            if (a16) a16[off + t + j * nt] = tern_bf16_from_f32(v);
        }
}

// tern_add_norm for steps of many rows (a batch of documents; the default, TERN_NORM_WARP_ROWS=0
// turns it off): one warp per row, 8 rows a block, no block barrier. The block form gives each
// row a block whose two sums each meet at two barriers, for a row of only 512 to 1024 values;
// ncu put that kernel at 2.8 ms of an eg2 8192-token document (72 launches, base clocks), about
// twice its bytes' time. Here lane L holds the row's 16-byte chunks L, L + 32, ... (NC chunks,
// d = 128·NC) of y and h, loaded before the first sum; the weights, the same for every row,
// come from L1 when used. Same products as tern_add_norm; the double sums run in another order
// (a lane's chunks, then the warp's butterfly), and the inverse RMS is that sum rounded to f32
// once, so it equals the block form's unless the exact value lies within ~1e-16 of an f32
// rounding boundary.
__device__ __forceinline__ double tern_sum_squares4(float4 v) {
    const double a = v.x, b = v.y, c = v.z, e = v.w;
    return ((a * a + b * b) + c * c) + e * e;
}
template <int NC>
__device__ __forceinline__ void tern_add_norm_rows_body(float* __restrict__ h, const float* __restrict__ y, const float* __restrict__ w,
                                                        float post, float eps, int d, const float* __restrict__ w2, float* __restrict__ a,
                                                        tern_bf16* __restrict__ a16, int rows) {
    const int lane = threadIdx.x % 32;
    const int row = (int)(blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32);
    if (row >= rows) return;  // uniform per warp: no shuffle is left half-joined
    const size_t off = (size_t)row * d;
    float4 yv[NC], hv[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int i = (c * 32 + lane) * 4;
        yv[c] = *reinterpret_cast<const float4*>(y + off + i);
        hv[c] = *reinterpret_cast<const float4*>(h + off + i);
    }
    double ss = 0.0;
#pragma unroll
    for (int c = 0; c < NC; ++c) ss += tern_sum_squares4(yv[c]);
    const float inv = tern_inv_rms_of(tern_warp_sum_d(ss), d, eps);
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int i = (c * 32 + lane) * 4;
        const float4 wv = *reinterpret_cast<const float4*>(w + i);
        float4 v = make_float4(hv[c].x + (yv[c].x * inv) * wv.x, hv[c].y + (yv[c].y * inv) * wv.y,
                               hv[c].z + (yv[c].z * inv) * wv.z, hv[c].w + (yv[c].w * inv) * wv.w);
        if (post != 1.0f) v = make_float4(v.x * post, v.y * post, v.z * post, v.w * post);
        hv[c] = v;
        *reinterpret_cast<float4*>(h + off + i) = v;
    }
    if (!w2) return;
    double ss2 = 0.0;
#pragma unroll
    for (int c = 0; c < NC; ++c) ss2 += tern_sum_squares4(hv[c]);
    const float inv2 = tern_inv_rms_of(tern_warp_sum_d(ss2), d, eps);
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int i = (c * 32 + lane) * 4;
        const float4 wv = *reinterpret_cast<const float4*>(w2 + i);
        const float4 v = make_float4((hv[c].x * inv2) * wv.x, (hv[c].y * inv2) * wv.y, (hv[c].z * inv2) * wv.z, (hv[c].w * inv2) * wv.w);
        if (a) *reinterpret_cast<float4*>(a + off + i) = v;
        if (a16) *reinterpret_cast<uint2*>(a16 + off + i) = make_uint2(tern_bf16_pair(v.x, v.y), tern_bf16_pair(v.z, v.w));
    }
}
#define TERN_ADD_NORM_ROWS(NC)                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) tern_add_norm_rows_c##NC(                                         \
        float* __restrict__ h, const float* __restrict__ y, const float* __restrict__ w, float post, float eps, int d,    \
        const float* __restrict__ w2, float* __restrict__ a, tern_bf16* __restrict__ a16, int rows) {                   \
        tern_await_prior_kernel();                                                                                      \
        tern_add_norm_rows_body<NC>(h, y, w, post, eps, d, w2, a, a16, rows);                                           \
    }
TERN_ADD_NORM_ROWS(1)
TERN_ADD_NORM_ROWS(2)
TERN_ADD_NORM_ROWS(3)
TERN_ADD_NORM_ROWS(4)
TERN_ADD_NORM_ROWS(5)
TERN_ADD_NORM_ROWS(6)
TERN_ADD_NORM_ROWS(7)
TERN_ADD_NORM_ROWS(8)
#undef TERN_ADD_NORM_ROWS
