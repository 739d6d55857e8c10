// Per-head RMS norm and rotate-half RoPE, CUDA form. CPU twin: rope/mod.rs (norm from a
// double sum, ((v·inv)·w), then the pair rotation a·c − b·s, b·c + a·s with the same f32
// cos/sin table, uploaded once). One warp per (row, head) of a strided view: head h of a section
// starting at column off starts at x[off + r·ld + h·hd], so the q, k and v sections of one fused
// projection are prepared in place, in one launch. The normalised head is written back before
// the rotation reads its pairs: __syncwarp orders the lanes' global writes and reads within the
// warp.

// Up to TERN_HEAD_SECTIONS sections of each row prepared by one launch (q, k and v of a fused
// projection): section i holds heads[i] heads of hd[i] channels from column off[i], each with
// its own norm (0 none, 1 with the weight w, or unweighted when w is null), eps and RoPE table
// (rot 0: none). Mirrors HeadSections in rope/cuda.rs field for field (C layout).
#define TERN_HEAD_SECTIONS 3
struct tern_head_sections {
    long long off[TERN_HEAD_SECTIONS];
    unsigned long long w[TERN_HEAD_SECTIONS];
    unsigned long long cos_t[TERN_HEAD_SECTIONS];
    unsigned long long sin_t[TERN_HEAD_SECTIONS];
    int heads[TERN_HEAD_SECTIONS];
    int hd[TERN_HEAD_SECTIONS];
    int norm[TERN_HEAD_SECTIONS];
    int rot[TERN_HEAD_SECTIONS];
    float eps[TERN_HEAD_SECTIONS];
    int n;
};

// This warp's (row r, section sec, head h of the section), one warp per (row, head of any
// section); false past the last (total_heads = the sections' heads summed).
__device__ __forceinline__ bool tern_head_item(const tern_head_sections& s, int rows, int total_heads, size_t& r, int& sec, int& h) {
    const size_t item = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (item >= (size_t)rows * total_heads) return false;
    r = item / total_heads;
    h = (int)(item % total_heads);
    sec = 0;
    while (sec + 1 < s.n && h >= s.heads[sec]) h -= s.heads[sec++];
    return true;
}

extern "C" __global__ void tern_head_prep(float* __restrict__ x, long long ld, int rows, int total_heads,
                                          const tern_head_sections s, const tern_u32* __restrict__ positions) {
    tern_await_prior_kernel();
    const int lane = threadIdx.x % 32;
    size_t r;
    int sec, h;
    if (!tern_head_item(s, rows, total_heads, r, sec, h)) return;
    const int hd = s.hd[sec], rot = s.rot[sec];
    const float* w = (const float*)s.w[sec];
    float* v = x + s.off[sec] + r * ld + (size_t)h * hd;
    if (s.norm[sec]) {
        double ss = 0.0;
        for (int i = lane; i < hd; i += 32) ss += (double)v[i] * (double)v[i];
        const float inv = tern_inv_rms_of(tern_warp_sum_d(ss), hd, s.eps[sec]);
        for (int i = lane; i < hd; i += 32) v[i] = w ? (v[i] * inv) * w[i] : v[i] * inv;
        __syncwarp();
    }
    if (rot > 0) {
        const int half = rot / 2;
        const size_t p = positions[r];
        const float* c = (const float*)s.cos_t[sec] + p * half;
        const float* sn = (const float*)s.sin_t[sec] + p * half;
        for (int i = lane; i < half; i += 32) {
            const float a = v[i], b = v[i + half];
            v[i] = a * c[i] - b * sn[i];
            v[i + half] = b * c[i] + a * sn[i];
        }
    }
}

// tern_head_prep with the head held in registers (steps of at most 64 rows; TERN_NORM_REGS=0 off): the
// position, the head's values and the norm weight are loaded first, the position's cos/sin
// right after it, so a head waits for memory about twice instead of once per step above
// (values, weight after the sum, position, its table, the normalised values read back); the
// rotation pairs values through the warp's shared row, as columns i and i + half sit in other
// lanes' registers. Same products and sums in the same order as tern_head_prep: the same
// bits. A short query's head preparation took 9.4 µs a launch (ncu, eg2, H200). Heads of at
// most 32 · TERN_PREP_SLOTS channels (MAX_HEAD_DIM); blocks of TERN_PREP_WARPS warps.
#define TERN_PREP_SLOTS 16
#define TERN_PREP_WARPS 4
extern "C" __global__ void tern_head_prep_regs(float* __restrict__ x, long long ld, int rows, int total_heads,
                                               const tern_head_sections s, const tern_u32* __restrict__ positions) {
    tern_await_prior_kernel();
    __shared__ float row_of_warp[TERN_PREP_WARPS][32 * TERN_PREP_SLOTS];
    const int lane = threadIdx.x % 32;
    size_t r;
    int sec, h;
    if (!tern_head_item(s, rows, total_heads, r, sec, h)) return;
    const int hd = s.hd[sec], rot = s.rot[sec], half = rot / 2;
    if (!s.norm[sec] && rot == 0) return;
    const float* w = (const float*)s.w[sec];
    float* v = x + s.off[sec] + r * ld + (size_t)h * hd;
    // The position first, then the values and the weight (tern_prep_head_to_shared), then the
    // position's cos/sin, which wait for it.
    const size_t p = rot > 0 ? positions[r] : 0;
    const float* c = rot > 0 ? (const float*)s.cos_t[sec] + p * half : nullptr;
    const float* sn = rot > 0 ? (const float*)s.sin_t[sec] + p * half : nullptr;
    float* row = row_of_warp[threadIdx.x / 32];
    tern_prep_head_to_shared<TERN_PREP_SLOTS>(row, v, hd, s.norm[sec], w, s.eps[sec], half, c, sn, lane);
#pragma unroll
    for (int j = 0; j < TERN_PREP_SLOTS; ++j)
        if (lane + 32 * j < hd) v[lane + 32 * j] = row[lane + 32 * j];
}
