// Bidirectional flash attention over packed variable-length sequences, f32 on CUDA cores.
// CPU twin: attention/mod.rs (scores scaled after the dot product, max-subtracted softmax).
// Here the softmax is online (running max and sum per query, the partial output rescaled when
// the max grows), so the result differs from the CPU only in rounding.
//
// One block per (tile of 32 queries of one sequence, query head); 8 warps. The block walks
// the band of keys its queries can see (|i - j| <= max_distance, or the whole sequence when
// max_distance < 0) in tiles of 32, with Q, K and V tiles in shared memory:
//  - scores: thread t forms queries t/8 x keys t%8 + 8m (m < 4) with float4 loads along d;
//    K rows are padded by 4 floats so that the 8 threads of a 128-bit load phase read 8
//    different bank groups;
//  - softmax and P·V: warp w owns queries 4w .. 4w+3; its lanes own output columns
//    4·lane + 128·c, so the running output lives in registers (HD_CHUNKS·16 floats).
// Operands are strided views (head h of row r at x[off + r·ld + h·hd]), so q, k and v are read
// straight out of one fused projection. The launcher checks hd % 4 == 0, hd <= 128·HD_CHUNKS
// and 16-byte alignment of every offset and stride.

#define TERN_ATT_BQ 32
#define TERN_ATT_BK 32

template <int HD_CHUNKS>
__device__ void tern_attention_tile(const float* __restrict__ q, long long q_off, long long q_ld,
                                    const float* __restrict__ k, long long k_off, long long k_ld,
                                    const float* __restrict__ v, long long v_off, long long v_ld,
                                    float* __restrict__ out, long long out_ld, tern_bf16* __restrict__ out16,
                                    const tern_u32* __restrict__ seg_start, const tern_u32* __restrict__ seg_len,
                                    const tern_u32* __restrict__ tile_seg, const tern_u32* __restrict__ tile_q0,
                                    int group, int hd, float scale, int max_distance) {
    extern __shared__ float4 tern_att_smem4[];
    float* smem = (float*)tern_att_smem4;
    const int ldp = hd + 4;
    float* qs = smem;                          // [BQ][hd + 4]
    float* ks = qs + TERN_ATT_BQ * ldp;         // [BK][hd + 4]
    float* vs = ks + TERN_ATT_BK * ldp;         // [BK][hd]
    float* ss = vs + TERN_ATT_BK * hd;          // [BQ][BK + 1]
    float* ps = ss + TERN_ATT_BQ * (TERN_ATT_BK + 1);  // [8 warps][BK][4]

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int head = blockIdx.y, kv_head = head / group;
    const size_t start = seg_start[tile_seg[blockIdx.x]];
    const int len = (int)seg_len[tile_seg[blockIdx.x]];
    const int q0 = (int)tile_q0[blockIdx.x];
    const int q1 = min(q0 + TERN_ATT_BQ, len);
    int lo, hi;
    tern_att_band(q0, q1, len, max_distance, lo, hi);
    const int h4 = hd / 4;

    // Q tile; rows past the sequence are zero (their results are never written).
    for (int e = tid; e < TERN_ATT_BQ * h4; e += blockDim.x) {
        const int r = e / h4, c = (e % h4) * 4;
        float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
        if (q0 + r < len) val = *(const float4*)(q + q_off + (long long)(start + q0 + r) * q_ld + (long long)head * hd + c);
        *(float4*)(qs + r * ldp + c) = val;
    }

    float acc[4][HD_CHUNKS][4];
    float m_run[4], l_run[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m_run[i] = -tern_inf();
        l_run[i] = 0.f;
#pragma unroll
        for (int c = 0; c < HD_CHUNKS; ++c)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][c][j] = 0.f;
    }

    for (int k0 = lo; k0 < hi; k0 += TERN_ATT_BK) {
        __syncthreads();  // the previous tile's readers are done with ks / vs
        for (int e = tid; e < TERN_ATT_BK * h4; e += blockDim.x) {
            const int r = e / h4, c = (e % h4) * 4;
            float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), vv = kv;
            if (k0 + r < hi) {
                const long long row = (long long)(start + k0 + r);
                kv = *(const float4*)(k + k_off + row * k_ld + (long long)kv_head * hd + c);
                vv = *(const float4*)(v + v_off + row * v_ld + (long long)kv_head * hd + c);
            }
            *(float4*)(ks + r * ldp + c) = kv;
            *(float4*)(vs + r * hd + c) = vv;
        }
        __syncthreads();
        {
            const int qi = tid / 8, kg = tid % 8;
            float s[4] = {0.f, 0.f, 0.f, 0.f};
            for (int c = 0; c < hd; c += 4) {
                const float4 a = *(const float4*)(qs + qi * ldp + c);
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const float4 b = *(const float4*)(ks + (kg + 8 * m) * ldp + c);
                    s[m] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                }
            }
#pragma unroll
            for (int m = 0; m < 4; ++m) ss[qi * (TERN_ATT_BK + 1) + kg + 8 * m] = s[m];
        }
        __syncthreads();
        float* pw = ps + warp * TERN_ATT_BK * 4;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int qi = q0 + 4 * warp + i, kj = k0 + lane;
            const bool visible = tern_att_visible(qi, kj, hi, max_distance);
            const float sc = visible ? ss[(4 * warp + i) * (TERN_ATT_BK + 1) + lane] * scale : -tern_inf();
            const float m_new = fmaxf(m_run[i], tern_warp_max(sc));
            // A query past the sequence end, or one whose window has not started yet, has no
            // visible key in this tile: keep its state (and avoid exp(-inf - -inf)).
            const float p = (m_new == -tern_inf()) ? 0.f : expf(sc - m_new);
            const float alpha = (m_new == -tern_inf()) ? 1.f : expf(m_run[i] - m_new);
            l_run[i] = l_run[i] * alpha + tern_warp_sum(p);
            m_run[i] = m_new;
#pragma unroll
            for (int c = 0; c < HD_CHUNKS; ++c)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][c][j] *= alpha;
            pw[lane * 4 + i] = p;
        }
        __syncwarp();
        const int kn = min(TERN_ATT_BK, hi - k0);
        for (int j = 0; j < kn; ++j) {
            const float4 p = *(const float4*)(pw + j * 4);
            const float pj[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
            for (int c = 0; c < HD_CHUNKS; ++c) {
                const int col = 4 * lane + 128 * c;
                if (col < hd) {
                    const float4 vv = *(const float4*)(vs + j * hd + col);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        acc[i][c][0] += pj[i] * vv.x;
                        acc[i][c][1] += pj[i] * vv.y;
                        acc[i][c][2] += pj[i] * vv.z;
                        acc[i][c][3] += pj[i] * vv.w;
                    }
                }
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int qi = q0 + 4 * warp + i;
        if (qi >= len) continue;
        const float inv = 1.0f / l_run[i];
        const size_t row = (size_t)(start + qi) * out_ld + (size_t)head * hd;
#pragma unroll
        for (int c = 0; c < HD_CHUNKS; ++c) {
            const int col = 4 * lane + 128 * c;
            if (col < hd) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float o = acc[i][c][j] * inv;
                    if (out) out[row + col + j] = o;
                    if (out16) out16[row + col + j] = tern_bf16_from_f32(o);
                }
            }
        }
    }
}

#define TERN_ATTENTION_ENTRY(CHUNKS)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) tern_attention_hd##CHUNKS(                                        \
        const float* q, long long q_off, long long q_ld, const float* k, long long k_off, long long k_ld, const float* v, \
        long long v_off, long long v_ld, float* out, long long out_ld, tern_bf16* out16, const tern_u32* seg_start,      \
        const tern_u32* seg_len, const tern_u32* tile_seg, const tern_u32* tile_q0, int group, int hd, float scale,       \
        int max_distance) { tern_await_prior_kernel();                                                                   \
        tern_attention_tile<CHUNKS>(q, q_off, q_ld, k, k_off, k_ld, v, v_off, v_ld, out, out_ld, out16, seg_start,       \
                                    seg_len, tile_seg, tile_q0, group, hd, scale, max_distance);                         \
    }
TERN_ATTENTION_ENTRY(1)
TERN_ATTENTION_ENTRY(2)
TERN_ATTENTION_ENTRY(4)

// Short sequences (every sequence of the batch at most TERN_ATT_SHORT_MAX rows: a query, a
// short prompt): one warp per (row, query head), 8 warps a block, no shared memory. The flash
// kernel above gives such a batch one block per head that stages 32-query tiles and meets at
// barriers around every stage, a chain of latencies (about 10 µs on the H200 for an 8-token
// query) for a few thousand multiply-adds. Here lane l holds the row's query columns
// 4l + 128c, the scores of the sequence's keys are warp sums of the lanes' partial products
// (key j's kept by lane j, so at most 32 keys), the softmax is the CPU's two-pass form (max,
// then exp and sum), and the lanes' output columns sum p_j·v_j over the keys. Keys are taken
// G at a time with their loads issued together (the last key repeated past the end, unused).
#define TERN_ATT_SHORT_MAX 32

template <int HD_CHUNKS>
__device__ void tern_attention_short_row(const float* __restrict__ q, long long q_off, long long q_ld,
                                         const float* __restrict__ k, long long k_off, long long k_ld,
                                         const float* __restrict__ v, long long v_off, long long v_ld,
                                         float* __restrict__ out, long long out_ld, tern_bf16* __restrict__ out16,
                                         const tern_u32* __restrict__ seg_start, const tern_u32* __restrict__ seg_len,
                                         const tern_u32* __restrict__ row_seg, int rows, int q_heads, int group, int hd,
                                         float scale, int max_distance) {
    constexpr int G = HD_CHUNKS == 4 ? 4 : 8;  // keys whose loads are in flight together
    const int lane = threadIdx.x % 32;
    const int task = (int)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (task >= rows * q_heads) return;
    const int row = task / q_heads, head = task % q_heads, kv_head = head / group;
    const int s = (int)row_seg[row];
    const long long start = seg_start[s];
    const int len = (int)seg_len[s], qi = row - (int)start;

    float4 qv[HD_CHUNKS];
#pragma unroll
    for (int c = 0; c < HD_CHUNKS; ++c) {
        const int col = 4 * lane + 128 * c;
        qv[c] = col < hd ? *(const float4*)(q + q_off + (long long)row * q_ld + (long long)head * hd + col) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float mine = -tern_inf();  // lane j: key j's scaled score, -inf where it is not seen
    for (int j0 = 0; j0 < len; j0 += G) {
        float d[G];
#pragma unroll
        for (int u = 0; u < G; ++u) {
            const long long at = k_off + (start + min(j0 + u, len - 1)) * k_ld + (long long)kv_head * hd;
            float acc = 0.f;
#pragma unroll
            for (int c = 0; c < HD_CHUNKS; ++c) {
                const int col = 4 * lane + 128 * c;
                if (col < hd) {
                    const float4 b = *(const float4*)(k + at + col);
                    acc += qv[c].x * b.x + qv[c].y * b.y + qv[c].z * b.z + qv[c].w * b.w;
                }
            }
            d[u] = acc;
        }
#pragma unroll
        for (int u = 0; u < G; ++u) {
            const float dot = tern_warp_sum(d[u]);
            const int j = j0 + u;
            if (lane == j && j < len && tern_att_visible(qi, j, len, max_distance)) mine = dot * scale;
        }
    }
    // Key qi itself is always seen, so the maximum is finite.
    const float m = tern_warp_max(mine);
    const float p = mine == -tern_inf() ? 0.f : expf(mine - m);
    const float l = tern_warp_sum(p);

    float4 acc[HD_CHUNKS];
#pragma unroll
    for (int c = 0; c < HD_CHUNKS; ++c) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j0 = 0; j0 < len; j0 += G) {
        float4 vv[G][HD_CHUNKS];
#pragma unroll
        for (int u = 0; u < G; ++u) {
            const long long at = v_off + (start + min(j0 + u, len - 1)) * v_ld + (long long)kv_head * hd;
#pragma unroll
            for (int c = 0; c < HD_CHUNKS; ++c) {
                const int col = 4 * lane + 128 * c;
                vv[u][c] = col < hd ? *(const float4*)(v + at + col) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
#pragma unroll
        for (int u = 0; u < G; ++u) {
            // p of a key past the end is lane j's 0.
            const float pj = __shfl_sync(0xffffffffu, p, (j0 + u) % 32);
            if (j0 + u < len) {
#pragma unroll
                for (int c = 0; c < HD_CHUNKS; ++c) {
                    acc[c].x += pj * vv[u][c].x;
                    acc[c].y += pj * vv[u][c].y;
                    acc[c].z += pj * vv[u][c].z;
                    acc[c].w += pj * vv[u][c].w;
                }
            }
        }
    }
    const float inv = 1.0f / l;
    const size_t o = (size_t)row * out_ld + (size_t)head * hd;
#pragma unroll
    for (int c = 0; c < HD_CHUNKS; ++c) {
        const int col = 4 * lane + 128 * c;
        if (col < hd) {
            const float r[4] = {acc[c].x * inv, acc[c].y * inv, acc[c].z * inv, acc[c].w * inv};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (out) out[o + col + j] = r[j];
                if (out16) out16[o + col + j] = tern_bf16_from_f32(r[j]);
            }
        }
    }
}

#define TERN_ATTENTION_SHORT_ENTRY(CHUNKS)                                                                               \
    extern "C" __global__ void __launch_bounds__(256) tern_attention_short_hd##CHUNKS(                                  \
        const float* q, long long q_off, long long q_ld, const float* k, long long k_off, long long k_ld, const float* v, \
        long long v_off, long long v_ld, float* out, long long out_ld, tern_bf16* out16, const tern_u32* seg_start,      \
        const tern_u32* seg_len, const tern_u32* row_seg, int rows, int q_heads, int group, int hd, float scale,          \
        int max_distance) { tern_await_prior_kernel();                                                                   \
        tern_attention_short_row<CHUNKS>(q, q_off, q_ld, k, k_off, k_ld, v, v_off, v_ld, out, out_ld, out16, seg_start,  \
                                         seg_len, row_seg, rows, q_heads, group, hd, scale, max_distance);               \
    }
TERN_ATTENTION_SHORT_ENTRY(1)
TERN_ATTENTION_SHORT_ENTRY(2)
TERN_ATTENTION_SHORT_ENTRY(4)
