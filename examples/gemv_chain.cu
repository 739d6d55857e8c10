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
// Layout: every block runs 8 warps and holds one warp's ring of RING pieces a lane (16 bytes,
// 8 bf16 each) per warp, [warp][piece][lane], so that a warp's 32 lanes fill and read 512
// contiguous bytes. Warp gw of the grid (of W warps) owns rows gw, gw + W, ... of every stage;
// lane l copies and later reads pieces l, l + 32, ... of each of its rows (k % 256 == 0), so a
// lane reads only the bytes it copied itself and its own cp.async groups order them: one
// commit group a row, at most MAX_ROWS rows in flight a warp.
//
// The grid barrier needs every block resident at once: the host launches one block per
// multiprocessor (its shared memory allows no second) as a cooperative launch, which the
// driver refuses rather than deadlocks when the blocks cannot all be resident. `arrivals`
// must be 0 at the start of a launch (the host clears it).

#define CHAIN_WARPS 8
#define CHAIN_MAX_ROWS 8

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
// (wait_group takes an immediate).
template <int N>
__device__ __forceinline__ void tern_chain_wait_n() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void tern_chain_wait(int pending) {
    switch (pending) {
        case 0: tern_chain_wait_n<0>(); break;
        case 1: tern_chain_wait_n<1>(); break;
        case 2: tern_chain_wait_n<2>(); break;
        case 3: tern_chain_wait_n<3>(); break;
        case 4: tern_chain_wait_n<4>(); break;
        case 5: tern_chain_wait_n<5>(); break;
        case 6: tern_chain_wait_n<6>(); break;
        default: tern_chain_wait_n<7>(); break;
    }
}

// Every block arrives; returns once `target` blocks in all have. The fences make the block's
// writes before the barrier visible to every block after it (the pattern of cooperative
// groups' grid sync).
__device__ __forceinline__ void tern_chain_grid_barrier(unsigned* arrivals, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(arrivals, 1u);
        while (*reinterpret_cast<volatile unsigned*>(arrivals) < target) {
        }
        __threadfence();
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(CHAIN_WARPS * 32, 1)
    tern_gemv_chain(const tern_chain_stage* stages, int n_stages, unsigned* arrivals, int ring, int x_max) {
    tern_await_prior_kernel();
    extern __shared__ __align__(16) unsigned char chain_smem[];
    float* xs = reinterpret_cast<float*>(chain_smem);
    uint4* rings = reinterpret_cast<uint4*>(chain_smem + (size_t)x_max * 4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * CHAIN_WARPS + warp, W = gridDim.x * CHAIN_WARPS;
    uint4* my = rings + (size_t)warp * ring * 32 + lane;  // piece p of this lane: my[p * 32]
    const auto rows_of = [&](int s) { const int n = stages[s].n; return n > gw ? (n - gw + W - 1) / W : 0; };

    // Issue cursor: the next row to request (stage is, its ir-th row of this warp). The ring's
    // next slot to fill and to read, and the pieces in it not yet read.
    int is = 0, ir = 0, in_flight = 0, fill = 0, read = 0, held = 0;
    const auto issue_ahead = [&]() {
        while (is < n_stages && in_flight < CHAIN_MAX_ROWS) {
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
        if (s > 0) tern_chain_grid_barrier(arrivals, (unsigned)(s * gridDim.x));
        const tern_chain_stage st = stages[s];
        const float* x = reinterpret_cast<const float*>(st.x);
        // The input as the stage before left it in L2 (not through L1, which other blocks'
        // writes do not reach).
        for (int i = threadIdx.x; i < st.k; i += blockDim.x) xs[i] = __ldcg(x + i);
        __syncthreads();
        const int rows = rows_of(s), per = st.k / 256;
        for (int r = 0; r < rows; r++) {
            issue_ahead();
            tern_chain_wait(in_flight - 1);  // this row's group is the oldest outstanding
            float acc = 0.0f;
            for (int i = 0; i < per; i++) {
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
                acc = fmaf(__uint_as_float(u.w & 0xffff0000u), xb.w, acc);
            }
            held -= per;
            in_flight--;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) reinterpret_cast<float*>(st.y)[gw + r * W] = acc;
        }
    }
}
