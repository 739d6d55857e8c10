// Causal attention of a sequence's new queries over its KV cache, f32, CUDA form. CPU twin:
// attention/mod.rs `causal_attention`, then × sigmoid(gate) (the gated attention of Qwen3.5).
// One block of TERN_KV_WARPS warps per (query row, query head): the warps take the visible
// keys round-robin, each keeps an online softmax (running max, sum, and hd/32 accumulators per
// lane), and the block merges the warps' partial results at the end. Keys and values are read
// straight from the cache (in a decode step, a row's own new key and value from the
// projection: FRESH below); the query heads that share a kv head find them in L2.

#define TERN_KV_WARPS 4

// Positions come from device memory (the batch's, one per row), never from kernel arguments:
// a decode step recorded as a CUDA graph replays with new positions and the same arguments.
// So do the caches: row r's sequence keeps its keys at k_at[r] and values at v_at[r] (device
// tables of addresses), so one launch serves every sequence of a batch.

// Rows of k and v (strided views of the fused projection) appended to the caches: row r goes
// to row positions[r] of its sequence's cache.
extern "C" __global__ void tern_kv_append(const float* __restrict__ k, long long k_off, long long k_ld,
                                          const float* __restrict__ v, long long v_off, long long v_ld, int rows,
                                          int width, const unsigned* __restrict__ positions,
                                          const unsigned long long* __restrict__ k_at,
                                          const unsigned long long* __restrict__ v_at) {
    tern_await_prior_kernel();
    const size_t n = (size_t)rows * width;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / width, i = e % width;
        const size_t at = (size_t)positions[r] * width + i;
        ((float*)k_at[r])[at] = k[k_off + r * k_ld + i];
        ((float*)v_at[r])[at] = v[v_off + r * v_ld + i];
    }
}

// Query row i (blockIdx.y) of the batch sits at position positions[i] and sees rows
// 0 ..= positions[i] of its sequence's cache. q and gate are strided views; out is [rows][q_heads·hd].
//
// A decode step's query is one row, so a block per (head, row) would leave the GPU idle and
// walk every key in turn (a chain of dependent loads per warp: about 20 µs a layer at 80 keys
// on the H200, and growing with the context). Instead the keys split into gridDim.z ranges
// (split-K, "flash decoding"): block (h, i, s) takes the s-th of the row's keys in gridDim.z
// equal ranges (the count known only on the device, from the positions: the launch shape
// stays fixed for a recorded step) and writes its softmax partial — max m, sum l and the
// unnormalised output — to `partial` [rows][q_heads][splits][hd + 2]; the last of a head's
// blocks to arrive (an arrival counter, zero between launches) merges the splits in order and
// writes the gated output. One split writes the output directly.
//
// FRESH (a decode step: each row its sequence's one new token): the row's own key and value,
// at position positions[i], are read from the projection's k and v views instead of the cache,
// and written to the cache by the first query head of each kv head in the first split, so the
// step needs no append launch before it (no block of this launch reads that cache row). The
// same values, so the same bits.
//
// PER: values of a head row a lane holds (hd <= 32·PER). A warp takes its keys KB at a time:
// the KB keys' k and v rows are requested together, then the keys go through the online
// softmax one by one in the order of the one-key loop (keys warp, warp + TERN_KV_WARPS, ...),
// so a warp waits for memory once per KB keys rather than once per key (a context of
// thousands of tokens is ~100 keys a warp) and the results are the same bits. The merge
// reads each split's max and sum once.
//
// WARPS: the block's warps, 4 or 16 (kernels _w16: the launcher's where one sequence decodes at a
// time, KvForm in cuda.rs). Each walks keys warp, warp + WARPS, ...,
// so a split's keys are walked by four times the warps, each a quarter as many keys (a decode
// step of one sequence has few blocks: Qwen3.5-0.8B's 8 query heads make 64 with 8 splits, and
// after 4096 tokens each of their 4 warps walks 128 keys in turn). The 16-warp form also takes
// a batch's KB scores before any enters the softmax (SCORES_FIRST below). Other warps, other
// partial sums: 4 and 16 warps agree to f32 rounding, not bit for bit.
#define TERN_KV_MAX_SPLITS 16

// PREP (a decode step whose q and k heads arrive as projected, prep.on): each block prepares
// its query head, and the row's own key where it writes that key to the cache or walks it, in
// shared memory, as tern_head_prep (rope.cu) would in place before the launch: RMS norm (with
// the weight w, unweighted where w is null; norm 0: none) over each head, then the rotation of
// its first rot channels (0: none) at the row's position. The same products and sums in the
// same order, so the same bits as the two launches, one launch fewer a layer: the preparation
// is a few hundred values, and a launch of its own costs a decode step more than its work. The
// cache keeps the prepared key, as it would after tern_head_prep. Section 0 is q, 1 is k;
// mirrors KvPrepArgs in cuda.rs field for field (C layout).
struct tern_kv_prep {
    unsigned long long w[2];
    unsigned long long cos_t[2];
    unsigned long long sin_t[2];
    int norm[2];
    int rot[2];
    float eps[2];
    int on;
};

// One warp prepares head `src` (hd values) of section `sec` at position `pos` into `s` (shared),
// as tern_head_prep_regs does (rope/head.cuh).
template <int PER>
__device__ __forceinline__ void tern_kv_prep_head(float* __restrict__ s, const float* __restrict__ src, int hd,
                                                  const tern_kv_prep& p, int sec, size_t pos, int lane) {
    const int half = p.rot[sec] / 2;
    const float* c = half > 0 ? (const float*)p.cos_t[sec] + pos * half : nullptr;
    const float* sn = half > 0 ? (const float*)p.sin_t[sec] + pos * half : nullptr;
    tern_prep_head_to_shared<PER>(s, src, hd, p.norm[sec], (const float*)p.w[sec], p.eps[sec], half, c, sn, lane);
}
template <int PER, int KB, int WARPS>
__device__ __forceinline__ void tern_kv_attention_body(const float* __restrict__ q, long long q_off, long long q_ld,
                                                       const float* __restrict__ gate, long long g_off, long long g_ld,
                                                       const float* __restrict__ k_new, long long k_off, long long k_ld,
                                                       const float* __restrict__ v_new, long long v_off, long long v_ld,
                                                       int fresh, const tern_kv_prep& prep,
                                                       const unsigned long long* __restrict__ k_at,
                                                       const unsigned long long* __restrict__ v_at,
                                                       const unsigned* __restrict__ positions, int q_heads, int kv_heads,
                                                       int hd, float scale, int min_keys, float* __restrict__ partial,
                                                       unsigned* __restrict__ counters, float* __restrict__ out) {
    constexpr int HD = 32 * PER;
    const int h = blockIdx.x, i = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int group = q_heads / kv_heads, kvh = h / group;
    const size_t kw = (size_t)kv_heads * hd;
    float* k_cache = (float*)k_at[i];
    float* v_cache = (float*)v_at[i];
    // Addresses read from memory: without the assumption the compiler issues generic loads,
    // which resolve the address space per access.
    __builtin_assume(__isGlobal(k_cache) && __isGlobal(v_cache));
    // The row's key count, requested with its q before the barrier.
    const int keys = (int)positions[i] + 1;
    // FRESH: the row's own key and value rows in the projection.
    const float* kr_new = k_new + k_off + (size_t)i * k_ld + (size_t)kvh * hd;
    const float* vr_new = v_new + v_off + (size_t)i * v_ld + (size_t)kvh * hd;
    // The block that writes the row's own key and value to the cache (PREP: after preparing it).
    const bool writes_own = fresh && split == 0 && h % group == 0;
    const bool prep_on = fresh && prep.on;
    const size_t own_at = (size_t)(keys - 1) * kw + (size_t)kvh * hd;
    if (writes_own && !prep_on) {
        for (int c = threadIdx.x; c < hd; c += blockDim.x) {
            k_cache[own_at + c] = kr_new[c];
            v_cache[own_at + c] = vr_new[c];
        }
    }
    // The splits this row's keys take: with min_keys set, as many as give each at least
    // min_keys keys (the launcher's one round of KB keys a warp), at most gridDim.z. A short
    // context then skips the partials' round trip through memory and the merge (one split
    // writes the output itself), and the blocks of the splits it does not take end here. It
    // depends on the row's own key count only, so a row gets the same bits alone and in a batch.
    const int used = min_keys > 0 ? min(splits, (keys + min_keys - 1) / min_keys) : splits;
    if (split >= used) return;
    __shared__ float qs[HD];
    __shared__ float ks[HD];  // PREP: the row's own key, prepared
    __shared__ float warp_max[WARPS], warp_sum[WARPS];
    __shared__ float warp_acc[WARPS][HD];
    __shared__ bool last;
    // This block's keys: the split-th of `keys` in `used` ranges (the first always holds key 0).
    const int chunk = (keys + used - 1) / used;
    const int j0 = split * chunk, j1 = min(keys, j0 + chunk);
    const float* qr = q + q_off + (size_t)i * q_ld + (size_t)h * hd;
    if (prep_on) {
        // Warp 0 prepares the query head; warp 1 the row's own key (the last, keys - 1) where
        // this block writes it to the cache or walks it. Blocks have at least 4 warps.
        if (warp == 0) tern_kv_prep_head<PER>(qs, qr, hd, prep, 0, keys - 1, lane);
        else if (warp == 1 && (writes_own || (keys - 1) / chunk == split)) tern_kv_prep_head<PER>(ks, kr_new, hd, prep, 1, keys - 1, lane);
    } else {
        for (int c = threadIdx.x; c < hd; c += blockDim.x) qs[c] = qr[c];
    }
    __syncthreads();
    if (writes_own && prep_on) {
        for (int c = threadIdx.x; c < hd; c += blockDim.x) {
            k_cache[own_at + c] = ks[c];
            v_cache[own_at + c] = vr_new[c];
        }
    }
    float m = -tern_inf(), l = 0.0f, acc[PER];
#pragma unroll
    for (int t = 0; t < PER; ++t) acc[t] = 0.0f;
    for (int jb = j0 + warp; jb < j1; jb += KB * WARPS) {
        float kv[KB][PER], vv[KB][PER];
#pragma unroll
        for (int u = 0; u < KB; ++u) {
            const int j = jb + u * WARPS;
            const bool own = fresh && j == keys - 1;
            const float* kr = own ? kr_new : k_cache + (size_t)j * kw + (size_t)kvh * hd;
            const float* vr = own ? vr_new : v_cache + (size_t)j * kw + (size_t)kvh * hd;
#pragma unroll
            for (int t = 0; t < PER; ++t) {
                const int c = lane + 32 * t;
                const bool in = j < j1 && c < hd;
                kv[u][t] = in ? (own && prep_on ? ks[c] : kr[c]) : 0.0f;
                vv[u][t] = in ? vr[c] : 0.0f;
            }
        }
        // SCORES_FIRST: the KB keys' dot products and warp sums level by level, so that their
        // shuffles are independent chains in flight together, where the one-key loop waits out
        // each key's five in turn before the next key's first. The same operations on each key
        // (a key past j1 has zeros and its score is not used) and the same order of the
        // softmax updates: the same bits as the one-key loop.
        constexpr bool SCORES_FIRST = WARPS > 4;
        // This lane's part of key u's dot product with the query.
        const auto dot = [&](int u) {
            float s = 0.0f;
#pragma unroll
            for (int t = 0; t < PER; ++t)
                if (lane + 32 * t < hd) s += qs[lane + 32 * t] * kv[u][t];
            return s;
        };
        float sc[KB];
        if constexpr (SCORES_FIRST) {
#pragma unroll
            for (int u = 0; u < KB; ++u) sc[u] = dot(u);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                for (int u = 0; u < KB; ++u) sc[u] += __shfl_xor_sync(0xffffffffu, sc[u], o);
        }
#pragma unroll
        for (int u = 0; u < KB; ++u) {
            if (jb + u * WARPS >= j1) break;
            const float s = (SCORES_FIRST ? sc[u] : tern_warp_sum(dot(u))) * scale;
            const float m_new = fmaxf(m, s);
            // The first key: m is −inf, so the old terms get weight exp(−inf) = 0.
            const float corr = expf(m - m_new), p = expf(s - m_new);
            l = l * corr + p;
#pragma unroll
            for (int t = 0; t < PER; ++t)
                if (lane + 32 * t < hd) acc[t] = acc[t] * corr + p * vv[u][t];
            m = m_new;
        }
    }
    if (lane == 0) {
        warp_max[warp] = m;
        warp_sum[warp] = l;
    }
#pragma unroll
    for (int t = 0; t < PER; ++t) {
        const int c = lane + 32 * t;
        if (c < hd) warp_acc[warp][c] = acc[t];
    }
    __syncthreads();
    // The block's max over its warps: −inf only for a split with no key (then it adds nothing:
    // its sum and output are written as 0). A warp that saw no key has max −inf and weight 0.
    float mx = -tern_inf();
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, warp_max[w]);
    const bool empty = mx == -tern_inf();
    float total = 0.0f;
    if (!empty)
        for (int w = 0; w < WARPS; ++w) total += warp_sum[w] * expf(warp_max[w] - mx);
    const size_t ld = (size_t)q_heads * hd;
    const float* gr = gate + g_off + (size_t)i * g_ld + (size_t)h * hd;
    float* o_row = out + (size_t)i * ld + (size_t)h * hd;
    if (used == 1) {
        for (int c = threadIdx.x; c < hd; c += blockDim.x) {
            float o = 0.0f;
            for (int w = 0; w < WARPS; ++w) o += warp_acc[w][c] * expf(warp_max[w] - mx);
            o_row[c] = o / total * (1.0f / (1.0f + expf(-gr[c])));
        }
        return;
    }
    const size_t head = (size_t)i * q_heads + h;
    float* mine = partial + (head * splits + split) * (size_t)(hd + 2);
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float o = 0.0f;
        if (!empty)
            for (int w = 0; w < WARPS; ++w) o += warp_acc[w][c] * expf(warp_max[w] - mx);
        mine[2 + c] = o;
    }
    if (threadIdx.x == 0) {
        mine[0] = mx;
        mine[1] = total;
    }
    // Every writer fences its writes before the block signals; the last block then reads the
    // other blocks' partials through L2 (__ldcg: this multiprocessor's L1 may hold stale lines).
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + head, 1u) == (unsigned)used - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* parts = partial + head * splits * (size_t)(hd + 2);
    // Each split's max and sum, read once (splits <= TERN_KV_MAX_SPLITS, checked by the host).
    float mt[TERN_KV_MAX_SPLITS], lt[TERN_KV_MAX_SPLITS];
#pragma unroll
    for (int t = 0; t < TERN_KV_MAX_SPLITS; ++t) {
        mt[t] = t < used ? __ldcg(parts + (size_t)t * (hd + 2)) : -tern_inf();
        lt[t] = t < used ? __ldcg(parts + (size_t)t * (hd + 2) + 1) : 0.0f;
    }
    float big = -tern_inf();
#pragma unroll
    for (int t = 0; t < TERN_KV_MAX_SPLITS; ++t)
        if (t < used) big = fmaxf(big, mt[t]);
    float sum = 0.0f;
#pragma unroll
    for (int t = 0; t < TERN_KV_MAX_SPLITS; ++t)
        if (t < used && mt[t] != -tern_inf()) sum += lt[t] * expf(mt[t] - big);
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float o = 0.0f;
#pragma unroll
        for (int t = 0; t < TERN_KV_MAX_SPLITS; ++t)
            if (t < used && mt[t] != -tern_inf()) o += __ldcg(parts + (size_t)t * (hd + 2) + 2 + c) * expf(mt[t] - big);
        o_row[c] = o / sum * (1.0f / (1.0f + expf(-gr[c])));
    }
    if (threadIdx.x == 0) counters[head] = 0u;
}

// One kernel per PER (heads of up to 64, 128, 256, 512 values; the launcher takes the
// smallest that holds hd) with its KB: 4 keys a warp at once, 2 for the 512-wide head (then
// 64 registers of rows either way); each with TERN_KV_WARPS warps and, _w16, with 16 (512
// threads: bounded so that a block's registers fit).
#define TERN_KV_ATTENTION_ENTRY(NAME, PER, KB, WARPS, BOUNDS)                                                        \
    extern "C" __global__ void BOUNDS NAME(                                                     \
        const float* __restrict__ q, long long q_off, long long q_ld, const float* __restrict__ gate, long long g_off,  \
        long long g_ld, const float* __restrict__ k_new, long long k_off, long long k_ld,                              \
        const float* __restrict__ v_new, long long v_off, long long v_ld, int fresh, const tern_kv_prep prep,          \
        const unsigned long long* __restrict__ k_at, const unsigned long long* __restrict__ v_at,                      \
        const unsigned* __restrict__ positions, int q_heads, int kv_heads, int hd, float scale, int min_keys,          \
        float* __restrict__ partial, unsigned* __restrict__ counters, float* __restrict__ out) {                       \
        tern_await_prior_kernel();                                                                                     \
        tern_kv_attention_body<PER, KB, WARPS>(q, q_off, q_ld, gate, g_off, g_ld, k_new, k_off, k_ld, v_new, v_off,   \
                                               v_ld, fresh, prep, k_at, v_at, positions, q_heads, kv_heads, hd, scale, \
                                               min_keys, partial, counters, out);                                      \
    }
#define TERN_KV_ATTENTION(PER, KB)                                                                                     \
    TERN_KV_ATTENTION_ENTRY(tern_kv_attention_p##PER, PER, KB, TERN_KV_WARPS, )                                        \
    TERN_KV_ATTENTION_ENTRY(tern_kv_attention_p##PER##_w16, PER, KB, 16, __launch_bounds__(512))
TERN_KV_ATTENTION(2, 4)
TERN_KV_ATTENTION(4, 4)
TERN_KV_ATTENTION(8, 4)
TERN_KV_ATTENTION(16, 2)
#undef TERN_KV_ATTENTION
#undef TERN_KV_ATTENTION_ENTRY

// out[r][c] *= sigmoid(gate[g_off + r·g_ld + c]) over rows × width (the prefill path, after the
// flash kernels' causal attention).
extern "C" __global__ void tern_sigmoid_gate(float* __restrict__ out, const float* __restrict__ gate, long long g_off,
                                             long long g_ld, int rows, int width) {
    tern_await_prior_kernel();
    const size_t n = (size_t)rows * width;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
        const size_t r = e / width, c = e % width;
        out[e] = out[e] * (1.0f / (1.0f + expf(-gate[g_off + r * g_ld + c])));
    }
}
