// One head's RMS norm and rotate-half RoPE by one warp, its values in registers: the body of
// tern_head_prep_regs (rope.cu) and of decode attention's own head preparation (PREP in
// attention/kv.cu), so that both give tern_head_prep's bits. CPU twin: rope/mod.rs.
//
// The head's hd values (src, hd <= 32·SLOTS) and the norm weight (w; null: unweighted; norm 0:
// no norm) are requested together, then the position's cos/sin rows (c, sn: half values each;
// half 0: no rotation), so a head waits for memory about twice. The norm's sum of squares is
// a double, summed in each lane's channel order, then over the warp; the rotation pairs
// channels i and i + half, which other lanes hold, through `row` (the warp's shared row of at
// least hd floats), which receives the prepared head.
template <int SLOTS>
__device__ __forceinline__ void tern_prep_head_to_shared(float* __restrict__ row, const float* __restrict__ src, int hd,
                                                         int norm, const float* __restrict__ w, float eps, int half,
                                                         const float* __restrict__ c, const float* __restrict__ sn,
                                                         int lane) {
    float vals[SLOTS], wv[SLOTS];
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) vals[j] = lane + 32 * j < hd ? src[lane + 32 * j] : 0.f;
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) wv[j] = norm && w && lane + 32 * j < hd ? w[lane + 32 * j] : 0.f;
    // half <= hd / 2 <= 16 · SLOTS: a channel lane + 32·j of the first half has j < SLOTS / 2.
    float cs[SLOTS / 2], sv[SLOTS / 2];
    if (half > 0) {
#pragma unroll
        for (int j = 0; j < SLOTS / 2; ++j) {
            const int i = lane + 32 * j;
            cs[j] = i < half ? c[i] : 0.f;
            sv[j] = i < half ? sn[i] : 0.f;
        }
    }
    if (norm) {
        double ss = 0.0;
#pragma unroll
        for (int j = 0; j < SLOTS; ++j)
            if (lane + 32 * j < hd) ss += (double)vals[j] * (double)vals[j];
        const float inv = tern_inv_rms_of(tern_warp_sum_d(ss), hd, eps);
#pragma unroll
        for (int j = 0; j < SLOTS; ++j)
            if (lane + 32 * j < hd) vals[j] = w ? (vals[j] * inv) * wv[j] : vals[j] * inv;
    }
#pragma unroll
    for (int j = 0; j < SLOTS; ++j)
        if (lane + 32 * j < hd) row[lane + 32 * j] = vals[j];
    __syncwarp();
    if (half > 0) {
#pragma unroll
        for (int j = 0; j < SLOTS / 2; ++j) {
            const int i = lane + 32 * j;
            if (i < half) {
                const float a = row[i], b = row[i + half];
                row[i] = a * cs[j] - b * sv[j];
                row[i + half] = b * cs[j] + a * sv[j];
            }
        }
        __syncwarp();
    }
}
