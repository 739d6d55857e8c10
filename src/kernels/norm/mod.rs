//! RMS normalisation: `rms(pre·x)·w`, and the post-norm residual add fused with the next
//! pre-norm, `H = (H + rms(Y)·w)·post; A = rms(H)·w2`. Weights are the effective multipliers:
//! models whose checkpoints store `w` for a `(1 + w)` norm add the one at load time, which is the
//! same f32 addition the reference performs on every call.
//!
//! Sums of squares accumulate in f64 (allowed by the numerics contract), the scale is rounded
//! to f32 once, and the products stay in f32 in the reference's order: `(x·inv)·w`.

pub mod cuda;

use rayon::prelude::*;

use super::{check_len, SharedMut};
use crate::error::Result;

/// Rows below this count are normalised on the calling thread (spawning costs more).
const PARALLEL_ROWS: usize = 64;

#[inline]
fn inv_rms(x: &[f32], pre: f32, eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| {
        let v = (v * pre) as f64;
        v * v
    }).sum();
    (1.0 / (ss / x.len() as f64 + eps as f64).sqrt()) as f32
}

#[inline]
fn norm_row(x: &[f32], w: Option<&[f32]>, pre: f32, eps: f32, y: &mut [f32]) {
    let inv = inv_rms(x, pre, eps);
    match w {
        Some(w) => {
            for ((o, &v), &wv) in y.iter_mut().zip(x).zip(w) {
                *o = ((v * pre) * inv) * wv;
            }
        }
        None => {
            for (o, &v) in y.iter_mut().zip(x) {
                *o = (v * pre) * inv;
            }
        }
    }
}

/// Y = rms(pre·X)·w over rows of width `d` (w = None: no weight).
pub fn rms_norm(x: &[f32], d: usize, w: Option<&[f32]>, pre: f32, eps: f32, y: &mut [f32]) -> Result<()> {
    check_len("rms_norm output", y.len(), x.len())?;
    if let Some(w) = w {
        check_len("rms_norm weight", w.len(), d)?;
    }
    if d == 0 || x.len() % d != 0 {
        return Err(crate::Error::Shape(format!("rms_norm: {} elements are not rows of {d}", x.len())));
    }
    if x.len() / d >= PARALLEL_ROWS {
        x.par_chunks(d).zip(y.par_chunks_mut(d)).for_each(|(x, y)| norm_row(x, w, pre, eps, y));
    } else {
        x.chunks(d).zip(y.chunks_mut(d)).for_each(|(x, y)| norm_row(x, w, pre, eps, y));
    }
    Ok(())
}

/// In-place form of [`rms_norm`].
pub fn rms_norm_inplace(x: &mut [f32], d: usize, w: Option<&[f32]>, eps: f32) -> Result<()> {
    if let Some(w) = w {
        check_len("rms_norm weight", w.len(), d)?;
    }
    if d == 0 || x.len() % d != 0 {
        return Err(crate::Error::Shape(format!("rms_norm: {} elements are not rows of {d}", x.len())));
    }
    let run = |row: &mut [f32]| {
        let inv = inv_rms(row, 1.0, eps);
        match w {
            Some(w) => row.iter_mut().zip(w).for_each(|(v, &wv)| *v = (*v * inv) * wv),
            None => row.iter_mut().for_each(|v| *v *= inv),
        }
    };
    if x.len() / d >= PARALLEL_ROWS {
        x.par_chunks_mut(d).for_each(run);
    } else {
        x.chunks_mut(d).for_each(run);
    }
    Ok(())
}

/// The pre-norm residual step: X += Y, then A = rms(X)·w, per row of `d`.
pub fn residual_norm(x: &mut [f32], y: &[f32], w: &[f32], d: usize, eps: f32, a: &mut [f32]) -> Result<()> {
    check_len("residual_norm input", y.len(), x.len())?;
    check_len("residual_norm weight", w.len(), d)?;
    check_len("residual_norm output", a.len(), x.len())?;
    if d == 0 || x.len() % d != 0 {
        return Err(crate::Error::Shape(format!("residual_norm: {} elements are not rows of {d}", x.len())));
    }
    let run = |((xr, yr), ar): ((&mut [f32], &[f32]), &mut [f32])| {
        xr.iter_mut().zip(yr).for_each(|(xv, &yv)| *xv += yv);
        norm_row(xr, Some(w), 1.0, eps, ar);
    };
    if x.len() / d >= PARALLEL_ROWS {
        x.par_chunks_mut(d).zip(y.par_chunks(d)).zip(a.par_chunks_mut(d)).for_each(run);
    } else {
        x.chunks_mut(d).zip(y.chunks(d)).zip(a.chunks_mut(d)).for_each(run);
    }
    Ok(())
}

/// H = (H + rms(Y)·w)·post, then, when `next` is given, A = rms(H)·w2.
pub fn add_norm(
    h: &mut [f32],
    y: &[f32],
    w: &[f32],
    post: f32,
    d: usize,
    eps: f32,
    next: Option<(&[f32], &mut [f32])>,
) -> Result<()> {
    check_len("add_norm input", y.len(), h.len())?;
    check_len("add_norm weight", w.len(), d)?;
    if d == 0 || h.len() % d != 0 {
        return Err(crate::Error::Shape(format!("add_norm: {} elements are not rows of {d}", h.len())));
    }
    let rows = h.len() / d;
    let (w2, a) = match next {
        Some((w2, a)) => {
            check_len("add_norm next weight", w2.len(), d)?;
            check_len("add_norm next output", a.len(), h.len())?;
            (Some(w2), Some(SharedMut(a.as_mut_ptr())))
        }
        None => (None, None),
    };
    let run = |(r, hr): (usize, &mut [f32])| {
        let yr = &y[r * d..(r + 1) * d];
        let inv = inv_rms(yr, 1.0, eps);
        for ((hv, &yv), &wv) in hr.iter_mut().zip(yr).zip(w) {
            *hv += (yv * inv) * wv;
            if post != 1.0 {
                *hv *= post;
            }
        }
        if let (Some(w2), Some(a)) = (w2, a) {
            // SAFETY: row r of A is written by this task alone; A has h.len() elements (checked).
            let ar = unsafe { std::slice::from_raw_parts_mut(a.ptr().add(r * d), d) };
            norm_row(hr, Some(w2), 1.0, eps, ar);
        }
    };
    if rows >= PARALLEL_ROWS {
        h.par_chunks_mut(d).enumerate().for_each(run);
    } else {
        h.chunks_mut(d).enumerate().for_each(run);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, 0.5, 0.0, 0.0, 0.0, 4.0];
        let w = [1.0f32, 2.0, 0.5, 1.5];
        let mut y = [0.0f32; 8];
        rms_norm(&x, 4, Some(&w), 1.0, 1e-6, &mut y).unwrap();
        let ms = (1.0 + 4.0 + 9.0 + 0.25) / 4.0f64;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        assert!((y[1] as f64 - (-2.0 * inv * 2.0)).abs() < 1e-6);
        assert!((y[7] as f64 - 4.0 / (4.0f64 + 1e-6).sqrt() * 1.5).abs() < 1e-6);
    }

    #[test]
    fn add_norm_fuses_residual_scale_and_next_norm() {
        let d = 4;
        let mut h = vec![1.0f32, 2.0, 3.0, 4.0];
        let y = vec![0.5f32, -0.5, 1.0, 2.0];
        let w = vec![1.0f32; 4];
        let w2 = vec![2.0f32; 4];
        let mut a = vec![f32::NAN; 4];
        let mut want = h.clone();
        let mut ny = vec![0.0; 4];
        rms_norm(&y, d, Some(&w), 1.0, 1e-6, &mut ny).unwrap();
        for i in 0..4 {
            want[i] = (want[i] + ny[i]) * 0.5;
        }
        add_norm(&mut h, &y, &w, 0.5, d, 1e-6, Some((&w2, &mut a))).unwrap();
        assert_eq!(h, want);
        let mut wa = vec![0.0; 4];
        rms_norm(&want, d, Some(&w2), 1.0, 1e-6, &mut wa).unwrap();
        assert_eq!(a, wa);
    }
}
