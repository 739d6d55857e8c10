// Products of a few rows (decode) with weights read in their stored type, and the expansion
// of stored weights into a GEMM's operand type. CPU twin: matmul/mod.rs `linear_w` (bf16 and
// Q8_0 weights are formed exactly in f32 there too, so in f32 mode only summation order differs).
//
// Weight types: f32; bf16 bits; Q8_0 repacked at upload into quants [out][in] (i8) and one f16
// scale per 32 consecutive weights of a row ([out][in / 32], bits). d·q is exact in f32 (an
// 11-bit by 8-bit product), as on the CPU.
//
// A decode step is bound by the bytes of the weights: each warp owns one output feature and
// streams its row once, a step of STEP weights per lane (16-byte loads of bf16, 8-byte of Q8_0),
// multiplying them into up to R rows of x (R a compile-time bound, rows <= R at run time) that
// every warp of the GPU reads and the L1/L2 caches hold. The row's partial sums meet in a
// butterfly warp sum (fixed order for a given input).
//
// A matrix of few output features (a layer's 1024-feature output projection) has too few
// rows to keep every multiprocessor's loads in flight, one warp a row: there `ks` warps of a
// block share each feature, warp slice s taking the warp's steps s, s + ks, ... of the
// row, and the slices' sums meet in shared memory, added in slice order. `ks` depends on the
// launch's matrices and the GPU (never on the rows of x), so a row's result is the same alone
// and in a batch.
//
// A decode step is also a chain of small launches, so one launch does more than one product:
// - up to TERN_GEMV_PARTS matrices that read the same x (a layer's input projections), each
//   writing its own output, the grid's blocks split between them (tern_gemv_parts);
// - an FFN's fused gate|up product and its gated activation, act(gate)·up written directly
//   (TERN_Y_SILU, TERN_Y_GELU);
// - a mixture-of-experts layer's routed products, the expert of each (row, choice) read from
//   device memory (routed on the device), so that a decode step of a MoE model records as a
//   graph like a dense one (tern_gemv_routed); for one row, the down products end in their
//   weighted sum, the residual step and the norm (tern_gemv_routed_res);
// - a prompt's expert products over tiles of its rows sorted by expert (tern_gemv_tiles).
// Fast mode's products of 2 to 8 rows with bf16 and Q8_0 weights run on the tensor cores
// instead (tern_gemv_mma, tern_gemv_mma_tiles).

#define TERN_GEMV_WARPS 8
#define TERN_GEMV_PARTS 4

// Mirrors GemvParts in matmul/cuda.rs field for field (C layout). Part i owns blocks
// block0[i] .. block0[i + 1] - 1 and output features 0 .. out[i] - 1 of its matrix.
struct tern_gemv_parts {
    unsigned long long w[TERN_GEMV_PARTS];       // weights (Q8_0: the quants)
    unsigned long long scales[TERN_GEMV_PARTS];  // Q8_0 scales, else unused
    unsigned long long y[TERN_GEMV_PARTS];       // outputs [rows][out]
    int out[TERN_GEMV_PARTS];
    int block0[TERN_GEMV_PARTS + 1];
    int n;
    int ks;  // warps per output feature (1, 2, 4 or 8): see tern_gemv_rows
    // TERN_Y_RESIDUAL and TERN_Y_ADD_NORM only (one part): the norm's weight [out], the
    // normalised output a [rows][out], epsilon, and the launch's arrival counter (0 between
    // launches); TERN_Y_ADD_NORM also the residual stream h, the next norm's weight and `post`.
    unsigned long long norm_w;
    unsigned long long norm_out;
    unsigned long long counter;
    float eps;
    unsigned long long stream;
    unsigned long long next_w;
    float post;
    // One row only (a decode step of one sequence): the outputs of part conv_part - 1 (0: no
    // part) go through a gated-delta layer's causal conv1d + SiLU of width K as they are
    // written (TernConvTaps, in the kernels built for that width, tern_gemv_conv_*_kK): its
    // weights [out][K] and the sequence's raw-input history [out][K - 1], which it advances.
    unsigned long long conv_w;
    unsigned long long conv_at;
    int conv_part;
    // TERN_Y_GELU_BY only: the view the product's gelu multiplies, row r at up + r·up_ld.
    unsigned long long up;
    long long up_ld;
    // One-row kernels only (R = 1): nonzero, each warp issues its first weight loads before it
    // awaits the prior kernel (W::EARLY_STEPS; tern_await_prior_kernel_unless, launch.cuh);
    // 2, the kernel first lets the next one be scheduled (tern_let_dependents_launch), since
    // it reads nothing but weights before its wait.
    int early;
    // One-row kernels only: with in_h set, the product's input is rms(h)·w (h = in_h, w = in_w,
    // epsilon in_eps; `in` values) rather than x, formed by every block (TernNormedInput), and
    // block 0 also writes it to in_a.
    float in_eps;
    unsigned long long in_h;
    unsigned long long in_w;
    unsigned long long in_a;
};
// The host's GemvParts mirrors this layout; its test (matmul/cuda.rs) checks the same size and
// the field offsets this order gives.
static_assert(sizeof(tern_gemv_parts) == 272, "tern_gemv_parts: 272 bytes, as GemvParts");

// The conv operands of a launch (from tern_gemv_parts, passed by value so that they stay kernel
// parameters rather than loads through a pointer to them); `on` for the conv part's warps.
struct TernConvArgs {
    const float* w;
    float* history;
    bool on;
};

// A conv channel's operands for the one-row GEMV that convolves the channels it writes (K the
// conv's width, a compile-time constant as in the conv kernel's instances): the K taps and the
// K - 1 history values, requested before the product (`load`) so that its end waits for no
// load; `step` then forms the causal depthwise conv1d + SiLU of the channel's new input xc and
// writes the history advanced. tern_gdn_conv_body's arithmetic for a one-position segment
// (gated_delta/cuda/conv.cu; the same rounding helpers, tern_conv_newest and
// tern_conv_add_tap, and the same silu), so the same bits as the product written out and that
// kernel after it. Only the channel's own warp reads or writes its history.
template <int K>
struct TernConvTaps {
    float w[K], h[K > 1 ? K - 1 : 1];
    __device__ __forceinline__ void load(const TernConvArgs& a, int c) {
        const float* wp = a.w + (size_t)c * K;
        const float* hp = a.history + (size_t)c * (K - 1);
#pragma unroll
        for (int t = 0; t < K; t++) w[t] = wp[t];
#pragma unroll
        for (int t = 0; t + 1 < K; t++) h[t] = hp[t];
    }
    __device__ __forceinline__ float step(const TernConvArgs& a, int c, float xc) const {
        float* hp = a.history + (size_t)c * (K - 1);
        float acc = tern_conv_newest(xc, w[K - 1]);
#pragma unroll
        for (int t = 0; t + 1 < K; t++) acc = tern_conv_add_tap(acc, h[t], w[t]);
#pragma unroll
        for (int t = 0; t + 1 < K; t++) hp[t] = t + 2 < K ? h[t + 1] : xc;
        return tern_silu(acc);
    }
};

__device__ __forceinline__ float tern_f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Byte `i` of `word`, a signed 8-bit integer, as a float. Not cvt.rn.f32.s32: integer to float
// conversions issue at 16 a clock per multiprocessor on the H200 (a quarter of the integer and
// an eighth of the float rate), as many quants as its memory can deliver a clock, so a Q8_0
// product at full bandwidth would pay in conversions what it saves in bytes. Instead the byte,
// biased to unsigned (b + 128), becomes the low mantissa byte of 2^23 (one byte permute) and
// the float subtraction of 2^23 + 128 leaves b: exact, as the conversion is. (At the rates the
// decode products reach today the two measured the same.)
__device__ __forceinline__ float tern_i8_to_f32(unsigned word, int i) {
    const unsigned biased = word ^ 0x80808080u;
    // Result bytes: byte i of `biased`, then bytes 4, 5, 7 of the pair (0x00, 0x00, 0x4b).
    const unsigned bits = __byte_perm(biased, 0x4b000000u, 0x7540u | (unsigned)i);
    return __uint_as_float(bits) - 8388736.0f;
}

// Each weight type loads STEP consecutive weights of a row per lane and step: 32 bytes of f32,
// 16 of bf16, 8 of Q8_0 quants (and the block's scale). `load_raw` keeps them as loaded (`Raw`)
// and `expand` forms the floats, so that the loads of several steps can be in flight before
// their use for few registers (TernGemvSteps); `load` is both at once. (16 Q8_0 quants a lane,
// one 16-byte load, measured slower on the H200 twice: a 1024-weight row is then two steps a
// warp, fewer than the loop's unroll, and the head product took 168 µs against 115.) The
// host's split rule (gemv_split in matmul/cuda.rs) counts in these steps: GEMV_STEP_WEIGHTS
// there is 32 * STEP. EARLY_STEPS: the steps a one-row warp requests before it awaits the
// prior kernel (tern_gemv_rows' `early`), 64 bytes of weights a lane and row at most (a bf16
// row of 1024 weights whole).
struct TernWeightsF32 {
    static constexpr int STEP = 8, EARLY_STEPS = 2;
    struct Raw { float4 a, b; };
    const float* w;
    __device__ TernWeightsF32(unsigned long long wp, unsigned long long) : w((const float*)wp) {}
    __device__ __forceinline__ Raw load_raw(size_t at) const {
        return {*reinterpret_cast<const float4*>(w + at), *reinterpret_cast<const float4*>(w + at + 4)};
    }
    __device__ __forceinline__ static void expand(const Raw& r, float* v) {
        v[0] = r.a.x; v[1] = r.a.y; v[2] = r.a.z; v[3] = r.a.w;
        v[4] = r.b.x; v[5] = r.b.y; v[6] = r.b.z; v[7] = r.b.w;
    }
    __device__ __forceinline__ void load(size_t at, float* v) const { expand(load_raw(at), v); }
};

struct TernWeightsBf16 {
    static constexpr int STEP = 8, EARLY_STEPS = 4;
    typedef uint4 Raw;
    const tern_bf16* w;
    __device__ TernWeightsBf16(unsigned long long wp, unsigned long long) : w((const tern_bf16*)wp) {}
    __device__ __forceinline__ Raw load_raw(size_t at) const { return *reinterpret_cast<const uint4*>(w + at); }
    __device__ __forceinline__ static void expand(const Raw& u, float* v) {
        const unsigned q[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = __uint_as_float(q[i] << 16);
            v[2 * i + 1] = __uint_as_float(q[i] & 0xffff0000u);
        }
    }
    __device__ __forceinline__ void load(size_t at, float* v) const { expand(load_raw(at), v); }
};

// The 8 quants of a lane lie in one 32-weight block (at % 8 == 0), so they share one scale.
struct TernWeightsQ8 {
    static constexpr int STEP = 8, EARLY_STEPS = 4;
    const signed char* q;
    const unsigned short* d;
    __device__ TernWeightsQ8(unsigned long long wp, unsigned long long sp)
        : q((const signed char*)wp), d((const unsigned short*)sp) {}
    struct Raw { uint2 q; unsigned short d; };
    __device__ __forceinline__ Raw load_raw(size_t at) const { return {*reinterpret_cast<const uint2*>(q + at), d[at / 32]}; }
    __device__ __forceinline__ static void expand(const Raw& r, float* v) {
        const float s = tern_f16_to_f32(r.d);
        const unsigned p[2] = {r.q.x, r.q.y};
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = s * tern_i8_to_f32(p[i / 4], i % 4);
    }
    __device__ __forceinline__ void load(size_t at, float* v) const { expand(load_raw(at), v); }
};

// Steps of a row whose weight loads a warp issues together, and the blocks a multiprocessor
// must then hold of the kernel (registers up to 65536 / (256 · MIN_BLOCKS) a thread; 0: the
// compiler's choice). Q8_0 weights, one row of x: 4 steps (a 1024-weight row), 5 blocks (48
// registers). Left to itself the compiler fits that kernel in 32 registers by issuing each
// step's weight load after the step before has used its own: a chain of memory latencies that
// held a Q8_0 product to the time of the bf16 one at half the bytes. Measured on the H200
// (gemv_bench, one row, µs): Qwen3.5-0.8B's 1024 x 2048 2.99 -> 2.61, 1024 x 3584 3.87 -> 3.23,
// gate|up 7168 x 1024 5.43 -> 4.72, the head 115 -> 111 (with 4 / 6 blocks: 119 / 103, the
// layer's products best at 5); decode of the Q8_0 file 4-7% faster. Kept one step at a time:
// bf16 weights (there the same, 48 registers, was slower: gate|up 4.20 -> 4.72) and rows of
// several x (for 8 rows, the narrow forms with their loads in flight were faster on
// EmbeddingGemma's 768-wide products and slower on Qwen3.5's).
template <typename W, int R, int OPW> struct TernGemvSteps { static constexpr int IN_FLIGHT = 1, MIN_BLOCKS = 0; };
template <> struct TernGemvSteps<TernWeightsQ8, 1, 1> { static constexpr int IN_FLIGHT = 4, MIN_BLOCKS = 5; };
// Two features a warp, one row (tern_gemv_q8_1x2, the vocabulary head): both rows' 4 steps in
// flight, 8 loads a lane (3 blocks, 80 registers: with 4 the compiler splits the loads into
// chains again). Qwen3.5-0.8B's Q8_0 head, 248 320 x 1024: 111 µs one feature a warp (0.58 of
// the copy bandwidth) -> 93 µs (0.69); decode of that file 1-2% faster (H200).
template <> struct TernGemvSteps<TernWeightsQ8, 1, 2> { static constexpr int IN_FLIGHT = 4, MIN_BLOCKS = 3; };

// What a GEMV writes: each output feature o of W (TERN_Y_PLAIN), or, for a matrix of 2·half
// rows stacking a gate [half][in] over an up [half][in] (an FFN's fused gate|up product),
// act(gate_o)·up_o for o < half (TERN_Y_SILU, TERN_Y_GELU; the activation kernels' own forms,
// prelude.cuh): one warp computes both rows of a pair and writes the gated value, so the
// activation costs nothing beyond the product and its input never goes to memory.
#define TERN_Y_PLAIN 0
#define TERN_Y_SILU 1
#define TERN_Y_GELU 2
// TERN_Y_RESIDUAL: a pre-norm layer's output projection and the residual step after it in one
// launch. y is the residual stream x, to which each feature adds its product (x + W·v, as
// tern_residual_norm adds); the last block to finish then writes a = rms(x)·w for the rows,
// the next sublayer's input, as tern_residual_norm forms it (same block size and order: the
// same bits as the product and that kernel in two launches).
#define TERN_Y_RESIDUAL 3
// TERN_Y_ADD_NORM: the sandwich-norm step of EmbeddingGemma after a product: y is written as
// TERN_Y_PLAIN writes it, then the last block forms h = (h + rms(y)·w)·post and a = rms(h)·w2
// as tern_add_norm does (same block size and order: the same bits as the two launches).
#define TERN_Y_ADD_NORM 4
// TERN_Y_GELU_BY (the tensor-core form only): gelu_tanh(x·w_o) · up[r·up_ld + o], up a strided
// view of another tensor (EmbeddingGemma 2's per-layer input gate: the product's gelu times the
// layer's slice of the per-layer inputs), as the gated activation kernel forms it
// (activation.cu: act(g) · u), so the same bits as the product and that kernel.
#define TERN_Y_GELU_BY 5

// A one-row product whose input is the pre-norm residual stream's norm, a = rms(h)·w (the
// operands of tern_gemv_parts' in_* fields, passed by value like TernConvArgs). Every block forms
// a itself, as the norm tail of the GEMV before it would have (tern_gemv_norm_tail_held: the
// same slots, sums and order, so the same bits), into its dynamic shared memory, and block 0
// also writes it out for whatever reads it later. So the product before needs no tail, on
// which every block of this one would wait: TERN_Y_RESIDUAL's tail costs ~2 µs a product on a
// decode step's critical path (H100, gemv_chain_bench). Every thread of the block must call
// it: it meets the block's barriers. h comes through L2 (__ldcg), as the tail reads it. The
// norm's weights are copied into the dynamic shared memory after the normed row (d values
// each; d % 4 == 0 and w 16-byte aligned, checked by the host) by tern_gemv_normed_weights,
// asynchronously (cp.async) and before the block awaits the prior kernel (no kernel writes
// them), so that after the wait only h's round trip and the block's sum stand between the
// block and its product, and no registers hold them meanwhile (the normed kernels' own count,
// 60-64 for bf16, would otherwise grow past 74, a block fewer a multiprocessor).
// Values a thread holds in the norm of one row: the tail's held form below, and this.
#define TERN_NORM_TAIL_SLOTS 8
struct TernNormedInput {
    const float* h;
    const float* w;
    float* a;
    float eps;
    bool on;
};
__device__ __forceinline__ void tern_gemv_normed_weights(const TernNormedInput& n, int d) {
    extern __shared__ float tern_gemv_normed[];
    for (int k = 4 * threadIdx.x; k < d; k += 4 * blockDim.x) {
        const unsigned dst = (unsigned)__cvta_generic_to_shared(tern_gemv_normed + d + k);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(n.w + k) : "memory");
    }
}
__device__ __forceinline__ const float* tern_gemv_normed_input(const TernNormedInput& n, int d) {
    extern __shared__ float tern_gemv_normed[];
    __shared__ double scratch[32];
    constexpr int S = TERN_NORM_TAIL_SLOTS;
    const int t = threadIdx.x, nt = blockDim.x;
    // The stream's values pass through this thread's own slots of shared memory rather than
    // registers held across the block's sum (a kernel's registers are its worst point's):
    // the same values, squares and sums in the same order as tern_held_sum_squares.
    float hv[S];
#pragma unroll
    for (int j = 0; j < S; ++j) {
        const int i = t + j * nt;
        hv[j] = i < d ? __ldcg(n.h + i) : 0.0f;
    }
    const double ss = tern_held_sum_squares(hv, t, nt, d);
#pragma unroll
    for (int j = 0; j < S; ++j) {
        const int i = t + j * nt;
        if (i < d) tern_gemv_normed[i] = hv[j];
    }
    // This thread's copies of the weights landed; the block sum's barrier shows every
    // thread's to all.
    asm volatile("cp.async.wait_all;" ::: "memory");
    const float inv = tern_inv_rms_of(tern_block_sum_d(ss, scratch), d, n.eps);
#pragma unroll
    for (int j = 0; j < S; ++j) {
        const int i = t + j * nt;
        if (i >= d) continue;
        const float v = (tern_gemv_normed[i] * inv) * tern_gemv_normed[d + i];
        tern_gemv_normed[i] = v;
        if (blockIdx.x == 0) n.a[i] = v;
    }
    __syncthreads();
    return tern_gemv_normed;
}

// One step of a warp: the lane's S weights of each of the NW rows it holds times the same S
// values of each row r < rows of x, added to acc in the order of the weights.
template <int R, int NW, int S>
__device__ __forceinline__ void tern_gemv_step(float (&acc)[NW][R], const float (&v)[NW][S], const float* __restrict__ x,
                                               int rows, int in, int c) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r < rows) {
#pragma unroll
            for (int q = 0; q < S; q += 4) {
                const float4 a = *reinterpret_cast<const float4*>(x + (size_t)r * in + c + q);
#pragma unroll
                for (int j = 0; j < NW; ++j) {
                    float s = acc[j][r];
                    s = fmaf(a.x, v[j][q], s); s = fmaf(a.y, v[j][q + 1], s); s = fmaf(a.z, v[j][q + 2], s); s = fmaf(a.w, v[j][q + 3], s);
                    acc[j][r] = s;
                }
            }
        }
    }
}

// The steps of tern_gemv_rows with the weight loads of U steps issued together, then used: a
// row of few steps is then one memory latency, not U in a chain. For that the loads take no
// branch: a feature past `out` reads the matrix's last row in its place (and is never written),
// and the steps come U at a time, then one at a time for the rest. Same products in the same
// order as the one-step loop, so the same bits.
template <int R, int NW, int U, typename W>
__device__ __forceinline__ void tern_gemv_rows_in_flight(const W& w, const float* __restrict__ x, int rows, int in, int c,
                                                         int o0, int opw, int out, int stride, float (&acc)[NW][R]) {
    constexpr int S = W::STEP;
    size_t row[NW];  // held rows' starts; gated: rows o (gate) for j < opw, then o + out (up)
#pragma unroll
    for (int j = 0; j < NW; ++j) {
        const int o = min(o0 + j % opw, out - 1);
        row[j] = (size_t)(j < opw ? o : o + out) * in;
    }
#pragma unroll 1
    for (; c + (U - 1) * stride < in; c += U * stride) {
        typename W::Raw raw[U][NW];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < NW; ++j) raw[u][j] = w.load_raw(row[j] + c + u * stride);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float v[NW][S];
#pragma unroll
            for (int j = 0; j < NW; ++j) W::expand(raw[u][j], v[j]);
            tern_gemv_step<R, NW, S>(acc, v, x, rows, in, c + u * stride);
        }
    }
#pragma unroll 1
    for (; c < in; c += stride) {
        float v[NW][S];
#pragma unroll
        for (int j = 0; j < NW; ++j) w.load(row[j] + c, v[j]);
        tern_gemv_step<R, NW, S>(acc, v, x, rows, in, c);
    }
}

// One warp's OPW consecutive output features o0 .. o0 + OPW - 1 (those below `out`: the
// matrix's rows, or `half` of them for a gated product) for rows r < rows <= R of x (rows of
// `in`), written to y[r·out + o]; in % STEP == 0 (Q8_0 rows are whole 32-weight blocks). Each
// x value a lane loads serves every weight row the warp holds: with several rows of x (a batch
// of decode steps, a short query) the x reads, which come from L1, would otherwise outweigh
// the weights.
//
// With ks > 1 (split), the warp is slice `slice` of ks and every warp of the block calls this
// (the slices meet at a barrier), those past `out` included.
//
// `early` (R = 1; the kernel has not awaited the prior kernel): the warp requests its first
// W::EARLY_STEPS steps of weights, then awaits the prior kernel, then reads x. Under dependent
// launch the kernel's blocks start while the kernel before it runs, so the memory latency of
// its first weights passes then rather than after. The steps are then taken in the same order:
// the same bits.
template <int R, int OPW, int OMODE, typename W, int CONV_K = 0>
__device__ __forceinline__ void tern_gemv_rows(const W& w, const float* __restrict__ x, int rows, int in, int o0, int out,
                                               float* __restrict__ y, int ks = 1, int slice = 0,
                                               TernConvArgs conv = {nullptr, nullptr, false}, bool early = false,
                                               TernNormedInput normed = {nullptr, nullptr, nullptr, 0.0f, false}) {
    constexpr bool GATED = OMODE == TERN_Y_SILU || OMODE == TERN_Y_GELU;
    constexpr int NW = GATED ? 2 * OPW : OPW;  // weight rows held
    constexpr int S = W::STEP;                 // weights a lane takes per step
    const int lane = threadIdx.x % 32;
    float acc[NW][R];
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[j][r] = 0.0f;
    const int stride = 32 * S * ks;
    int c0 = o0 < out ? lane * S + 32 * S * slice : in;  // a warp past `out` loads nothing
    constexpr int EARLY = R == 1 ? W::EARLY_STEPS : 1;
    typename W::Raw first[EARLY][NW];
    if constexpr (R == 1) {
        if (early) {
            // Gated: rows o (gate) for j < OPW, then o + out (up); a feature past `out` reads
            // the matrix's last row in its place (never written).
#pragma unroll
            for (int u = 0; u < EARLY; ++u)
#pragma unroll
                for (int j = 0; j < NW; ++j) {
                    const int o = min(o0 + j % OPW, out - 1);
                    if (c0 + u * stride < in) first[u][j] = w.load_raw((size_t)(j < OPW ? o : o + out) * in + c0 + u * stride);
                }
            // (normed: its norm's weights too, in flight with the early weights.)
            if (normed.on) tern_gemv_normed_weights(normed, in);
            tern_await_prior_kernel();
        } else if (normed.on) {
            tern_gemv_normed_weights(normed, in);
        }
        // (normed: after the prior kernel, whose output h is; every warp of the block is here.)
        if (normed.on) x = tern_gemv_normed_input(normed, in);
    }
    // CONV_K (one row, one feature a warp, plain): the convolving lane's operands, in flight
    // during the product.
    TernConvTaps<(CONV_K > 0 ? CONV_K : 1)> taps;
    if constexpr (CONV_K > 0) {
        if (conv.on && lane == 0 && slice == 0 && o0 < out) taps.load(conv, o0);
    }
    if constexpr (R == 1) {
        if (early) {
#pragma unroll
            for (int u = 0; u < EARLY; ++u)
                if (c0 + u * stride < in) {
                    float v[NW][S];
#pragma unroll
                    for (int j = 0; j < NW; ++j) W::expand(first[u][j], v[j]);
                    tern_gemv_step<R, NW, S>(acc, v, x, rows, in, c0 + u * stride);
                }
            c0 = min(in, c0 + EARLY * stride);
        }
    }
    if constexpr (TernGemvSteps<W, R, OPW>::IN_FLIGHT > 1) {
        tern_gemv_rows_in_flight<R, NW, TernGemvSteps<W, R, OPW>::IN_FLIGHT>(w, x, rows, in, c0, o0, OPW, out, stride, acc);
    } else {
        // One step at a time; a feature past `out` loads nothing (zeros).
#pragma unroll 4
        for (int c = c0; c < in; c += stride) {
            float v[NW][S];
#pragma unroll
            for (int j = 0; j < NW; ++j) {
                // Gated: rows o (gate) for j < OPW, then o + out (up).
                const int o = o0 + j % OPW;
                if (o < out) {
                    w.load((size_t)(j < OPW ? o : o + out) * in + c, v[j]);
                } else {
#pragma unroll
                    for (int i = 0; i < S; ++i) v[j][i] = 0.0f;
                }
            }
            tern_gemv_step<R, NW, S>(acc, v, x, rows, in, c);
        }
    }
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[j][r] = tern_warp_sum(acc[j][r]);
    if (ks > 1) {
        // Slice sums of the block's warps, [warp][j][r]; slice 0 adds the others in order.
        __shared__ float part[TERN_GEMV_WARPS][NW][R];
        const int warp = threadIdx.x / 32;
        if (lane == 0)
#pragma unroll
            for (int j = 0; j < NW; ++j)
#pragma unroll
                for (int r = 0; r < R; ++r) part[warp][j][r] = acc[j][r];
        __syncthreads();
        if (slice != 0) return;
        for (int t = 1; t < ks; ++t)
#pragma unroll
            for (int j = 0; j < NW; ++j)
#pragma unroll
                for (int r = 0; r < R; ++r) acc[j][r] += part[warp + t][j][r];
    }
#pragma unroll
    for (int j = 0; j < OPW; ++j)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float s = acc[j][r];
            if constexpr (GATED) s = (OMODE == TERN_Y_SILU ? tern_silu(s) : tern_gelu_tanh(s)) * acc[j + OPW][r];
            if constexpr (CONV_K > 0) {
                static_assert(R == 1 && OPW == 1 && OMODE == TERN_Y_PLAIN, "the conv takes one row, one feature a warp");
                if (conv.on && lane == 0 && o0 + j < out) s = taps.step(conv, o0 + j, s);
            }
            if (lane == 0 && r < rows && o0 + j < out) {
                float* at = y + (size_t)r * out + o0 + j;
                *at = OMODE == TERN_Y_RESIDUAL ? *at + s : s;
            }
        }
}

// The end of TERN_Y_RESIDUAL and TERN_Y_ADD_NORM: every block, once its warps have written
// their features, signals; the last one (which then sees every block's writes: each fenced
// them before its signal) forms the rows' norms and resets the counter for the next launch.
// What other blocks wrote is read through L2 (__ldcg): this multiprocessor's L1 may hold
// lines of it from before they wrote.
//
// The tail runs on one block after all the others, so its loads are on the step's critical
// path: a thread's loads from L2 must be in flight together. The sums' loops are unrolled
// (the additions keep their order, so the bits are those of the norm kernel). The elementwise
// passes go TERN_NORM_TAIL_CHUNK elements a thread at a time, every load of a chunk before its
// first store: the compiler cannot move a load past a store that may alias it, so a plain loop
// waits out one L2 round trip per element (4 for a 1024-wide row). Chunked, Qwen3.5-0.8B's
// BF16 decode of one sequence went from 850 / 880 to 917 / 914 tok/s (f32 / bf16 mode, H200).
// (Forming the norm of several rows here, one warp per row, measured slower than a norm
// launch after the product: the 8-token EmbeddingGemma 300M query 1.17 -> 1.38 ms f32.)
#define TERN_NORM_TAIL_CHUNK 4
__device__ __forceinline__ double tern_gemv_sum_squares(const float* v, int d, double* scratch) {
    double ss = 0.0;
#pragma unroll 4
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const double e = (double)(__ldcg(v + i) * 1.0f);
        ss += e * e;
    }
    return tern_block_sum_d(ss, scratch);
}

// The tail of a one-row launch (a decode step) whose row fits TERN_NORM_TAIL_SLOTS values a
// thread: every operand (h, w, and for ADD_NORM y and the next norm's weight) loaded at once,
// so the tail waits for L2 once; the loop form below waits once per pass (h for the sum, then h
// and w again for the output). Same values, products and sums in the same order: the same
// bits. (Qwen3.5's rows of 1024 and 2048, EmbeddingGemma's of 768.) TERN_NORM_TAIL_SLOTS: above.
template <int OMODE>
__device__ __forceinline__ void tern_gemv_norm_tail_held(const tern_gemv_parts& p, double* scratch) {
    constexpr int S = TERN_NORM_TAIL_SLOTS;
    const int d = p.out[0], t = threadIdx.x, nt = blockDim.x;
    // RESIDUAL: the stream is y, already x + W·v, written by every block (read through L2).
    // ADD_NORM: y is the product (through L2), h the stream, which this launch has not written.
    float* h = OMODE == TERN_Y_RESIDUAL ? (float*)p.y[0] : (float*)p.stream;
    const float* y = (const float*)p.y[0];
    const float* w = (const float*)p.norm_w;
    const float* w2 = (const float*)p.next_w;
    float hv[S], wv[S], yv[S], w2v[S];
#pragma unroll
    for (int j = 0; j < S; ++j) {
        const int i = t + j * nt;
        const bool in = i < d;
        if (OMODE == TERN_Y_RESIDUAL) {
            hv[j] = in ? __ldcg(h + i) : 0.0f;
        } else {
            hv[j] = in ? h[i] : 0.0f;
            yv[j] = in ? __ldcg(y + i) : 0.0f;
            w2v[j] = in ? w2[i] : 0.0f;
        }
        wv[j] = in ? w[i] : 0.0f;
    }
    if (OMODE == TERN_Y_ADD_NORM) {
        const float inv = tern_inv_rms_of(tern_block_sum_d(tern_held_sum_squares(yv, t, nt, d), scratch), d, p.eps);
#pragma unroll
        for (int j = 0; j < S; ++j) {
            const int i = t + j * nt;
            if (i >= d) continue;
            float v = hv[j] + (yv[j] * inv) * wv[j];
            if (p.post != 1.0f) v *= p.post;
            hv[j] = v;
            h[i] = v;
            wv[j] = w2v[j];  // the output's weight: the next norm's
        }
    }
    const float inv = tern_inv_rms_of(tern_block_sum_d(tern_held_sum_squares(hv, t, nt, d), scratch), d, p.eps);
    float* a = (float*)p.norm_out;
#pragma unroll
    for (int j = 0; j < S; ++j) {
        const int i = t + j * nt;
        if (i < d) a[i] = (hv[j] * inv) * wv[j];
    }
}

template <int R, int OMODE>
__device__ __forceinline__ void tern_gemv_norm_tail(const tern_gemv_parts& p, int rows) {
    __shared__ int last;
    __shared__ double scratch[32];
    // No norm asked for (TERN_Y_RESIDUAL with norm_out 0): the product after this one forms it
    // from the stream itself (TernNormedInput).
    if (OMODE == TERN_Y_RESIDUAL && !p.norm_out) return;
    // Every writer fences its own writes before the block signals.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd((unsigned*)p.counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    constexpr int C = TERN_NORM_TAIL_CHUNK;
    const int d = p.out[0];
    if (R == 1 && d <= TERN_NORM_TAIL_SLOTS * (int)blockDim.x) {
        tern_gemv_norm_tail_held<OMODE>(p, scratch);
        if (threadIdx.x == 0) *(unsigned*)p.counter = 0u;
        return;
    }
    const float* w = (const float*)p.norm_w;
    float* a = (float*)p.norm_out;
    // (R == 1: the one row a decode step has, known at compile time.)
    for (int r = 0; r < (R == 1 ? 1 : rows); ++r) {
        const size_t off = (size_t)r * d;
        // RESIDUAL: the stream is y, already x + W·v. ADD_NORM: y is the product, h the stream.
        float* h = OMODE == TERN_Y_RESIDUAL ? (float*)p.y[0] + off : (float*)p.stream + off;
        const float* w_out = w;
        if (OMODE == TERN_Y_ADD_NORM) {
            const float* y = (const float*)p.y[0] + off;
            const float inv = tern_inv_rms_of(tern_gemv_sum_squares(y, d, scratch), d, p.eps);
            for (int i0 = threadIdx.x; i0 < d; i0 += C * blockDim.x) {
                float hv[C], yv[C], wv[C];
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    const int i = i0 + c * blockDim.x;
                    if (i < d) hv[c] = h[i], yv[c] = __ldcg(y + i), wv[c] = w[i];
                }
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    const int i = i0 + c * blockDim.x;
                    if (i >= d) continue;
                    float v = hv[c] + (yv[c] * inv) * wv[c];
                    if (p.post != 1.0f) v *= p.post;
                    h[i] = v;
                }
            }
            w_out = (const float*)p.next_w;
        }
        // Each thread re-reads only the entries of h it wrote itself (ADD_NORM), or reads
        // through L2 what other blocks wrote (RESIDUAL).
        const float inv = tern_inv_rms_of(tern_gemv_sum_squares(h, d, scratch), d, p.eps);
        for (int i0 = threadIdx.x; i0 < d; i0 += C * blockDim.x) {
            float hv[C], wv[C];
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const int i = i0 + c * blockDim.x;
                if (i < d) hv[c] = __ldcg(h + i), wv[c] = w_out[i];
            }
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const int i = i0 + c * blockDim.x;
                if (i < d) a[off + i] = (hv[c] * inv) * wv[c];
            }
        }
    }
    if (threadIdx.x == 0) *(unsigned*)p.counter = 0u;
}

// y_part[r][o] for r < rows <= R, o < out[part] (see tern_gemv_rows); a block covers
// TERN_GEMV_WARPS / ks · OPW output features of its part, warp w slice w % ks of its feature
// group w / ks.
// CONV_K: the kernel convolves its conv part's outputs (TernConvTaps<CONV_K>); only the
// one-row plain kernels built for it do (tern_gemv_conv_*), so that the others keep their
// registers (the vocabulary head's 1-row GEMV: 31).
// Whether the launch's warps request their first weights before awaiting the prior kernel
// (tern_gemv_rows' `early`): one-row kernels, where the host asks for it.
template <int R>
__device__ __forceinline__ bool tern_gemv_early(const tern_gemv_parts& p) {
    return R == 1 && p.early != 0;
}

template <int R, int OPW, int OMODE, typename W, int CONV_K = 0, bool NORMED = false>
__device__ __forceinline__ void tern_gemv(const tern_gemv_parts& p, const float* __restrict__ x, int rows, int in) {
    if (R == 1 && p.early == 2) tern_let_dependents_launch();
    int part = 0;
    while (part + 1 < p.n && (int)blockIdx.x >= p.block0[part + 1]) ++part;
    const int ks = p.ks, warp = threadIdx.x / 32;
    const int o0 = (((int)blockIdx.x - p.block0[part]) * (TERN_GEMV_WARPS / ks) + warp / ks) * OPW;
    // Only the kernels built for it (NORMED: tern_gemv_*_1_normed) form their input: in the
    // others the path compiles away, and with it its registers and the shared-memory x (whose
    // generic loads would replace the global ones).
    const TernNormedInput normed{(const float*)p.in_h, (const float*)p.in_w, (float*)p.in_a, p.in_eps, NORMED && R == 1 && p.in_h != 0};
    // Unsplit, a warp past the features leaves; split (or ending in the residual norm, or
    // forming its input's norm), it still meets its block's barriers.
    constexpr bool tail = OMODE == TERN_Y_RESIDUAL || OMODE == TERN_Y_ADD_NORM;
    if (ks == 1 && !tail && !normed.on && o0 >= p.out[part]) return;
    tern_gemv_rows<R, OPW, OMODE, W, CONV_K>(W(p.w[part], p.scales[part]), x, rows, in, o0, p.out[part], (float*)p.y[part], ks,
                                             warp % ks,
                                             TernConvArgs{(const float*)p.conv_w, (float*)p.conv_at, CONV_K > 0 && part + 1 == p.conv_part},
                                             tern_gemv_early<R>(p), normed);
    if constexpr (tail) tern_gemv_norm_tail<R, OMODE>(p, rows);
}

// Eight consecutive weights of a row (at % 8 == 0) as four bf16 pairs, lower index in the low
// half: the tensor-core GEMV's A operand and the fast mode's expansion of Q8_0 experts for its
// GEMMs (tern_expand_q8_bf16_many). bf16 weights as stored; Q8_0 weights d·q (exact in f32)
// rounded to bf16 as tern_bf16_from_f32 rounds (tern_expand_q8_bf16's value per weight).
__device__ __forceinline__ uint4 tern_weights_bf16x8(const TernWeightsBf16& w, size_t at) { return w.load_raw(at); }
__device__ __forceinline__ uint4 tern_weights_bf16x8(const TernWeightsQ8& w, size_t at) {
    float v[8];
    w.load(at, v);
    unsigned h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = tern_bf16_pair(v[2 * i], v[2 * i + 1]);
    return make_uint4(h[0], h[1], h[2], h[3]);
}

// Fast mode's products of 2 to 8 rows with bf16 weights (Q8_0 weights: d·q rounded to bf16,
// tern_weights_bf16x8), on the tensor cores: x rounded to bf16 (as the fast mode's GEMMs round
// it), f32 accumulation. The CUDA-core form above reads every x value once per feature from
// L1, 8 rows of it per weight, which for a short query's products (EmbeddingGemma's 768-wide
// rows) costs more than their weights' bytes; here one mma.sync m16n8k16 multiplies 16
// features by the 8 rows (x's rows are B's columns), x is read once per 16 features, and a
// block's warps split the row's 32-weight chunks (warp w takes chunks w, w + 8, ...), their
// partial sums added in warp order through shared memory. A block is 16 features (and, gated,
// their 16 up rows) of one part of p, or of one tile of an expert's rows.
//
// The weights are read as the GEMV reads them, 8 consecutive ones a lane (one 16-byte load of
// bf16, one 8-byte load of Q8_0 quants and the block's scale), and the dot product's k order
// is permuted to fit: lane (g, t) loads weights 8t .. 8t + 7 of a chunk for features g and
// g + 8, and x's row g at the same 8 positions, and passes them as the fragments' k positions
// {2t, 2t + 1, 2t + 8, 2t + 9} of two mma steps (weights 8t + 0..3, then 8t + 4..7). A and B
// see the same permutation, so the products pair up as in the plain order; only the summation
// order differs. A row's result depends on its own x and the matrix only, never on the other
// rows. in % 32 == 0 (checked by the host).
//
// U consecutive steps of a warp (chunks k, k + 256, ...): every step's weight and x loads
// first, then the mma of each step in order, so U steps wait for memory once; the products are
// added in the order of the one-step loop (the same bits).
#define TERN_GEMV_MMA_KSTEP (32 * TERN_GEMV_WARPS)
template <int U, int NT, typename W>
__device__ __forceinline__ void tern_gemv_mma_steps(const W& w, const size_t (&wr)[NT][2], const float* __restrict__ xr, bool has_x,
                                                    int k, float (&c)[NT][4]) {
    uint4 a[U][NT][2];
    float4 x0[U], x1[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) a[u][j][h] = tern_weights_bf16x8(w, wr[j][h] + k + u * TERN_GEMV_MMA_KSTEP);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        x0[u] = x1[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (has_x) {
            x0[u] = *reinterpret_cast<const float4*>(xr + k + u * TERN_GEMV_MMA_KSTEP);
            x1[u] = *reinterpret_cast<const float4*>(xr + k + u * TERN_GEMV_MMA_KSTEP + 4);
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const tern_u32 b00 = tern_tc_pack(x0[u].x, x0[u].y), b01 = tern_tc_pack(x0[u].z, x0[u].w);
        const tern_u32 b10 = tern_tc_pack(x1[u].x, x1[u].y), b11 = tern_tc_pack(x1[u].z, x1[u].w);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            tern_tc_mma(c[j], a[u][j][0].x, a[u][j][1].x, a[u][j][0].y, a[u][j][1].y, b00, b01);
            tern_tc_mma(c[j], a[u][j][0].z, a[u][j][1].z, a[u][j][0].w, a[u][j][1].w, b10, b11);
        }
    }
}

// Features o0 .. o0 + 15 of w ([out][in], or gated [2·out][in]: gate rows, then up rows) for
// rows r < rows <= 8 of x, written to y[r·out + o]; one block of TERN_GEMV_WARPS warps.
// AHEAD (the default; TERN_GEMV_MMA_AHEAD=0 off): a warp's steps four at a time
// (tern_gemv_mma_steps), then two, then one, where the loop below has two steps' loads in
// flight; rows of 1024 to 2048 weights (an output or down projection: 4 to 8 steps a warp)
// then wait for memory once or twice instead of two to four times. The same bits. Its kernels
// are bounded to 2 blocks an SM (128 registers): with the default bound ptxas placed each
// step's loads after the previous step's mma, one or two steps in flight (SASS, sm_90).
template <int OMODE, typename W, bool AHEAD = false>
__device__ __forceinline__ void tern_gemv_mma_block(const W& w, int out, int o0, const float* __restrict__ x,
                                                    int rows, int in, float* __restrict__ y,
                                                    const float* __restrict__ up = nullptr, long long up_ld = 0) {
    constexpr bool GATED = OMODE == TERN_Y_SILU || OMODE == TERN_Y_GELU;
    constexpr int NT = GATED ? 2 : 1;  // A tiles: the features, and gated, their up rows
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    // The lane's weight rows: features o0 + g and o0 + g + 8 (a feature past `out` reads the
    // last one in its place and is never written); gated, tile 1 is their up rows.
    size_t wr[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int o = min(o0 + g + 8 * h, out - 1);
            wr[j][h] = (size_t)(j == 0 ? o : o + out) * in;
        }
    const bool has_x = g < rows;
    const float* xr = x + (size_t)(has_x ? g : 0) * in;
    float c[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
    if constexpr (AHEAD) {
        int k = 32 * warp + 8 * t;
        for (; k + 3 * TERN_GEMV_MMA_KSTEP < in; k += 4 * TERN_GEMV_MMA_KSTEP) tern_gemv_mma_steps<4>(w, wr, xr, has_x, k, c);
        if (k + TERN_GEMV_MMA_KSTEP < in) {
            tern_gemv_mma_steps<2>(w, wr, xr, has_x, k, c);
            k += 2 * TERN_GEMV_MMA_KSTEP;
        }
        if (k < in) tern_gemv_mma_steps<1>(w, wr, xr, has_x, k, c);
    } else {
#pragma unroll 2
        for (int k = 32 * warp + 8 * t; k < in; k += TERN_GEMV_MMA_KSTEP) tern_gemv_mma_steps<1>(w, wr, xr, has_x, k, c);
    }
    __shared__ float partial[TERN_GEMV_WARPS][NT][4][32];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) partial[warp][j][i][lane] = c[j][i];
    __syncthreads();
    if (warp != 0) return;
    for (int v = 1; v < TERN_GEMV_WARPS; ++v)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) c[j][i] += partial[v][j][i][lane];
    // c[j][2h + q]: feature o0 + g + 8h, row 2t + q.
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int o = o0 + g + 8 * h, r = 2 * t + q;
            if (o >= out || r >= rows) continue;
            float s = c[0][2 * h + q];
            if constexpr (GATED) s = (OMODE == TERN_Y_SILU ? tern_silu(s) : tern_gelu_tanh(s)) * c[NT - 1][2 * h + q];
            if constexpr (OMODE == TERN_Y_GELU_BY) s = tern_gelu_tanh(s) * up[(size_t)r * up_ld + o];
            y[(size_t)r * out + o] = s;
        }
}

// The parts of p, 16 features a block, for the rows of tile blockIdx.y (rows 8y .. 8y + 7):
// one tile where rows <= 8. More rows (fast mode's products of Q8_0 weights for a round of
// several sequences, Blas::linear) take a tile each; each tile reads the matrix, the first
// from memory and the rest mostly from L2 (a layer's Q8_0 matrix is a few MB), where a GEMM
// would first expand the whole matrix to bf16. A row's result is the one it gets in any tile:
// it depends on its own x and the matrix only.
template <int OMODE, typename W, bool AHEAD = false>
__device__ __forceinline__ void tern_gemv_mma(const tern_gemv_parts& p, const float* __restrict__ x, int rows, int in) {
    int part = 0;
    while (part + 1 < p.n && (int)blockIdx.x >= p.block0[part + 1]) ++part;
    const int r0 = 8 * (int)blockIdx.y, out = p.out[part];
    const float* up = (const float*)p.up;
    tern_gemv_mma_block<OMODE, W, AHEAD>(W(p.w[part], p.scales[part]), out, ((int)blockIdx.x - p.block0[part]) * 16,
                                         x + (size_t)r0 * in, min(8, rows - r0), in, (float*)p.y[part] + (size_t)r0 * out,
                                         up ? up + (size_t)r0 * p.up_ld : up, p.up_ld);
}

// Fast mode's tiles of a prompt's expert rows (tern_gemv_tiles) on the tensor cores: tile
// blockIdx.y's rows, 16 features a block.
template <int OMODE, typename W>
__device__ __forceinline__ void tern_gemv_mma_tiles(const unsigned long long* __restrict__ w_table,
                                                    const unsigned long long* __restrict__ s_table, const int* __restrict__ tiles,
                                                    const float* __restrict__ x, int in, int out, float* __restrict__ y) {
    const int* tile = tiles + 3 * (size_t)blockIdx.y;
    const int e = tile[0], r0 = tile[1], n = tile[2];
    tern_gemv_mma_block<OMODE>(W(w_table[e], s_table[e]), out, (int)blockIdx.x * 16, x + (size_t)r0 * in, n, in, y + (size_t)r0 * out);
}

#define TERN_GEMV_MMA_KERNEL(name, W, OMODE, AHEAD)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * TERN_GEMV_WARPS, AHEAD ? 2 : 0)                                \
        name(const tern_gemv_parts p, const float* __restrict__ x, int rows, int in) {                               \
        tern_await_prior_kernel();                                                                                   \
        tern_gemv_mma<OMODE, W, AHEAD>(p, x, rows, in);                                                              \
    }
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_bf16, TernWeightsBf16, TERN_Y_PLAIN, false)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_silu_bf16, TernWeightsBf16, TERN_Y_SILU, false)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_gelu_bf16, TernWeightsBf16, TERN_Y_GELU, false)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_q8, TernWeightsQ8, TERN_Y_PLAIN, false)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_silu_q8, TernWeightsQ8, TERN_Y_SILU, false)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_gelu_q8, TernWeightsQ8, TERN_Y_GELU, false)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_ahead_bf16, TernWeightsBf16, TERN_Y_PLAIN, true)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_ahead_silu_bf16, TernWeightsBf16, TERN_Y_SILU, true)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_ahead_gelu_bf16, TernWeightsBf16, TERN_Y_GELU, true)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_ahead_q8, TernWeightsQ8, TERN_Y_PLAIN, true)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_ahead_silu_q8, TernWeightsQ8, TERN_Y_SILU, true)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_ahead_gelu_q8, TernWeightsQ8, TERN_Y_GELU, true)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_gelu_by_bf16, TernWeightsBf16, TERN_Y_GELU_BY, false)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_gelu_by_q8, TernWeightsQ8, TERN_Y_GELU_BY, false)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_ahead_gelu_by_bf16, TernWeightsBf16, TERN_Y_GELU_BY, true)
TERN_GEMV_MMA_KERNEL(tern_gemv_mma_ahead_gelu_by_q8, TernWeightsQ8, TERN_Y_GELU_BY, true)

// Routed experts (a mixture-of-experts layer's few rows, routed on the device): slot s =
// blockIdx.y is row s / k's choice s % k, expert ids[s], whose matrix comes from the tables of
// every expert's weights (and Q8_0 scales). Its input is row s / x_div of x (x_div = k: the
// layer's input rows; 1: the slot's own row) and its output row s of y [slots][out] (`out`
// features, or gated values of a [gate | up] matrix, as tern_gemv_rows).
template <int OMODE, typename W>
__device__ __forceinline__ void tern_gemv_routed(const unsigned long long* __restrict__ w_table,
                                                 const unsigned long long* __restrict__ s_table,
                                                 const int* __restrict__ ids, int x_div, const float* __restrict__ x,
                                                 int in, int out, float* __restrict__ y) {
    const int slot = blockIdx.y, e = ids[slot];
    const int o = (int)blockIdx.x * TERN_GEMV_WARPS + threadIdx.x / 32;
    if (o >= out) return;
    tern_gemv_rows<1, 1, OMODE>(W(w_table[e], s_table[e]), x + (size_t)(slot / x_div) * in, 1, in, o, out,
                                y + (size_t)slot * out);
}

// A prompt's expert products as GEMVs of a few rows (the rows sorted by expert): tile
// t = blockIdx.y is rows r0 .. r0 + n - 1 (n <= 8) of x and y, all routed to expert e, with
// tiles[t] = (e, r0, n); each warp computes one feature of the tile's rows as tern_gemv_rows
// does for a batch of n decode rows (so a row's result is the one it gets in a decode step,
// whatever other rows share its tile). An expert's weights are read once per tile of its rows,
// and its tiles are neighbours in the grid, so the re-reads mostly come from L2: for prompts
// whose experts get few rows each this beats one cuBLAS GEMM per expert, whose launches and
// small-M kernels cost far more than its weights' bytes.
template <int OMODE, typename W>
__device__ __forceinline__ void tern_gemv_tiles(const unsigned long long* __restrict__ w_table,
                                                const unsigned long long* __restrict__ s_table,
                                                const int* __restrict__ tiles, const float* __restrict__ x, int in,
                                                int out, float* __restrict__ y) {
    const int* tile = tiles + 3 * (size_t)blockIdx.y;
    const int e = tile[0], r0 = tile[1], n = tile[2];
    const int o = (int)blockIdx.x * TERN_GEMV_WARPS + threadIdx.x / 32;
    if (o >= out) return;
    tern_gemv_rows<8, 1, OMODE>(W(w_table[e], s_table[e]), x + (size_t)r0 * in, n, in, o, out, y + (size_t)r0 * out);
}

// A one-row decode step's routed down products, their weighted sum, the residual step and the
// norm in one launch (CPU twin: the MoE's expert sum, moe/mod.rs, then norm/mod.rs
// residual_norm). The residual stream x = p.y[0] (d = p.out[0] values) gets, at feature o (one
// warp),
//   x[o] += Σ_j weights[j] · (W_{ids[j]}[o] · act[j])    (j < k = per_row)
// each slot's product formed as tern_gemv_rows forms it (the routed GEMV's bits), the slots
// added from zero in slot order with each product rounded first (tern_moe_combine's sequence),
// and the sum added to x as tern_residual_norm adds; the last block then writes a = rms(x)·w
// (tern_gemv_norm_tail): the bits of those three launches.
//
// One warp's slots are different experts' rows, so their loads do not depend on each other:
// TERN_ROUTED_GROUP slots' loads of a step are issued together (a row's k routed experts and the
// shared one, Qwen3.5's 8 + 1), where the routed GEMV put each slot in a block of its own.
#define TERN_ROUTED_GROUP 9
template <typename W>
__device__ __forceinline__ void tern_gemv_routed_residual(const tern_gemv_parts& p, const unsigned long long* __restrict__ w_table,
                                                          const unsigned long long* __restrict__ s_table,
                                                          const int* __restrict__ ids, const float* __restrict__ weights,
                                                          int per_row, const float* __restrict__ act, int in) {
    constexpr int S = W::STEP, G = TERN_ROUTED_GROUP;
    const int lane = threadIdx.x % 32, d = p.out[0];
    const int o = (int)blockIdx.x * TERN_GEMV_WARPS + threadIdx.x / 32;
    // A warp past d still meets the tail's barriers.
    if (o < d) {
        // Lane j holds slot j's expert and weight (per_row <= 32, checked by the host).
        const int my_e = lane < per_row ? ids[lane] : 0;
        const float my_w = lane < per_row ? weights[lane] : 0.0f;
        float sum = 0.0f;
#pragma unroll 1
        for (int j0 = 0; j0 < per_row; j0 += G) {
            unsigned long long wp[G], sp[G];
            float acc[G][1][1];
#pragma unroll
            for (int u = 0; u < G; ++u) {
                const int e = __shfl_sync(0xffffffffu, my_e, min(j0 + u, 31));
                wp[u] = w_table[e];
                sp[u] = s_table[e];
                acc[u][0][0] = 0.0f;
            }
#pragma unroll 1
            for (int c = lane * S; c < in; c += 32 * S) {
                typename W::Raw raw[G];
#pragma unroll
                for (int u = 0; u < G; ++u)
                    if (j0 + u < per_row) raw[u] = W(wp[u], sp[u]).load_raw((size_t)o * in + c);
#pragma unroll
                for (int u = 0; u < G; ++u) {
                    if (j0 + u < per_row) {
                        float v[1][S];
                        W::expand(raw[u], v[0]);
                        tern_gemv_step<1, 1, S>(acc[u], v, act + (size_t)(j0 + u) * in, 1, in, c);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < G; ++u) {
                const float wu = __shfl_sync(0xffffffffu, my_w, min(j0 + u, 31));
                const float dot = tern_warp_sum(acc[u][0][0]);
                if (j0 + u < per_row) sum = sum + __fmul_rn(dot, wu);
            }
        }
        if (lane == 0) {
            float* at = (float*)p.y[0] + o;
            *at = *at + sum;
        }
    }
    tern_gemv_norm_tail<1, TERN_Y_RESIDUAL>(p, 1);
}

// OPW, output features per warp for R rows of x (plain, and gated products, whose warps hold
// two weight rows per feature): gemv_outputs_per_warp in matmul/cuda.rs.
#define TERN_GEMV_KERNEL(name, R, OPW, W, OMODE)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * TERN_GEMV_WARPS, TernGemvSteps<W, R, OPW>::MIN_BLOCKS)       \
        name(const tern_gemv_parts p, const float* __restrict__ x, int rows, int in) {                            \
        tern_await_prior_kernel_unless(tern_gemv_early<R>(p));                                                    \
        tern_gemv<R, OPW, OMODE, W>(p, x, rows, in);                                                              \
    }
// SUFFIX names the variant: R (the wide form, OPW and OPW_GATED as given) or Rn (the narrow
// form, one output feature per warp, for matrices too small to fill the GPU otherwise).
#define TERN_GEMV_KERNELS(SUFFIX, R, OPW, OPW_GATED)                                                              \
    TERN_GEMV_KERNEL(tern_gemv_f32_##SUFFIX, R, OPW, TernWeightsF32, TERN_Y_PLAIN)                               \
    TERN_GEMV_KERNEL(tern_gemv_bf16_##SUFFIX, R, OPW, TernWeightsBf16, TERN_Y_PLAIN)                             \
    TERN_GEMV_KERNEL(tern_gemv_q8_##SUFFIX, R, OPW, TernWeightsQ8, TERN_Y_PLAIN)                                 \
    TERN_GEMV_KERNEL(tern_gemv_silu_f32_##SUFFIX, R, OPW_GATED, TernWeightsF32, TERN_Y_SILU)                     \
    TERN_GEMV_KERNEL(tern_gemv_silu_bf16_##SUFFIX, R, OPW_GATED, TernWeightsBf16, TERN_Y_SILU)                   \
    TERN_GEMV_KERNEL(tern_gemv_silu_q8_##SUFFIX, R, OPW_GATED, TernWeightsQ8, TERN_Y_SILU)                       \
    TERN_GEMV_KERNEL(tern_gemv_gelu_f32_##SUFFIX, R, OPW_GATED, TernWeightsF32, TERN_Y_GELU)                     \
    TERN_GEMV_KERNEL(tern_gemv_gelu_bf16_##SUFFIX, R, OPW_GATED, TernWeightsBf16, TERN_Y_GELU)                   \
    TERN_GEMV_KERNEL(tern_gemv_gelu_q8_##SUFFIX, R, OPW_GATED, TernWeightsQ8, TERN_Y_GELU)                       \
    TERN_GEMV_KERNEL(tern_gemv_res_f32_##SUFFIX, R, OPW, TernWeightsF32, TERN_Y_RESIDUAL)                        \
    TERN_GEMV_KERNEL(tern_gemv_res_bf16_##SUFFIX, R, OPW, TernWeightsBf16, TERN_Y_RESIDUAL)                      \
    TERN_GEMV_KERNEL(tern_gemv_res_q8_##SUFFIX, R, OPW, TernWeightsQ8, TERN_Y_RESIDUAL)                          \
    TERN_GEMV_KERNEL(tern_gemv_addnorm_f32_##SUFFIX, R, OPW, TernWeightsF32, TERN_Y_ADD_NORM)                    \
    TERN_GEMV_KERNEL(tern_gemv_addnorm_bf16_##SUFFIX, R, OPW, TernWeightsBf16, TERN_Y_ADD_NORM)                  \
    TERN_GEMV_KERNEL(tern_gemv_addnorm_q8_##SUFFIX, R, OPW, TernWeightsQ8, TERN_Y_ADD_NORM)

TERN_GEMV_KERNELS(1, 1, 1, 1)
TERN_GEMV_KERNELS(2, 2, 2, 1)
TERN_GEMV_KERNELS(4, 4, 4, 2)
TERN_GEMV_KERNELS(8, 8, 4, 2)
TERN_GEMV_KERNELS(2n, 2, 1, 1)
TERN_GEMV_KERNELS(4n, 4, 1, 1)
TERN_GEMV_KERNELS(8n, 8, 1, 1)
// A one-row Q8_0 product of many features (the head), two features a warp (see
// Q8_PAIRED_MIN_FEATURES in matmul/cuda.rs).
TERN_GEMV_KERNEL(tern_gemv_q8_1x2, 1, 2, TernWeightsQ8, TERN_Y_PLAIN)
// The one-row kernels of their own (the CUDA-core form, one feature a warp), so that the others
// keep their registers: CONV_K > 0 convolves a conv part's outputs as they are written
// (TernConvTaps; Blas::linears_conv), NORMED forms the input as the residual stream's norm in
// every block (TernNormedInput; Blas::linear_residual_norm_then and _conv); BOUND<W>::MIN is
// the launch's blocks a multiprocessor.
#define TERN_GEMV_ONE_ROW_KERNEL(name, W, OMODE, CONV_K, NORMED, BOUND)                                          \
    extern "C" __global__ void __launch_bounds__(32 * TERN_GEMV_WARPS, BOUND<W>::MIN)                            \
        name(const tern_gemv_parts p, const float* __restrict__ x, int rows, int in) {                            \
        tern_await_prior_kernel_unless(tern_gemv_early<1>(p));                                                    \
        tern_gemv<1, 1, OMODE, W, CONV_K, NORMED>(p, x, rows, in);                                                \
    }
template <typename W> struct TernGemvOneRowBlocks { static constexpr int MIN = TernGemvSteps<W, 1, 1>::MIN_BLOCKS; };
// The normed plain and gated products: bf16 weights bound to four blocks a multiprocessor (64
// registers): unbound, the gated one takes 80 with the norm's weights copied ahead, a block
// fewer.
template <typename W> struct TernGemvNormedBlocks { static constexpr int MIN = TernGemvSteps<W, 1, 1>::MIN_BLOCKS; };
template <> struct TernGemvNormedBlocks<TernWeightsBf16> { static constexpr int MIN = 4; };
#define TERN_GEMV_NORMED_KERNELS(PREFIX, OMODE)                                                                   \
    TERN_GEMV_ONE_ROW_KERNEL(tern_gemv_##PREFIX##f32_1_normed, TernWeightsF32, OMODE, 0, true, TernGemvNormedBlocks)   \
    TERN_GEMV_ONE_ROW_KERNEL(tern_gemv_##PREFIX##bf16_1_normed, TernWeightsBf16, OMODE, 0, true, TernGemvNormedBlocks) \
    TERN_GEMV_ONE_ROW_KERNEL(tern_gemv_##PREFIX##q8_1_normed, TernWeightsQ8, OMODE, 0, true, TernGemvNormedBlocks)
TERN_GEMV_NORMED_KERNELS(, TERN_Y_PLAIN)
TERN_GEMV_NORMED_KERNELS(silu_, TERN_Y_SILU)
TERN_GEMV_NORMED_KERNELS(gelu_, TERN_Y_GELU)
// The plain products with a conv part of width K (Qwen3.5's is 4), without and with the normed
// input (SUFFIX _normed: a dense FFN's down projection, then the next gated-delta layer's input
// projections with no norm tail between them), by weight type.
#define TERN_GEMV_CONV_KERNELS(K, NORMED, SUFFIX)                                                                                    \
    TERN_GEMV_ONE_ROW_KERNEL(tern_gemv_conv_f32_1_k##K##SUFFIX, TernWeightsF32, TERN_Y_PLAIN, K, NORMED, TernGemvOneRowBlocks)   \
    TERN_GEMV_ONE_ROW_KERNEL(tern_gemv_conv_bf16_1_k##K##SUFFIX, TernWeightsBf16, TERN_Y_PLAIN, K, NORMED, TernGemvOneRowBlocks) \
    TERN_GEMV_ONE_ROW_KERNEL(tern_gemv_conv_q8_1_k##K##SUFFIX, TernWeightsQ8, TERN_Y_PLAIN, K, NORMED, TernGemvOneRowBlocks)
TERN_GEMV_CONV_KERNELS(2, false, )
TERN_GEMV_CONV_KERNELS(3, false, )
TERN_GEMV_CONV_KERNELS(4, false, )
TERN_GEMV_CONV_KERNELS(2, true, _normed)
TERN_GEMV_CONV_KERNELS(3, true, _normed)
TERN_GEMV_CONV_KERNELS(4, true, _normed)

#define TERN_GEMV_ROUTED_KERNEL(name, W, OMODE)                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * TERN_GEMV_WARPS, TernGemvSteps<W, 1, 1>::MIN_BLOCKS)         \
        name(const unsigned long long* __restrict__ w_table, const unsigned long long* __restrict__ s_table,     \
             const int* __restrict__ ids, int x_div, const float* __restrict__ x, int in, int out,               \
             float* __restrict__ y) { tern_await_prior_kernel();                                                  \
        tern_gemv_routed<OMODE, W>(w_table, s_table, ids, x_div, x, in, out, y);                                  \
    }
TERN_GEMV_ROUTED_KERNEL(tern_gemv_routed_f32, TernWeightsF32, TERN_Y_PLAIN)
TERN_GEMV_ROUTED_KERNEL(tern_gemv_routed_bf16, TernWeightsBf16, TERN_Y_PLAIN)
TERN_GEMV_ROUTED_KERNEL(tern_gemv_routed_q8, TernWeightsQ8, TERN_Y_PLAIN)
TERN_GEMV_ROUTED_KERNEL(tern_gemv_routed_silu_f32, TernWeightsF32, TERN_Y_SILU)
TERN_GEMV_ROUTED_KERNEL(tern_gemv_routed_silu_bf16, TernWeightsBf16, TERN_Y_SILU)
TERN_GEMV_ROUTED_KERNEL(tern_gemv_routed_silu_q8, TernWeightsQ8, TERN_Y_SILU)

// FORM: tern_gemv_tiles (CUDA cores) or tern_gemv_mma_tiles (tensor cores), one signature.
// name_counted takes a tile list made on the device (moe.cu's tern_moe_sort_slots): the grid
// covers the list's room, and the blocks past its count n_tiles[0] return (the whole block:
// the tensor-core form's warps never split at its barriers).
#define TERN_GEMV_TILES_KERNEL(name, FORM, W, OMODE)                                                               \
    extern "C" __global__ void __launch_bounds__(32 * TERN_GEMV_WARPS)                                               \
        name(const unsigned long long* __restrict__ w_table, const unsigned long long* __restrict__ s_table,        \
             const int* __restrict__ tiles, const float* __restrict__ x, int in, int out, float* __restrict__ y) {  \
        tern_await_prior_kernel();                                                                                   \
        FORM<OMODE, W>(w_table, s_table, tiles, x, in, out, y);                                                      \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(32 * TERN_GEMV_WARPS)                                               \
        name##_counted(const unsigned long long* __restrict__ w_table, const unsigned long long* __restrict__ s_table,\
                       const int* __restrict__ tiles, const int* __restrict__ n_tiles, const float* __restrict__ x,  \
                       int in, int out, float* __restrict__ y) {                                                     \
        tern_await_prior_kernel();                                                                                   \
        if ((int)blockIdx.y >= n_tiles[0]) return;                                                                   \
        FORM<OMODE, W>(w_table, s_table, tiles, x, in, out, y);                                                      \
    }
TERN_GEMV_TILES_KERNEL(tern_gemv_tiles_f32, tern_gemv_tiles, TernWeightsF32, TERN_Y_PLAIN)
TERN_GEMV_TILES_KERNEL(tern_gemv_tiles_bf16, tern_gemv_tiles, TernWeightsBf16, TERN_Y_PLAIN)
TERN_GEMV_TILES_KERNEL(tern_gemv_tiles_q8, tern_gemv_tiles, TernWeightsQ8, TERN_Y_PLAIN)
TERN_GEMV_TILES_KERNEL(tern_gemv_tiles_silu_f32, tern_gemv_tiles, TernWeightsF32, TERN_Y_SILU)
TERN_GEMV_TILES_KERNEL(tern_gemv_tiles_silu_bf16, tern_gemv_tiles, TernWeightsBf16, TERN_Y_SILU)
TERN_GEMV_TILES_KERNEL(tern_gemv_tiles_silu_q8, tern_gemv_tiles, TernWeightsQ8, TERN_Y_SILU)
TERN_GEMV_TILES_KERNEL(tern_gemv_mma_tiles_bf16, tern_gemv_mma_tiles, TernWeightsBf16, TERN_Y_PLAIN)
TERN_GEMV_TILES_KERNEL(tern_gemv_mma_tiles_silu_bf16, tern_gemv_mma_tiles, TernWeightsBf16, TERN_Y_SILU)
TERN_GEMV_TILES_KERNEL(tern_gemv_mma_tiles_q8, tern_gemv_mma_tiles, TernWeightsQ8, TERN_Y_PLAIN)
TERN_GEMV_TILES_KERNEL(tern_gemv_mma_tiles_silu_q8, tern_gemv_mma_tiles, TernWeightsQ8, TERN_Y_SILU)

#define TERN_GEMV_ROUTED_RESIDUAL_KERNEL(name, W)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * TERN_GEMV_WARPS)                                               \
        name(const tern_gemv_parts p, const unsigned long long* __restrict__ w_table,                                \
             const unsigned long long* __restrict__ s_table, const int* __restrict__ ids,                           \
             const float* __restrict__ weights, int per_row, const float* __restrict__ act, int in) {               \
        tern_await_prior_kernel();                                                                                   \
        tern_gemv_routed_residual<W>(p, w_table, s_table, ids, weights, per_row, act, in);                          \
    }
TERN_GEMV_ROUTED_RESIDUAL_KERNEL(tern_gemv_routed_res_f32, TernWeightsF32)
TERN_GEMV_ROUTED_RESIDUAL_KERNEL(tern_gemv_routed_res_bf16, TernWeightsBf16)
TERN_GEMV_ROUTED_RESIDUAL_KERNEL(tern_gemv_routed_res_q8, TernWeightsQ8)

// Stored weights expanded to a GEMM operand (prefill, and fast mode's products of more rows
// than the tensor-core GEMV takes): bf16 -> f32 (exact), Q8_0 -> f32 (exact) or -> bf16 (d·q
// rounded to nearest even: the fast mode's operand rounding, tern_weights_bf16x8's value per
// weight). Eight weights a thread, as the GEMV reads them (one 16-byte load of bf16, or an
// 8-byte load of quants and their block's scale), stored in 16-byte pieces: one weight a
// thread, with byte loads and 2-byte stores, ran at a fraction of the copy rate, and a round of
// many sequences through Q8_0 weights paid it at every product. Weights past the last whole
// eight (bf16 rows of in % 8 != 0; Q8_0 holds whole 32-weight blocks) and buffers not aligned
// for the wide accesses (an expert's weights inside its layer's tensor) go one a thread.
__device__ __forceinline__ void tern_expand_store8(float* y, size_t g, const float (&v)[8]) {
    float4* o = reinterpret_cast<float4*>(y) + 2 * g;
    o[0] = make_float4(v[0], v[1], v[2], v[3]);
    o[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void tern_expand_store8(tern_bf16* y, size_t g, const float (&v)[8]) {
    reinterpret_cast<uint4*>(y)[g] = make_uint4(tern_bf16_pair(v[0], v[1]), tern_bf16_pair(v[2], v[3]), tern_bf16_pair(v[4], v[5]),
                                                tern_bf16_pair(v[6], v[7]));
}
__device__ __forceinline__ void tern_expand_store1(float* y, size_t e, float v) { y[e] = v; }
__device__ __forceinline__ void tern_expand_store1(tern_bf16* y, size_t e, float v) { y[e] = tern_bf16_from_f32(v); }
__device__ __forceinline__ float tern_expand_one(const TernWeightsBf16& w, size_t e) { return tern_bf16_to_f32(w.w[e]); }
__device__ __forceinline__ float tern_expand_one(const TernWeightsQ8& w, size_t e) { return tern_f16_to_f32(w.d[e / 32]) * (float)w.q[e]; }
__device__ __forceinline__ bool tern_expand_wide(const TernWeightsBf16& w) { return ((unsigned long long)w.w & 15) == 0; }
__device__ __forceinline__ bool tern_expand_wide(const TernWeightsQ8& w) { return ((unsigned long long)w.q & 7) == 0; }

// Weights 0 .. n - 1 of w into y, over the grid's x dimension.
template <typename W, typename T>
__device__ __forceinline__ void tern_expand(const W& w, size_t n, T* __restrict__ y) {
    const size_t stride = (size_t)gridDim.x * blockDim.x, first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t n8 = tern_expand_wide(w) && ((unsigned long long)y & 15) == 0 ? n / 8 : 0;
    for (size_t g = first; g < n8; g += stride) {
        float v[8];
        w.load(8 * g, v);
        tern_expand_store8(y, g, v);
    }
    for (size_t e = 8 * n8 + first; e < n; e += stride) tern_expand_store1(y, e, tern_expand_one(w, e));
}

extern "C" __global__ void tern_expand_bf16_f32(const tern_bf16* __restrict__ w, size_t n, float* __restrict__ y) {
    tern_await_prior_kernel();
    tern_expand(TernWeightsBf16((unsigned long long)w, 0), n, y);
}

extern "C" __global__ void tern_expand_q8_f32(const signed char* __restrict__ q, const unsigned short* __restrict__ d,
                                              size_t n, float* __restrict__ y) {
    tern_await_prior_kernel();
    tern_expand(TernWeightsQ8((unsigned long long)q, (unsigned long long)d), n, y);
}

extern "C" __global__ void tern_expand_q8_bf16(const signed char* __restrict__ q, const unsigned short* __restrict__ d,
                                               size_t n, tern_bf16* __restrict__ y) {
    tern_await_prior_kernel();
    tern_expand(TernWeightsQ8((unsigned long long)q, (unsigned long long)d), n, y);
}

// Many Q8_0 matrices of n weights each at once (a MoE layer's experts for a prompt's products):
// matrix blockIdx.y's quants and scales at quants[y] and scales[y], expanded as
// tern_expand_q8_bf16 does into y + blockIdx.y·n (one launch for a chunk of experts instead of
// one per expert).
extern "C" __global__ void tern_expand_q8_bf16_many(const unsigned long long* __restrict__ quants,
                                                    const unsigned long long* __restrict__ scales, size_t n,
                                                    tern_bf16* __restrict__ y) {
    tern_await_prior_kernel();
    tern_expand(TernWeightsQ8(quants[blockIdx.y], scales[blockIdx.y]), n, y + (size_t)blockIdx.y * n);
}
