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
//! Precision: the operands, the small matrices, W, U, Δ and the state are stored in f32, but
//! every dot product and every sum over a chunk accumulates in f64, and G is summed in f64.
//! The chunked form reaches each output through several more stages than the scan (A, the
//! substitution, W and U, Δ, the read-out, the state carry), and each stage is a sum of up to
//! 64 (tokens) or d_k products. In f32 such a sum has a worst-case error bound of about
//! n·2⁻²⁴ ≈ 4e−6 (n = 64) relative to the sum of magnitudes, and the substitution and the
//! chunk-to-chunk carry compound the stages, so f32 sums give no guaranteed margin under the
//! 1e−5 budget against the scan. Accumulated in f64, each stage costs one f32 rounding of its
//! result, and the measured difference to the scan (≤ 1.5e−7 in the tests, up to 4096
//! tokens) is the size of the scan's own f32 rounding.
//!
//! Work is split per (sequence, value head); chunks run in order within a task, carrying the
//! state in place. Lengths that are not multiples of 64 end with a short chunk.

use rayon::prelude::*;

use super::{check_delta_rule, dot_f64, DeltaRuleHeads, DeltaRuleInputs, Segment};
use crate::error::Result;
use crate::kernels::SharedMut;

/// Tokens per chunk: fla's block size, kept by every backend so their chunk boundaries agree.
pub const DELTA_RULE_CHUNK: usize = 64;

/// Per-task buffers, allocated once and reused across the task's chunks.
struct ChunkWork {
    k: Vec<f32>,     // [C][d_k]
    q: Vec<f32>,     // [C][d_k]
    w: Vec<f32>,     // [C][d_k]
    u_t: Vec<f32>,   // [d_v][C]: U transposed, so a state row's column of U is contiguous
    a: Vec<f32>,     // [C][C] strictly lower: the system matrix, then T
    qk: Vec<f32>,    // [C][C] lower: (q_r·k_c) exp(G_r − G_c)
    cum: Vec<f64>,   // [C] G_r
    from_start: Vec<f64>, // [C] exp(G_r): decay of the chunk's starting state up to token r
    to_end: Vec<f64>,     // [C] exp(G_{L−1} − G_c): decay from token c to the chunk's end
    delta: Vec<f32>, // [C] column j of Δ
    acc: Vec<f64>,   // [max(d_k, d_v)]
}

impl ChunkWork {
    fn new(d_k: usize, d_v: usize) -> Self {
        let c = DELTA_RULE_CHUNK;
        ChunkWork {
            k: vec![0.0; c * d_k],
            q: vec![0.0; c * d_k],
            w: vec![0.0; c * d_k],
            u_t: vec![0.0; d_v * c],
            a: vec![0.0; c * c],
            qk: vec![0.0; c * c],
            cum: vec![0.0; c],
            from_start: vec![0.0; c],
            to_end: vec![0.0; c],
            delta: vec![0.0; c],
            acc: vec![0.0; d_k.max(d_v)],
        }
    }
}

/// One chunk of one value head: tokens `t0 .. t0 + len` of the packed operands, `state` the
/// head's `[d_v][d_k]` rows (advanced in place), `out` the whole output buffer.
#[allow(clippy::too_many_arguments)]
fn delta_rule_chunk(
    heads: &DeltaRuleHeads,
    x: &DeltaRuleInputs,
    h: usize,
    t0: usize,
    len: usize,
    state: &mut [f32],
    work: &mut ChunkWork,
    out: SharedMut,
) {
    let DeltaRuleHeads { n_k_heads, n_v_heads, d_k, d_v, .. } = *heads;
    let kh = heads.key_head_of(h);
    let stride = DELTA_RULE_CHUNK; // row stride of the [C][C] matrices
    let ChunkWork { k, q, w, u_t, a, qk, cum, from_start, to_end, delta, acc } = work;

    // Gather the chunk's operands; G summed in f64 so that differences of nearby prefix sums
    // keep the small per-token terms.
    let mut g_sum = 0.0f64;
    let mut beta = [0.0f64; DELTA_RULE_CHUNK];
    for r in 0..len {
        let t = t0 + r;
        let src = (t * n_k_heads + kh) * d_k;
        k[r * d_k..(r + 1) * d_k].copy_from_slice(&x.k[src..src + d_k]);
        q[r * d_k..(r + 1) * d_k].copy_from_slice(&x.q[src..src + d_k]);
        g_sum += x.g[t * n_v_heads + h] as f64;
        cum[r] = g_sum;
        beta[r] = x.beta[t * n_v_heads + h] as f64;
    }
    let last = len - 1;
    for r in 0..len {
        from_start[r] = cum[r].exp();
        to_end[r] = (cum[last] - cum[r]).exp();
    }
    let k = &k[..len * d_k];
    let q = &q[..len * d_k];
    let k_row = |r: usize| &k[r * d_k..(r + 1) * d_k];
    let q_row = |r: usize| &q[r * d_k..(r + 1) * d_k];

    // A (strictly lower) and the read-out weights (lower, diagonal included).
    for r in 0..len {
        for c in 0..=r {
            let decay = (cum[r] - cum[c]).exp();
            if c < r {
                a[r * stride + c] = (beta[r] * dot_f64(k_row(r), k_row(c)) * decay) as f32;
            }
            qk[r * stride + c] = (dot_f64(q_row(r), k_row(c)) * decay) as f32;
        }
    }

    // T = (I + A)⁻¹ by forward substitution, overwriting A's strictly lower part (T's diagonal
    // is 1 and implicit): (I + A)·T = I gives, for c < r,
    // T[r][c] = −(A[r][c] + Σ_{c<m<r} A[r][m]·T[m][c]). Row r needs rows < r of T, already
    // final, and entries m > c of row r of A; walking c upward replaces A[r][c] only after
    // every entry of the row that still needs it has been computed.
    for r in 1..len {
        for c in 0..r {
            let mut s = a[r * stride + c] as f64;
            for m in c + 1..r {
                s += a[r * stride + m] as f64 * a[m * stride + c] as f64;
            }
            a[r * stride + c] = (-s) as f32;
        }
    }
    let t_at = |r: usize, c: usize| -> f64 {
        if r == c {
            1.0
        } else {
            a[r * stride + c] as f64
        }
    };

    // W = T·diag(β exp(G))·K and U = T·diag(β)·V, rows r = Σ_{c≤r} T[r][c]·(…)_c.
    for r in 0..len {
        let acc_k = &mut acc[..d_k];
        acc_k.iter_mut().for_each(|e| *e = 0.0);
        for c in 0..=r {
            let f = t_at(r, c) * beta[c] * from_start[c];
            acc_k.iter_mut().zip(k_row(c)).for_each(|(e, &kv)| *e += f * kv as f64);
        }
        w[r * d_k..(r + 1) * d_k].iter_mut().zip(acc_k.iter()).for_each(|(o, &e)| *o = e as f32);

        let acc_v = &mut acc[..d_v];
        acc_v.iter_mut().for_each(|e| *e = 0.0);
        for c in 0..=r {
            let f = t_at(r, c) * beta[c];
            let src = ((t0 + c) * n_v_heads + h) * d_v;
            acc_v.iter_mut().zip(&x.v[src..src + d_v]).for_each(|(e, &vv)| *e += f * vv as f64);
        }
        for j in 0..d_v {
            u_t[j * stride + r] = acc_v[j] as f32;
        }
    }

    // Per state row j (column j of S₀): Δ's column, the outputs' column, then the row's update.
    // Everything reads the chunk's starting row before the update overwrites it.
    let keep = from_start[last];
    for (j, s_row) in state.chunks_exact_mut(d_k).enumerate() {
        for r in 0..len {
            delta[r] = (u_t[j * stride + r] as f64 - dot_f64(&w[r * d_k..(r + 1) * d_k], s_row)) as f32;
        }
        for r in 0..len {
            let mut o = from_start[r] * dot_f64(q_row(r), s_row);
            for c in 0..=r {
                o += qk[r * stride + c] as f64 * delta[c] as f64;
            }
            let dst = ((t0 + r) * n_v_heads + h) * d_v + j;
            // SAFETY: segments are disjoint (checked) and each task owns one value head, so
            // this element is written by this task alone; `out` has that length (checked).
            unsafe { *out.ptr().add(dst) = o as f32 };
        }
        let acc_k = &mut acc[..d_k];
        acc_k.iter_mut().zip(s_row.iter()).for_each(|(e, &s)| *e = keep * s as f64);
        for c in 0..len {
            let f = to_end[c] * delta[c] as f64;
            acc_k.iter_mut().zip(k_row(c)).for_each(|(e, &kv)| *e += f * kv as f64);
        }
        s_row.iter_mut().zip(acc_k.iter()).for_each(|(s, &e)| *s = e as f32);
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
            let end = seg.start + seg.len;
            for t0 in (seg.start..end).step_by(DELTA_RULE_CHUNK) {
                let len = DELTA_RULE_CHUNK.min(end - t0);
                delta_rule_chunk(heads, &inputs, h, t0, len, state, work, out);
            }
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
