//! The family's two per-head normalisations.
//!
//! - L2 normalisation of q and k, as fla's and transformers' `l2norm`:
//!   `x / sqrt(Σx² + eps)` with eps = 1e−6 added to the SUM of squares (not the mean, and
//!   inside the root), then q times `1/√d_k`. Normalised keys are what keep the delta rule
//!   stable: with `‖k‖ = 1` and `β ∈ (0, 1)` the update `S ← S(I − βkkᵀ)` is a contraction.
//! - Gated RMSNorm on the recurrence output: `rms(y)·w·silu(z)` per value head of `d_v`, with
//!   ONE weight of `d_v` shared by every head (the checkpoint stores a single vector; indexing
//!   it per head would read past it), eps inside the root of the mean of squares, and no `+1`
//!   on w (this norm is the exception among Qwen3.5's norms).
//!
//! Sums of squares accumulate in f64 (allowed by the numerics contract), the scale is rounded
//! to f32 once, and the products stay in f32 in a fixed order: `(x·inv)·scale` and
//! `((y·inv)·w)·silu(z)`.

use rayon::prelude::*;

use super::{check_len, silu};
use crate::error::{Error, Result};

/// eps of the q/k L2 normalisation in Qwen3.5 (fla and transformers `l2norm`).
pub const L2_NORM_EPS: f32 = 1e-6;

/// Rows below this count are normalised on the calling thread.
const PARALLEL_ROWS: usize = 256;

fn check_rows(what: &str, len: usize, d: usize) -> Result<()> {
    if d == 0 || len % d != 0 {
        return Err(Error::Shape(format!("{what}: {len} elements are not rows of {d}")));
    }
    Ok(())
}

#[inline]
fn sum_sq(x: &[f32]) -> f64 {
    x.iter().map(|&v| v as f64 * v as f64).sum()
}

/// In place, per row of `d`: `x ← (x / sqrt(Σx² + eps)) · scale`.
pub fn l2_normalize(x: &mut [f32], d: usize, eps: f32, scale: f32) -> Result<()> {
    check_rows("l2_normalize", x.len(), d)?;
    let run = |row: &mut [f32]| {
        let inv = (1.0 / (sum_sq(row) + eps as f64).sqrt()) as f32;
        row.iter_mut().for_each(|v| *v = (*v * inv) * scale);
    };
    if x.len() / d >= PARALLEL_ROWS {
        x.par_chunks_mut(d).for_each(run);
    } else {
        x.chunks_mut(d).for_each(run);
    }
    Ok(())
}

/// Qwen3.5's q/k preparation, in place on `[tokens][heads][d_k]` buffers: both L2-normalised
/// per head with eps 1e−6, q then scaled by `1/√d_k` (the f64 value rounded to f32 once, as a
/// Python scalar multiplies an f32 tensor).
pub fn normalize_qk(q: &mut [f32], k: &mut [f32], d_k: usize) -> Result<()> {
    check_len("normalize_qk k", k.len(), q.len())?;
    check_rows("normalize_qk", q.len(), d_k)?;
    let scale = (1.0 / (d_k as f64).sqrt()) as f32;
    l2_normalize(q, d_k, L2_NORM_EPS, scale)?;
    l2_normalize(k, d_k, L2_NORM_EPS, 1.0)
}

#[inline]
fn gated_row(y: &[f32], z: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = (1.0 / (sum_sq(y) / y.len() as f64 + eps as f64).sqrt()) as f32;
    for (((o, &yv), &zv), &wv) in out.iter_mut().zip(y).zip(z).zip(w) {
        *o = ((yv * inv) * wv) * silu(zv);
    }
}

/// `out = rms(y)·w·silu(z)` per head: rows of `d = w.len()` in `y`, `z` and `out`, the one
/// weight shared by every row.
pub fn gated_rms_norm(y: &[f32], z: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
    let d = w.len();
    check_rows("gated_rms_norm", y.len(), d)?;
    check_len("gated_rms_norm gate", z.len(), y.len())?;
    check_len("gated_rms_norm output", out.len(), y.len())?;
    let run = |((y, z), o): ((&[f32], &[f32]), &mut [f32])| gated_row(y, z, w, eps, o);
    if y.len() / d >= PARALLEL_ROWS {
        y.par_chunks(d).zip(z.par_chunks(d)).zip(out.par_chunks_mut(d)).for_each(run);
    } else {
        y.chunks(d).zip(z.chunks(d)).zip(out.chunks_mut(d)).for_each(run);
    }
    Ok(())
}

/// In-place form of [`gated_rms_norm`]: `y ← rms(y)·w·silu(z)`.
pub fn gated_rms_norm_inplace(y: &mut [f32], z: &[f32], w: &[f32], eps: f32) -> Result<()> {
    let d = w.len();
    check_rows("gated_rms_norm", y.len(), d)?;
    check_len("gated_rms_norm gate", z.len(), y.len())?;
    let run = |(y, z): (&mut [f32], &[f32])| {
        // The scale needs the whole row before any element is overwritten.
        let inv = (1.0 / (sum_sq(y) / d as f64 + eps as f64).sqrt()) as f32;
        for ((yv, &zv), &wv) in y.iter_mut().zip(z).zip(w) {
            *yv = ((*yv * inv) * wv) * silu(zv);
        }
    };
    if y.len() / d >= PARALLEL_ROWS {
        y.par_chunks_mut(d).zip(z.par_chunks(d)).for_each(run);
    } else {
        y.chunks_mut(d).zip(z.chunks(d)).for_each(run);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_bits_eq, Lcg};
    use super::*;

    #[test]
    fn normalize_qk_matches_definition() {
        let mut rng = Lcg(3);
        let d = 32;
        let q0 = rng.vec(3 * d, -2.0, 2.0);
        let mut k0 = rng.vec(3 * d, -2.0, 2.0);
        k0[d..2 * d].iter_mut().for_each(|v| *v = 0.0); // an all-zero head stays zero (eps)
        let (mut q, mut k) = (q0.clone(), k0.clone());
        normalize_qk(&mut q, &mut k, d).unwrap();
        for r in 0..3 {
            for (x0, x, scale) in [(&q0, &q, 1.0 / (d as f64).sqrt()), (&k0, &k, 1.0)] {
                let ss: f64 = x0[r * d..(r + 1) * d].iter().map(|&v| (v as f64).powi(2)).sum();
                for i in r * d..(r + 1) * d {
                    let want = x0[i] as f64 / (ss + 1e-6).sqrt() * scale;
                    assert!((x[i] as f64 - want).abs() <= 2e-7 * want.abs() + 1e-12, "row {r} i {i}");
                }
            }
        }
        assert!(k[d..2 * d].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn gated_rms_norm_shares_the_weight_across_heads() {
        let mut rng = Lcg(5);
        let (heads, d) = (4, 16);
        let y = rng.vec(heads * d, -3.0, 3.0);
        let z = rng.vec(heads * d, -6.0, 6.0);
        let w = rng.vec(d, 0.5, 1.5);
        let mut out = vec![f32::NAN; y.len()];
        gated_rms_norm(&y, &z, &w, 1e-6, &mut out).unwrap();
        for h in 0..heads {
            let row = &y[h * d..(h + 1) * d];
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
            for i in 0..d {
                let zv = z[h * d + i] as f64;
                let want = row[i] as f64 / (ms + 1e-6).sqrt() * w[i] as f64 * zv / (1.0 + (-zv).exp());
                assert!((out[h * d + i] as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()), "h {h} i {i}");
            }
        }
        let mut inplace = y.clone();
        gated_rms_norm_inplace(&mut inplace, &z, &w, 1e-6).unwrap();
        assert_bits_eq("in place", &inplace, &out);
    }

    #[test]
    fn norm_shape_errors() {
        let err = |r: Result<()>| assert!(matches!(r, Err(Error::Shape(_))), "{r:?}");
        let mut buf = vec![1.0f32; 10];
        err(l2_normalize(&mut buf, 4, 1e-6, 1.0));
        err(l2_normalize(&mut buf, 0, 1e-6, 1.0));
        let mut k = vec![1.0f32; 8];
        err(normalize_qk(&mut buf, &mut k, 5));
        let mut out = vec![0.0f32; 10];
        err(gated_rms_norm(&buf, &buf[..8], &[1.0; 5], 1e-6, &mut out));
        err(gated_rms_norm(&buf, &buf, &[1.0; 4], 1e-6, &mut out));
        err(gated_rms_norm(&buf, &buf, &[1.0; 5], 1e-6, &mut out[..5]));
        err(gated_rms_norm_inplace(&mut buf, &k, &[1.0; 5], 1e-6));
    }
}
