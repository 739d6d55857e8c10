// The warpgroup products of ../../wgmma.cuh checked against the CPU (tests.rs) before the fast
// prefill builds on them: d = c + a b^T for one 64 x 32 tile over k (a multiple of 16, at most
// 128), a [64][k] and b [32][k] bf16 rows and c, d [64][32] f32 in global memory; c null: the
// first k-step replaces the accumulators, which start as NaN (so a product that read them would
// show). The operands go to shared memory at the strides the test picks (lbo, sbo a tile; b's
// tile at byte b_at), so both strides of the descriptor are exercised in either order of the
// core matrices; a_m_major: a's tile M-major (tern_wgmma_offset_mn) and multiplied by the
// transposed-A form. One warpgroup: 128 threads.
extern "C" __global__ void __launch_bounds__(128) tern_gdn_wgmma_check_m64n32(const unsigned short* a, const unsigned short* b, const float* c, float* d,
                                                                               int k, unsigned lbo_a, unsigned sbo_a, unsigned lbo_b, unsigned sbo_b,
                                                                               unsigned b_at, int a_m_major) {
    tern_await_prior_kernel();
    extern __shared__ __align__(16) unsigned char tern_gdn_wgmma_smem[];
    unsigned char* const sa = tern_gdn_wgmma_smem;
    unsigned char* const sb = tern_gdn_wgmma_smem + b_at;
    const int tid = threadIdx.x;
    for (int idx = tid; idx < 64 * k; idx += 128)
        *reinterpret_cast<unsigned short*>(sa + (a_m_major ? tern_wgmma_offset_mn : tern_wgmma_offset)(idx / k, idx % k, lbo_a, sbo_a)) = a[idx];
    for (int idx = tid; idx < 32 * k; idx += 128)
        *reinterpret_cast<unsigned short*>(sb + tern_wgmma_offset(idx / k, idx % k, lbo_b, sbo_b)) = b[idx];
    tern_wgmma_fence_stores();
    __syncthreads();

    const int w = tid >> 5, g = (tid & 31) >> 2, q = tid & 3;
    float acc[16];
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const int row = 16 * w + g + 8 * ((j >> 1) & 1), col = 8 * (j >> 2) + 2 * q + (j & 1);
        acc[j] = c ? c[row * 32 + col] : __int_as_float(0x7fc00000);
    }
    tern_wgmma_fence();
    for (int kt = 0; kt < k / 16; kt++) {
        const unsigned long long da = tern_wgmma_desc(sa + 2 * kt * lbo_a, lbo_a, sbo_a);
        const unsigned long long db = tern_wgmma_desc(sb + 2 * kt * lbo_b, lbo_b, sbo_b);
        if (a_m_major) tern_wgmma_m64n32k16_mn_a(acc, da, db, kt > 0 || c != nullptr);
        else tern_wgmma_m64n32k16(acc, da, db, kt > 0 || c != nullptr);
    }
    tern_wgmma_commit();
    tern_wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < 16; j++) {
        const int row = 16 * w + g + 8 * ((j >> 1) & 1), col = 8 * (j >> 2) + 2 * q + (j & 1);
        d[row * 32 + col] = acc[j];
    }
}
