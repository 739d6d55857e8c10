// The best entries of each row of logits, on the device. CPU twin and the two orders:
// sample/mod.rs (`best_entries`). Each row has a divisor (0: greedy order, raw logits; t > 0:
// logit / t, divided as the host divides, IEEE f32) and a count (0: the row is not asked for).
//
// An entry's rank key is an unsigned integer whose order is the row's order: the float's bits
// with negatives flipped whole and positives' sign bit set (the order of f32::total_cmp),
// -0 read as +0 in the greedy order; NaN entries have no key and are never taken. Among equal
// keys the lower id ranks first.

#define TERN_SELECT_THREADS 1024
#define TERN_SELECT_MAX 256  // mirrors MAX_BEST in sample/mod.rs
#define TERN_GREEDY_THREADS 256

// The value an entry is ranked by and returned as (greedy: the logit, -0 read as +0).
__device__ __forceinline__ float tern_ranked_value(float logit, float divisor) {
    return divisor > 0.0f ? logit / divisor : (logit == 0.0f ? 0.0f : logit);
}

// False for NaN; else *key holds the value's rank key.
__device__ __forceinline__ bool tern_rank_key(float v, bool greedy, unsigned* key) {
    if (isnan(v)) return false;
    const unsigned b = (greedy && v == 0.0f) ? 0u : __float_as_uint(v);
    *key = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return true;
}

// Greedy rows that want one entry (divisor 0, count 1): blocks of a row take slices of it and
// meet in one 64-bit atomicMax of (key << 32 | ~id), the larger key first and of equal keys the
// lower id: best[row] (zeroed by the launcher; 0 means no entry, the row was all NaN). A row
// of the 248 320-entry Qwen3.5 vocabulary is one read spread over many multiprocessors.
extern "C" __global__ void __launch_bounds__(TERN_GREEDY_THREADS)
    tern_best_greedy(const float* __restrict__ logits, int vocab, const float* __restrict__ divisors,
                     const int* __restrict__ counts, unsigned long long* __restrict__ best) {
    tern_await_prior_kernel();
    const int row = blockIdx.y;
    if (counts[row] != 1 || divisors[row] != 0.0f) return;
    const float* l = logits + (size_t)row * vocab;
    unsigned long long mine = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vocab; i += gridDim.x * blockDim.x) {
        unsigned key;
        if (tern_rank_key(l[i], true, &key)) {
            const unsigned long long packed = ((unsigned long long)key << 32) | (unsigned)~(unsigned)i;
            mine = packed > mine ? packed : mine;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, mine, o);
        mine = other > mine ? other : mine;
    }
    if (threadIdx.x % 32 == 0 && mine != 0) atomicMax(best + row, mine);
}

// Every other asked-for row, one block a row: a radix select finds T, the key of the
// count-th best entry (four passes of 8 bits, high first; each pass counts the entries whose
// key matches T's bits found so far, by their next 8 bits, and keeps the bin where the count
// is reached), then one pass in id order takes every entry above T and, in id order, the
// entries equal to T that are still needed; the block then ranks its picks by (key, id) and
// writes them best first to ids / values [row][stride], the rest of the row's count padded
// with id 0xffffffff. A row with fewer non-NaN entries than its count gives all of them.
extern "C" __global__ void __launch_bounds__(TERN_SELECT_THREADS)
    tern_best_select(const float* __restrict__ logits, int vocab, const float* __restrict__ divisors,
                     const int* __restrict__ counts, int stride, unsigned* __restrict__ ids,
                     float* __restrict__ values) {
    tern_await_prior_kernel();
    const int row = blockIdx.x;
    const float divisor = divisors[row];
    const bool greedy = divisor == 0.0f;
    const int count = counts[row];
    if (count <= 0 || count > TERN_SELECT_MAX || (greedy && count == 1)) return;
    const float* l = logits + (size_t)row * vocab;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    __shared__ unsigned hist[256];
    __shared__ unsigned s_prefix, s_need, s_count;
    __shared__ unsigned pick_key[TERN_SELECT_MAX], pick_id[TERN_SELECT_MAX];
    __shared__ float pick_value[TERN_SELECT_MAX];
    __shared__ unsigned s_above, s_equal_taken, s_warp_equal[TERN_SELECT_THREADS / 32];

    unsigned prefix = 0, mask = 0;
    unsigned need = (unsigned)count;  // entries still to take among those matching the prefix
    // Every lane of a warp runs the same number of iterations (the match below needs them all).
    const int span = (vocab + TERN_SELECT_THREADS - 1) / TERN_SELECT_THREADS * TERN_SELECT_THREADS;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < span; i += blockDim.x) {
            unsigned key = 0;
            const bool counted = i < vocab && tern_rank_key(tern_ranked_value(l[i], divisor), greedy, &key) &&
                                 (key & mask) == prefix;
            // Lanes with the same bin add once (a row's keys crowd into few bins: most logits
            // share their sign and exponent).
            const unsigned bin = counted ? (key >> shift) & 0xffu : 256u + lane;
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (counted && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned)__popc(peers));
        }
        __syncthreads();
        // Warp 0 finds the bin, scanning from the top: lane j holds bins 255 - 8j down to 248 - 8j.
        if (warp == 0) {
            unsigned c[8], sum = 0;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                c[k] = hist[255 - 8 * lane - k];
                sum += c[k];
            }
            unsigned incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            const unsigned total = __shfl_sync(0xffffffffu, incl, 31);
            // Fewer matching entries than needed (a row short of non-NaN entries): take them all.
            const unsigned want = need < total ? need : total;
            if (shift == 24 && lane == 0) s_count = want;
            const unsigned reached = __ballot_sync(0xffffffffu, want > 0 && incl >= want);
            if (reached != 0 && lane == __ffs(reached) - 1) {
                unsigned above = incl - sum;
                int k = 0;
                while (above + c[k] < want) above += c[k++];
                s_prefix = prefix | ((unsigned)(255 - 8 * lane - k) << shift);
                s_need = want - above;
            }
            if (reached == 0 && lane == 0) {  // nothing matches: the row has no entry at all
                s_prefix = prefix;
                s_need = 0;
            }
        }
        __syncthreads();
        prefix = s_prefix;
        need = s_need;
        mask |= 0xffu << shift;
        __syncthreads();
    }
    // prefix is now T, `need` the entries equal to T to take and s_count the entries taken in
    // all (the count, or the row's non-NaN entries if fewer; 0 when the row has none).
    if (threadIdx.x == 0) {
        s_above = 0;
        s_equal_taken = 0;
    }
    __syncthreads();
    const unsigned taken = s_count;
    const bool any = taken > 0;
    for (int base = 0; any && base < span; base += blockDim.x) {
        const int i = base + threadIdx.x;
        unsigned key = 0;
        float v = 0.0f;
        bool valid = false;
        if (i < vocab) {
            v = tern_ranked_value(l[i], divisor);
            valid = tern_rank_key(v, greedy, &key);
        }
        if (valid && key > prefix) {
            const unsigned slot = atomicAdd(&s_above, 1u);
            pick_key[slot] = key;
            pick_id[slot] = (unsigned)i;
            pick_value[slot] = v;
        }
        // Entries equal to T, in id order: a block-wide prefix count of them.
        const bool equal = valid && key == prefix;
        const unsigned ballot = __ballot_sync(0xffffffffu, equal);
        if (lane == 0) s_warp_equal[warp] = __popc(ballot);
        __syncthreads();
        unsigned before = s_equal_taken;
        for (int w = 0; w < warp; ++w) before += s_warp_equal[w];
        before += __popc(ballot & ((1u << lane) - 1u));
        if (equal && before < need) {
            // Slots after every entry above T: there are exactly taken - need of those.
            const unsigned slot = taken - need + before;
            pick_key[slot] = key;
            pick_id[slot] = (unsigned)i;
            pick_value[slot] = v;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned total = 0;
            for (int w = 0; w < TERN_SELECT_THREADS / 32; ++w) total += s_warp_equal[w];
            s_equal_taken += total;
        }
        __syncthreads();
        if (s_equal_taken >= need && base + (int)blockDim.x < span) {
            // Every entry equal to T is taken; those above T may still lie ahead.
            for (int j = base + (int)blockDim.x + threadIdx.x; j < vocab; j += blockDim.x) {
                unsigned k2;
                const float v2 = tern_ranked_value(l[j], divisor);
                if (tern_rank_key(v2, greedy, &k2) && k2 > prefix) {
                    const unsigned slot = atomicAdd(&s_above, 1u);
                    pick_key[slot] = k2;
                    pick_id[slot] = (unsigned)j;
                    pick_value[slot] = v2;
                }
            }
            break;
        }
    }
    __syncthreads();
    unsigned* out_ids = ids + (size_t)row * stride;
    float* out_values = values + (size_t)row * stride;
    if (threadIdx.x < taken) {
        const unsigned k = pick_key[threadIdx.x], id = pick_id[threadIdx.x];
        int rank = 0;
        for (unsigned j = 0; j < taken; ++j) rank += pick_key[j] > k || (pick_key[j] == k && pick_id[j] < id);
        out_ids[rank] = id;
        out_values[rank] = pick_value[threadIdx.x];
    } else if ((int)threadIdx.x < count) {
        out_ids[threadIdx.x] = 0xffffffffu;
        out_values[threadIdx.x] = 0.0f;
    }
}
