//! The per-token gates: the log-decay `g = a·softplus(α + dt)` and `β = sigmoid(b)`.
//!
//! `a` is the per-head negative coefficient as the checkpoint gives it after loading
//! (`−exp(A_log)`; GGUF `ssm_a` already stores that value): it is never exponentiated here.
//! With `a < 0` and softplus > 0, `g < 0` and the recurrence's decay `exp(g)` lies in (0, 1).
//!
//! softplus has two hazards:
//!
//! - Overflow. `exp(v)` overflows f32 above v ≈ 88.7, which would make softplus infinite, `g`
//!   −∞ and `exp(g)` exactly 0: the head's whole state would be wiped on the next token. Above
//!   the guard at 20, `softplus(v) − v = log1p(e^−v) < 2.1e−9`, far below an f32 ulp of v, so
//!   v itself is returned.
//! - Cancellation. `log(1 + x)` with `x = e^v` small loses x's low-order bits in the addition
//!   (and returns 0 once x is below half an ulp of 1). One token's decay would only be off by a
//!   sub-ulp amount, but the chunked prefill takes CUMULATIVE sums of g along a chunk, so a
//!   bias toward zero would add up instead of averaging out. For `x ≤ 1` the identity
//!   `log(1 + x) = 2·atanh(s)`, `s = x / (2 + x) ≤ 1/3`, summed as its odd series up to `s^15`,
//!   is free of cancellation (every term is positive) and truncates at `s^16/17 < 3e−9`
//!   relative. Above `x = 1` the addition absorbs nothing that matters and `log` is exact to an
//!   ulp. The series, rather than `f32::ln_1p`, keeps the formula one that every backend can
//!   spell the same way (GPU shading languages lack log1p).
//!
//! Below v ≈ −87.3, `e^v` and so `g` are subnormal in f32 and carry fewer significant bits;
//! `exp(g)` is exactly 1 there, so the lost precision changes nothing downstream.

use rayon::prelude::*;

use super::check_len;
use crate::error::{Error, Result};

/// Elements below this count are computed on the calling thread.
const PARALLEL_ELEMENTS: usize = 1 << 15;

/// Above this pre-activation softplus(v) is v to within 2.1e−9.
const SOFTPLUS_GUARD: f32 = 20.0;

/// `log(1 + e^v)`, guarded against overflow above 20 and free of cancellation for v ≤ 0.
#[inline]
pub fn softplus(v: f32) -> f32 {
    if v > SOFTPLUS_GUARD {
        return v;
    }
    let x = v.exp();
    if x > 1.0 {
        return (1.0 + x).ln();
    }
    let s = x / (2.0 + x);
    let s2 = s * s;
    let mut poly = 1.0f32 / 15.0;
    for c in [1.0f32 / 13.0, 1.0 / 11.0, 1.0 / 9.0, 1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0, 1.0] {
        poly = poly * s2 + c;
    }
    2.0 * s * poly
}

/// `1 / (1 + e^−b)`; for b → −∞ the divisor overflows to +∞ and the result is 0.
#[inline]
pub fn sigmoid(b: f32) -> f32 {
    1.0 / (1.0 + (-b).exp())
}

/// Log-decay `g[r][h] = a[h] · softplus(alpha[r][h] + dt_bias[h])` over rows of `n_heads`
/// values, where `n_heads = a.len()`; `alpha` and `g` are `[rows][n_heads]`.
pub fn decay_gate(alpha: &[f32], dt_bias: &[f32], a: &[f32], g: &mut [f32]) -> Result<()> {
    let n_heads = a.len();
    check_len("decay_gate dt_bias", dt_bias.len(), n_heads)?;
    check_len("decay_gate output", g.len(), alpha.len())?;
    if n_heads == 0 || alpha.len() % n_heads != 0 {
        return Err(Error::Shape(format!(
            "decay_gate: {} elements are not rows of {n_heads} heads",
            alpha.len()
        )));
    }
    let row = |(alpha, g): (&[f32], &mut [f32])| {
        for h in 0..n_heads {
            g[h] = a[h] * softplus(alpha[h] + dt_bias[h]);
        }
    };
    if alpha.len() >= PARALLEL_ELEMENTS {
        alpha.par_chunks(n_heads).zip(g.par_chunks_mut(n_heads)).for_each(row);
    } else {
        alpha.chunks(n_heads).zip(g.chunks_mut(n_heads)).for_each(row);
    }
    Ok(())
}

/// `beta = sigmoid(b)`, elementwise.
pub fn beta_gate(b: &[f32], beta: &mut [f32]) -> Result<()> {
    check_len("beta_gate output", beta.len(), b.len())?;
    let run = |(b, beta): (&[f32], &mut [f32])| {
        for (o, &x) in beta.iter_mut().zip(b) {
            *o = sigmoid(x);
        }
    };
    if b.len() >= PARALLEL_ELEMENTS {
        b.par_chunks(4096).zip(beta.par_chunks_mut(4096)).for_each(run);
    } else {
        run((b, beta));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn softplus_f64(v: f64) -> f64 {
        if v > 0.0 {
            v + (-v).exp().ln_1p()
        } else {
            v.exp().ln_1p()
        }
    }

    /// Spacing of f32 values below the smallest normal: results there can be no closer.
    const SUBNORMAL_ULP: f64 = 1.401298464324817e-45;

    /// alpha + dt over [−100, 100] in steps of 1/512 (exact binary steps, so the f32 sum is
    /// exact and the f64 reference sees the same pre-activation), for several coefficients.
    /// Bound: |Δg| ≤ 1e−6·|g| + 4·(1 + |a|)·2^−149. The absolute term only matters below
    /// v ≈ −87, where e^v or g is subnormal in f32 and carries few significant bits (the
    /// multiply by `a` rounds once more there); wherever both are normal the relative bound
    /// 1e−6 is asserted alone.
    #[test]
    fn decay_gate_is_finite_and_accurate_from_minus_100_to_100() {
        let a_values = [-0.05f32, -1.0, -(1.5f32).exp(), -16.0];
        let dt = [0.25f32, -0.5, 0.0, 1.0];
        let steps = 200 * 512 + 1;
        let mut alpha = Vec::with_capacity(steps * 4);
        for s in 0..steps {
            let v = -100.0 + s as f32 / 512.0;
            for h in 0..4 {
                alpha.push(v - dt[h]);
            }
        }
        let mut g = vec![f32::NAN; alpha.len()];
        decay_gate(&alpha, &dt, &a_values, &mut g).unwrap();
        let (mut worst_rel, mut worst_v) = (0.0f64, 0.0f64);
        let mut worst_exp_ulps = 0.0f64;
        let mut worst_abs = 0.0f64;
        for (r, row) in g.chunks(4).enumerate() {
            for h in 0..4 {
                let v = (alpha[r * 4 + h] + dt[h]) as f64;
                let want = a_values[h] as f64 * softplus_f64(v);
                let got = row[h] as f64;
                assert!(row[h].is_finite() && row[h] < 0.0, "g({v}) = {got}");
                let err = (got - want).abs();
                let bound = 1e-6 * want.abs() + 4.0 * (1.0 + a_values[h].abs() as f64) * SUBNORMAL_ULP;
                assert!(err <= bound, "v = {v}, a = {}: g = {got:e}, want {want:e}", a_values[h]);
                // Where e^v and g are normal f32 values the relative bound holds on its own.
                if v.exp().min(want.abs()) >= f32::MIN_POSITIVE as f64 {
                    assert!(err <= 1e-6 * want.abs(), "v = {v}, a = {}: relative {:e}", a_values[h], err / want.abs());
                    if err / want.abs() > worst_rel {
                        worst_rel = err / want.abs();
                        worst_v = v;
                    }
                } else {
                    worst_abs = worst_abs.max(err);
                }
                // The recurrence's decay: exp of the f32 g, within one f32 ulp of the exact
                // value whenever the result is a normal f32.
                let decay = row[h].exp() as f64;
                let exact = got.exp();
                if exact >= f32::MIN_POSITIVE as f64 {
                    let ulp = (exact as f32).to_bits();
                    let ulp = (f32::from_bits(ulp + 1) - f32::from_bits(ulp)) as f64;
                    worst_exp_ulps = worst_exp_ulps.max((decay - exact).abs() / ulp);
                }
            }
        }
        assert!(worst_exp_ulps <= 1.0, "exp(g) off by {worst_exp_ulps} ulp");
        eprintln!(
            "decay_gate: worst relative error {worst_rel:.3e} at v = {worst_v} (e^v, g normal); \
             worst absolute error {worst_abs:.3e} where either is subnormal; exp(g) worst {worst_exp_ulps:.3} ulp"
        );
    }

    #[test]
    fn softplus_guard_and_small_branch() {
        assert_eq!(softplus(20.5), 20.5);
        assert_eq!(softplus(100.0), 100.0);
        // Where 1 + e^v rounds to 1 the naive form returns 0; the series does not.
        let v = -20.0f32;
        assert_eq!((1.0f32 + v.exp()).ln(), 0.0);
        let want = softplus_f64(v as f64);
        assert!(((softplus(v) as f64 - want) / want).abs() < 1e-6);
    }

    #[test]
    fn beta_is_sigmoid() {
        let b = [-100.0f32, -2.0, 0.0, 3.0, 100.0];
        let mut beta = [f32::NAN; 5];
        beta_gate(&b, &mut beta).unwrap();
        for (&x, &y) in b.iter().zip(&beta) {
            let want = 1.0 / (1.0 + (-(x as f64)).exp());
            assert!((y as f64 - want).abs() <= 1e-7 * want.max(1e-30) + 1e-45, "{x}: {y}");
        }
        assert_eq!(beta[2], 0.5);
    }

    #[test]
    fn gate_shape_errors() {
        let mut g = [0.0f32; 6];
        assert!(matches!(decay_gate(&[0.0; 6], &[0.0; 4], &[-1.0; 4], &mut g[..]), Err(Error::Shape(_))));
        assert!(matches!(decay_gate(&[0.0; 6], &[0.0; 3], &[-1.0; 3], &mut g[..5]), Err(Error::Shape(_))));
        assert!(matches!(decay_gate(&[0.0; 6], &[0.0; 2], &[-1.0; 3], &mut g[..]), Err(Error::Shape(_))));
        assert!(matches!(decay_gate(&[], &[], &[], &mut []), Err(Error::Shape(_))));
        assert!(matches!(beta_gate(&[0.0; 3], &mut g[..]), Err(Error::Shape(_))));
    }
}
