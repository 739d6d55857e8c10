// A measurement for examples/gemv_chain_bench.rs, not an op of tern: a chain of one-row bf16
// products y_s = W_s x_s, each stage's input read from the stage before's output, run as ONE
// persistent launch instead of one launch a stage.
//
// Why: a decode step of Qwen3.5-0.8B is ~130 launches whose weights take 1-17 MB each, 1-4 µs
// of the copy rate; between two launches the memory idles (the ramp of the next grid, the tail
// of the last blocks, the graph's gap), and the step runs at ~0.4 of the weight roofline. The
// weights of every stage are known before the step starts and do not depend on activations;
// only the multiply-adds wait for the stage before. So each warp streams its rows of every
// stage into a ring in shared memory (cp.async), as far ahead as the ring holds, and waits for
// the previous stage (a grid barrier) only before it multiplies: the memory keeps fetching the
// next stage's weights across the barrier.
//
// Layout: a block runs WARPS streaming warps (8 or 16) and a control warp, and holds a ring of
// RING pieces a lane (16 bytes, 8 bf16 each) per streaming warp, [warp][piece][lane], so that a warp's 32 lanes fill and read 512
// contiguous bytes. Warp gw of the grid (of W warps) owns rows gw, gw + W, ... of every stage;
// lane l copies and later reads pieces l, l + 32, ... of each of its rows (k % 256 == 0), so a
// lane reads only the bytes it copied itself and its own cp.async groups order them: one
// commit group a row, at most MAX_ROWS rows in flight a warp.
//
// The grid barrier needs every block resident at once: the host launches as many blocks as
// fit on the multiprocessors together, as a cooperative launch, which the
// driver refuses rather than deadlocks when the blocks cannot all be resident. `arrivals`
// must be 0 at the start of a launch (the host clears it).

#define CHAIN_MAX_ROWS 32

struct tern_chain_stage {
    unsigned long long w;  // bf16 bits [n][k]
    unsigned long long x;  // f32, the first k read
    unsigned long long y;  // f32 [n]
    int n, k;
};

__device__ __forceinline__ void tern_chain_cp16(void* smem, const void* global) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(global) : "memory");
}

// Waits until at most `pending` of this thread's newest cp.async groups are outstanding
// (wait_group takes an immediate; pending < CHAIN_MAX_ROWS).
template <int N>
__device__ __forceinline__ void tern_chain_wait_n() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void tern_chain_wait(int pending) {
    if constexpr (N + 1 < CHAIN_MAX_ROWS) {
        if (pending > N) return tern_chain_wait<N + 1>(pending);
    }
    tern_chain_wait_n<N>();
}

// Every block arrives; returns once `target` blocks in all have. The fences make the block's
// writes before the barrier visible to every block after it (the pattern of cooperative
// groups' grid sync).
__device__ __forceinline__ void tern_chain_grid_barrier(unsigned* arrivals, unsigned target, int control) {
    __syncthreads();
    if (threadIdx.x == control) {
        __threadfence();
        atomicAdd(arrivals, 1u);
        // The sleep is short against a stage (µs); hostcuda needs it to run the other blocks.
        while (*reinterpret_cast<volatile unsigned*>(arrivals) < target) __nanosleep(32);
        __threadfence();
    }
    __syncthreads();
}

// WARPS streaming warps and one control warp, which only stages the inputs and meets the
// grid barrier (its thread has no copies in flight for the barrier's fence to wait out).
template <int WARPS>
__device__ void tern_gemv_chain_body(const tern_chain_stage* stages, int n_stages, unsigned* arrivals, int ring, int x_max) {
    extern __shared__ __align__(16) unsigned char chain_smem[];
    float* xs = reinterpret_cast<float*>(chain_smem);
    uint4* rings = reinterpret_cast<uint4*>(chain_smem + (size_t)x_max * 4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * WARPS + warp, W = gridDim.x * WARPS;
    const bool streams = warp < WARPS;
    uint4* my = rings + (size_t)warp * ring * 32 + lane;  // piece p of this lane: my[p * 32]
    const auto rows_of = [&](int s) { const int n = stages[s].n; return n > gw ? (n - gw + W - 1) / W : 0; };

    // Issue cursor: the next row to request (stage is, its ir-th row of this warp). The ring's
    // next slot to fill and to read, and the pieces in it not yet read.
    int is = 0, ir = 0, in_flight = 0, fill = 0, read = 0, held = 0;
    const auto issue_ahead = [&]() {
        while (streams && is < n_stages && in_flight < CHAIN_MAX_ROWS) {
            if (ir >= rows_of(is)) { is++; ir = 0; continue; }
            const tern_chain_stage st = stages[is];
            const int per = st.k / 256;
            if (held + per > ring) break;
            const unsigned short* src = reinterpret_cast<const unsigned short*>(st.w) + (size_t)(gw + ir * W) * st.k + lane * 8;
            for (int i = 0; i < per; i++) {
                tern_chain_cp16(&my[fill * 32], src + i * 256);
                if (++fill == ring) fill = 0;
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
            held += per;
            ir++;
            in_flight++;
        }
    };

    for (int s = 0; s < n_stages; s++) {
        issue_ahead();
        if (s > 0) tern_chain_grid_barrier(arrivals, (unsigned)(s * gridDim.x), WARPS * 32);
        const tern_chain_stage st = stages[s];
        const float* x = reinterpret_cast<const float*>(st.x);
        // The input as the stage before left it in L2 (not through L1, which other blocks'
        // writes do not reach).
        for (int i = threadIdx.x; i < st.k; i += blockDim.x) xs[i] = __ldcg(x + i);
        __syncthreads();
        const int rows = streams ? rows_of(s) : 0, per = st.k / 256;
        for (int r = 0; r < rows; r++) {
            issue_ahead();
            tern_chain_wait<0>(in_flight - 1);  // this row's group is the oldest outstanding
            // Two sums (even and odd pieces), so that the multiply-adds are two chains, not one.
            float even = 0.0f, odd = 0.0f;
            const auto piece = [&](int i, float acc) {
                const uint4 u = my[read * 32];
                if (++read == ring) read = 0;
                const float4 xa = *reinterpret_cast<const float4*>(xs + 8 * lane + 256 * i);
                const float4 xb = *reinterpret_cast<const float4*>(xs + 8 * lane + 256 * i + 4);
                acc = fmaf(__uint_as_float(u.x << 16), xa.x, acc);
                acc = fmaf(__uint_as_float(u.x & 0xffff0000u), xa.y, acc);
                acc = fmaf(__uint_as_float(u.y << 16), xa.z, acc);
                acc = fmaf(__uint_as_float(u.y & 0xffff0000u), xa.w, acc);
                acc = fmaf(__uint_as_float(u.z << 16), xb.x, acc);
                acc = fmaf(__uint_as_float(u.z & 0xffff0000u), xb.y, acc);
                acc = fmaf(__uint_as_float(u.w << 16), xb.z, acc);
                return fmaf(__uint_as_float(u.w & 0xffff0000u), xb.w, acc);
            };
            int i = 0;
            for (; i + 1 < per; i += 2) {
                even = piece(i, even);
                odd = piece(i + 1, odd);
            }
            if (i < per) even = piece(i, even);
            held -= per;
            in_flight--;
            float acc = even + odd;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) reinterpret_cast<float*>(st.y)[gw + r * W] = acc;
        }
    }
}

extern "C" __global__ void __launch_bounds__(9 * 32, 1)
    tern_gemv_chain_w8(const tern_chain_stage* stages, int n_stages, unsigned* arrivals, int ring, int x_max) {
    tern_await_prior_kernel();
    tern_gemv_chain_body<8>(stages, n_stages, arrivals, ring, x_max);
}
extern "C" __global__ void __launch_bounds__(17 * 32, 1)
    tern_gemv_chain_w16(const tern_chain_stage* stages, int n_stages, unsigned* arrivals, int ring, int x_max) {
    tern_await_prior_kernel();
    tern_gemv_chain_body<16>(stages, n_stages, arrivals, ring, x_max);
}
