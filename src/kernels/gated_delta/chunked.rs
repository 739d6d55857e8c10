//! Chunked prefill of the delta rule: the same outputs and final state as the sequential scan
//! ([`super::delta_rule_scan`], its oracle), computed chunk by chunk in matrix form with the
//! UT transform (the WY representation of fla's `chunk_gated_delta_rule`).
//!
//! Within a chunk of L ≤ 64 tokens starting from state `S₀` (`[d_k][d_v]`), let
//! `G_r = g_0 + … + g_r` be the cumulative log-decay and `δ_r` the sequential scan's correction
//! at token r. Unrolling the recurrence gives a unit lower-triangular system for the δ's:
//!
//! ```text
//! A[r][c] = β_r (k_r·k_c) exp(G_r − G_c)            c < r   (strictly lower)
//! T       = (I + A)⁻¹                                forward substitution
//! W       = T · diag(β exp(G)) · K                   [L][d_k]
//! U       = T · diag(β) · V                          [L][d_v]
//! Δ       = U − W·S₀                                 row r is δ_r
//! o_r     = exp(G_r)·S₀ᵀq_r + Σ_{c≤r} (q_r·k_c) exp(G_r − G_c) δ_c
//! S_L     = exp(G_{L−1})·S₀ + Σ_c exp(G_{L−1} − G_c) k_c δ_cᵀ
//! ```
//!
//! Overflow: every exponent is `G_r` or a difference `G_r − G_c` with `c ≤ r`, never a lone
//! `−G_c`. With `g ≤ 0` (the decay gate's sign) those are all ≤ 0, so the factors lie in
//! [0, 1] and at worst underflow to 0 over a long chunk, which is the true value's limit.
//! (A form that divides by `exp(G_c)` overflows f32 after a few dozen strongly decaying tokens.)
//!
//! Precision: every stage is computed in f64 — the chunk's operands are widened once, the
//! small matrices, W, U, Δ and the outputs are f64, G is summed in f64, and a task carries its
//! head's state in f64 from chunk to chunk, rounding to f32 only when it writes an output or
//! the final state. The chunked form reaches each output through several more stages than the
//! scan (A, the substitution, W and U, Δ, the read-out, the state carry), and each stage is a sum
//! of up to 64 (tokens) or d_k products. In f32 such a sum has a worst-case error bound of about
//! n·2⁻²⁴ ≈ 4e−6 (n = 64) relative to the sum of magnitudes, and the substitution and the
//! chunk-to-chunk carry compound the stages, so f32 sums give no guaranteed margin under the
//! 1e−5 budget against the scan. In f64 the measured difference to the scan (≤ 1.5e−7 in the
//! tests, up to 4096 tokens) is the size of the scan's own f32 rounding.
//!
//! Speed: at the released head size (d_k = d_v = 128) nearly all the work is seven products of
//! [64 × 128]-sized matrices per chunk (KKᵀ, QKᵀ, W, U, Δ, the read-out and the state update),
//! which run as f64 GEMMs; only the substitution (64³/6 multiply-adds) is a plain loop.
//!
//! Work is split per (sequence, value head); chunks run in order within a task, carrying the
//! state in place. Lengths that are not multiples of 64 end with a short chunk.

use rayon::prelude::*;

use super::{check_delta_rule, DeltaRuleHeads, DeltaRuleInputs, Segment};
use crate::error::Result;
use crate::kernels::SharedMut;

/// Tokens per chunk: fla's block size, kept by every backend so their chunk boundaries agree.
pub const DELTA_RULE_CHUNK: usize = 64;

/// Per-task buffers, allocated once and reused across the task's chunks. Row strides are the
/// full sizes (C, d_k, d_v) whatever the chunk's length.
struct ChunkWork {
    k: Vec<f64>,  // [C][d_k] keys
    q: Vec<f64>,  // [C][d_k] queries, then scaled by exp(G_r)
    kb: Vec<f64>, // [C][d_k] β_c exp(G_c) k_c
    ke: Vec<f64>, // [C][d_k] exp(G_{L−1} − G_c) k_c
    v: Vec<f64>,  // [C][d_v] β_c v_c
    w: Vec<f64>,  // [C][d_k] W
    d: Vec<f64>,  // [C][d_v] U, then Δ
    o: Vec<f64>,  // [C][d_v] outputs
    a: Vec<f64>,  // [C][C] KKᵀ, then A, then T (unit lower, zeros above)
    qk: Vec<f64>, // [C][C] QKᵀ, then (q_r·k_c) exp(G_r − G_c) on c ≤ r, zeros above
    s: Vec<f64>,  // [d_v][d_k] the head's state, carried across chunks
}

impl ChunkWork {
    fn new(d_k: usize, d_v: usize) -> Self {
        let c = DELTA_RULE_CHUNK;
        let z = |n: usize| vec![0.0f64; n];
        ChunkWork {
            k: z(c * d_k),
            q: z(c * d_k),
            kb: z(c * d_k),
            ke: z(c * d_k),
            v: z(c * d_v),
            w: z(c * d_k),
            d: z(c * d_v),
            o: z(c * d_v),
            a: z(c * c),
            qk: z(c * c),
            s: z(d_v * d_k),
        }
    }
}

/// `dst = alpha·dst + beta·lhs·rhs` for [m × k]·[k × n] f64 operands given by (row stride, column
/// stride), on the calling thread (the tasks already run one per head in parallel).
///
/// # Safety
/// Every index the strides reach for m, n, k lies inside its buffer; dst does not alias lhs, rhs.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm64(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f64,
    dst_rs: usize,
    dst_cs: usize,
    alpha: f64,
    lhs: *const f64,
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: *const f64,
    rhs_rs: usize,
    rhs_cs: usize,
    beta: f64,
) {
    gemm::gemm(
        m, n, k, dst, dst_cs as isize, dst_rs as isize, alpha != 0.0, lhs, lhs_cs as isize, lhs_rs as isize, rhs,
        rhs_cs as isize, rhs_rs as isize, alpha, beta, false, false, false, gemm::Parallelism::None,
    );
}

/// One chunk of one value head: tokens `t0 .. t0 + len` of the packed operands; `work.s` holds
/// the head's state `[d_v][d_k]` in f64 and is advanced in place; `out` is the whole output.
fn delta_rule_chunk(
    heads: &DeltaRuleHeads,
    x: &DeltaRuleInputs,
    h: usize,
    t0: usize,
    len: usize,
    work: &mut ChunkWork,
    out: SharedMut,
) {
    let DeltaRuleHeads { n_k_heads, n_v_heads, d_k, d_v, .. } = *heads;
    let kh = heads.key_head_of(h);
    let cs = DELTA_RULE_CHUNK; // row stride of the [C][C] matrices
    let ChunkWork { k, q, kb, ke, v, w, d, o, a, qk, s } = work;

    // Gather and widen the chunk's operands; G summed in f64 so that differences of nearby
    // prefix sums keep the small per-token terms.
    let mut cum = [0.0f64; DELTA_RULE_CHUNK];
    let mut beta = [0.0f64; DELTA_RULE_CHUNK];
    let mut g_sum = 0.0f64;
    for r in 0..len {
        let t = t0 + r;
        let src = (t * n_k_heads + kh) * d_k;
        for i in 0..d_k {
            k[r * d_k + i] = x.k[src + i] as f64;
            q[r * d_k + i] = x.q[src + i] as f64;
        }
        g_sum += x.g[t * n_v_heads + h] as f64;
        cum[r] = g_sum;
        beta[r] = x.beta[t * n_v_heads + h] as f64;
        let vs = (t * n_v_heads + h) * d_v;
        for j in 0..d_v {
            v[r * d_v + j] = beta[r] * x.v[vs + j] as f64;
        }
    }
    let last = len - 1;
    let from_start: [f64; DELTA_RULE_CHUNK] = std::array::from_fn(|r| if r < len { cum[r].exp() } else { 0.0 });

    // SAFETY (every gemm64 below): the operands are the work buffers, sized for a full chunk of
    // C rows with the row strides given, and len ≤ C; no destination aliases its sources.
    unsafe {
        // KKᵀ and QKᵀ: [len × len], contracting over d_k.
        gemm64(len, len, d_k, a.as_mut_ptr(), cs, 1, 0.0, k.as_ptr(), d_k, 1, k.as_ptr(), 1, d_k, 1.0);
        gemm64(len, len, d_k, qk.as_mut_ptr(), cs, 1, 0.0, q.as_ptr(), d_k, 1, k.as_ptr(), 1, d_k, 1.0);
    }
    // A = β_r (k_r·k_c) exp(G_r − G_c) strictly below the diagonal; the read-out weights on and
    // below it. Zeros above, so both can enter full products.
    for r in 0..len {
        for c in 0..len {
            if c <= r {
                let decay = (cum[r] - cum[c]).exp();
                a[r * cs + c] = if c < r { beta[r] * a[r * cs + c] * decay } else { 0.0 };
                qk[r * cs + c] *= decay;
            } else {
                a[r * cs + c] = 0.0;
                qk[r * cs + c] = 0.0;
            }
        }
    }
    // T = (I + A)⁻¹ by forward substitution, in place: (I + A)·T = I gives, for c < r,
    // T[r][c] = −(A[r][c] + Σ_{c<m<r} A[r][m]·T[m][c]). Row r needs rows < r of T, already
    // final, and entries m > c of row r of A; walking c upward replaces A[r][c] only after
    // every entry of the row that still needs it has been computed. Then the unit diagonal.
    for r in 1..len {
        for c in 0..r {
            let mut acc = a[r * cs + c];
            for m in c + 1..r {
                acc += a[r * cs + m] * a[m * cs + c];
            }
            a[r * cs + c] = -acc;
        }
    }
    for r in 0..len {
        a[r * cs + r] = 1.0;
    }
    // Row scalings: kb_c = β_c exp(G_c) k_c, ke_c = exp(G_{L−1} − G_c) k_c, q_r ← exp(G_r) q_r.
    for r in 0..len {
        let (fb, fe) = (beta[r] * from_start[r], (cum[last] - cum[r]).exp());
        for i in 0..d_k {
            let kv = k[r * d_k + i];
            kb[r * d_k + i] = fb * kv;
            ke[r * d_k + i] = fe * kv;
            q[r * d_k + i] *= from_start[r];
        }
    }
    let keep = from_start[last];
    // SAFETY: as above; `out` rows t0..t0+len of head h are this task's alone (segments are
    // disjoint, checked, and each task owns one value head).
    unsafe {
        // W = T·diag(β exp(G))·K, U = T·diag(β)·V.
        gemm64(len, d_k, len, w.as_mut_ptr(), d_k, 1, 0.0, a.as_ptr(), cs, 1, kb.as_ptr(), d_k, 1, 1.0);
        gemm64(len, d_v, len, d.as_mut_ptr(), d_v, 1, 0.0, a.as_ptr(), cs, 1, v.as_ptr(), d_v, 1, 1.0);
        // Δ = U − W·S₀ (S₀ element (i, j) is s[j][i]).
        gemm64(len, d_v, d_k, d.as_mut_ptr(), d_v, 1, 1.0, w.as_ptr(), d_k, 1, s.as_ptr(), 1, d_k, -1.0);
        // o_r = exp(G_r)·S₀ᵀq_r + Σ_{c≤r} (q_r·k_c) exp(G_r − G_c) δ_c.
        gemm64(len, d_v, d_k, o.as_mut_ptr(), d_v, 1, 0.0, q.as_ptr(), d_k, 1, s.as_ptr(), 1, d_k, 1.0);
        gemm64(len, d_v, len, o.as_mut_ptr(), d_v, 1, 1.0, qk.as_ptr(), cs, 1, d.as_ptr(), d_v, 1, 1.0);
        // S_L = exp(G_{L−1})·S₀ + Σ_c exp(G_{L−1} − G_c) k_c δ_cᵀ, as s[j][i] += Σ_c δ_c[j]·ke_c[i].
        gemm64(d_v, d_k, len, s.as_mut_ptr(), d_k, 1, keep, d.as_ptr(), 1, d_v, ke.as_ptr(), d_k, 1, 1.0);
        for r in 0..len {
            let dst = out.ptr().add(((t0 + r) * n_v_heads + h) * d_v);
            for j in 0..d_v {
                *dst.add(j) = o[r * d_v + j] as f32;
            }
        }
    }
}

/// The chunked prefill over a packed batch, with the operands, segments and states of
/// [`super::delta_rule_scan`] and the same results (to f32 rounding: ‖Δ‖/‖ref‖ ≤ 1e−5).
/// `g` must be ≤ 0 (as [`super::decay_gate`] makes it with a negative `a`).
pub fn delta_rule_chunked(
    heads: &DeltaRuleHeads,
    inputs: DeltaRuleInputs,
    segments: &[Segment],
    states: &mut [&mut [f32]],
    out: &mut [f32],
) -> Result<()> {
    check_delta_rule("delta_rule_chunked", heads, &inputs, segments, states, out)?;
    let (d_k, d_v) = (heads.d_k, heads.d_v);
    let out = SharedMut(out.as_mut_ptr());
    let mut tasks: Vec<(Segment, usize, &mut [f32])> = Vec::new();
    for (&seg, state) in segments.iter().zip(states.iter_mut()) {
        if seg.len > 0 {
            tasks.extend(state.chunks_mut(d_v * d_k).enumerate().map(|(h, s)| (seg, h, s)));
        }
    }
    tasks.into_par_iter().for_each_init(
        || ChunkWork::new(d_k, d_v),
        |work, (seg, h, state)| {
            work.s.iter_mut().zip(state.iter()).for_each(|(w, &v)| *w = v as f64);
            let end = seg.start + seg.len;
            for t0 in (seg.start..end).step_by(DELTA_RULE_CHUNK) {
                let len = DELTA_RULE_CHUNK.min(end - t0);
                delta_rule_chunk(heads, &inputs, h, t0, len, work, out);
            }
            state.iter_mut().zip(work.s.iter()).for_each(|(v, &w)| *v = w as f32);
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::recurrence::tests::{split, Operands};
    use super::super::test_util::{rel_err, Lcg};
    use super::super::{delta_rule_scan, KeyHeadMap};
    use super::*;
    use crate::error::Error;
    use crate::kernels::pack;

    /// Runs both forms from the same non-zero initial states and returns the worst relative
    /// error (output, state).
    fn compare(rng: &mut Lcg, heads: &DeltaRuleHeads, lengths: &[usize]) -> (f64, f64) {
        let tokens: usize = lengths.iter().sum();
        let x = Operands::random(rng, heads, tokens);
        let init = rng.vec(lengths.len() * heads.state_len(), -0.5, 0.5);
        let segments = pack(lengths.iter().copied());
        let n = tokens * heads.n_v_heads * heads.d_v;

        let mut scan_state = init.clone();
        let mut scan_out = vec![f32::NAN; n];
        delta_rule_scan(heads, x.inputs(), &segments, &mut split(&mut scan_state, heads.state_len()), &mut scan_out).unwrap();
        let mut chunk_state = init.clone();
        let mut chunk_out = vec![f32::NAN; n];
        delta_rule_chunked(heads, x.inputs(), &segments, &mut split(&mut chunk_state, heads.state_len()), &mut chunk_out)
            .unwrap();

        let (mut eo, mut es) = (0.0f64, 0.0f64);
        let (od, sd) = (heads.n_v_heads * heads.d_v, heads.state_len());
        for (s, seg) in segments.iter().enumerate() {
            let o = seg.start * od..(seg.start + seg.len) * od;
            eo = eo.max(rel_err(&chunk_out[o.clone()], &scan_out[o]));
            es = es.max(rel_err(&chunk_state[s * sd..(s + 1) * sd], &scan_state[s * sd..(s + 1) * sd]));
        }
        (eo, es)
    }

    /// The chunked prefill equals the sequential scan within 1e−5 relative (outputs per
    /// sequence, final states per sequence) for lengths around the chunk size and long
    /// sequences, from non-zero initial states, several sequences at once.
    #[test]
    fn chunked_equals_scan() {
        let mut rng = Lcg(2024);
        let cases: &[(usize, usize, usize, KeyHeadMap, &[usize])] = &[
            (2, 4, 32, KeyHeadMap::Grouped, &[1, 2, 63, 64, 65]),
            (2, 4, 16, KeyHeadMap::Tiled, &[127, 128, 300]),
            (1, 2, 128, KeyHeadMap::Grouped, &[65, 130]),
            (1, 2, 16, KeyHeadMap::Grouped, &[1000, 4096]),
            (2, 4, 64, KeyHeadMap::Tiled, &[200]),
        ];
        let mut worst = (0.0f64, 0.0f64);
        for &(nk, nv, d, key_head, lengths) in cases {
            let heads = DeltaRuleHeads { n_k_heads: nk, n_v_heads: nv, d_k: d, d_v: d, key_head };
            let (eo, es) = compare(&mut rng, &heads, lengths);
            eprintln!("chunked vs scan nk {nk} nv {nv} d {d} lengths {lengths:?}: output {eo:.3e}, state {es:.3e}");
            assert!(eo <= 1e-5 && es <= 1e-5, "lengths {lengths:?}: output {eo:e}, state {es:e}");
            worst = (worst.0.max(eo), worst.1.max(es));
        }
        // Unequal key and value head sizes.
        let heads = DeltaRuleHeads { n_k_heads: 2, n_v_heads: 4, d_k: 24, d_v: 40, key_head: KeyHeadMap::Grouped };
        let (eo, es) = compare(&mut rng, &heads, &[70, 5]);
        assert!(eo <= 1e-5 && es <= 1e-5, "d_k ≠ d_v: output {eo:e}, state {es:e}");
        eprintln!("chunked vs scan worst: output {:.3e}, state {:.3e}", worst.0.max(eo), worst.1.max(es));
    }

    /// Strong decays (g down to about −100 per token) must not overflow: every factor is an
    /// exp of a non-positive difference.
    #[test]
    fn chunked_survives_strong_decay() {
        let mut rng = Lcg(77);
        let heads = DeltaRuleHeads { n_k_heads: 1, n_v_heads: 2, d_k: 16, d_v: 16, key_head: KeyHeadMap::Grouped };
        let tokens = 150;
        let mut x = Operands::random(&mut rng, &heads, tokens);
        x.g.iter_mut().enumerate().for_each(|(i, g)| *g = if i % 3 == 0 { -100.0 } else { -5.0 });
        let init = rng.vec(heads.state_len(), -0.5, 0.5);
        let (mut s1, mut s2) = (init.clone(), init);
        let (mut o1, mut o2) = (vec![0.0f32; tokens * 32], vec![0.0f32; tokens * 32]);
        delta_rule_scan(&heads, x.inputs(), &pack([tokens]), &mut [&mut s1[..]], &mut o1).unwrap();
        delta_rule_chunked(&heads, x.inputs(), &pack([tokens]), &mut [&mut s2[..]], &mut o2).unwrap();
        assert!(o2.iter().chain(&s2).all(|v| v.is_finite()));
        assert!(rel_err(&o2, &o1) <= 1e-5 && rel_err(&s2, &s1) <= 1e-5);
    }

    #[test]
    fn chunked_shape_errors() {
        let heads = DeltaRuleHeads { n_k_heads: 2, n_v_heads: 4, d_k: 8, d_v: 8, key_head: KeyHeadMap::Tiled };
        let mut rng = Lcg(1);
        let x = Operands::random(&mut rng, &heads, 3);
        let mut st = vec![0.0f32; 2 * heads.state_len()];
        let mut out = vec![0.0f32; 3 * 4 * 8];
        let err = |r: Result<()>| assert!(matches!(r, Err(Error::Shape(_))), "{r:?}");
        let short = DeltaRuleInputs { beta: &x.beta[1..], ..x.inputs() };
        err(delta_rule_chunked(&heads, short, &pack([3]), &mut split(&mut st[..heads.state_len()], heads.state_len()), &mut out));
        err(delta_rule_chunked(&heads, x.inputs(), &pack([2, 2]), &mut split(&mut st, heads.state_len()), &mut out));
        err(delta_rule_chunked(&heads, x.inputs(), &pack([1, 2]), &mut split(&mut st[1..], heads.state_len()), &mut out));
        err(delta_rule_chunked(&heads, x.inputs(), &pack([3]), &mut split(&mut st, heads.state_len()), &mut out));
    }
}
