//! Per-head RMS normalisation and rotary position embedding, in place on a projection's output.
//!
//! RoPE here is `rotate_half` over the first `rot` channels of each head (rot = hd for the
//! EmbeddingGemma text models; partial rotation for Qwen3.5): channel i pairs with i + rot/2.
//! Angles are computed exactly as the reference does, in f32: `inv_freq = 1 / θ^(2i/rot)` and
//! `angle = pos · inv_freq`, rounded to f32 before cos/sin. At position 2048 one f32 ulp of the
//! angle is 2.4e-4 rad, so computing the product in f64 would *disagree* with the reference.

pub mod cuda;

use rayon::prelude::*;

use super::{check_at_least, check_len};
use crate::error::{Error, Result};

/// cos/sin tables [position][rot/2] for one (θ, rot) pair.
pub struct RopeTable {
    pub rot: usize,
    pub theta: f64,
    cos: Vec<f32>,
    sin: Vec<f32>,
    positions: usize,
}

impl RopeTable {
    pub fn new(theta: f64, rot: usize, positions: usize) -> RopeTable {
        let half = rot / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                let exponent = (2 * i) as f32 / rot as f32;
                1.0f32 / (theta.powf(exponent as f64) as f32)
            })
            .collect();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for &f in &inv_freq {
                let angle = p as f32 * f;
                cos.push((angle as f64).cos() as f32);
                sin.push((angle as f64).sin() as f32);
            }
        }
        RopeTable { rot, theta, cos, sin, positions }
    }

    pub fn positions(&self) -> usize {
        self.positions
    }
    /// cos values, [position][rot/2].
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }
    /// sin values, [position][rot/2].
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }
}

/// What to do to each head of a [rows][heads·hd] buffer.
pub struct HeadPrep<'a> {
    pub heads: usize,
    pub hd: usize,
    /// RMS-norm each head first: `Some(Some(w))` with a weight, `Some(None)` without.
    pub norm: Option<Option<&'a [f32]>>,
    pub eps: f32,
    /// Rotate with this table at each row's position.
    pub rope: Option<&'a RopeTable>,
}

/// Applies `prep` to every head of every row; `positions[r]` is row r's position in its sequence.
pub fn head_prep(x: &mut [f32], rows: usize, positions: &[u32], prep: &HeadPrep) -> Result<()> {
    let width = prep.heads * prep.hd;
    check_len("head_prep input", x.len(), rows * width)?;
    head_prep_view(x, 0, width, rows, positions, prep)
}

/// Where a head prep works: `rows` rows of `heads` heads of `hd` channels, row r's from
/// `offset + r·stride` of a buffer of `len` values.
pub(crate) struct HeadPrepView {
    pub len: usize,
    pub offset: usize,
    pub stride: usize,
    pub rows: usize,
    pub heads: usize,
    pub hd: usize,
}

/// The checks of a head prep, for the CPU and CUDA forms alike: the view holds every head, a
/// norm weight (`norm_len`) is one head wide, a rotation (`rope`: rotated channels, table
/// positions) covers whole pairs of the head, there is a position per row, and the largest
/// (`max_position`; the CUDA form passes None without rows) is inside the table.
pub(crate) fn check_head_prep(
    v: HeadPrepView,
    norm_len: Option<usize>,
    rope: Option<(usize, usize)>,
    positions: usize,
    max_position: Option<usize>,
) -> Result<()> {
    crate::kernels::backend::check_view("head_prep input", v.len, v.offset, v.stride, v.rows, v.heads * v.hd)?;
    if let Some(n) = norm_len {
        check_len("head_prep norm weight", n, v.hd)?;
    }
    if let Some((rot, table)) = rope {
        check_len("head_prep positions", positions, v.rows)?;
        if rot > v.hd || rot % 2 != 0 {
            return Err(Error::Shape(format!("rope over {rot} channels of a {}-channel head", v.hd)));
        }
        if let Some(max) = max_position {
            check_at_least("rope table positions", table, max + 1)?;
        }
    }
    Ok(())
}

/// [`head_prep`] in place on a strided view: row r's heads start at `x[offset + r·stride]`, the
/// rest of each row is left as it is (q, k or v inside one fused projection).
pub fn head_prep_view(x: &mut [f32], offset: usize, stride: usize, rows: usize, positions: &[u32], prep: &HeadPrep) -> Result<()> {
    let width = prep.heads * prep.hd;
    let max_position = positions.iter().copied().max().unwrap_or(0) as usize;
    check_head_prep(
        HeadPrepView { len: x.len(), offset, stride, rows, heads: prep.heads, hd: prep.hd },
        prep.norm.flatten().map(<[f32]>::len),
        prep.rope.map(|t| (t.rot, t.positions)),
        positions.len(),
        Some(max_position),
    )?;
    if rows == 0 || width == 0 {
        return Ok(());
    }
    let run = |(r, row): (usize, &mut [f32])| {
        for head in row[..width].chunks_mut(prep.hd) {
            if let Some(w) = prep.norm {
                let ss: f64 = head.iter().map(|&v| (v as f64) * (v as f64)).sum();
                let inv = (1.0 / (ss / prep.hd as f64 + prep.eps as f64).sqrt()) as f32;
                match w {
                    Some(w) => head.iter_mut().zip(w).for_each(|(v, &wv)| *v = (*v * inv) * wv),
                    None => head.iter_mut().for_each(|v| *v *= inv),
                }
            }
            if let Some(t) = prep.rope {
                let half = t.rot / 2;
                let p = positions[r] as usize;
                let (c, s) = (&t.cos[p * half..(p + 1) * half], &t.sin[p * half..(p + 1) * half]);
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * c[i] - b * s[i];
                    head[i + half] = b * c[i] + a * s[i];
                }
            }
        }
    };
    // Rows of `stride` from the offset; the last may be cut short after its heads.
    let end = offset + (rows - 1) * stride + width;
    let body = &mut x[offset..end];
    if rows >= 32 {
        body.par_chunks_mut(stride.max(width)).enumerate().for_each(run);
    } else {
        body.chunks_mut(stride.max(width)).enumerate().for_each(run);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() {
        let t = RopeTable::new(10_000.0, 8, 4);
        let mut x: Vec<f32> = (0..16).map(|i| i as f32 * 0.25 - 1.0).collect();
        let before: f32 = x[8..].iter().map(|v| v * v).sum();
        let prep = HeadPrep { heads: 1, hd: 8, norm: None, eps: 1e-6, rope: Some(&t) };
        head_prep(&mut x, 2, &[0, 3], &prep).unwrap();
        // Position 0 is the identity.
        assert_eq!(&x[..8], &(0..8).map(|i| i as f32 * 0.25 - 1.0).collect::<Vec<_>>()[..]);
        let after: f32 = x[8..].iter().map(|v| v * v).sum();
        assert!((before - after).abs() < 1e-5);
        // Channel 0 at position 3 turns by 3 radians.
        let (a, b) = (8.0 * 0.25 - 1.0, 12.0 * 0.25 - 1.0);
        assert!((x[8] - (a * 3f32.cos() - b * 3f32.sin())).abs() < 1e-6);
        assert!(head_prep(&mut x, 2, &[0, 4], &prep).is_err(), "positions beyond the table are refused");
    }
}
