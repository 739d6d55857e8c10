//! Products with Q8_0 weights kept quantized (GGUF blocks: an f16 scale d, then 32 i8 quants).
//! Every weight is formed as d·q in f32 — exact (an 11-bit by 8-bit product fits f32's 24 bits),
//! so the maths is that of the weights decoded at load, in a quarter of their bytes.
//!
//! One or two X rows (decode) take a fused kernel that reads the blocks once, forms the weights
//! in registers and accumulates; more rows dequantize panels of W to f32 for the GEMM.

use half::f16;
use rayon::prelude::*;

pub(super) const BLOCK: usize = 32;
pub(super) const BLOCK_BYTES: usize = 34;
/// Up to this many X rows take the fused kernel.
const FUSED_MAX_ROWS: usize = 2;

#[inline(always)]
fn scale(block: &[u8]) -> f32 {
    f16::from_le_bytes([block[0], block[1]]).to_f32()
}

/// Decodes whole blocks into `out` (32 values per block).
pub(super) fn dequantize_into(blocks: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(BLOCK).zip(blocks.chunks_exact(BLOCK_BYTES)) {
        let d = scale(b);
        for (o, &q) in o.iter_mut().zip(&b[2..]) {
            *o = d * f32::from(q as i8);
        }
    }
}

pub(super) fn linear_q8_0_into(x: &[f32], rows: usize, w: &[u8], out: usize, inp: usize, y: &mut [f32]) {
    let row_bytes = inp / BLOCK * BLOCK_BYTES;
    if rows > FUSED_MAX_ROWS {
        super::panel_gemm(x, rows, out, inp, y, |o0, p, panel| {
            let src = &w[o0 * row_bytes..(o0 + p) * row_bytes];
            panel.par_chunks_mut(inp).zip(src.par_chunks(row_bytes)).for_each(|(d, s)| dequantize_into(s, d));
        });
        return;
    }
    let dot = dot_kernel();
    super::over_row_blocks(out, row_bytes, y, |o0, o1, put| {
        for o in o0..o1 {
            let wr = &w[o * row_bytes..(o + 1) * row_bytes];
            for t in 0..rows {
                put(t, o, dot(&x[t * inp..(t + 1) * inp], wr));
            }
        }
    });
}

/// One X row against one row of Q8_0 blocks.
type Dot = fn(&[f32], &[u8]) -> f32;

fn dot_kernel() -> Dot {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return |x, w| unsafe { x86::dot_avx512(x, w) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return |x, w| unsafe { x86::dot_avx2(x, w) };
        }
    }
    dot_portable
}

fn dot_portable(x: &[f32], w: &[u8]) -> f32 {
    let mut acc = 0.0f32;
    for (xb, b) in x.chunks_exact(BLOCK).zip(w.chunks_exact(BLOCK_BYTES)) {
        let d = scale(b);
        for (&xv, &q) in xb.iter().zip(&b[2..]) {
            acc += xv * (d * f32::from(q as i8));
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{scale, BLOCK, BLOCK_BYTES};

    /// # Safety
    /// The CPU has AVX-512F; `w` holds whole blocks for the `x.len()` values.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_avx512(x: &[f32], w: &[u8]) -> f32 {
        let blocks = x.len() / BLOCK;
        debug_assert!(w.len() >= blocks * BLOCK_BYTES);
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for b in 0..blocks {
            let bp = wp.add(b * BLOCK_BYTES);
            // A few blocks ahead: the rows are long runs, but 34-byte blocks cross pages often.
            _mm_prefetch::<_MM_HINT_T0>(bp.wrapping_add(8 * BLOCK_BYTES) as *const i8);
            let d = _mm512_set1_ps(scale(std::slice::from_raw_parts(bp, 2)));
            let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bp.add(2) as *const __m128i)));
            let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bp.add(18) as *const __m128i)));
            a0 = _mm512_fmadd_ps(_mm512_mul_ps(d, q0), _mm512_loadu_ps(xp.add(b * BLOCK)), a0);
            a1 = _mm512_fmadd_ps(_mm512_mul_ps(d, q1), _mm512_loadu_ps(xp.add(b * BLOCK + 16)), a1);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(a0, a1))
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; `w` holds whole blocks for the `x.len()` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_avx2(x: &[f32], w: &[u8]) -> f32 {
        let blocks = x.len() / BLOCK;
        debug_assert!(w.len() >= blocks * BLOCK_BYTES);
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        for b in 0..blocks {
            let bp = wp.add(b * BLOCK_BYTES);
            _mm_prefetch::<_MM_HINT_T0>(bp.wrapping_add(8 * BLOCK_BYTES) as *const i8);
            let d = _mm256_set1_ps(scale(std::slice::from_raw_parts(bp, 2)));
            for (i, a) in acc.iter_mut().enumerate() {
                let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(bp.add(2 + 8 * i) as *const __m128i)));
                *a = _mm256_fmadd_ps(_mm256_mul_ps(d, q), _mm256_loadu_ps(xp.add(b * BLOCK + 8 * i)), *a);
            }
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps::<1>(h, h)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q8_0 blocks of `n` values: scales of a few magnitudes, quants over the whole i8 range.
    fn blocks(n: usize, seed: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n / BLOCK * BLOCK_BYTES);
        for b in 0..n / BLOCK {
            let d = f16::from_f32(0.001 * (1 + (b * 7 + seed) % 13) as f32);
            out.extend_from_slice(&d.to_le_bytes());
            out.extend((0..BLOCK).map(|i| ((i * 37 + b * 11 + seed * 5) % 256) as u8));
        }
        out
    }

    fn reference(x: &[f32], rows: usize, w: &[u8], out: usize, inp: usize) -> Vec<f64> {
        let mut wf = vec![0.0f32; out * inp];
        dequantize_into(w, &mut wf);
        (0..rows * out)
            .map(|i| {
                let (t, o) = (i / out, i % out);
                (0..inp).map(|k| x[t * inp + k] as f64 * wf[o * inp + k] as f64).sum()
            })
            .collect()
    }

    #[test]
    fn every_form_matches_the_f64_sum_of_the_decoded_weights() {
        for &(rows, inp, out) in &[(1usize, 64usize, 5usize), (2, 1024, 37), (3, 96, 8), (17, 256, 70), (130, 64, 9)] {
            let x: Vec<f32> = (0..rows * inp).map(|i| ((i * 13 % 31) as f32 - 15.0) / 7.0).collect();
            let w = blocks(out * inp, rows);
            let mut y = vec![f32::NAN; rows * out];
            linear_q8_0_into(&x, rows, &w, out, inp, &mut y);
            let want = reference(&x, rows, &w, out, inp);
            for (i, (&g, &r)) in y.iter().zip(&want).enumerate() {
                assert!((g as f64 - r).abs() <= 1e-5 * (1.0 + r.abs()), "rows {rows} in {inp} out {out} [{i}]: {g} vs {r}");
            }
        }
    }

    #[test]
    fn instruction_set_forms_agree() {
        for &n in &[32usize, 96, 1024] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 11 % 19) as f32 - 9.0) / 4.0).collect();
            let w = blocks(n, 3);
            let want = dot_portable(&x, &w);
            #[cfg(target_arch = "x86_64")]
            {
                let mut forms: Vec<(&str, f32)> = Vec::new();
                if std::arch::is_x86_feature_detected!("avx512f") {
                    forms.push(("avx512", unsafe { x86::dot_avx512(&x, &w) }));
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    forms.push(("avx2", unsafe { x86::dot_avx2(&x, &w) }));
                }
                for (name, got) in forms {
                    assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "{name} n {n}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn dequantizing_is_the_loaders_decoding() {
        let w = blocks(64, 1);
        let mut a = vec![0.0f32; 64];
        dequantize_into(&w, &mut a);
        for (i, v) in a.iter().enumerate() {
            let b = &w[(i / BLOCK) * BLOCK_BYTES..];
            let want = f16::from_le_bytes([b[0], b[1]]).to_f32() * f32::from(b[2 + i % BLOCK] as i8);
            assert_eq!(v.to_bits(), want.to_bits());
        }
    }
}
