// The routed experts' combine and the shared expert's gate, CUDA form. CPU twins: moe/mod.rs
// (`out[t] += y·w`, experts in index order) and the CPU backend's shared expert in its moe. The product is
// rounded before the add (__fmul_rn keeps the compiler from fusing them into one FMA), as on
// the CPU, so each addition rounds the same way there and here.

// The shared expert's gate: the sigmoid of its logit, one form for the two kernels that use it
// (the decode step's routing writes it as the shared slot's weight).
__device__ __forceinline__ float tern_moe_shared_gate(float logit) { return 1.0f / (1.0f + expf(-logit)); }

// out[r] += sigmoid(gate[r·gate_stride])·y[r], rows of d (the gate logit: a column of the
// router's [rows][experts + 1] output).
extern "C" __global__ void tern_add_sigmoid_gated(float* __restrict__ out, const float* __restrict__ y,
                                                  const float* __restrict__ gate, int gate_stride, int n, int d) {
    tern_await_prior_kernel();
    const size_t total = (size_t)n * d;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        const float s = tern_moe_shared_gate(gate[(e / d) * gate_stride]);
        out[e] = out[e] + __fmul_rn(s, y[e]);
    }
}

// Routing of a few rows on the device (a decode step, which a graph records; CPU twin: mod.rs
// `route`). One warp per row, the row's probabilities in shared memory (ne floats):
// softmax in f32 with the row's sum taken in index order by one lane (the CPU's order), then k
// rounds of a warp argmax over the untaken experts (highest probability, ties to the lower
// index, as the CPU's sort and torch.topk), the chosen probabilities summed in the order they
// were chosen, and the weights p / sum. A row's k choices are written in ascending expert
// order: the order tern_moe_combine adds them in, which is the CPU's (experts in index order).
//
// Rows of the logits are `stride` apart. With `shared`, column ne of a row is the shared
// expert's gate logit and the row gets k + 1 slots: the k routed ones, then the shared expert
// (id ne, the tables' entry after the routed experts) weighted by sigmoid(gate), added last as
// the CPU adds it.
extern "C" __global__ void tern_moe_route(const float* __restrict__ logits, int ne, int stride, int k, int shared,
                                          int* __restrict__ ids, float* __restrict__ weights) {
    tern_await_prior_kernel();
    extern __shared__ float tern_moe_p[];
    const int row = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (size_t)row * stride;
    float mx = -tern_inf();
    for (int e = lane; e < ne; e += 32) mx = fmaxf(mx, l[e]);
    mx = tern_warp_max(mx);
    for (int e = lane; e < ne; e += 32) tern_moe_p[e] = expf(l[e] - mx);
    __syncwarp();
    float total = 0.0f;
    if (lane == 0)
        for (int e = 0; e < ne; ++e) total += tern_moe_p[e];
    total = __shfl_sync(0xffffffffu, total, 0);
    for (int e = lane; e < ne; e += 32) tern_moe_p[e] = tern_moe_p[e] / total;
    __syncwarp();
    // Round j's expert is marked taken in shared memory (-inf: below every probability, and
    // not a NaN's fallback either) and kept, with its probability, by lane j (k <= 32), so
    // nothing is indexed at run time in registers (which would go to local memory).
    int my_id = ne;
    float my_p = 0.0f;
    for (int j = 0; j < k; ++j) {
        float best = -1.0f;
        int at = ne;
        for (int e = lane; e < ne; e += 32) {
            const float p = tern_moe_p[e];
            if (p > best || (p == best && e < at)) {
                best = p;
                at = e;
            }
        }
        for (int m = 16; m > 0; m >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, m);
            const int oa = __shfl_xor_sync(0xffffffffu, at, m);
            if (ob > best || (ob == best && oa < at)) {
                best = ob;
                at = oa;
            }
        }
        // NaN probabilities compare false everywhere: take the first untaken expert so that
        // an id never leaves the table (the output is NaN either way).
        for (int e = 0; at >= ne && e < ne; ++e)
            if (tern_moe_p[e] != -tern_inf()) at = e;
        const float p = tern_moe_p[at];
        if (lane == j) {
            my_id = at;
            my_p = p;
        }
        __syncwarp();
        if (lane == 0) tern_moe_p[at] = -tern_inf();
        __syncwarp();
    }
    // The chosen probabilities summed in the order they were chosen; each choice's place in
    // ascending expert order is the count of chosen ids below it (the ids are distinct).
    float sum = 0.0f;
    int rank = 0;
    for (int j = 0; j < k; ++j) {
        sum += __shfl_sync(0xffffffffu, my_p, j);
        rank += __shfl_sync(0xffffffffu, my_id, j) < my_id;
    }
    const size_t at = (size_t)row * (k + shared);
    if (lane < k) {
        ids[at + rank] = my_id;
        weights[at + rank] = my_p / sum;
    }
    if (shared && lane == 0) {
        ids[at + k] = ne;
        weights[at + k] = tern_moe_shared_gate(l[ne]);
    }
}

// out[r] = Σ_j y[s·d ..]·weights[r·k + j] over a row's k routed outputs (rows of d), s the
// slot r·k + j itself or, with `pos`, the row pos[r·k + j] of y that holds it (the outputs of a
// prompt's experts, whose rows are sorted by expert). Added in slot order from zero, each
// product rounded first: the CPU's sequence of additions.
extern "C" __global__ void tern_moe_combine(const float* __restrict__ y, const float* __restrict__ weights,
                                            const tern_u32* __restrict__ pos, int rows, int k, int d,
                                            float* __restrict__ out) {
    tern_await_prior_kernel();
    const size_t total = (size_t)rows * d;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / d, c = e % d;
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) {
            const size_t slot = r * k + j, at = pos ? (size_t)pos[slot] : slot;
            acc = acc + __fmul_rn(y[at * d + c], weights[slot]);
        }
        out[e] = acc;
    }
}

// A prompt's (row, choice) slots sorted by expert on the device, so that nothing returns to the
// host and a step of many rows can be recorded as a graph. CPU twin: sort_slots_on_host in
// cuda.rs, with matmul/cuda.rs expert_tiles. One block; thread e < ne owns expert e
// (ne <= blockDim.x = TERN_MOE_SORT_THREADS). The block counts each expert's slots (shared
// atomics: a count has no order) and scans the counts (and the tiles, ceil(count / 8)) into
// each expert's first sorted row and first tile; then thread e walks the slots in order, giving
// its slots consecutive sorted rows: pos[s] the sorted row of slot s, token[at] the input row
// (s / k) of sorted row at, and its tiles (e, first row, rows <= 8), the same as the host's.
// n_tiles[0] is the tile count. The walk reads the ids from shared memory, staged a chunk at a
// time, four a load (every thread reads the same words: broadcasts); each thread reading all
// of them from global memory, twice, took 0.75 ms a layer for a 2048-token prompt (H200).
// Every id must lie in [0, ne): tern_moe_route never writes another.
#define TERN_MOE_SORT_THREADS 1024
#define TERN_MOE_TILE_ROWS 8
#define TERN_MOE_SORT_CHUNK 8192

// Exclusive prefix sums over the block of a and b (one value each a thread); b's total lands in
// every thread's tb.
__device__ __forceinline__ void tern_moe_block_scan2(int a, int b, int& ea, int& eb, int& tb) {
    __shared__ int wa[32], wb[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    int ia = a, ib = b;
    for (int o = 1; o < 32; o <<= 1) {
        const int xa = __shfl_up_sync(0xffffffffu, ia, o), xb = __shfl_up_sync(0xffffffffu, ib, o);
        if (lane >= o) {
            ia += xa;
            ib += xb;
        }
    }
    if (lane == 31) {
        wa[warp] = ia;
        wb[warp] = ib;
    }
    __syncthreads();
    if (warp == 0) {
        int sa = lane < warps ? wa[lane] : 0, sb = lane < warps ? wb[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const int xa = __shfl_up_sync(0xffffffffu, sa, o), xb = __shfl_up_sync(0xffffffffu, sb, o);
            if (lane >= o) {
                sa += xa;
                sb += xb;
            }
        }
        wa[lane] = sa;  // inclusive sums of the warps' totals
        wb[lane] = sb;
    }
    __syncthreads();
    ea = ia - a + (warp > 0 ? wa[warp - 1] : 0);
    eb = ib - b + (warp > 0 ? wb[warp - 1] : 0);
    tb = wb[warps - 1];
}

extern "C" __global__ void __launch_bounds__(TERN_MOE_SORT_THREADS)
    tern_moe_sort_slots(const int* __restrict__ ids, int slots, int k, int ne, tern_u32* __restrict__ token,
                        tern_u32* __restrict__ pos, int* __restrict__ tiles, int* __restrict__ n_tiles) {
    tern_await_prior_kernel();
    __shared__ int4 staged4[TERN_MOE_SORT_CHUNK / 4];
    __shared__ int counts[TERN_MOE_SORT_THREADS];
    int* staged = (int*)staged4;
    const int e = threadIdx.x;
    counts[e] = 0;
    __syncthreads();
    // An id outside [0, ne) (none comes from tern_moe_route) is counted nowhere, as the walk
    // places it nowhere, rather than written past the counts.
    for (int s = e; s < slots; s += TERN_MOE_SORT_THREADS) {
        const int id = ids[s];
        if ((unsigned)id < (unsigned)ne) atomicAdd(&counts[id], 1);
    }
    __syncthreads();
    const int count = e < ne ? counts[e] : 0;
    const int my_tiles = (count + TERN_MOE_TILE_ROWS - 1) / TERN_MOE_TILE_ROWS;
    int first_row, first_tile, tiles_total;
    tern_moe_block_scan2(count, my_tiles, first_row, first_tile, tiles_total);
    int at = first_row;
    auto place = [&](int id, int s) {
        if (id == e) {
            pos[s] = (tern_u32)at;
            token[at] = (tern_u32)(s / k);
            ++at;
        }
    };
    for (int c0 = 0; c0 < slots; c0 += TERN_MOE_SORT_CHUNK) {
        const int n = min(TERN_MOE_SORT_CHUNK, slots - c0);
        __syncthreads();  // every walker is done with the previous chunk
        for (int i = e; i < n; i += TERN_MOE_SORT_THREADS) staged[i] = ids[c0 + i];
        __syncthreads();
        if (count > 0) {
            int i = 0;
            for (; i + 4 <= n; i += 4) {
                const int4 v = staged4[i / 4];
                place(v.x, c0 + i);
                place(v.y, c0 + i + 1);
                place(v.z, c0 + i + 2);
                place(v.w, c0 + i + 3);
            }
            for (; i < n; ++i) place(staged[i], c0 + i);
        }
    }
    if (count > 0) {
        for (int i = 0; i < my_tiles; ++i) {
            int* t = tiles + 3 * (size_t)(first_tile + i);
            t[0] = e;
            t[1] = first_row + i * TERN_MOE_TILE_ROWS;
            t[2] = min(TERN_MOE_TILE_ROWS, count - i * TERN_MOE_TILE_ROWS);
        }
    }
    if (e == 0) n_tiles[0] = tiles_total;
}
