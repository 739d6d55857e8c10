//! Bidirectional attention over packed variable-length sequences, with an optional window.
//!
//! Each sequence attends only within itself; query i sees key j iff |i − j| ≤ `max_distance`
//! (None: every key of the sequence). EmbeddingGemma 2's window is inclusive (`|i−j| ≤ W`),
//! EmbeddingGemma 300M's is exclusive (`|i−j| < W`, so max_distance = W − 1): the model layer
//! does that translation, the kernel knows one rule.
//!
//! CPU form: one task per (sequence, query head, block of QUERY_BLOCK queries). A task takes
//! the band of keys its queries can see, forms the scores with one matrix product, applies a
//! max-subtracted softmax per row and multiplies by V. Tasks own disjoint output rows×heads, so
//! nothing depends on which other sequences share the batch.

pub mod cuda;

use rayon::prelude::*;

use super::matmul::gemm_f32;
use super::backend::check_view;
use super::{check_len, Segment, SharedMut};
use crate::error::{Error, Result};

const QUERY_BLOCK: usize = 64;

pub struct AttentionShape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
    pub scale: f32,
    pub max_distance: Option<usize>,
}

/// out[t][h·hd..] = softmax(scale · q_h(t)·K_gᵀ) · V_g over the visible keys of t's sequence,
/// g = h / (q_heads / kv_heads). q: [T][q_heads·hd], k and v: [T][kv_heads·hd].
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    segments: &[Segment],
    shape: &AttentionShape,
    out: &mut [f32],
) -> Result<()> {
    let (ldq, ldk) = (shape.q_heads * shape.hd, shape.kv_heads * shape.hd);
    attention_views((q, 0, ldq), (k, 0, ldk), (v, 0, ldk), segments, shape, out)
}

/// [`attention`] over strided operands `(buffer, offset, row stride)`: row t of q starts at
/// `q.0[q.1 + t·q.2]` (q, k and v read in place from one fused projection).
pub fn attention_views(
    q: (&[f32], usize, usize),
    k: (&[f32], usize, usize),
    v: (&[f32], usize, usize),
    segments: &[Segment],
    shape: &AttentionShape,
    out: &mut [f32],
) -> Result<()> {
    let AttentionShape { q_heads, kv_heads, hd, scale, max_distance } = *shape;
    if kv_heads == 0 || q_heads % kv_heads != 0 {
        return Err(Error::Shape(format!("attention: {q_heads} query heads over {kv_heads} kv heads")));
    }
    let rows: usize = segments.last().map(|s| s.start + s.len).unwrap_or(0);
    let (ldq, ldk, ldv) = (q.2, k.2, v.2);
    check_view("attention q", q.0.len(), q.1, ldq, rows, q_heads * hd)?;
    check_view("attention k", k.0.len(), k.1, ldk, rows, kv_heads * hd)?;
    check_view("attention v", v.0.len(), v.1, ldv, rows, kv_heads * hd)?;
    let (q, k, v) = (&q.0[q.1..], &k.0[k.1..], &v.0[v.1..]);
    let ldo = q_heads * hd;
    check_len("attention out", out.len(), rows * ldo)?;
    let group = q_heads / kv_heads;
    let mut tasks = Vec::new();
    for seg in segments {
        for h in 0..q_heads {
            for q0 in (0..seg.len).step_by(QUERY_BLOCK) {
                tasks.push((*seg, h, q0));
            }
        }
    }
    let out_ptr = SharedMut(out.as_mut_ptr());
    tasks.into_par_iter().for_each_init(Vec::new, |scores, (seg, h, q0)| {
        let q1 = (q0 + QUERY_BLOCK).min(seg.len);
        let (lo, hi) = match max_distance {
            Some(w) => (q0.saturating_sub(w), (q1 - 1 + w + 1).min(seg.len)),
            None => (0, seg.len),
        };
        let (nq, nk) = (q1 - q0, hi - lo);
        let g = h / group;
        scores.clear();
        scores.resize(nq * nk, 0.0);
        let qp = q[(seg.start + q0) * ldq + h * hd..].as_ptr();
        let kp = k[(seg.start + lo) * ldk + g * hd..].as_ptr();
        let vp = v[(seg.start + lo) * ldv + g * hd..].as_ptr();
        // SAFETY: rows q0..q1 and lo..hi lie inside the sequence, which lies inside the checked
        // buffers; `scores` holds nq·nk values.
        unsafe {
            gemm_f32(nq, nk, hd, scores.as_mut_ptr(), nk as isize, 1, qp, ldq as isize, 1, kp, 1, ldk as isize, false);
        }
        for (i, row) in scores.chunks_mut(nk).enumerate() {
            let qi = q0 + i;
            let (vis_lo, vis_hi) = match max_distance {
                Some(w) => (qi.saturating_sub(w).max(lo) - lo, (qi + w + 1).min(hi) - lo),
                None => (0, nk),
            };
            softmax_visible(row, vis_lo, vis_hi, scale);
        }
        // SAFETY: this task alone writes rows q0..q1, columns h·hd..(h+1)·hd of `out`.
        unsafe {
            let op = out_ptr.ptr().add((seg.start + q0) * ldo + h * hd);
            gemm_f32(nq, hd, nk, op, ldo as isize, 1, scores.as_ptr(), nk as isize, 1, vp, ldv as isize, 1, false);
        }
    });
    Ok(())
}

/// Scales the visible scores `row[lo..hi]` and turns them into a max-subtracted softmax;
/// every other entry becomes 0.
fn softmax_visible(row: &mut [f32], lo: usize, hi: usize, scale: f32) {
    let mut mx = f32::NEG_INFINITY;
    for s in &mut row[lo..hi] {
        *s *= scale;
        mx = mx.max(*s);
    }
    let mut sum = 0.0f32;
    for s in &mut row[lo..hi] {
        *s = (*s - mx).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    row[..lo].fill(0.0);
    row[hi..].fill(0.0);
    row[lo..hi].iter_mut().for_each(|s| *s *= inv);
}

/// Causal attention of `n` new queries of one sequence against its key/value cache:
/// query i sits at position `past + i` and sees cache rows `0 ..= past + i`.
/// q: [n][q_heads·hd]; k, v: [past + n][kv_heads·hd] (the cache, new rows appended);
/// out: [n][q_heads·hd]. `shape.max_distance` must be None.
pub fn causal_attention(
    q: &[f32],
    n: usize,
    past: usize,
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    out: &mut [f32],
) -> Result<()> {
    let AttentionShape { q_heads, kv_heads, hd, scale, max_distance } = *shape;
    if kv_heads == 0 || q_heads % kv_heads != 0 || max_distance.is_some() {
        return Err(Error::Shape(format!("causal_attention: {q_heads} query heads over {kv_heads} kv heads, window {max_distance:?}")));
    }
    let (ldq, ldk, keys) = (q_heads * hd, kv_heads * hd, past + n);
    check_len("causal_attention q", q.len(), n * ldq)?;
    check_len("causal_attention k", k.len(), keys * ldk)?;
    check_len("causal_attention v", v.len(), keys * ldk)?;
    check_len("causal_attention out", out.len(), n * ldq)?;
    let group = q_heads / kv_heads;
    let tasks: Vec<(usize, usize)> =
        (0..q_heads).flat_map(|h| (0..n).step_by(QUERY_BLOCK).map(move |q0| (h, q0))).collect();
    let out_ptr = SharedMut(out.as_mut_ptr());
    tasks.into_par_iter().for_each_init(Vec::new, |scores: &mut Vec<f32>, (h, q0)| {
        let q1 = (q0 + QUERY_BLOCK).min(n);
        let (nq, nk) = (q1 - q0, past + q1);
        let g = h / group;
        scores.clear();
        scores.resize(nq * nk, 0.0);
        // SAFETY: rows q0..q1 of q and 0..past+q1 of k, v lie inside the checked buffers.
        unsafe {
            gemm_f32(nq, nk, hd, scores.as_mut_ptr(), nk as isize, 1, q[q0 * ldq + h * hd..].as_ptr(), ldq as isize, 1,
                k[g * hd..].as_ptr(), 1, ldk as isize, false);
        }
        for (i, row) in scores.chunks_mut(nk).enumerate() {
            softmax_visible(row, 0, past + q0 + i + 1, scale);
        }
        // SAFETY: this task alone writes rows q0..q1, columns h·hd..(h+1)·hd of `out`.
        unsafe {
            gemm_f32(nq, hd, nk, out_ptr.ptr().add(q0 * ldq + h * hd), ldq as isize, 1, scores.as_ptr(), nk as isize, 1,
                v[g * hd..].as_ptr(), ldk as isize, 1, false);
        }
    });
    Ok(())
}

/// The plain definition, one score at a time in f64: the oracle for the kernel's tests.
pub fn attention_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    segments: &[Segment],
    shape: &AttentionShape,
) -> Vec<f32> {
    let AttentionShape { q_heads, kv_heads, hd, scale, max_distance } = *shape;
    let (ldq, ldk) = (q_heads * hd, kv_heads * hd);
    let rows: usize = segments.last().map(|s| s.start + s.len).unwrap_or(0);
    let mut out = vec![0.0f32; rows * ldq];
    for seg in segments {
        for h in 0..q_heads {
            let g = h / (q_heads / kv_heads);
            for i in 0..seg.len {
                let visible: Vec<usize> =
                    (0..seg.len).filter(|&j| max_distance.is_none_or(|w| i.abs_diff(j) <= w)).collect();
                let s: Vec<f64> = visible
                    .iter()
                    .map(|&j| {
                        (0..hd)
                            .map(|c| q[(seg.start + i) * ldq + h * hd + c] as f64 * k[(seg.start + j) * ldk + g * hd + c] as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                let total: f64 = e.iter().sum();
                for c in 0..hd {
                    let acc: f64 = visible.iter().zip(&e).map(|(&j, &p)| p * v[(seg.start + j) * ldk + g * hd + c] as f64).sum();
                    out[(seg.start + i) * ldq + h * hd + c] = (acc / total) as f32;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::pack;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn causal_attention_with_a_cache_matches_the_reference() {
        let mut seed = 11;
        let (qh, kvh, hd) = (4, 2, 16);
        for (past, n) in [(0usize, 1usize), (0, 70), (5, 1), (63, 66)] {
            let keys = past + n;
            let q: Vec<f32> = (0..n * qh * hd).map(|_| lcg(&mut seed)).collect();
            let k: Vec<f32> = (0..keys * kvh * hd).map(|_| lcg(&mut seed)).collect();
            let v: Vec<f32> = (0..keys * kvh * hd).map(|_| lcg(&mut seed)).collect();
            let shape = AttentionShape { q_heads: qh, kv_heads: kvh, hd, scale: 0.25, max_distance: None };
            let mut out = vec![f32::NAN; n * qh * hd];
            causal_attention(&q, n, past, &k, &v, &shape, &mut out).unwrap();
            for i in 0..n {
                // Query i alone against its visible prefix, through the bidirectional oracle.
                let vis = past + i + 1;
                let mut qq = vec![0.0f32; vis * qh * hd];
                qq[(vis - 1) * qh * hd..].copy_from_slice(&q[i * qh * hd..(i + 1) * qh * hd]);
                let want = attention_reference(&qq, &k[..vis * kvh * hd], &v[..vis * kvh * hd], &pack([vis]), &shape);
                let got = &out[i * qh * hd..(i + 1) * qh * hd];
                let w = &want[(vis - 1) * qh * hd..];
                let err = got.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                assert!(err < 1e-5, "past {past} n {n} row {i}: {err}");
            }
        }
    }

    #[test]
    fn kernel_matches_reference_with_windows_and_gqa() {
        let mut seed = 7;
        for (lens, qh, kvh, hd, win) in [
            (vec![1usize, 5, 130], 4, 2, 16, Some(8usize)),
            (vec![70, 3], 2, 1, 32, None),
            (vec![200], 3, 1, 8, Some(63)),
        ] {
            let segs = pack(lens.iter().copied());
            let rows: usize = lens.iter().sum();
            let q: Vec<f32> = (0..rows * qh * hd).map(|_| lcg(&mut seed)).collect();
            let k: Vec<f32> = (0..rows * kvh * hd).map(|_| lcg(&mut seed)).collect();
            let v: Vec<f32> = (0..rows * kvh * hd).map(|_| lcg(&mut seed)).collect();
            let shape = AttentionShape { q_heads: qh, kv_heads: kvh, hd, scale: 0.7, max_distance: win };
            let mut out = vec![f32::NAN; rows * qh * hd];
            attention(&q, &k, &v, &segs, &shape, &mut out).unwrap();
            let want = attention_reference(&q, &k, &v, &segs, &shape);
            let err: f64 = out.iter().zip(&want).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt();
            let norm: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
            assert!(err / norm < 1e-6, "relative error {}", err / norm);
        }
    }
}
