//! The delta-rule recurrence, one token at a time: decode ([`delta_rule_step`]) and the
//! sequential scan ([`delta_rule_scan`]), the permanent oracle of the chunked prefill.
//!
//! Per token t and value head h, with `S_h` the `[d_k][d_v]` state (`i` over keys, `j` over
//! values) and k, q of the key head that h reads:
//!
//! ```text
//! S      ← exp(g_t) · S                       decay
//! kv_j   = Σ_i S[i][j] · k_i                   what the state predicts for key k
//! δ_j    = (v_j − kv_j) · β_t                  the correction
//! S[i][j] += k_i · δ_j                         rank-1 write
//! o_j    = Σ_i S[i][j] · q_i                   read-out after the write
//! ```
//!
//! In the transposed layout row j of the state is `S[·][j]`, so every line above is, per row, a
//! contiguous scale, dot, axpy and dot that needs only this token's k, q, v_j, g and β: the
//! rows never interact. Both dots go through one fixed-order routine, and the decode step is the
//! scan over one-token segments through the same launcher and the same per-position routine,
//! so n steps and one scan of n tokens agree bit for bit. q is expected pre-scaled by `1/√d_k`
//! (see [`super::normalize_qk`]); no scale is applied here, so it cannot be applied twice.

use rayon::prelude::*;

use super::{check_delta_rule, dot_f32, DeltaRuleHeads, DeltaRuleInputs, Segment};
use crate::error::Result;
use crate::kernels::SharedMut;

/// Below this many state-element updates the launch stays on the calling thread.
const RECURRENCE_PARALLEL_WORK: usize = 1 << 16;

/// One token of one value head: `state` is that head's `[d_v][d_k]` rows, `q`, `k` its key
/// head's vectors (`d_k`), `v` and `out` its `d_v` values.
#[inline]
fn delta_rule_position(state: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32, out: &mut [f32]) {
    let d_k = k.len();
    let decay = g.exp();
    for (j, row) in state.chunks_exact_mut(d_k).enumerate() {
        row.iter_mut().for_each(|s| *s *= decay);
        let delta = (v[j] - dot_f32(row, k)) * beta;
        row.iter_mut().zip(k).for_each(|(s, &ki)| *s += ki * delta);
        out[j] = dot_f32(row, q);
    }
}

/// The one launcher of both forms: every (sequence, value head) is a task that walks its
/// segment's tokens in order on that head's slice of the sequence's state.
pub(super) fn launch_delta_rule(
    what: &str,
    heads: &DeltaRuleHeads,
    x: &DeltaRuleInputs,
    segments: &[Segment],
    states: &mut [&mut [f32]],
    out: &mut [f32],
) -> Result<()> {
    check_delta_rule(what, heads, x, segments, states, out)?;
    let DeltaRuleHeads { n_k_heads, n_v_heads, d_k, d_v, .. } = *heads;
    let out = SharedMut(out.as_mut_ptr());
    let mut tasks: Vec<(Segment, usize, &mut [f32])> = Vec::new();
    for (&seg, state) in segments.iter().zip(states.iter_mut()) {
        if seg.len > 0 {
            tasks.extend(state.chunks_mut(d_v * d_k).enumerate().map(|(h, s)| (seg, h, s)));
        }
    }
    let run = |(seg, h, state): (Segment, usize, &mut [f32])| {
        let kh = heads.key_head_of(h);
        for t in seg.start..seg.start + seg.len {
            let qk = (t * n_k_heads + kh) * d_k;
            let vo = (t * n_v_heads + h) * d_v;
            let gb = t * n_v_heads + h;
            // SAFETY: segments are disjoint (checked) and each task owns one value head, so
            // rows vo..vo + d_v are written by this task alone; `out` has that length (checked).
            let o = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(vo), d_v) };
            delta_rule_position(
                state,
                &x.q[qk..qk + d_k],
                &x.k[qk..qk + d_k],
                &x.v[vo..vo + d_v],
                x.g[gb],
                x.beta[gb],
                o,
            );
        }
    };
    let work = segments.iter().map(|s| s.len).sum::<usize>() * heads.state_len();
    if work >= RECURRENCE_PARALLEL_WORK && tasks.len() > 1 {
        tasks.into_par_iter().for_each(run);
    } else {
        tasks.into_iter().for_each(run);
    }
    Ok(())
}

/// One decode token for each of several sequences: row `s` of every operand (`q`, `k`:
/// `[n_seqs][n_k_heads][d_k]`; `v`, `out`: `[n_seqs][n_v_heads][d_v]`; `g`, `beta`:
/// `[n_seqs][n_v_heads]`) belongs to sequence `s`, whose state `states[s]`
/// (`[n_v_heads][d_v][d_k]`, transposed) is advanced in place.
pub fn delta_rule_step(
    heads: &DeltaRuleHeads,
    inputs: DeltaRuleInputs,
    states: &mut [&mut [f32]],
    out: &mut [f32],
) -> Result<()> {
    heads.validate()?;
    // One row per state: the launcher alone would accept extra rows and leave them untouched.
    super::check_len("delta_rule_step q", inputs.q.len(), states.len() * heads.n_k_heads * heads.d_k)?;
    let segments = crate::kernels::pack(std::iter::repeat_n(1, states.len()));
    launch_delta_rule("delta_rule_step", heads, &inputs, &segments, states, out)
}

/// The sequential scan over a packed batch: sequence `s` owns token rows `segments[s]` of
/// every operand and advances `states[s]` through them in order. Rows outside every segment
/// are left untouched in `out`.
pub fn delta_rule_scan(
    heads: &DeltaRuleHeads,
    inputs: DeltaRuleInputs,
    segments: &[Segment],
    states: &mut [&mut [f32]],
    out: &mut [f32],
) -> Result<()> {
    launch_delta_rule("delta_rule_scan", heads, &inputs, segments, states, out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::test_util::{assert_bits_eq, rel_err, Lcg};
    use super::super::{decay_gate, normalize_qk, KeyHeadMap};
    use super::*;
    use crate::error::Error;
    use crate::kernels::pack;

    /// Model-like random operands for `tokens` rows: q, k L2-normalised (q scaled), g from the
    /// decay gate over a wide range of pre-activations, β in (0, 1), v in [−1, 1].
    pub(crate) struct Operands {
        pub q: Vec<f32>,
        pub k: Vec<f32>,
        pub v: Vec<f32>,
        pub g: Vec<f32>,
        pub beta: Vec<f32>,
    }

    impl Operands {
        pub(crate) fn random(rng: &mut Lcg, heads: &DeltaRuleHeads, tokens: usize) -> Self {
            let qk = tokens * heads.n_k_heads * heads.d_k;
            let mut q = rng.vec(qk, -1.0, 1.0);
            let mut k = rng.vec(qk, -1.0, 1.0);
            normalize_qk(&mut q, &mut k, heads.d_k).unwrap();
            let v = rng.vec(tokens * heads.n_v_heads * heads.d_v, -1.0, 1.0);
            let alpha = rng.vec(tokens * heads.n_v_heads, -6.0, 3.0);
            let dt = rng.vec(heads.n_v_heads, -1.0, 1.0);
            let a: Vec<f32> = (0..heads.n_v_heads).map(|_| -rng.range(-2.0, 1.0).exp()).collect();
            let mut g = vec![0.0; alpha.len()];
            decay_gate(&alpha, &dt, &a, &mut g).unwrap();
            let beta = rng.vec(tokens * heads.n_v_heads, 0.0, 1.0);
            Operands { q, k, v, g, beta }
        }

        pub(crate) fn inputs(&self) -> DeltaRuleInputs<'_> {
            DeltaRuleInputs { q: &self.q, k: &self.k, v: &self.v, g: &self.g, beta: &self.beta }
        }

        /// Token row t alone.
        fn row(&self, heads: &DeltaRuleHeads, t: usize) -> Operands {
            let (qk, v, n) = (heads.n_k_heads * heads.d_k, heads.n_v_heads * heads.d_v, heads.n_v_heads);
            Operands {
                q: self.q[t * qk..(t + 1) * qk].to_vec(),
                k: self.k[t * qk..(t + 1) * qk].to_vec(),
                v: self.v[t * v..(t + 1) * v].to_vec(),
                g: self.g[t * n..(t + 1) * n].to_vec(),
                beta: self.beta[t * n..(t + 1) * n].to_vec(),
            }
        }
    }

    pub(crate) fn split(buf: &mut [f32], per: usize) -> Vec<&mut [f32]> {
        buf.chunks_mut(per).collect()
    }

    /// The scan over a packed batch equals the same tokens fed through decode steps, bit for
    /// bit, in outputs and states; decode steps batch several sequences at once.
    #[test]
    fn recurrence_scan_equals_steps_bit_for_bit() {
        let mut rng = Lcg(42);
        for &(nk, nv, d) in &[(2usize, 4usize, 16usize), (2, 4, 32), (4, 8, 64), (1, 2, 128), (2, 2, 48)] {
            for key_head in [KeyHeadMap::Grouped, KeyHeadMap::Tiled] {
                let heads = DeltaRuleHeads { n_k_heads: nk, n_v_heads: nv, d_k: d, d_v: d, key_head };
                let lengths = [9usize, 9, 9];
                let tokens: usize = lengths.iter().sum();
                let x = Operands::random(&mut rng, &heads, tokens);
                let init = rng.vec(lengths.len() * heads.state_len(), -0.5, 0.5);

                let mut scan_state = init.clone();
                let mut scan_out = vec![f32::NAN; tokens * nv * d];
                delta_rule_scan(&heads, x.inputs(), &pack(lengths), &mut split(&mut scan_state, heads.state_len()), &mut scan_out)
                    .unwrap();

                // Decode: step p advances every sequence by its p-th token in one batched call.
                let mut step_state = init.clone();
                let mut step_out = vec![f32::NAN; tokens * nv * d];
                for p in 0..9 {
                    let rows: Vec<Operands> = (0..3).map(|s| x.row(&heads, s * 9 + p)).collect();
                    let cat = |f: fn(&Operands) -> &Vec<f32>| rows.iter().flat_map(|r| f(r).iter().copied()).collect::<Vec<f32>>();
                    let batch = Operands {
                        q: cat(|r| &r.q),
                        k: cat(|r| &r.k),
                        v: cat(|r| &r.v),
                        g: cat(|r| &r.g),
                        beta: cat(|r| &r.beta),
                    };
                    let mut o = vec![f32::NAN; 3 * nv * d];
                    delta_rule_step(&heads, batch.inputs(), &mut split(&mut step_state, heads.state_len()), &mut o).unwrap();
                    for s in 0..3 {
                        let t = s * 9 + p;
                        step_out[t * nv * d..(t + 1) * nv * d].copy_from_slice(&o[s * nv * d..(s + 1) * nv * d]);
                    }
                }
                assert_bits_eq("recurrence output", &scan_out, &step_out);
                assert_bits_eq("recurrence state", &scan_state, &step_state);
            }
        }
    }

    /// The transposed-state scan against the recurrence written in f64 on the untransposed
    /// `S[i][j]`, with an explicit per-head key-head map and unequal d_k, d_v.
    #[test]
    fn recurrence_matches_textbook_form() {
        let mut rng = Lcg(9);
        for key_head in [KeyHeadMap::Grouped, KeyHeadMap::Tiled] {
            let heads = DeltaRuleHeads { n_k_heads: 2, n_v_heads: 6, d_k: 12, d_v: 20, key_head };
            let (dk, dv, nk, nv) = (12, 20, 2, 6);
            let tokens = 40;
            let x = Operands::random(&mut rng, &heads, tokens);
            let init = rng.vec(heads.state_len(), -0.5, 0.5);
            let mut state = init.clone();
            let mut out = vec![f32::NAN; tokens * nv * dv];
            delta_rule_scan(&heads, x.inputs(), &pack([tokens]), &mut [&mut state[..]], &mut out).unwrap();

            let mut want_out = vec![0.0f32; out.len()];
            let mut want_state = vec![0.0f32; init.len()];
            for h in 0..nv {
                let kh = if key_head == KeyHeadMap::Grouped { h / (nv / nk) } else { h % nk };
                let mut s = vec![vec![0.0f64; dv]; dk];
                for i in 0..dk {
                    for j in 0..dv {
                        s[i][j] = init[h * dv * dk + j * dk + i] as f64;
                    }
                }
                for t in 0..tokens {
                    let k = &x.k[(t * nk + kh) * dk..][..dk];
                    let q = &x.q[(t * nk + kh) * dk..][..dk];
                    let v = &x.v[(t * nv + h) * dv..][..dv];
                    let (decay, beta) = ((x.g[t * nv + h] as f64).exp(), x.beta[t * nv + h] as f64);
                    s.iter_mut().flatten().for_each(|e| *e *= decay);
                    for j in 0..dv {
                        let kv: f64 = (0..dk).map(|i| s[i][j] * k[i] as f64).sum();
                        let delta = (v[j] as f64 - kv) * beta;
                        (0..dk).for_each(|i| s[i][j] += k[i] as f64 * delta);
                        want_out[(t * nv + h) * dv + j] = (0..dk).map(|i| s[i][j] * q[i] as f64).sum::<f64>() as f32;
                    }
                }
                for i in 0..dk {
                    for j in 0..dv {
                        want_state[h * dv * dk + j * dk + i] = s[i][j] as f32;
                    }
                }
            }
            let (eo, es) = (rel_err(&out, &want_out), rel_err(&state, &want_state));
            eprintln!("recurrence vs f64 textbook ({key_head:?}): output {eo:.3e}, state {es:.3e}");
            assert!(eo < 1e-5 && es < 1e-5, "output {eo:e}, state {es:e}");
        }
    }

    #[test]
    fn recurrence_shape_errors() {
        let heads = DeltaRuleHeads { n_k_heads: 2, n_v_heads: 4, d_k: 8, d_v: 8, key_head: KeyHeadMap::Grouped };
        let mut rng = Lcg(1);
        let x = Operands::random(&mut rng, &heads, 3);
        let mut st = vec![0.0f32; heads.state_len()];
        let mut out = vec![0.0f32; 3 * 4 * 8];
        let err = |r: Result<()>| assert!(matches!(r, Err(Error::Shape(_))), "{r:?}");
        let short = DeltaRuleInputs { v: &x.v[1..], ..x.inputs() };
        err(delta_rule_scan(&heads, short, &pack([3]), &mut [&mut st[..]], &mut out));
        let short = DeltaRuleInputs { g: &x.g[1..], ..x.inputs() };
        err(delta_rule_scan(&heads, short, &pack([3]), &mut [&mut st[..]], &mut out));
        let short = DeltaRuleInputs { k: &x.k[8..], ..x.inputs() };
        err(delta_rule_scan(&heads, short, &pack([3]), &mut [&mut st[..]], &mut out));
        err(delta_rule_scan(&heads, x.inputs(), &pack([4]), &mut [&mut st[..]], &mut out));
        err(delta_rule_scan(&heads, x.inputs(), &pack([3]), &mut [&mut st[1..]], &mut out));
        err(delta_rule_scan(&heads, x.inputs(), &pack([3]), &mut [&mut st[..]], &mut out[1..]));
        err(delta_rule_scan(&heads, x.inputs(), &pack([1, 2]), &mut [&mut st[..]], &mut out));
        let bad = DeltaRuleHeads { n_k_heads: 3, ..heads };
        err(delta_rule_scan(&bad, x.inputs(), &pack([3]), &mut [&mut st[..]], &mut out));
        // Three decode rows but one state.
        err(delta_rule_step(&heads, x.inputs(), &mut [&mut st[..]], &mut out));
    }
}
